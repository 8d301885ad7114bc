//! raw bindings to the system libfabric (under construction)

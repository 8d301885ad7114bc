//! raw bindings to the system UCX (under construction)

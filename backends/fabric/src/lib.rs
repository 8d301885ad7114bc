//! kvxfer libfabric backend (under construction)

//! kvxfer UCX backend (under construction)

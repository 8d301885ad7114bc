//! kvxfer TCP backend (under construction)

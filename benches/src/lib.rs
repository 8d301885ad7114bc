//! kvxfer benches (under construction)

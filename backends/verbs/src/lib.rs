//! kvxfer ibverbs backend (under construction)

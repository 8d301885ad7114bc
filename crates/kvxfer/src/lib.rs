//! kvxfer facade

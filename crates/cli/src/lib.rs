//! kvxfer command

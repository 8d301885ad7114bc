//! kvxfer conformance suite (under construction)

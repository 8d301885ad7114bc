//! Bootstrap: peer discovery (being written).

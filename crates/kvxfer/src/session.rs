//! Sessions (being written).

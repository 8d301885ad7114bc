//! The bench's reference: a plain `fi_write` loop between two endpoints of one process.

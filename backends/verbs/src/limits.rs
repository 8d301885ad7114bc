//! The handshake limits are the toolkit's: [`kvxfer_core::toolkit::handshake`].

pub use kvxfer_core::toolkit::handshake::{
    HandshakeLimits, HandshakeRefusals, LimitRefusal, RefusalCounters, Slot, DEFAULT_MAX_HANDSHAKES,
    DEFAULT_MAX_HANDSHAKES_PER_SOURCE,
};

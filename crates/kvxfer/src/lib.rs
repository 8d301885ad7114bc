//! kvxfer: what a serving engine links.
//!
//! - [`session`]: sender and receiver sessions that drive the planner, the completion tracker and a
//!   backend. Both notification styles go through the same code, chosen by the backend's capability.
//! - [`bootstrap`]: how ranks of different processes and hosts find each other.
//! - [`backends`]: the backends compiled in (cargo features `local`, `tcp`, `ucx`, `fabric`, `verbs`).

pub mod bootstrap;
pub mod session;

pub use kvxfer_core as core;
pub use kvxfer_core::*;

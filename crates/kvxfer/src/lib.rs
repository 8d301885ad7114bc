//! kvxfer: what a serving engine links.
//!
//! - [`session`]: sender and receiver sessions that drive the planner, the completion tracker and a
//!   backend. Both notification styles go through the same code, chosen by the backend's capability.
//! - [`bootstrap`]: how ranks of different processes and hosts find each other.
//! - [`metadata`]: the metadata-store interface (leases, watches) over the embedded bootstrap or
//!   etcd (cargo feature `etcd`), and rank membership that names a dead rank.
//! - [`backends`]: the backends compiled in (cargo features `local`, `tcp`, `ucx`, `fabric`, `verbs`,
//!   `cuda-ipc`).

pub mod bootstrap;
pub mod engine;
#[cfg(any(fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod metadata;
pub mod metrics;
pub mod session;

pub use kvxfer_core as core;
pub use kvxfer_core::*;

pub mod backends {
    //! The backends compiled into this build, selected by cargo features.
    //!
    //! `inventory` registration happens at link time, and a linker may drop a crate nothing
    //! references; [`linked`] references every enabled backend's constructor so that cannot happen.

    use std::sync::Arc;

    use kvxfer_core::backend::{lookup, Constructor, UnknownBackend};
    use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

    /// The names of the backends enabled by cargo features (each also referenced, so it is linked).
    #[allow(unused_mut, clippy::vec_init_then_push)] // one cfg-gated push per enabled feature
    pub fn linked() -> Vec<(&'static str, Constructor)> {
        let mut v: Vec<(&'static str, Constructor)> = Vec::new();
        #[cfg(feature = "local")]
        v.push((kvxfer_local::NAME, kvxfer_local::create));
        #[cfg(feature = "tcp")]
        v.push((kvxfer_tcp::NAME, kvxfer_tcp::create));
        #[cfg(feature = "ucx")]
        v.push((kvxfer_ucx::NAME, kvxfer_ucx::create));
        #[cfg(feature = "fabric")]
        v.push((kvxfer_fabric::NAME, kvxfer_fabric::create));
        #[cfg(feature = "verbs")]
        v.push((kvxfer_verbs::NAME, kvxfer_verbs::create));
        #[cfg(feature = "cuda-ipc")]
        v.push((kvxfer_cuda_ipc::NAME, kvxfer_cuda_ipc::create));
        v
    }

    #[cfg(feature = "ucx")]
    pub use kvxfer_ucx as ucx;

    #[cfg(feature = "fabric")]
    pub use kvxfer_fabric as fabric;

    #[cfg(feature = "verbs")]
    pub use kvxfer_verbs as verbs;

    #[cfg(feature = "cuda-ipc")]
    pub use kvxfer_cuda_ipc as cuda_ipc;

    /// A failure to build a backend by name.
    #[derive(Debug, thiserror::Error)]
    pub enum CreateError {
        /// Not compiled in.
        #[error(transparent)]
        Unknown(#[from] UnknownBackend),
        /// The constructor failed.
        #[error(transparent)]
        Backend(#[from] BackendError),
    }

    /// Builds an endpoint of the backend called `name`.
    pub fn create(name: &str, config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, CreateError> {
        let _ = linked();
        Ok((lookup(name)?.create)(config)?)
    }
}

/// docs/engine-api.md's Rust blocks, compiled and run as doctests (the "Embedding kvxfer in an engine" example).
#[cfg(doctest)]
#[doc = include_str!("../../../docs/engine-api.md")]
pub struct ReadmeDoctests;

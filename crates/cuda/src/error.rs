//! Typed errors: what failed, with which driver call and code, and what to do.

use std::time::Duration;

/// A CUDA failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// The driver library could not be loaded (no NVIDIA driver on this host, or not on the
    /// loader's path).
    #[error(
        "the CUDA driver library {library} could not be loaded ({detail}): CUDA memory needs the NVIDIA driver on \
         this host (set {env} to the library's path if it is not on the loader's path), or register host memory"
    , env = crate::LIBRARY_ENV)]
    Load {
        /// The library asked for.
        library: String,
        /// The loader's message.
        detail: String,
    },
    /// The driver library lacks an entry point kvxfer calls.
    #[error("the CUDA driver library {library} has no {symbol}: the driver is too old (kvxfer needs a CUDA 11.3 or newer driver)")]
    Symbol {
        /// The library.
        library: String,
        /// The missing function.
        symbol: &'static str,
    },
    /// A driver call failed.
    #[error("{call} failed with {name} ({code}): {description}{context}")]
    Call {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult`.
        code: i32,
        /// The result's name (`cuGetErrorName`).
        name: String,
        /// The result's description (`cuGetErrorString`).
        description: String,
        /// What it was called for (empty, or starting with "; ").
        context: String,
    },
    /// A device ordinal this host does not have.
    #[error("there is no CUDA device {device}: this host has {count} (CUDA_VISIBLE_DEVICES renumbers them)")]
    NoDevice {
        /// The ordinal asked for.
        device: u32,
        /// Devices visible.
        count: u32,
    },
    /// An argument the driver would refuse or that would reach outside its memory: a copy whose
    /// shapes differ, a range outside its reservation or buffer, a kind that is not CUDA memory.
    #[error("{what}")]
    Invalid {
        /// What is wrong and what to do.
        what: String,
    },
    /// Queued work that did not complete in time.
    #[error("{what} did not complete within {after:?}")]
    Timeout {
        /// The work.
        what: String,
        /// How long it was waited for.
        after: Duration,
    },
}

impl CudaError {
    /// An [`CudaError::Invalid`] with this message.
    pub fn invalid(what: impl Into<String>) -> Self {
        CudaError::Invalid { what: what.into() }
    }
}

//! kvxfer's libfabric backend.
//!
//! One libfabric RDM endpoint per backend instance (`FI_EP_RDM`, `FI_MSG | FI_RMA`), tested with the
//! `tcp;ofi_rxm` and `shm` providers of libfabric 1.17:
//!
//! - data: `fi_writemsg` RMA writes from registered regions into the peer's registered regions
//!   (pieces that follow each other on both sides coalesced, up to the provider's `iov_limit` ranges
//!   per post), with `FI_DELIVERY_COMPLETE` where the provider grants it: only then does the endpoint
//!   report [`kvxfer_core::Completion::Remote`] (and the out-of-band style); otherwise `Local`;
//! - `post` returns a [`kvxfer_core::Transfer`] at once; abort stops posting and waits for the
//!   completions of what was posted (libfabric 1.17's tcp and shm providers cannot cancel writes);
//! - attached notifications: remote CQ data on the transfer's last write (`FI_REMOTE_CQ_DATA`),
//!   paired at the receiver with a staged message carrying the notification; or, where the provider
//!   has no CQ data, a message sent after the writes completed;
//! - out-of-band notifications: `fi_send` messages into receive buffers each endpoint keeps posted,
//!   fragmented with the toolkit's `Fragmenter` to the receiver's buffer size;
//! - memory registration follows the provider's `mr_mode` bits; a region is registered for local
//!   use, and once more for each peer instance that connects, whose keys it gets in the connect's
//!   answer; closing a registration revokes it at every peer that connected here (acknowledged
//!   after their writes into it completed) before `fi_close` of the MRs;
//! - cutting a peer off ([`kvxfer_core::KvTransferBackend::cut_off`]) closes that instance's keys,
//!   drops its messages, refuses its hellos, and over `tcp;ofi_rxm` closes the connection
//!   (`fi_av_remove` with `FI_AV_REMOVE_CLEANUP=1`, which stops a write already past the key check);
//!   confirmed only where that is known to stop every write (see the README);
//! - progress: a dedicated thread polls the completion queue; every wait has a deadline;
//! - liveness: hello on connect, heartbeats, "gone" on drop; receivers report silent peers lost.
//! - authentication: with a cluster secret ([`kvxfer_core::BackendConfig::secret`]) the hello starts
//!   a mutual challenge-response (both sides' fresh nonces, both identities; a mismatch fails
//!   `connect` naming authentication), nothing of a peer is applied before it proved the secret, and
//!   every notification must carry the identity its sender proved as its key (a forged one is
//!   dropped, counted in [`FabricBackend::forged_notifications`], the sender refused and reported
//!   lost). Limits in the README.
//!
//! See README.md in this crate for the options, the provider findings and the shm workarounds.
//! The `baseline` module (cargo feature `baseline`, off by default; `kvxfer bench` and
//! `examples/fabric_bench.rs` turn it on) measures plain `fi_write` loops, the reference the bench
//! compares the backend with; `tests/completion.rs` probes what a write completion means on each
//! provider.

mod backend;
#[cfg(feature = "baseline")]
pub mod baseline;
pub mod ffi;
#[cfg(any(fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod wire;

use std::sync::Arc;

use kvxfer_core::{BackendConfig, BackendError, Capabilities, Completion, KvTransferBackend, Limits};

pub use backend::{capabilities_for, AttachedMode, FabricBackend, Options, MAX_IN_FLIGHT, MAX_NOTIFICATION, OPTIONS};

/// Registry name.
pub const NAME: &str = "fabric";

/// Capabilities of the default (`tcp;ofi_rxm`) endpoint, which grants `FI_DELIVERY_COMPLETE` on
/// libfabric 1.17; every instance reports its own ([`capabilities_for`] its provider).
pub const CAPABILITIES: Capabilities = Capabilities::new(true, true, true, true)
    .with_limits(Limits::new(u64::MAX, MAX_NOTIFICATION as u64, u64::MAX))
    .with_completion(Completion::Remote);

/// Builds an endpoint from a config (see README.md for the options).
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    backend::create_backend(config)
}

kvxfer_core::register_backend!(
    NAME,
    "libfabric RDM endpoint (FI_RMA writes, remote CQ data; providers tcp;ofi_rxm, shm, ...)",
    CAPABILITIES,
    OPTIONS,
    create
);

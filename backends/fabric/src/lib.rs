//! kvxfer's libfabric backend.
//!
//! One libfabric RDM endpoint per backend instance (`FI_EP_RDM`, `FI_MSG | FI_RMA`), tested with the
//! `tcp;ofi_rxm` and `shm` providers of libfabric 1.17:
//!
//! - data: `fi_writemsg` RMA writes from registered regions into the peer's registered regions, a
//!   strided op as iovs within the provider's `iov_limit`; `write` returns after the writes'
//!   completions (`FI_DELIVERY_COMPLETE` where the provider offers it);
//! - attached notifications: remote CQ data on the batch's last write (`FI_REMOTE_CQ_DATA`, what
//!   `fi_writedata` does), paired at the receiver with a staged message carrying the notification; or,
//!   where the provider has no CQ data, a message sent after the writes completed;
//! - out-of-band notifications: `fi_send` messages into receive buffers each endpoint keeps posted;
//! - memory registration follows the provider's `mr_mode` bits (`FI_MR_LOCAL`, `FI_MR_VIRT_ADDR`,
//!   `FI_MR_PROV_KEY`, `FI_MR_ENDPOINT`, `FI_MR_ALLOCATED`); the endpoint address and each region's key
//!   (and base address under `FI_MR_VIRT_ADDR`) travel in the endpoint metadata;
//! - progress: a dedicated thread polls the completion queue; every wait has a deadline;
//! - liveness: hello on connect, heartbeats, "gone" on drop; receivers report silent peers lost.
//!
//! See README.md in this crate for the provider findings and the shm workarounds.
//!
//! Options (`BackendConfig::options`, env fallback in parentheses):
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `provider` (env `FI_PROVIDER`) | `tcp` | libfabric provider; `tcp` means `tcp;ofi_rxm`; `shm` for same-host |
//! | `addr` (env `KVXFER_FABRIC_ADDR`) | provider's first | local address to bind, e.g. `127.0.0.1` (not for shm) |
//! | `timeout_ms` | 30000 | deadline of each `write` / `notify` / `connect` |
//! | `peer_timeout_ms` | 5000 | silence after which a connected peer is reported lost |
//! | `wait` (env `KVXFER_FABRIC_WAIT`) | `fd` (tcp), `poll` (shm) | how the idle progress thread waits |
//! | `recv_buffers` | 64 | receive buffers kept posted |
//! | `recv_buf_size` | 65536 | bytes per receive buffer (larger notifications are fragmented) |
//! | `attached` | `auto` | `auto`, `cq-data` (remote CQ data) or `message` |
//! | `idle_poll_us` | 200 | longest sleep of the idle progress thread |
//!
//! [`baseline`] measures a plain `fi_write` loop between two endpoints of one process, the reference
//! the bench compares the backend with.

mod backend;
pub mod baseline;
pub mod ffi;
mod ffi_mem;
pub mod wire;

use std::sync::Arc;

use kvxfer_core::{BackendConfig, BackendError, Capabilities, KvTransferBackend};

pub use backend::{AttachedMode, FabricBackend, Options};

/// Registry name.
pub const NAME: &str = "fabric";

/// Capabilities of the default (`tcp;ofi_rxm`) endpoint; an `shm` endpoint reports `cross_host: false`.
pub const CAPABILITIES: Capabilities =
    Capabilities { attached: true, out_of_band: true, cross_process: true, cross_host: true };

/// Builds an endpoint from a config (see the option table above).
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    backend::create_backend(config)
}

kvxfer_core::inventory::submit! {
    kvxfer_core::BackendDescriptor {
        name: NAME,
        description: "libfabric RDM endpoint (FI_RMA writes, remote CQ data; providers tcp;ofi_rxm, shm, ...)",
        capabilities: CAPABILITIES,
        create,
    }
}

//! kvxfer-core: the pure heart of kvxfer.
//!
//! - [`model`]: KV geometry, layouts, parallel configs, sender keys, and the validated [`Topology`].
//! - [`heads`]: head ownership (SEMANTICS §2).
//! - [`plan`]: the slice planner (SEMANTICS §3-4).
//! - [`tracker`]: the sans-IO completion tracker (SEMANTICS §5).
//! - [`notify`]: typed notifications and their binary codec.
//! - [`backend`]: the [`KvTransferBackend`] trait, capabilities, and the `inventory` registry.
//! - [`mem`]: memory regions (the crate's only `unsafe`, behind [`MemRegion::from_raw_parts`]).
//!
//! No IO, no runtime, no FFI: time is passed in, and every function returns its result.

pub mod backend;
pub mod error;
pub mod heads;
pub mod mem;
pub mod model;
pub mod notify;
pub mod oracle;
pub mod plan;
pub mod tracker;

pub use backend::{
    BackendConfig, BackendDescriptor, BackendError, BackendEvent, Capabilities, EndpointMetadata, KvTransferBackend,
    NotifyStyle, PeerId, RegionId, WriteOp,
};
pub use error::{CodecError, ConfigError, Mismatch, PlanError, TrackerError};
pub use mem::{HostBuffer, MemError, MemRegion};
pub use model::{Attention, KvKind, KvSpec, Layout, Parallel, RankId, SenderKey, Side, SideSpec, Topology};
pub use notify::{Notification, NotificationBody, RequestId};
pub use plan::{BufferRef, ChunkPlan, KindSlice, PageRun, PairPlan, PlannedOp};
pub use tracker::{CompletionTracker, ExpectSpec, Failure, Handled, Status, TrackerStats};

/// Re-exported so backend crates submit descriptors without naming `inventory` themselves.
pub use inventory;

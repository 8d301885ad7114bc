//! kvxfer-core: the pure heart of kvxfer.
//!
//! - [`model`]: KV geometry, layouts, parallel configs, sender keys, and the validated [`Topology`].
//! - [`heads`]: head ownership (SEMANTICS §2).
//! - [`plan`]: the slice planner (SEMANTICS §3-4).
//! - [`tracker`]: the sans-IO completion tracker: the decode side's rules (SEMANTICS §5-6).
//! - [`decode`]: the sans-IO decode request book around the tracker (handoff generations, the fence
//!   asks, the digest check, outcomes).
//! - [`prefill`]: the sans-IO prefill request book: the prefill side's rules (SEMANTICS §7).
//! - [`phase`]: where a request stands, as the engine API reports it.
//! - [`notify`]: typed notifications and their binary codec.
//! - [`digest`]: the opt-in end-to-end digest of what each sender writes.
//! - [`backend`]: the [`KvTransferBackend`] trait, capabilities, and the `inventory` registry.
//! - [`mem`]: memory descriptors with a kind, and the memory-lifetime rules (`unsafe` behind
//!   [`MemDesc::from_raw_parts`]; the crate's other `unsafe` is `CudaHandle::from_raw` in [`order`]).
//! - [`secret`]: the cluster's shared secret and the keyed proofs of every authenticated channel.
//! - [`toolkit`]: what every backend needs (region and peer tables, event queue, options,
//!   op segmentation, notification fragments), written once.
//!
//! No IO, no runtime, no FFI: time is passed in, and every function returns its result. The
//! contract types and the toolkit wait with tokio's sync and time types inside the caller's runtime.

pub mod backend;
pub mod decode;
pub mod digest;
pub mod error;
#[cfg(any(fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod heads;
pub mod mem;
pub mod model;
pub mod notify;
pub mod oracle;
pub mod order;
pub mod phase;
pub mod plan;
pub mod prefill;
pub mod protocol;
pub mod secret;
pub mod toolkit;
pub mod tracker;

pub use backend::{
    check_documented_defaults, AbortTransfer, BackendConfig, BackendDescriptor, BackendError, BackendEvent, BoxFuture,
    Capabilities, CloseRegistration, Completion, CutOff, EndpointMetadata, IndexedOp, KvTransferBackend, Limits,
    NotifyStyle, OptionDoc, PeerId, RegionId, Registration, Transfer, TransferState, TransferStatus, WriteOp,
};
pub use error::{CodecError, ConfigError, Mismatch, PlanError, TrackerError};
pub use mem::{
    HostBuffer, MemDesc, MemError, MemKind, MemKinds, ReadGuard, Reservation, StridedWriteGuard, WriteGuard,
};
pub use model::{
    from_identity, identity, own_key, rank_of_key, Attention, KvKind, KvSpec, LayerPartition, Layout, Parallel, RankId,
    SenderKey, Side, SideSpec, Topology, MAX_PARTITION_STAGES,
};
pub use notify::{Notification, NotificationBody, RequestId};
pub use order::{CudaHandle, GpuOrder};
pub use phase::Phase;
pub use plan::{BufferRef, ChunkPlan, KindSlice, PageRun, PairPlan, PlannedOp};
pub use prefill::{BookConfig, PrefillBook};
pub use protocol::{Feature, Negotiated, ProtocolMismatch, ProtocolRange};
pub use secret::{Secret, SecretError, SECRET_ENV};
pub use tracker::{CompletionTracker, ExpectSpec, Failure, Fence, Handled, Loss, Status, TrackerConfig, TrackerStats};

/// Re-exported so backend crates submit descriptors without naming `inventory` themselves.
pub use inventory;

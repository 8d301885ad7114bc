//! The verbs interface the endpoint is written against, and the plain types it exchanges (no
//! `unsafe`, no handles).
//!
//! Two implementations exist: [`crate::ffi::Ibv`], libibverbs itself (always compiled and linted),
//! and, with the test-only `emulator` feature, `crate::emu::Emulated`, an in-process software model
//! of the same calls. The endpoint is generic over [`Verbs`]; which implementation an endpoint uses
//! is chosen at run time (`device=emulated` picks the model), so a build with the model still
//! contains, compiles and lints the real FFI layer.

use std::fmt;
use std::os::raw::c_int;
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as sys;
use kvxfer_core::{BackendError, MemDesc};

use crate::NAME;

/// A family of verbs handles (device, PD, MR, completion channel, CQ, QP).
pub(crate) trait Verbs: Sized + Send + Sync + 'static {
    /// Whether this is the in-process model rather than libibverbs.
    const EMULATED: bool;
    /// An open device.
    type Context: Device<Self>;
    /// A protection domain.
    type Pd: ProtectionDomain<Self>;
    /// A registered memory region.
    type Mr: MemoryRegion<Self>;
    /// A completion channel.
    type Channel: EventChannel<Self>;
    /// One completion event (acknowledged when dropped).
    type Event: CqEvent;
    /// A completion queue.
    type Cq: CompletionQueue<Self>;
    /// A reliable-connected queue pair.
    type Qp: QueuePair<Self>;

    /// The text of a completion status.
    fn status_str(status: u32) -> String;
}

/// An open device context.
pub(crate) trait Device<V: Verbs>: Send + Sync + 'static {
    /// Opens the device named `wanted`, or the first device.
    fn open(wanted: Option<&str>) -> Result<Arc<Self>, OpenError>;
    /// The device name.
    fn name(&self) -> &str;
    /// Device limits.
    fn query_device(&self) -> Result<DeviceCaps, BackendError>;
    /// Port properties.
    fn query_port(&self, port: u8) -> Result<PortInfo, BackendError>;
    /// A GID table entry.
    fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16], BackendError>;
}

/// A protection domain.
pub(crate) trait ProtectionDomain<V: Verbs>: Send + Sync + 'static {
    /// Allocates one on `ctx`.
    fn alloc(ctx: &Arc<V::Context>) -> Result<Arc<Self>, BackendError>;
}

/// A registered memory region; dropping it deregisters (which invalidates its keys).
pub(crate) trait MemoryRegion<V: Verbs>: Send + Sync + 'static {
    /// Registers the described host memory (pins its pages; may take long: call it off the runtime).
    fn register(pd: &Arc<V::Pd>, mem: MemDesc, access: Access) -> Result<Self, BackendError>
    where
        Self: Sized;
    /// Start address (the remote address of offset 0).
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Remote key.
    fn rkey(&self) -> u32;
}

/// A completion channel the poller thread sleeps on.
pub(crate) trait EventChannel<V: Verbs>: Send + Sync + 'static {
    /// Creates one on `ctx`.
    fn create(ctx: &Arc<V::Context>) -> Result<Arc<Self>, BackendError>;
    /// Waits up to `timeout` for one completion event.
    fn next_event(&self, timeout: Duration) -> Result<Option<V::Event>, BackendError>;
}

/// One completion event. Look the CQ's owner up by [`CqEvent::key`] before dropping the event
/// (dropping acknowledges it, after which the CQ may be destroyed).
pub(crate) trait CqEvent {
    /// The key the CQ was created with.
    fn key(&self) -> u64;
}

/// A completion queue bound to a channel.
pub(crate) trait CompletionQueue<V: Verbs>: Send + Sync + 'static {
    /// Creates a CQ of at least `depth` entries reporting to `channel`, tagged with `key`, armed.
    fn create(
        ctx: &Arc<V::Context>,
        channel: &Arc<V::Channel>,
        depth: u32,
        key: u64,
    ) -> Result<Arc<Self>, BackendError>;
    /// Requests an event for the next completion.
    fn arm(&self) -> Result<(), BackendError>;
    /// Polls up to `max` completions into `out`; returns how many.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, BackendError>;
}

/// A reliable-connected queue pair.
pub(crate) trait QueuePair<V: Verbs>: Send + Sync + 'static {
    /// Creates one in RESET.
    fn create(pd: &Arc<V::Pd>, send_cq: &Arc<V::Cq>, recv_cq: &Arc<V::Cq>, want: QpCaps) -> Result<Self, BackendError>
    where
        Self: Sized;
    /// Granted sizes.
    fn caps(&self) -> QpCaps;
    /// The QP number peers address.
    fn qp_num(&self) -> u32;
    /// Applies a state transition.
    fn modify(&self, attr: &sys::ibv_qp_attr, mask: sys::ibv_qp_attr_mask, what: &str) -> Result<(), BackendError>;
    /// Posts a chain of send work requests (ids increase across calls). The registrations the SGEs
    /// name stay referenced until [`QueuePair::retire_through`] passes the request's id.
    fn post_send(&self, wrs: &[SendWr<V>]) -> Result<(), PostError>;
    /// Releases the registrations of every posted send request up to and including `wr_id`.
    fn retire_through(&self, wr_id: u64);
    /// Posts one receive buffer: `len` bytes at `offset` of `mr`, reported as `wr_id`.
    fn post_recv(&self, wr_id: u64, mr: &Arc<V::Mr>, offset: u64, len: u32) -> Result<(), BackendError>;
}

/// A refused `post_send`: the first `posted` requests of the chain were accepted, the rest not.
#[derive(Debug, Clone)]
pub(crate) struct PostError {
    /// Requests accepted before the refused one.
    pub posted: usize,
    /// Why.
    pub error: BackendError,
}

/// Turns a failed C call into a typed error naming the call; `code` is the return value or errno.
pub(crate) fn ffi_error(call: &'static str, code: i32, context: impl fmt::Display) -> BackendError {
    let os = std::io::Error::from_raw_os_error(code.abs());
    BackendError::Ffi { backend: NAME, call, code: i64::from(code), detail: format!("{os}; {context}") }
}

/// Device limits the backend sizes its queues, work requests and region count by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceCaps {
    /// Largest work-request count per queue.
    pub max_qp_wr: u32,
    /// Largest scatter/gather count per work request.
    pub max_sge: u32,
    /// Largest completion queue.
    pub max_cqe: u32,
    /// Most memory registrations.
    pub max_mr: u32,
}

/// Port properties used to build queue-pair attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PortInfo {
    /// `ibv_port_state` value (4 = ACTIVE).
    pub state: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Active MTU as an `ibv_mtu` value (1 = 256 .. 5 = 4096).
    pub active_mtu: u32,
    /// Link layer (1 InfiniBand, 2 Ethernet).
    pub link_layer: u8,
    /// Largest message size.
    pub max_msg_sz: u32,
}

/// Why a device could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OpenError {
    /// `ibv_get_device_list` failed.
    List {
        /// errno.
        errno: i32,
    },
    /// No (matching) device.
    NotFound {
        /// The name asked for.
        wanted: Option<String>,
        /// What exists.
        available: Vec<String>,
    },
    /// `ibv_open_device` failed.
    Open {
        /// Device.
        name: String,
        /// errno.
        errno: i32,
    },
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpenError::List { errno } => write!(
                f,
                "ibv_get_device_list failed: {}; this kernel has no usable RDMA subsystem \
                 (no ib_uverbs). On an RDMA host load the NIC driver, or set up Soft-RoCE with \
                 `rdma link add rxe0 type rxe netdev eth0`",
                std::io::Error::from_raw_os_error(*errno)
            ),
            OpenError::NotFound { wanted: None, .. } => write!(
                f,
                "ibv_get_device_list returned no RDMA devices; load the NIC driver or set up Soft-RoCE with \
                 `rdma link add rxe0 type rxe netdev eth0`"
            ),
            OpenError::NotFound { wanted: Some(w), available } => write!(
                f,
                "RDMA device {w:?} (KVXFER_VERBS_DEVICE / option device) not found; available: [{}]",
                available.join(", ")
            ),
            OpenError::Open { name, errno } => write!(
                f,
                "ibv_open_device({name}) failed: {} (errno {errno})",
                std::io::Error::from_raw_os_error(*errno)
            ),
        }
    }
}

/// Access a registration grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Local read and write (receive buffers, staging).
    Local,
    /// Local write plus remote RDMA WRITE (KV regions, notification rings).
    RemoteWrite,
}

impl Access {
    /// `ibv_access_flags` bits.
    pub(crate) fn flags(self) -> c_int {
        let f = match self {
            Access::Local => sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE,
            Access::RemoteWrite => {
                sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            }
        };
        f.0 as c_int
    }
}

/// One work completion, copied out of `ibv_wc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// `ibv_wc_status` (0 = success).
    pub status: u32,
    /// Vendor error syndrome.
    pub vendor_err: u32,
    /// `ibv_wc_opcode`.
    pub opcode: u32,
    /// Bytes received (receive completions).
    pub byte_len: u32,
    /// Immediate data in host order, when present.
    pub imm: Option<u32>,
    /// The local QP number.
    pub qp_num: u32,
}

impl Completion {
    /// Whether it succeeded.
    pub fn ok(&self) -> bool {
        self.status == sys::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// Whether it is the receive side of an RDMA WRITE WITH IMMEDIATE.
    pub fn is_recv_imm(&self) -> bool {
        self.opcode == sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
    }

    /// Whether it is the receive side of a SEND.
    pub fn is_recv_send(&self) -> bool {
        self.opcode == sys::ibv_wc_opcode::IBV_WC_RECV
    }
}

/// Sizes of a queue pair, as requested and as granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send work request.
    pub max_send_sge: u32,
    /// Inline bytes per send work request.
    pub max_inline: u32,
}

/// One local scatter/gather entry: `len` bytes at `offset` of a registered region.
pub(crate) struct LocalSge<V: Verbs> {
    /// The registration (kept alive by the QP until the request retires).
    pub mr: Arc<V::Mr>,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u32,
}

/// What a send work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendKind {
    /// RDMA WRITE to `remote_addr` under `rkey`.
    Write {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// RDMA WRITE WITH IMMEDIATE (`imm` in host order).
    WriteImm {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// SEND into the peer's next receive buffer.
    Send,
}

/// A send work request in owned, checked form.
pub(crate) struct SendWr<V: Verbs> {
    /// Id reported by its completion.
    pub wr_id: u64,
    /// Operation.
    pub kind: SendKind,
    /// Local data.
    pub sges: Vec<LocalSge<V>>,
    /// Ask for a completion.
    pub signaled: bool,
    /// Copy the data into the WQE at post time.
    pub inline: bool,
}

//! Plain types shared by the FFI layer and the test emulator (no `unsafe`, no handles).

use std::fmt;
use std::os::raw::c_int;
use std::sync::Arc;

use ibverbs_sys as sys;

use kvxfer_core::BackendError;

use crate::ffi::Mr;
use crate::NAME;

/// Turns a failed C call into a typed error naming the call; `code` is the return value or errno.
pub(crate) fn ffi_error(call: &'static str, code: i32, context: impl fmt::Display) -> BackendError {
    let os = std::io::Error::from_raw_os_error(code.abs());
    BackendError::Ffi { backend: NAME, call, code: i64::from(code), detail: format!("{os}; {context}") }
}

/// Device limits the backend sizes its queues and work requests by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceCaps {
    /// Largest work-request count per queue.
    pub max_qp_wr: u32,
    /// Largest scatter/gather count per work request.
    pub max_sge: u32,
    /// Largest completion queue.
    pub max_cqe: u32,
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
#[cfg_attr(feature = "emulator", allow(dead_code))] // the emulator never fails to list or open
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
    #[cfg_attr(feature = "emulator", allow(dead_code))] // the emulator keeps the enum
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
#[derive(Clone)]
pub(crate) struct LocalSge {
    /// The registration (kept alive by the QP until the request retires).
    pub mr: Arc<Mr>,
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
#[derive(Clone)]
pub(crate) struct SendWr {
    /// Id reported by its completion.
    pub wr_id: u64,
    /// Operation.
    pub kind: SendKind,
    /// Local data.
    pub sges: Vec<LocalSge>,
    /// Ask for a completion.
    pub signaled: bool,
    /// Copy the data into the WQE at post time.
    pub inline: bool,
}

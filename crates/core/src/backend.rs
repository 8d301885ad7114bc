//! The transport interface every backend implements, its capabilities, and the registry.
//!
//! A backend moves byte ranges between registered memory regions of endpoints and carries small
//! notifications. It knows nothing of heads, layers or completion: the planner decides which
//! bytes go where, and the tracker decides when a request is done.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::CodecError;
use crate::mem::{MemError, MemRegion};
use crate::notify::Notification;

/// A caller-chosen id of a registered memory region, unique per endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId(pub u32);

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "region {}", self.0)
    }
}

/// A connected peer, as numbered by the local endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PeerId(pub u64);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer {}", self.0)
    }
}

/// One strided write: `count` ranges of `len` bytes from the local region `src` at
/// `src_offset + i*src_stride` to the peer's region `dst` at `dst_offset + i*dst_stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteOp {
    /// Local source region.
    pub src: RegionId,
    /// Offset of the first source range.
    pub src_offset: u64,
    /// Peer's destination region.
    pub dst: RegionId,
    /// Offset of the first destination range.
    pub dst_offset: u64,
    /// Bytes per range.
    pub len: u64,
    /// Ranges (at least 1).
    pub count: u64,
    /// Source stride.
    pub src_stride: u64,
    /// Destination stride.
    pub dst_stride: u64,
}

impl WriteOp {
    /// A contiguous write.
    pub fn contiguous(src: RegionId, src_offset: u64, dst: RegionId, dst_offset: u64, len: u64) -> Self {
        Self { src, src_offset, dst, dst_offset, len, count: 1, src_stride: len, dst_stride: len }
    }

    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }

    /// The ranges `(src_offset, dst_offset, len)` this op covers.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        (0..self.count)
            .map(move |i| (self.src_offset + i * self.src_stride, self.dst_offset + i * self.dst_stride, self.len))
    }

    /// Checks every source range against the local source region's length; the error names the
    /// region (and `peer`, when given) and is what every backend returns before moving a byte.
    pub fn check_src(&self, backend: &'static str, peer: Option<PeerId>, region_len: u64) -> Result<(), BackendError> {
        Self::check_bounds(self.src_offset, self.src_stride, self.len, self.count, region_len)
            .map_err(|source| BackendError::OutOfBounds { backend, side: "source", region: self.src, peer, source })
    }

    /// Checks every destination range against the length of the peer's destination region.
    pub fn check_dst(&self, backend: &'static str, peer: Option<PeerId>, region_len: u64) -> Result<(), BackendError> {
        Self::check_bounds(self.dst_offset, self.dst_stride, self.len, self.count, region_len).map_err(|source| {
            BackendError::OutOfBounds { backend, side: "destination", region: self.dst, peer, source }
        })
    }

    /// Checks every range against a region length (source or destination side), with overflow
    /// checks. `Ok` means every byte of every stride step lies inside `[0, region_len)`.
    pub fn check_bounds(offset: u64, stride: u64, len: u64, count: u64, region_len: u64) -> Result<(), MemError> {
        let err = MemError { offset, len: len.saturating_mul(count), region_len };
        if count == 0 {
            return Err(err);
        }
        let last = stride.checked_mul(count - 1).and_then(|s| s.checked_add(offset)).ok_or(err)?;
        match last.checked_add(len) {
            Some(end) if end <= region_len => Ok(()),
            _ => Err(err),
        }
    }
}

/// How a backend reports that a chunk's bytes have landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NotifyStyle {
    /// NIXL-like: the notification rides with the data and is delivered only after it.
    Attached,
    /// Mooncake-like: the sender waits for its writes to complete, then sends the notification on a
    /// separate channel.
    OutOfBand,
}

impl fmt::Display for NotifyStyle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NotifyStyle::Attached => "attached",
            NotifyStyle::OutOfBand => "out-of-band",
        })
    }
}

/// What a backend can do; tests and sessions consult it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Supports [`NotifyStyle::Attached`].
    pub attached: bool,
    /// Supports [`NotifyStyle::OutOfBand`].
    pub out_of_band: bool,
    /// Endpoints in different processes can talk (false for the in-process backend).
    pub cross_process: bool,
    /// Endpoints on different hosts can talk.
    pub cross_host: bool,
}

impl Capabilities {
    /// Whether `style` is supported.
    pub fn supports(&self, style: NotifyStyle) -> bool {
        match style {
            NotifyStyle::Attached => self.attached,
            NotifyStyle::OutOfBand => self.out_of_band,
        }
    }
}

/// Version of the [`EndpointMetadata`] envelope.
pub const METADATA_VERSION: u32 = 1;

/// What a peer needs to connect to an endpoint: published through bootstrap, opaque to everyone but
/// the backend that made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointMetadata {
    /// Envelope version ([`METADATA_VERSION`]).
    pub version: u32,
    /// Name of the backend that produced it; `connect` rejects another backend's metadata.
    pub backend: String,
    /// The endpoint's identity (for prefill ranks, the sender key's `to_u64`).
    pub identity: u64,
    /// Backend-specific payload (addresses, remote keys, tokens).
    pub payload: Vec<u8>,
}

impl EndpointMetadata {
    /// An envelope of the current version, made by `backend`.
    pub fn new(backend: &str, identity: u64, payload: Vec<u8>) -> Self {
        Self { version: METADATA_VERSION, backend: backend.to_owned(), identity, payload }
    }

    /// Checks that `backend` made this metadata and that this build speaks its envelope version, so
    /// every backend rejects foreign or future metadata the same way before reading its payload.
    pub fn check(&self, backend: &'static str) -> Result<(), BackendError> {
        if self.backend != backend {
            return Err(BackendError::BadMetadata {
                backend,
                detail: format!("metadata was made by backend {:?}, not {backend:?}", self.backend),
            });
        }
        if self.version != METADATA_VERSION {
            return Err(BackendError::BadMetadata {
                backend,
                detail: format!("metadata version {}, this build speaks {METADATA_VERSION}", self.version),
            });
        }
        Ok(())
    }
}

/// Something the transport reports to the receiving side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendEvent {
    /// A notification arrived (after the bytes it covers, in the attached style).
    Notification(Notification),
    /// A connected peer went away.
    PeerLost {
        /// The peer's identity (from its metadata or handshake).
        identity: u64,
        /// What happened.
        reason: String,
    },
}

/// Per-endpoint construction settings.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BackendConfig {
    /// This endpoint's identity, carried in its metadata (prefill ranks: `SenderKey::to_u64`).
    pub identity: u64,
    /// Backend-specific options, e.g. `listen=127.0.0.1:0`, `connections=4`, `tls=tcp`.
    pub options: BTreeMap<String, String>,
}

impl BackendConfig {
    /// A config with an identity and no options.
    pub fn new(identity: u64) -> Self {
        Self { identity, options: BTreeMap::new() }
    }

    /// Adds an option.
    pub fn with(mut self, key: &str, value: impl Into<String>) -> Self {
        self.options.insert(key.to_owned(), value.into());
        self
    }

    /// An option parsed as `T`, or `default` when absent. A value that does not parse is an error
    /// naming the option.
    pub fn parse_or<T: std::str::FromStr>(
        &self,
        backend: &'static str,
        key: &str,
        default: T,
    ) -> Result<T, BackendError> {
        match self.options.get(key) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| BackendError::Config { backend, detail: format!("option {key}={v} does not parse") }),
        }
    }
}

/// A transport failure, with the call and the peer it concerns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// Bad configuration or option.
    #[error("{backend}: bad configuration: {detail}")]
    Config {
        /// Backend.
        backend: &'static str,
        /// What.
        detail: String,
    },
    /// No usable device (e.g. no RDMA NIC on this host).
    #[error("{backend}: no device: {detail}")]
    NoDevice {
        /// Backend.
        backend: &'static str,
        /// What was looked for and what was found.
        detail: String,
    },
    /// A region id that is not registered (locally or at the peer).
    #[error("{backend}: {region} is not registered{}", peer.map(|p| format!(" at {p}")).unwrap_or_default())]
    UnknownRegion {
        /// Backend.
        backend: &'static str,
        /// Region.
        region: RegionId,
        /// Peer, when the region is the peer's.
        peer: Option<PeerId>,
    },
    /// A region id registered twice.
    #[error("{backend}: {region} is already registered; deregister it first")]
    RegionInUse {
        /// Backend.
        backend: &'static str,
        /// Region.
        region: RegionId,
    },
    /// A write op outside its source or destination region: rejected before any byte moved.
    #[error("{backend}: write out of bounds ({side} {region}{}): {source}", peer.map(|p| format!(", {p}")).unwrap_or_default())]
    OutOfBounds {
        /// Backend.
        backend: &'static str,
        /// "source" or "destination".
        side: &'static str,
        /// Region.
        region: RegionId,
        /// Peer.
        peer: Option<PeerId>,
        /// Bounds detail.
        source: MemError,
    },
    /// An unknown peer id.
    #[error("{backend}: unknown {peer}; connect first")]
    UnknownPeer {
        /// Backend.
        backend: &'static str,
        /// Peer.
        peer: PeerId,
    },
    /// Metadata that this backend cannot use.
    #[error("{backend}: unusable peer metadata: {detail}")]
    BadMetadata {
        /// Backend.
        backend: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// Connecting failed.
    #[error("{backend}: connecting to {peer} failed: {detail}")]
    Connect {
        /// Backend.
        backend: &'static str,
        /// Peer description (address or identity).
        peer: String,
        /// Cause.
        detail: String,
    },
    /// The peer violated the protocol (malformed frame, bad token, out-of-range write request).
    #[error("{backend}: protocol error with {peer}: {detail}")]
    Protocol {
        /// Backend.
        backend: &'static str,
        /// Peer description.
        peer: String,
        /// What.
        detail: String,
    },
    /// The connection to a peer is gone.
    #[error("{backend}: lost {peer}: {detail}")]
    PeerLost {
        /// Backend.
        backend: &'static str,
        /// Peer description.
        peer: String,
        /// Cause.
        detail: String,
    },
    /// A C library call failed.
    #[error("{backend}: {call} failed with {code} ({detail})")]
    Ffi {
        /// Backend.
        backend: &'static str,
        /// The C function.
        call: &'static str,
        /// Its return code.
        code: i64,
        /// Its error string and context.
        detail: String,
    },
    /// An OS I/O error.
    #[error("{backend}: {context}: {detail}")]
    Io {
        /// Backend.
        backend: &'static str,
        /// What was being done.
        context: String,
        /// The error.
        detail: String,
    },
    /// A wait ran past its deadline.
    #[error("{backend}: {what} did not finish within {after:?}")]
    Timeout {
        /// Backend.
        backend: &'static str,
        /// What was waited on.
        what: String,
        /// How long.
        after: Duration,
    },
    /// Not supported by this backend.
    #[error("{backend}: {what} is not supported")]
    Unsupported {
        /// Backend.
        backend: &'static str,
        /// What.
        what: String,
    },
    /// A notification failed to encode or decode.
    #[error("{backend}: notification codec: {source}")]
    Codec {
        /// Backend.
        backend: &'static str,
        /// Cause.
        source: CodecError,
    },
    /// The endpoint was shut down.
    #[error("{backend}: endpoint is closed")]
    Closed {
        /// Backend.
        backend: &'static str,
    },
}

/// A transport between KV pools.
///
/// Contract, checked by the conformance suite (`kvxfer-conformance`) for every backend:
/// - Regions are registered before they are written or read; ids are unique per endpoint.
/// - `write` moves exactly the bytes of its ops, nothing else; ops outside a registered region
///   (source or peer destination, any stride step) fail before any byte of the batch moves.
/// - Ordering: bytes of a `write` are visible in the peer's memory before its attached notification
///   is delivered there, and before `write` returns (remote completion), so an out-of-band
///   notification sent after `write` returns is never early.
/// - Notifications are delivered at most once per send, in the order sent on one connection
///   (duplicates and reordering across connections are the tracker's job).
/// - Every call that waits honours a deadline or returns promptly; nothing blocks forever.
#[async_trait::async_trait]
pub trait KvTransferBackend: Send + Sync + 'static {
    /// The registry name ("local", "tcp", "ucx", "verbs", "fabric").
    fn name(&self) -> &'static str;

    /// What this backend supports.
    fn capabilities(&self) -> Capabilities;

    /// Registers memory under `id`. Errors if `id` is in use. Peers connected before this call may
    /// need to reconnect to see the region (metadata is a snapshot).
    fn register(&self, id: RegionId, mem: MemRegion) -> Result<(), BackendError>;

    /// Deregisters `id`; later writes naming it fail with [`BackendError::UnknownRegion`].
    fn deregister(&self, id: RegionId) -> Result<(), BackendError>;

    /// This endpoint's metadata: address, registered regions (with remote keys), access token.
    fn metadata(&self) -> Result<EndpointMetadata, BackendError>;

    /// Connects to a peer from its metadata. Rejects another backend's metadata or a version it does
    /// not speak with [`BackendError::BadMetadata`].
    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError>;

    /// Posts `ops` to `peer` and returns when every byte is placed in the peer's memory. With
    /// `notify`, the notification is delivered to the peer after those bytes (attached style).
    /// An empty `ops` with a notification just delivers the notification, ordered after earlier
    /// writes to the same peer.
    async fn write(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<(), BackendError>;

    /// Sends a notification on the out-of-band channel (Mooncake-like).
    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError>;

    /// Waits up to `max_wait` for events and returns those available (possibly none).
    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError>;

    /// Closes the connection to `peer`; its id becomes unknown.
    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError>;
}

/// Builds a backend endpoint.
pub type Constructor = fn(&BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError>;

/// A backend's registry entry, submitted with `inventory::submit!`.
#[derive(Debug)]
pub struct BackendDescriptor {
    /// Registry name.
    pub name: &'static str,
    /// One line for listings.
    pub description: &'static str,
    /// Capabilities (the same the instances report).
    pub capabilities: Capabilities,
    /// Constructor.
    pub create: Constructor,
}

inventory::collect!(BackendDescriptor);

/// Every backend linked into this binary, sorted by name.
pub fn registered() -> Vec<&'static BackendDescriptor> {
    let mut v: Vec<_> = inventory::iter::<BackendDescriptor>.into_iter().collect();
    v.sort_by_key(|d| d.name);
    v
}

/// A backend that is not compiled in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no backend named {name:?} is compiled in; available: {}. Enable its cargo feature on the kvxfer crate (e.g. --features {name})", available.join(", "))]
pub struct UnknownBackend {
    /// The name asked for.
    pub name: String,
    /// The names that are compiled in.
    pub available: Vec<&'static str>,
}

/// Looks a backend up by name.
pub fn lookup(name: &str) -> Result<&'static BackendDescriptor, UnknownBackend> {
    let all = registered();
    all.iter()
        .find(|d| d.name == name)
        .copied()
        .ok_or_else(|| UnknownBackend { name: name.to_owned(), available: all.iter().map(|d| d.name).collect() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stride_bounds() {
        assert!(WriteOp::check_bounds(0, 16, 8, 4, 56).is_ok());
        assert!(WriteOp::check_bounds(0, 16, 8, 4, 55).is_err());
        assert!(WriteOp::check_bounds(u64::MAX - 4, 1, 8, 1, u64::MAX).is_err());
        assert!(WriteOp::check_bounds(0, u64::MAX, 1, 3, u64::MAX).is_err());
        assert!(WriteOp::check_bounds(0, 0, 0, 0, 10).is_err());
    }

    #[test]
    fn metadata_envelope_checks() {
        let m = EndpointMetadata::new("tcp", 7, vec![1]);
        assert!(m.check("tcp").is_ok());
        let e = m.check("ucx").unwrap_err().to_string();
        assert!(e.contains("\"tcp\"") && e.contains("\"ucx\""), "{e}");
        let m = EndpointMetadata { version: METADATA_VERSION + 1, ..m };
        assert!(m.check("tcp").unwrap_err().to_string().contains("version 2"));
    }

    #[test]
    fn unknown_backend_lists_what_exists() {
        let e = lookup("nope").unwrap_err();
        assert!(e.to_string().contains("nope"));
    }
}

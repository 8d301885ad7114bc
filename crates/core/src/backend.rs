//! The transport interface every backend implements, its capabilities, and the registry.
//!
//! A backend moves byte ranges between registered memory regions of endpoints and carries small
//! notifications. It knows nothing of heads, layers or completion: the planner decides which
//! bytes go where, and the tracker decides when a request is done.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::CodecError;
use crate::mem::{MemDesc, MemError, MemKind, MemKinds};
use crate::notify::Notification;

/// A boxed, sendable future (what the object-safe contract types return).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

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
        let err = MemError::out_of_bounds(offset, len.saturating_mul(count), region_len);
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

/// One [`WriteOp`] shape repeated at many pages: what a request on a fragmented pool is made of.
///
/// `template` is the write of page 0 of the source to page 0 of the destination: `count` ranges
/// of `len` bytes per page, at `src_stride` / `dst_stride`. A page spans `count * stride` bytes on
/// each side, so page `p` starts `p * count * stride` bytes after page 0, and a run of `n`
/// consecutive pages is the same ranges continued (`n * count` of them). Each [`PageRun`] of
/// `pages` (source page, destination page, pages in the run) becomes one strided write, merged into
/// one contiguous range where the strides equal `len`. The planner emits one per (layer, kv kind,
/// pair) on a fragmented pool: a 32K-token request on shuffled pages is a few hundred of these
/// rather than hundreds of thousands of [`WriteOp`]s.
///
/// [`KvTransferBackend::post_indexed`] takes them; every backend does (the default expands them
/// into [`WriteOp`]s, [`Capabilities::indexed`] says which backends move them without that step).
/// Bounds are checked per run, with overflow checks, before anything is posted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexedOp {
    template: WriteOp,
    runs: Arc<[crate::plan::PageRun]>,
    start: usize,
    end: usize,
}

impl IndexedOp {
    /// `template` (page 0 to page 0) at every run of `runs`.
    pub fn new(template: WriteOp, runs: Arc<[crate::plan::PageRun]>) -> Self {
        let end = runs.len();
        Self { template, runs, start: 0, end }
    }

    /// The write of source page 0 to destination page 0.
    pub fn template(&self) -> &WriteOp {
        &self.template
    }

    /// The page runs this op writes.
    pub fn runs(&self) -> &[crate::plan::PageRun] {
        &self.runs[self.start..self.end]
    }

    /// The number of [`WriteOp`]s it expands into (one per run): what counts against
    /// [`Limits::max_ops_per_post`].
    pub fn write_ops(&self) -> usize {
        self.end - self.start
    }

    /// Total bytes (saturating).
    pub fn bytes(&self) -> u64 {
        let pages: u64 = self.runs().iter().map(|r| u64::from(r.len)).sum();
        self.template.bytes().saturating_mul(pages)
    }

    /// How many leading runs fit in `bytes` (at least one, when there is one): where to
    /// [`Self::split_off`] to keep a post under a byte budget.
    pub fn runs_within(&self, bytes: u64) -> usize {
        let per_page = self.template.bytes();
        let mut total = 0u64;
        let fit = self
            .runs()
            .iter()
            .take_while(|r| {
                total = total.saturating_add(per_page.saturating_mul(u64::from(r.len)));
                total <= bytes
            })
            .count();
        fit.max(1).min(self.write_ops())
    }

    /// Splits off the runs from `at` on (`at` counted within [`Self::runs`]); both halves share the
    /// run list. `None` when `at` is not strictly inside.
    pub fn split_off(&mut self, at: usize) -> Option<IndexedOp> {
        if at == 0 || at >= self.write_ops() {
            return None;
        }
        let tail =
            IndexedOp { template: self.template, runs: Arc::clone(&self.runs), start: self.start + at, end: self.end };
        self.end = self.start + at;
        Some(tail)
    }

    /// The write of one run, `None` when an offset overflows `u64`.
    pub fn write_of(&self, run: &crate::plan::PageRun) -> Option<WriteOp> {
        let t = &self.template;
        let g = crate::plan::Strided {
            src_offset: t.src_offset,
            dst_offset: t.dst_offset,
            len: t.len,
            count: t.count,
            src_stride: t.src_stride,
            dst_stride: t.dst_stride,
        }
        .at_run(run)?;
        Some(WriteOp {
            src_offset: g.src_offset,
            dst_offset: g.dst_offset,
            len: g.len,
            count: g.count,
            src_stride: g.src_stride,
            dst_stride: g.dst_stride,
            ..*t
        })
    }

    /// The [`WriteOp`]s it stands for, one per run, in order; an offset that overflows is
    /// [`BackendError::OutOfBounds`] (on the side it overflows).
    pub fn writes(
        &self,
        backend: &'static str,
        peer: Option<PeerId>,
    ) -> impl Iterator<Item = Result<WriteOp, BackendError>> + '_ {
        self.runs().iter().map(move |r| self.write_of(r).ok_or_else(|| self.overflow(backend, peer, r)))
    }

    /// The error of a run whose offsets overflow `u64`: out of every region (`region_len`
    /// `u64::MAX`), on the side that overflows.
    fn overflow(&self, backend: &'static str, peer: Option<PeerId>, r: &crate::plan::PageRun) -> BackendError {
        let t = &self.template;
        let at = |offset: u64, stride: u64, page: u32| {
            t.count.checked_mul(stride)?.checked_mul(u64::from(page))?.checked_add(offset)
        };
        let bytes = t.bytes().saturating_mul(u64::from(r.len));
        let (side, region, offset) = match at(t.src_offset, t.src_stride, r.src) {
            None => ("source", t.src, None),
            Some(_) => ("destination", t.dst, at(t.dst_offset, t.dst_stride, r.dst)),
        };
        let source = MemError::out_of_bounds(offset.unwrap_or(u64::MAX), bytes, u64::MAX);
        BackendError::OutOfBounds { backend, side, region, peer, source }
    }

    /// `ops` cut into posts of at most `per_post` writes and about `max_bytes` bytes each (a post
    /// closes once it reaches either; an op is split where one fills; a run larger than
    /// `max_bytes` is a post of its own), in order: what a caller hands
    /// [`KvTransferBackend::post_indexed`] under [`Limits::max_ops_per_post`]. The sessions cut
    /// the same way.
    pub fn batches(ops: impl IntoIterator<Item = IndexedOp>, per_post: usize, max_bytes: u64) -> Vec<Vec<IndexedOp>> {
        let (per_post, max_bytes) = (per_post.max(1), max_bytes.max(1));
        let (mut out, mut batch, mut writes, mut bytes) = (Vec::new(), Vec::new(), 0usize, 0u64);
        for mut op in ops {
            loop {
                let tail = op.split_off(op.runs_within(max_bytes.saturating_sub(bytes)).min(per_post - writes));
                writes += op.write_ops();
                bytes = bytes.saturating_add(op.bytes());
                batch.push(op);
                if writes >= per_post || bytes >= max_bytes {
                    out.push(std::mem::take(&mut batch));
                    (writes, bytes) = (0, 0);
                }
                match tail {
                    Some(t) => op = t,
                    None => break,
                }
            }
        }
        if !batch.is_empty() {
            out.push(batch);
        }
        out
    }

    /// Expands `ops` into [`WriteOp`]s (what the default [`KvTransferBackend::post_indexed`] posts).
    pub fn expand(
        ops: &[IndexedOp],
        backend: &'static str,
        peer: Option<PeerId>,
    ) -> Result<Vec<WriteOp>, BackendError> {
        let mut out = Vec::with_capacity(ops.iter().map(IndexedOp::write_ops).sum());
        for op in ops {
            for w in op.writes(backend, peer) {
                out.push(w?);
            }
        }
        Ok(out)
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

/// What a finished transfer guarantees (see [`Capabilities::completion`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Completion {
    /// [`TransferStatus::Done`] means every byte is visible in the peer's memory (remote
    /// completion). Needed for the out-of-band style: its notification is sent after `Done`.
    Remote,
    /// `Done` means only that the bytes left this endpoint (local completion); they may still be in
    /// flight or be retried by the transport. Such a backend cannot offer the out-of-band style.
    Local,
}

/// Limits of one endpoint. `u64::MAX` means no limit of the backend's own.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Most [`WriteOp`]s one [`KvTransferBackend::post`] takes (more: [`BackendError::Limit`]).
    pub max_ops_per_post: u64,
    /// Largest encoded notification [`KvTransferBackend::notify`] and an attached notification carry.
    pub max_notification_bytes: u64,
    /// Most regions registered at once.
    pub max_regions: u64,
}

impl Limits {
    /// No limits.
    pub const UNLIMITED: Limits =
        Limits { max_ops_per_post: u64::MAX, max_notification_bytes: u64::MAX, max_regions: u64::MAX };

    /// Limits with every field given.
    pub const fn new(max_ops_per_post: u64, max_notification_bytes: u64, max_regions: u64) -> Self {
        Limits { max_ops_per_post, max_notification_bytes, max_regions }
    }
}

/// What one backend endpoint can do, reported per instance (the configured transport decides: a
/// UCX endpoint on tcp and one on shared memory may differ). Tests and sessions consult it; the
/// conformance suite exercises every claim and checks that every unclaimed feature is refused with
/// a typed error ([`BackendError::Unsupported`]).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Supports [`NotifyStyle::Attached`].
    pub attached: bool,
    /// Supports [`NotifyStyle::OutOfBand`] (only with [`Completion::Remote`]).
    pub out_of_band: bool,
    /// Endpoints in different processes can talk (false for the in-process backend).
    pub cross_process: bool,
    /// Endpoints on different hosts can talk.
    pub cross_host: bool,
    /// Memory kinds [`KvTransferBackend::register`] accepts.
    pub memory: MemKinds,
    /// Limits.
    pub limits: Limits,
    /// What [`TransferStatus::Done`] guarantees.
    pub completion: Completion,
    /// [`KvTransferBackend::cut_off`] can confirm the cut-off of a peer instance that is still alive
    /// (its connections closed and its writes refused by this endpoint). `false` (cuda-ipc: legacy
    /// CUDA IPC mappings cannot be revoked) means a cut-off is confirmed only once the peer process
    /// is gone and refused with [`BackendError::Unsupported`] otherwise: pages a live peer given up
    /// on could write stay quarantined.
    pub cut_off_live: bool,
    /// [`KvTransferBackend::post_indexed`] moves [`IndexedOp`]s as they are (its wire or its copy
    /// loop walks the page runs), where `false` means the trait's default expands them into one
    /// [`WriteOp`] per run first. Every backend takes indexed ops either way; this only says
    /// whether the page list travels to the backend's data path whole.
    #[serde(default)]
    pub indexed: bool,
}

impl Capabilities {
    /// Capabilities with the given styles and reach, host memory, no limits and remote completion.
    pub const fn new(attached: bool, out_of_band: bool, cross_process: bool, cross_host: bool) -> Self {
        Capabilities {
            attached,
            out_of_band,
            cross_process,
            cross_host,
            memory: MemKinds::HOST,
            limits: Limits::UNLIMITED,
            completion: Completion::Remote,
            cut_off_live: true,
            indexed: false,
        }
    }

    /// With [`Self::indexed`] set to `native`.
    pub const fn with_indexed(mut self, native: bool) -> Self {
        self.indexed = native;
        self
    }

    /// With these memory kinds.
    pub const fn with_memory(mut self, memory: MemKinds) -> Self {
        self.memory = memory;
        self
    }

    /// With these limits.
    pub const fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// With [`Self::cut_off_live`] set to `live`.
    pub const fn with_cut_off_live(mut self, live: bool) -> Self {
        self.cut_off_live = live;
        self
    }

    /// With this completion guarantee; [`Completion::Local`] also withdraws the out-of-band style.
    pub const fn with_completion(mut self, completion: Completion) -> Self {
        self.completion = completion;
        if matches!(completion, Completion::Local) {
            self.out_of_band = false;
        }
        self
    }

    /// Whether `style` is supported.
    pub fn supports(&self, style: NotifyStyle) -> bool {
        match style {
            NotifyStyle::Attached => self.attached,
            NotifyStyle::OutOfBand => self.out_of_band && self.completion == Completion::Remote,
        }
    }

    /// [`BackendError::Unsupported`] unless `style` is supported.
    pub fn check_style(&self, backend: &'static str, style: NotifyStyle) -> Result<(), BackendError> {
        if self.supports(style) {
            return Ok(());
        }
        Err(BackendError::Unsupported { backend, what: format!("{style} notifications") })
    }

    /// [`BackendError::Unsupported`] unless memory of `kind` can be registered.
    pub fn check_memory(&self, backend: &'static str, kind: &MemKind) -> Result<(), BackendError> {
        if self.memory.contains(kind) {
            return Ok(());
        }
        Err(BackendError::Unsupported {
            backend,
            what: format!("registering {kind} (this endpoint takes: {})", self.memory.names().join(", ")),
        })
    }

    /// [`BackendError::Limit`] when `ops` or an encoded notification of `notification_bytes` exceed
    /// the limits.
    pub fn check_post(&self, backend: &'static str, ops: usize, notification_bytes: usize) -> Result<(), BackendError> {
        if ops as u64 > self.limits.max_ops_per_post {
            return Err(BackendError::Limit {
                backend,
                what: "ops per post",
                asked: ops as u64,
                limit: self.limits.max_ops_per_post,
            });
        }
        if notification_bytes as u64 > self.limits.max_notification_bytes {
            return Err(BackendError::Limit {
                backend,
                what: "notification bytes",
                asked: notification_bytes as u64,
                limit: self.limits.max_notification_bytes,
            });
        }
        Ok(())
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
    /// The cluster's shared secret ([`crate::secret`]). When set, a backend that supports it admits
    /// only connections that prove the same secret by challenge-response, binds each connection to
    /// the identity it proved, and proves itself to the peers it connects to; when unset, it trusts
    /// whoever reaches its ports (the backend's README says what that means for it). Never printed.
    pub secret: Option<crate::secret::Secret>,
}

impl BackendConfig {
    /// A config with an identity and no options.
    pub fn new(identity: u64) -> Self {
        Self { identity, options: BTreeMap::new(), secret: None }
    }

    /// Sets the shared secret.
    pub fn with_secret(mut self, secret: Option<crate::secret::Secret>) -> Self {
        self.secret = secret;
        self
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
    /// A request over one of the endpoint's [`Limits`]; nothing was posted. Split the request.
    #[error("{backend}: {asked} {what} is over this endpoint's limit of {limit}; split the request")]
    Limit {
        /// Backend.
        backend: &'static str,
        /// Which limit.
        what: &'static str,
        /// What was asked for.
        asked: u64,
        /// The limit.
        limit: u64,
    },
    /// The transfer was aborted (what [`Transfer::wait`] answers for an aborted transfer).
    #[error("{backend}: transfer to {peer} was aborted")]
    Aborted {
        /// Backend.
        backend: &'static str,
        /// The peer.
        peer: PeerId,
    },
}

/// Where a posted transfer stands. Only [`TransferStatus::InFlight`] is not final.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferStatus {
    /// Bytes may still move (and, after an abort was asked for, may still land).
    InFlight,
    /// Every byte was placed (at the peer, for [`Completion::Remote`]), and the attached
    /// notification, if any, was delivered after them.
    Done,
    /// The transfer will not complete. This endpoint reads no more of its source. The peer may still
    /// place bytes that were already on the wire until it reports the connection lost
    /// ([`BackendEvent::PeerLost`] comes only after its reader stopped placing bytes).
    Failed(BackendError),
    /// Aborted and fenced: no byte of it can land at the peer any more, and no source byte is read.
    Aborted,
}

impl TransferStatus {
    /// Whether nothing of the transfer moves any more on this side (source pages may be changed).
    pub fn is_final(&self) -> bool {
        !matches!(self, TransferStatus::InFlight)
    }
}

#[derive(Debug)]
struct StateInner {
    status: TransferStatus,
    abort_requested: bool,
}

/// The completion state of one posted transfer, shared between the [`Transfer`] handle and the
/// backend that moves it. Backends set it final exactly once (later calls are ignored).
#[derive(Debug)]
pub struct TransferState {
    backend: &'static str,
    peer: PeerId,
    inner: Mutex<StateInner>,
    changed: tokio::sync::Notify,
}

impl TransferState {
    /// A new in-flight state.
    pub fn new(backend: &'static str, peer: PeerId) -> Arc<Self> {
        Arc::new(Self {
            backend,
            peer,
            inner: Mutex::new(StateInner { status: TransferStatus::InFlight, abort_requested: false }),
            changed: tokio::sync::Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StateInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn finish(&self, status: TransferStatus) -> bool {
        let mut i = self.lock();
        if i.status.is_final() {
            return false;
        }
        i.status = status;
        drop(i);
        self.changed.notify_waiters();
        true
    }

    /// Every byte placed (and the attached notification delivered). Returns whether this call made
    /// the state final.
    pub fn complete(&self) -> bool {
        self.finish(TransferStatus::Done)
    }

    /// The transfer failed with `error`.
    pub fn fail(&self, error: BackendError) -> bool {
        self.finish(TransferStatus::Failed(error))
    }

    /// The abort is fenced: no byte can land any more.
    pub fn aborted(&self) -> bool {
        self.finish(TransferStatus::Aborted)
    }

    /// Whether [`Transfer::abort`] was called: post nothing more of this transfer.
    pub fn abort_requested(&self) -> bool {
        self.lock().abort_requested
    }

    /// The status now.
    pub fn status(&self) -> TransferStatus {
        self.lock().status.clone()
    }

    fn request_abort(&self) -> bool {
        let mut i = self.lock();
        let first = !i.abort_requested && !i.status.is_final();
        i.abort_requested = true;
        first
    }

    /// Waits until the status is final or `deadline` passes; returns the status then.
    pub async fn settled(&self, deadline: Instant) -> TransferStatus {
        loop {
            let mut changed = std::pin::pin!(self.changed.notified());
            changed.as_mut().enable();
            let s = self.status();
            if s.is_final() {
                return s;
            }
            if tokio::time::timeout_at(deadline.into(), changed).await.is_err() {
                return self.status();
            }
        }
    }
}

/// What a backend does when a transfer is aborted: stop posting its remaining pieces and start
/// fencing (cancel, drain or flush). The backend marks the state [`TransferState::aborted`] (or
/// `complete`/`fail`, whichever happened first) once no byte can land any more.
pub trait AbortTransfer: Send + Sync + 'static {
    /// Starts the abort of `state`'s transfer; must not block.
    fn abort(&self, state: &Arc<TransferState>);
}

/// A posted transfer: await it ([`Transfer::wait`]), poll it ([`Transfer::status`]), or abort it
/// ([`Transfer::abort`]).
///
/// Dropping the handle neither waits for nor aborts the transfer: it runs to its end. Source pages
/// must not change, and the destination pages not be reused, until the status is final.
pub struct Transfer {
    state: Arc<TransferState>,
    aborter: Option<Arc<dyn AbortTransfer>>,
    bytes: u64,
}

impl fmt::Debug for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Transfer({} -> {}, {} bytes, {:?})", self.state.backend, self.state.peer, self.bytes, self.status())
    }
}

impl Transfer {
    /// A handle on `state`, aborted through `aborter` (backends call this from `post`).
    pub fn new(state: Arc<TransferState>, aborter: Arc<dyn AbortTransfer>, bytes: u64) -> Self {
        Self { state, aborter: Some(aborter), bytes }
    }

    /// A transfer that is already final (nothing to move, or everything moved inside `post`).
    pub fn finished(backend: &'static str, peer: PeerId, status: TransferStatus, bytes: u64) -> Self {
        let state = TransferState::new(backend, peer);
        state.finish(status);
        Self { state, aborter: None, bytes }
    }

    /// The peer it writes to.
    pub fn peer(&self) -> PeerId {
        self.state.peer
    }

    /// Bytes it moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The status now, without blocking.
    pub fn status(&self) -> TransferStatus {
        self.state.status()
    }

    /// Waits until the transfer is final or `deadline` passes. `Ok` when every byte was placed;
    /// the failure, [`BackendError::Aborted`], or [`BackendError::Timeout`] otherwise. After a
    /// timeout the transfer is still in flight: abort it before reusing its memory.
    pub async fn wait(&self, deadline: Instant) -> Result<(), BackendError> {
        match self.state.settled(deadline).await {
            TransferStatus::Done => Ok(()),
            TransferStatus::Failed(e) => Err(e),
            TransferStatus::Aborted => {
                Err(BackendError::Aborted { backend: self.state.backend, peer: self.state.peer })
            }
            TransferStatus::InFlight => Err(BackendError::Timeout {
                backend: self.state.backend,
                what: format!("transfer of {} bytes to {}", self.bytes, self.state.peer),
                after: deadline.saturating_duration_since(Instant::now()),
            }),
        }
    }

    /// Aborts the transfer and waits for the fence: when this returns `Ok(status)`, no byte of the
    /// transfer can land at the peer any more and no source byte is read; `status` is how it ended
    /// ([`TransferStatus::Done`] if it finished first: abort of a finished transfer is a no-op).
    /// [`BackendError::Timeout`] when the fence did not come by `deadline`: the memory is still in
    /// use; disconnect the peer (which fences every transfer to it) before reusing it.
    pub async fn abort(&self, deadline: Instant) -> Result<TransferStatus, BackendError> {
        if self.state.request_abort() {
            if let Some(a) = &self.aborter {
                a.abort(&self.state);
            }
        }
        match self.state.settled(deadline).await {
            TransferStatus::InFlight => Err(BackendError::Timeout {
                backend: self.state.backend,
                what: format!("abort of a transfer to {}", self.state.peer),
                after: deadline.saturating_duration_since(Instant::now()),
            }),
            s => Ok(s),
        }
    }
}

/// What a backend does to close a registration (see [`Registration`]).
pub trait CloseRegistration: Send + 'static {
    /// Makes the region unknown to new operations, then resolves once no local operation and no
    /// connected peer can touch the memory any more.
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>>;

    /// The same, in the background (the registration was dropped without `close`). Must not block.
    fn close_detached(self: Box<Self>);
}

/// A registered memory region, owned by the caller of [`KvTransferBackend::register`].
///
/// While it lives, the backend may read and write the memory for transfers. [`Registration::close`]
/// resolves when no local operation can touch the memory and every connected peer can no longer
/// write into it (the backend's revoke was acknowledged, or the transport guarantees it); only then
/// may the engine free or repurpose memory it described with [`MemDesc::from_raw_parts`]. Dropping a
/// registration without closing it starts the same close in the background: the memory must then
/// stay valid until the endpoint is dropped. See the [`crate::mem`] module for the whole lifetime.
pub struct Registration {
    id: RegionId,
    backend: &'static str,
    len: u64,
    kind: MemKind,
    /// Only touched through `&mut self` (close, drop); the mutex makes the handle `Sync` without
    /// asking closers to be.
    closer: Mutex<Option<Box<dyn CloseRegistration>>>,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Registration({} {}, {} bytes of {})", self.backend, self.id, self.len, self.kind)
    }
}

impl Registration {
    /// A registration of `mem` under `id`, closed through `closer` (backends call this).
    pub fn new(backend: &'static str, id: RegionId, mem: &MemDesc, closer: Box<dyn CloseRegistration>) -> Self {
        Self { id, backend, len: mem.len() as u64, kind: mem.kind(), closer: Mutex::new(Some(closer)) }
    }

    /// The region id.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// Bytes registered.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the registered range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memory kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// Closes the registration; see the type's docs for what `Ok` guarantees.
    /// [`BackendError::Timeout`] when it did not finish by `deadline`: the region takes no new
    /// operations, but something may still touch the memory, so do not free it.
    pub async fn close(mut self, deadline: Instant) -> Result<(), BackendError> {
        let Some(c) = self.closer.get_mut().unwrap_or_else(|p| p.into_inner()).take() else { return Ok(()) };
        // What the caller allowed, measured before waiting (after the wait it is zero).
        let allowed = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout_at(deadline.into(), c.close()).await {
            Ok(r) => r,
            Err(_) => Err(BackendError::Timeout {
                backend: self.backend,
                what: format!("closing {}", self.id),
                after: allowed,
            }),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(c) = self.closer.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            c.close_detached();
        }
    }
}

/// A transport between KV pools.
///
/// Contract, checked by the conformance suite (`kvxfer-conformance`) for every backend:
/// - Memory is registered before it is written or read; ids are unique per endpoint; a kind the
///   endpoint's [`Capabilities::memory`] lacks is refused with [`BackendError::Unsupported`].
/// - [`post`](Self::post) checks every op (source and peer destination, every stride step) and the
///   [`Limits`] before anything moves: a bad op is an error and nothing is posted. It returns a
///   [`Transfer`] at once; the bytes move in the background.
/// - Ordering: the bytes of a transfer are placed before its attached notification is delivered,
///   and (for [`Completion::Remote`]) before its status becomes [`TransferStatus::Done`], so an
///   out-of-band notification sent after `Done` is never early.
/// - Abort: [`Transfer::abort`] resolves only when no byte of the transfer can land any more.
/// - [`Registration::close`] resolves only when nothing local or remote can touch the memory.
/// - Notifications are delivered at most once per send, in the order sent on one connection
///   (duplicates and reordering across connections are the tracker's job).
/// - Every call that waits honours a deadline or returns promptly; nothing blocks forever.
#[async_trait::async_trait]
pub trait KvTransferBackend: Send + Sync + 'static {
    /// The registry name ("local", "tcp", "ucx", "verbs", "fabric").
    fn name(&self) -> &'static str;

    /// What this endpoint supports (per instance: the configured transport decides).
    fn capabilities(&self) -> Capabilities;

    /// Registers `mem` under `id` (pinning it with the NIC where the transport needs that, which may
    /// take a while: this is async so it does not block the runtime). Errors if `id` is in use, the
    /// kind is not supported, or the region limit is reached. Peers connected before this call may
    /// need to reconnect to see the region (metadata is a snapshot).
    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError>;

    /// This endpoint's metadata: address, registered regions (with remote keys), access token.
    fn metadata(&self) -> Result<EndpointMetadata, BackendError>;

    /// Connects to a peer from its metadata. Rejects another backend's metadata or a version it does
    /// not speak with [`BackendError::BadMetadata`].
    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError>;

    /// Posts `ops` to `peer` and returns a handle at once. With `notify`, the notification is
    /// delivered to the peer after those bytes (attached style). An empty `ops` with a notification
    /// just delivers the notification, ordered after earlier transfers to the same peer that are
    /// done. Errors (bounds, unknown region or peer, limits, unsupported style) mean nothing was
    /// posted.
    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError>;

    /// [`Self::post`] of ops given as page lists against a template (see [`IndexedOp`]): the same
    /// bytes as the [`WriteOp`]s they expand into, in the same order, with the same contract
    /// (checked whole before anything is posted; an error means nothing was posted). Each indexed
    /// op counts as its runs against [`Limits::max_ops_per_post`]. The default expands them and
    /// calls [`Self::post`]; a backend whose data path walks page lists itself overrides it and
    /// says so in [`Capabilities::indexed`].
    fn post_indexed(
        &self,
        peer: PeerId,
        ops: &[IndexedOp],
        notify: Option<&Notification>,
    ) -> Result<Transfer, BackendError> {
        let writes = IndexedOp::expand(ops, self.name(), Some(peer))?;
        self.post(peer, &writes, notify)
    }

    /// [`Self::post`], reading no source byte before the GPU work `order` names completed (see
    /// [`crate::order`]); the host is not blocked for it. The order is captured during the call.
    /// The default takes only [`GpuOrder::Ready`](crate::GpuOrder::Ready); a backend that moves CUDA memory overrides it.
    fn post_ordered(
        &self,
        peer: PeerId,
        ops: &[WriteOp],
        notify: Option<&Notification>,
        order: crate::order::GpuOrder,
    ) -> Result<Transfer, BackendError> {
        if order.is_ready() {
            return self.post(peer, ops, notify);
        }
        Err(BackendError::Unsupported {
            backend: self.name(),
            what: "GPU-ordered sends (a send that waits for a CUDA event)".into(),
        })
    }

    /// Sends a notification on the out-of-band channel (Mooncake-like).
    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError>;

    /// Waits up to `max_wait` for events and returns those available (possibly none).
    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError>;

    /// Closes the connection to `peer`; its id becomes unknown. Resolves after every transfer to
    /// the peer is final.
    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError>;

    /// Cuts off the peer instance that `peer` is connected to (SEMANTICS §6, "known dead"): the
    /// only way a rank that gave up on a peer (its lease expired, the metadata store is
    /// unreachable, a liveness timeout, an abort) learns that the peer can no longer write into its
    /// memory. A stopped process resumes and a partition heals, so giving up is not proof that the
    /// peer stopped: this call makes it so.
    ///
    /// What it does, in one step that cannot be undone:
    /// - closes this connection and every connection the same peer instance opened to this
    ///   endpoint (both directions; nothing more is sent, nothing is waited for from the peer);
    /// - refuses, for this endpoint's lifetime, every later connection, handshake, frame, message
    ///   or write of that instance; the remote keys it holds become useless (revoked, or their
    ///   writes dropped by the receiving side);
    /// - fails every transfer to it (their states become final as soon as no local send still
    ///   reads their source memory).
    ///
    /// `Ok` is the confirmation: from its return on, no byte the cut-off instance sent or will send
    /// can land in this endpoint's registered memory, and no transfer to it reads local memory.
    /// [`CutOff`] says how the backend made it so. `peer` becomes unknown to posts; a second
    /// `cut_off` of it answers at once, with [`BackendError::UnknownPeer`] or (a backend that
    /// remembers the instances it cut off) the first call's outcome.
    ///
    /// Other instances of the same identity are untouched: a restarted process (a new endpoint,
    /// published under a new epoch) connects, and is connected to, as a new peer. An instance is
    /// one endpoint object: the backend tells instances apart by a value each endpoint draws at
    /// creation and carries in its metadata and handshakes.
    ///
    /// An error means the cut-off is not confirmed: the caller must treat the memory the peer could
    /// write as quarantined (never reused) until a later call succeeds. The default refuses
    /// ([`BackendError::Unsupported`]), which quarantines; every kvxfer backend overrides it.
    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        let _ = (peer, reason);
        Err(BackendError::Unsupported { backend: self.name(), what: "cutting a peer off".into() })
    }
}

/// How a backend confirmed a [`KvTransferBackend::cut_off`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CutOff {
    /// Connections (streams, endpoints, queue pairs) closed by the call.
    pub closed: usize,
    /// Transfers to the peer that were still in flight and were failed.
    pub failed_transfers: usize,
    /// The mechanism, in words, for logs ("connections closed, instance refused").
    pub how: &'static str,
}

/// Builds a backend endpoint.
pub type Constructor = fn(&BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError>;

/// One option a backend accepts, as listings show it (`kvxfer backends`): its name, its default and
/// what it does. A backend's [`BackendDescriptor::options`] is the one list of its options: the
/// toolkit's [`crate::toolkit::Options::new`] refuses every name not in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionDoc {
    /// The key in [`BackendConfig::options`] (its environment fallback is
    /// `KVXFER_<BACKEND>_<NAME>`). A name with a `<...>` part (ucx's `ucx.<NAME>`) stands for a
    /// family of keys, which the backend takes out before the toolkit checks the rest.
    pub name: &'static str,
    /// The default, as a user would write the value (`127.0.0.1:0`, `200`, `auto`), or a phrase
    /// where it is computed or left to someone else ("UCX's", "the listen address", "none").
    pub default: &'static str,
    /// One line: what the option does, with its range where it has one.
    pub doc: &'static str,
}

impl OptionDoc {
    /// An option's entry.
    pub const fn new(name: &'static str, default: &'static str, doc: &'static str) -> Self {
        Self { name, default, doc }
    }
}

/// For a backend's tests: every option of `options` whose documented default is a value (every
/// one not named in `phrases`, whose defaults are computed or someone else's) parses, set to that
/// default, to what leaving it unset gives, one at a time and all together. `parse` is the
/// backend's option parser; it must accept a config with no options. Panics naming the first option
/// whose documented default is not its default.
pub fn check_documented_defaults<T: PartialEq + fmt::Debug, E: fmt::Debug>(
    options: &[OptionDoc],
    phrases: &[&str],
    parse: impl Fn(&BackendConfig) -> Result<T, E>,
) {
    let unset = parse(&BackendConfig::new(1)).expect("no options parse");
    let mut all = BackendConfig::new(1);
    for d in options.iter().filter(|d| !phrases.contains(&d.name)) {
        let one = parse(&BackendConfig::new(1).with(d.name, d.default));
        assert_eq!(one.as_ref().ok(), Some(&unset), "{}={} (documented default): {one:?}", d.name, d.default);
        all = all.with(d.name, d.default);
    }
    assert_eq!(parse(&all).ok().as_ref(), Some(&unset), "every documented default at once");
}

/// A backend's registry entry, submitted with `inventory::submit!`.
#[derive(Debug)]
pub struct BackendDescriptor {
    /// Registry name.
    pub name: &'static str,
    /// One line for listings.
    pub description: &'static str,
    /// Capabilities of an endpoint with default options (instances report their own, which the
    /// configured transport decides).
    pub capabilities: Capabilities,
    /// Every option the backend accepts, with its default and one line of docs (empty: none). The
    /// same list the backend gives [`crate::toolkit::Options::new`].
    pub options: &'static [OptionDoc],
    /// Constructor.
    pub create: Constructor,
}

inventory::collect!(BackendDescriptor);

/// Registers a backend with the link-time registry:
/// `kvxfer_core::register_backend!(NAME, "one line", CAPABILITIES, OPTIONS, create);`, where
/// `OPTIONS` is the backend's `&'static [OptionDoc]` (the list its `Options::new` checks keys
/// against). `kvxfer_core::register_backend!(NAME, "one line", CAPABILITIES, create);` registers a
/// backend that lists no options (test backends).
#[macro_export]
macro_rules! register_backend {
    ($name:expr, $description:expr, $capabilities:expr, $create:expr $(,)?) => {
        $crate::register_backend!($name, $description, $capabilities, &[], $create);
    };
    ($name:expr, $description:expr, $capabilities:expr, $options:expr, $create:expr $(,)?) => {
        $crate::inventory::submit! {
            $crate::backend::BackendDescriptor {
                name: $name,
                description: $description,
                capabilities: $capabilities,
                options: $options,
                create: $create,
            }
        }
    };
}

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

    fn runs(list: &[(u32, u32, u32)]) -> Arc<[crate::plan::PageRun]> {
        list.iter().map(|&(src, dst, len)| crate::plan::PageRun { src, dst, len }).collect()
    }

    #[test]
    fn indexed_ops_expand_split_and_refuse_overflow() {
        // 4 ranges of 8 bytes per page, 16 apart on the source and 32 on the destination.
        let t = WriteOp {
            src: RegionId(1),
            src_offset: 8,
            dst: RegionId(2),
            dst_offset: 0,
            len: 8,
            count: 4,
            src_stride: 16,
            dst_stride: 32,
        };
        let mut op = IndexedOp::new(t, runs(&[(0, 3, 1), (5, 1, 2)]));
        let w = IndexedOp::expand(std::slice::from_ref(&op), "t", None).unwrap();
        assert_eq!(
            w,
            vec![
                WriteOp { dst_offset: 3 * 128, ..t },
                WriteOp { src_offset: 8 + 5 * 64, dst_offset: 128, count: 8, ..t },
            ]
        );
        assert_eq!(op.bytes(), 3 * 32);
        assert!(op.split_off(0).is_none() && op.split_off(2).is_none());
        let tail = op.split_off(1).unwrap();
        assert_eq!((op.write_ops(), tail.write_ops()), (1, 1));
        assert_eq!(tail.runs()[0].src, 5);
        let two = IndexedOp::new(t, runs(&[(0, 3, 1), (5, 1, 2)]));
        assert_eq!((two.runs_within(0), two.runs_within(32), two.runs_within(95), two.runs_within(96)), (1, 1, 1, 2));
        // Batches of at most 3 writes: three ops of 2 runs become [2, 1] and [1, 2].
        let three = IndexedOp::new(t, runs(&[(0, 0, 1), (1, 1, 1)]));
        let sizes = |b: Vec<Vec<IndexedOp>>| -> Vec<Vec<usize>> {
            b.iter().map(|b| b.iter().map(IndexedOp::write_ops).collect()).collect()
        };
        let b = IndexedOp::batches(vec![three.clone(), three.clone(), three.clone()], 3, u64::MAX);
        assert_eq!(sizes(b), vec![vec![2, 1], vec![1, 2]]);
        // And at most 64 bytes (two runs of 32): [2], [2], [2]; a budget under one run: one run each.
        assert_eq!(
            sizes(IndexedOp::batches(vec![three.clone(), three.clone(), three.clone()], 8, 64)),
            vec![vec![2]; 3]
        );
        assert_eq!(sizes(IndexedOp::batches(vec![three.clone(), three], 8, 1)), vec![vec![1]; 4]);
        // Contiguous pages merge into one range per run.
        let c = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 64);
        let op = IndexedOp::new(WriteOp { count: 2, len: 32, src_stride: 32, dst_stride: 32, ..c }, runs(&[(2, 0, 3)]));
        assert_eq!(
            IndexedOp::expand(&[op], "t", None).unwrap(),
            vec![WriteOp { src_offset: 128, ..WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 192) }]
        );
        // A page index whose offset overflows u64 is refused, naming the side.
        let op = IndexedOp::new(WriteOp { src_stride: u64::MAX / 2, ..t }, runs(&[(0, 0, 1), (7, 0, 1)]));
        let e = IndexedOp::expand(&[op], "t", Some(PeerId(3))).unwrap_err();
        assert!(
            matches!(e, BackendError::OutOfBounds { side: "source", region: RegionId(1), peer: Some(PeerId(3)), .. }),
            "{e}"
        );
        let op = IndexedOp::new(t, runs(&[(0, u32::MAX, 1)]));
        let op = IndexedOp { template: WriteOp { dst_stride: u64::MAX / 8, ..t }, ..op };
        let e = IndexedOp::expand(&[op], "t", None).unwrap_err();
        assert!(matches!(e, BackendError::OutOfBounds { side: "destination", .. }), "{e}");
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

    fn no_endpoint(_: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        Err(BackendError::Config { backend: "test", detail: "no endpoint".into() })
    }

    const TEST_OPTIONS: &[OptionDoc] = &[OptionDoc::new("depth", "4", "queue depth (1..=64)")];
    crate::register_backend!(
        "core-test-options",
        "test: lists options",
        Capabilities::new(true, true, false, false),
        TEST_OPTIONS,
        no_endpoint
    );
    crate::register_backend!(
        "core-test-plain",
        "test: lists none",
        Capabilities::new(true, true, false, false),
        no_endpoint,
    );

    #[test]
    fn descriptors_carry_their_options() {
        let d = lookup("core-test-options").unwrap();
        assert_eq!(d.options, TEST_OPTIONS);
        assert_eq!((d.options[0].name, d.options[0].default), ("depth", "4"));
        assert!(lookup("core-test-plain").unwrap().options.is_empty());
    }

    #[test]
    fn unknown_backend_lists_what_exists() {
        let e = lookup("nope").unwrap_err();
        assert!(e.to_string().contains("nope"));
    }
}

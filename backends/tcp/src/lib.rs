//! kvxfer TCP backend: a pure-Rust tokio transport between KV pools of different processes and hosts.
//!
//! - **Data path without staging copies.** The sender writes frame headers plus payload straight from
//!   read guards of registered source memory with vectored writes; the receiver validates a frame's
//!   op descriptors against its region table, takes write guards of every destination piece, then
//!   reads the payload straight into them with vectored reads. A strided op travels as one descriptor.
//!   No `unsafe` in this crate: memory is touched only through `MemDesc::read_guard`/`write_guard`.
//! - **Transfers.** [`KvTransferBackend::post`] checks everything, queues the frames and returns a
//!   [`Transfer`] at once. It completes when the receiver acknowledged every frame (remote
//!   completion), so an out-of-band notification sent after it is never early. Abort drops the frames
//!   no stream started yet and resolves once every started frame was acknowledged.
//! - **Both notification styles.** Attached notifications ride on data stream 0 after the data and
//!   are delivered only once every stream's part of the batch is placed (never for an aborted batch);
//!   out-of-band notifications use a separate control stream.
//! - **Several streams per peer** (`connections`), a post's frames dealt over them by bytes; each
//!   stream runs on a thread of its own (a current-thread runtime watching only that socket).
//! - **Authentication** ([`BackendConfig::secret`], the cluster secret). Every stream opens with a
//!   challenge-response handshake: the listener sends a fresh nonce, the connecting side answers with
//!   an HMAC of the secret over that nonce, its own nonce, both identities, the link and stream ids
//!   and the token, and the listener answers with its own proof over the whole exchange (mutual; no
//!   reusable token crosses the wire, and a captured exchange does not verify on another stream).
//!   Endpoints connect only when both have the same secret or neither has one; a mismatch fails
//!   `connect` naming authentication. With a secret every notification, attached or out of band,
//!   must be keyed with the identity its stream proved ([`Notification::is_from`]); one that is not
//!   is never delivered, is counted ([`TcpBackend::forged_notifications`]), fails the link and is
//!   reported as [`BackendEvent::PeerLost`]. Without a secret nothing is authenticated: anyone who
//!   has the endpoint's metadata can write into its registered regions and notify with any key (the
//!   embedded default for local use). The handshake is bounded by `handshake_timeout_s`.
//! - **Wire safety.** A random per-endpoint token, carried only in the endpoint metadata, is checked
//!   in the handshake (with or without a secret). Every WRITE frame is checked against the
//!   receiver's registered regions (every stride step, payload length, overlaps with itself and with
//!   frames in flight on other streams) before one byte is placed; a violation answers an ERROR frame
//!   and closes the link's streams, nothing written. Malformed frames are protocol errors, never
//!   panics.
//! - **Peer loss** fails the link's transfers (error naming the peer and the cause) and reports
//!   [`BackendEvent::PeerLost`] with the peer's identity on both sides.
//! - **Cutting a peer off** ([`KvTransferBackend::cut_off`]): every endpoint draws a random
//!   instance at creation, publishes it in its metadata and carries it in every HELLO. A cut-off
//!   fails the outgoing link to the peer, bans the peer's (identity, instance) under the lock that
//!   admits incoming streams, stops every incoming stream of that instance and resolves once each
//!   one left its frame loop: a stream checks the stop signal before it admits each frame, so
//!   after the call returns nothing that instance sent or sends is placed or delivered, and none of
//!   its later connections passes the handshake. A restarted process is a new instance.
//!
//! The wire protocol is in [`wire`] and the crate README. Options (`BackendConfig::options`, with
//! environment fallbacks `KVXFER_TCP_<OPTION>`): `listen` (default `127.0.0.1:0`), `advertise`
//! (host put in the metadata; default: the listen address, or 127.0.0.1 when it is unspecified),
//! `connections` (data streams per peer, default 1), `timeout_s` (connect, rest-of-a-frame once its
//! first byte arrived, acknowledgement, notification and disconnect deadline, default 120),
//! `handshake_timeout_s` (a stream's whole handshake, default 5), `max_handshakes` (incoming
//! connections in their handshake at once, in total, default 256) and `max_handshakes_per_source`
//! (the same per source IP address, default 64; a connection beyond either is refused at once,
//! naming the limit), `socket_buffer`
//! (SO_SNDBUF/SO_RCVBUF in bytes, default 0: the kernel's autotuning), `poll_us` (how long a
//! stream polls its socket before sleeping, a receiver an empty one mid-frame or while more frames
//! of a batch are due and a sender a full send buffer, default 200; 0 never polls), `tls` (`on`/`off`, default
//! off), `tls_cert`, `tls_key`, `tls_ca` (PEM files; default: `KVXFER_TLS_CERT`, `KVXFER_TLS_KEY`,
//! `KVXFER_TLS_CA`).
//!
//! - **TLS** (`tls=on`). Every stream of every link, data and control, runs TLS 1.3 over its socket
//!   with mutual authentication under one cluster CA ([`kvxfer_tls`]), and the handshake above
//!   (token, cluster secret) runs inside it unchanged. The metadata says whether an endpoint
//!   requires TLS, so `connect` between a TLS and a plaintext endpoint fails at once naming TLS.
//!   The plaintext path is unchanged (the stream types are enums whose plaintext arm is the socket
//!   itself); with TLS rustls copies every byte into and out of its record buffers.

pub mod wire;

pub use limits::{HandshakeRefusals, LimitRefusal};

mod conn;

#[cfg(any(fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod io;
mod limits;
mod recv;
mod send;
mod sock;
mod staging;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::{EventQueue, Options, PeerTable, RegionTable};
use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, BoxFuture, Capabilities, CloseRegistration, Completion, CutOff,
    EndpointMetadata, KvTransferBackend, Limits, MemDesc, MemKinds, Notification, OptionDoc, PeerId, RegionId,
    Registration, Transfer, TransferState, TransferStatus, WriteOp,
};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio::task::AbortHandle;

use crate::conn::{Conn, Sock};
use crate::recv::Shared;
use crate::send::{Item, Link, SrcOp};
use crate::wire::{Hello, OpDesc, StreamKind};

/// Registry name.
pub const NAME: &str = "tcp";

/// Most ops one post takes: the frame format has no limit of its own (a post becomes as many frames
/// as it needs), this bounds the memory one post's books take.
pub const MAX_OPS_PER_POST: u64 = 1 << 20;

/// What a TCP endpoint supports: both styles, across processes and hosts, host memory, remote
/// completion; notifications up to what a NOTE frame carries.
pub const CAPABILITIES: Capabilities = Capabilities::new(true, true, true, true)
    .with_memory(MemKinds::HOST)
    .with_limits(Limits::new(MAX_OPS_PER_POST, wire::MAX_NOTE as u64, u64::MAX))
    .with_completion(Completion::Remote)
    .with_indexed(true);

/// Every option of a TCP endpoint, with its default and what it does: the list
/// [`TcpOptions::from_config`] checks keys against and `kvxfer backends` prints.
pub const OPTIONS: &[OptionDoc] = &[
    OptionDoc::new("listen", "127.0.0.1:0", "address to listen on (0.0.0.0:0 or a NIC address for other hosts)"),
    OptionDoc::new(
        "advertise",
        "the listen address (127.0.0.1 if unspecified)",
        "host or IP put in the metadata for peers to connect to",
    ),
    OptionDoc::new("connections", "1", "data streams per peer (1..=64), plus one control stream"),
    OptionDoc::new(
        "timeout_s",
        "120",
        "seconds for connect, the rest of a frame, an acknowledgement, a notification, a disconnect (up to 86400)",
    ),
    OptionDoc::new(
        "handshake_timeout_s",
        "5",
        "seconds from an incoming stream's accept to its complete HELLO, and for each answer (up to 3600)",
    ),
    OptionDoc::new(
        "max_handshakes",
        "256",
        "incoming connections in their handshake at once, in total (1..=1048576); one beyond is refused at once",
    ),
    OptionDoc::new("max_handshakes_per_source", "64", "the same per source IP address (1..=1048576)"),
    OptionDoc::new(
        "socket_buffer",
        "0",
        "SO_SNDBUF and SO_RCVBUF of every stream in bytes (0: the kernel's autotuning; up to 1073741824)",
    ),
    OptionDoc::new(
        "poll_us",
        "200",
        "microseconds a stream polls its socket before it sleeps: a receiver mid-frame or while more frames of a batch are due, a sender on a full send buffer (0..=1000000; 0: never polls)",
    ),
    OptionDoc::new("tls", "off", "on: every stream runs TLS 1.3 with mutual authentication; off: plaintext"),
    OptionDoc::new("tls_cert", "KVXFER_TLS_CERT", "this endpoint's certificate (chain), PEM; with tls=on only"),
    OptionDoc::new("tls_key", "KVXFER_TLS_KEY", "its private key, PEM (PKCS#8, PKCS#1 or SEC1)"),
    OptionDoc::new("tls_ca", "KVXFER_TLS_CA", "the cluster CA certificate(s), PEM: the only roots trusted for peers"),
];

kvxfer_core::register_backend!(
    NAME,
    "pure-Rust TCP (tokio): vectored zero-copy frames, challenge-response handshake, both notification styles",
    CAPABILITIES,
    OPTIONS,
    create,
);

/// Builds a TCP endpoint from a config. Inside a tokio runtime, the endpoint's listener and accept
/// task live on that runtime; outside one, on a small process-wide background runtime.
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    Ok(Arc::new(TcpBackend::new(config)?))
}

/// Parsed options of a TCP endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpOptions {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Host or IP to advertise in the metadata (default: the bound address).
    pub advertise: Option<String>,
    /// Data streams per peer.
    pub connections: u32,
    /// Deadline for connect, the rest of a frame once its first byte arrived, an acknowledgement,
    /// a notification and a disconnect.
    pub timeout: Duration,
    /// Deadline of a stream's handshake: an incoming stream must complete its HELLO within it from
    /// its accept (else it is closed), and a connecting side waits at most this long for each answer.
    pub handshake_timeout: Duration,
    /// Most incoming connections in their handshake at once, in total (`max_handshakes`); one
    /// beyond is refused at once, naming the limit.
    pub max_handshakes: u32,
    /// Most incoming connections in their handshake at once from one source IP address
    /// (`max_handshakes_per_source`); one beyond is refused at once, naming the limit.
    pub max_handshakes_per_source: u32,
    /// SO_SNDBUF and SO_RCVBUF requested for every stream, in bytes (0: the kernel's autotuning).
    pub socket_buffer: u32,
    /// How long a receiving stream polls its empty socket before it sleeps (zero: never polls).
    pub poll: Duration,
    /// Whether every stream runs TLS (`tls=on`).
    pub tls: bool,
    /// The PEM files of `tls_cert`, `tls_key` and `tls_ca` (`None`: not given, so with `tls=on`
    /// the `KVXFER_TLS_*` variables name them).
    pub tls_files: Option<kvxfer_tls::TlsFiles>,
}

/// Default of the `connections` option: one data stream per peer. On the 2-core development
/// machine one polling stream beat two sleeping ones at every block size (see
/// `recv::DEFAULT_POLL`). Two polling streams were slower than two sleeping ones when measured on
/// 2026-12-02, with 8 MiB frames (every core busy copying); not re-measured with 1 MiB frames.
/// More streams can pay across hosts, where one flow may not fill the link.
pub const DEFAULT_CONNECTIONS: u32 = 1;

impl TcpOptions {
    /// Parses `config.options`, falling back to `KVXFER_TCP_<OPTION>` environment variables, then
    /// to the defaults. Unknown options are an error that lists the known ones.
    pub fn from_config(config: &BackendConfig) -> Result<Self, BackendError> {
        let o = Options::new(NAME, config, OPTIONS)?;
        let tls = o.flag("tls", false)?;
        let files = ["tls_cert", "tls_key", "tls_ca"].map(|k| (k, o.get(k).filter(|v| !v.trim().is_empty())));
        let given: Vec<&str> = files.iter().filter(|(_, v)| v.is_some()).map(|(k, _)| *k).collect();
        let config = |detail: String| BackendError::Config { backend: NAME, detail };
        let tls_files = match (tls, given.len()) {
            (_, 0) => None,
            (false, _) => {
                return Err(config(format!(
                    "{} given but tls is off: set tls=on to encrypt the streams with them, or drop them",
                    given.join(", ")
                )))
            }
            (true, 3) => {
                let [c, k, a] = files.map(|(_, v)| std::path::PathBuf::from(v.unwrap_or_default()));
                Some(kvxfer_tls::TlsFiles { cert: c, key: k, ca: a })
            }
            (true, _) => {
                let missing: Vec<&str> = files.iter().filter(|(_, v)| v.is_none()).map(|(k, _)| *k).collect();
                return Err(config(format!(
                    "tls=on with {} but not {}: give all of tls_cert, tls_key and tls_ca (PEM files), or none \
                     to use {}, {} and {}",
                    given.join(", "),
                    missing.join(", "),
                    kvxfer_tls::CERT_ENV,
                    kvxfer_tls::KEY_ENV,
                    kvxfer_tls::CA_ENV
                )));
            }
        };
        Ok(Self {
            listen: o.parse("listen", SocketAddr::from(([127, 0, 0, 1], 0)), "an address like 127.0.0.1:0")?,
            advertise: o.get("advertise"),
            connections: o.int_in("connections", DEFAULT_CONNECTIONS, 1..=64)?,
            timeout: o.seconds("timeout_s", Duration::from_secs(120), 86_400.0)?,
            handshake_timeout: o.seconds("handshake_timeout_s", recv::DEFAULT_HANDSHAKE, 3_600.0)?,
            max_handshakes: o.int_in("max_handshakes", limits::DEFAULT_MAX_HANDSHAKES, 1..=1 << 20)?,
            max_handshakes_per_source: o.int_in(
                "max_handshakes_per_source",
                limits::DEFAULT_MAX_HANDSHAKES_PER_SOURCE,
                1..=1 << 20,
            )?,
            socket_buffer: o.int_in("socket_buffer", sock::DEFAULT_BUFFER, 0..=1 << 30)?,
            poll: Duration::from_micros(o.int_in("poll_us", recv::DEFAULT_POLL.as_micros() as u64, 0..=1_000_000)?),
            tls,
            tls_files,
        })
    }

    /// The TLS setup these options ask for: `None` with `tls=off`; with `tls=on`, the files of
    /// `tls_cert`/`tls_key`/`tls_ca`, else those `KVXFER_TLS_CERT`/`KEY`/`CA` name, else an error
    /// saying how to make a pair.
    pub fn load_tls(&self) -> Result<Option<kvxfer_tls::Tls>, BackendError> {
        let config = |detail: String| BackendError::Config { backend: NAME, detail };
        if !self.tls {
            return Ok(None);
        }
        let loaded = match &self.tls_files {
            Some(f) => kvxfer_tls::Tls::from_files(f, None).map(Some),
            None => kvxfer_tls::Tls::from_env(),
        };
        match loaded {
            Ok(Some(t)) => Ok(Some(t)),
            Ok(None) => Err(config(format!(
                "tls=on but no certificate is configured: missing tls_cert, tls_key and tls_ca (PEM files: this \
                 rank's certificate and key, and the cluster CA), and {}, {} and {} are not set; for a demo, \
                 make a self-signed cluster pair with `cargo run -p kvxfer-tls --example generate -- DIR` \
                 (kvxfer_tls::Tls::generate) and give every endpoint the same three files",
                kvxfer_tls::CERT_ENV,
                kvxfer_tls::KEY_ENV,
                kvxfer_tls::CA_ENV
            ))),
            Err(e) => Err(config(format!("tls=on: {e}"))),
        }
    }
}

/// The backend-specific part of [`EndpointMetadata::payload`] (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpMetadata {
    /// Wire protocol version.
    pub protocol: u16,
    /// `host:port` to connect to.
    pub addr: String,
    /// Access token, hex.
    pub token: String,
    /// Registered regions and their lengths at the time of the snapshot.
    pub regions: Vec<(u32, u64)>,
    /// Whether the endpoint requires TLS on every stream (`tls=on`). Absent (false) for a plaintext
    /// endpoint, whose metadata is then what it was before TLS existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls: bool,
    /// The endpoint's instance (random, drawn at creation; protocol 4).
    pub instance: u64,
}

impl TcpMetadata {
    /// Parses a peer's metadata envelope.
    pub fn from_envelope(meta: &EndpointMetadata) -> Result<Self, BackendError> {
        let bad = |detail: String| BackendError::BadMetadata { backend: NAME, detail };
        meta.check(NAME)?;
        let m: Self =
            serde_json::from_slice(&meta.payload).map_err(|e| bad(format!("payload is not TCP metadata: {e}")))?;
        if m.protocol != wire::PROTOCOL_VERSION {
            return Err(bad(format!("peer speaks protocol {}, this build {}", m.protocol, wire::PROTOCOL_VERSION)));
        }
        Ok(m)
    }

    /// The token as bytes.
    pub fn token_bytes(&self) -> Result<[u8; wire::TOKEN_LEN], BackendError> {
        from_hex(&self.token).ok_or_else(|| BackendError::BadMetadata {
            backend: NAME,
            detail: format!("token is not {} hex bytes", wire::TOKEN_LEN),
        })
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex(s: &str) -> Option<[u8; wire::TOKEN_LEN]> {
    // Hex digits only: `from_str_radix` alone also takes a sign (`+f`).
    if s.len() != 2 * wire::TOKEN_LEN || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; wire::TOKEN_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Random bytes from the OS, through the one source in core ([`kvxfer_core::secret::random_bytes`]).
fn random_bytes<const N: usize>() -> Result<[u8; N], BackendError> {
    kvxfer_core::secret::random_bytes().map_err(|e| BackendError::Io {
        backend: NAME,
        context: "drawing random bytes (access token, instance and link ids)".into(),
        detail: e.to_string(),
    })
}

/// A background runtime for endpoints created outside any tokio runtime (e.g. to read capabilities).
fn fallback_runtime() -> Result<tokio::runtime::Handle, BackendError> {
    static RT: std::sync::OnceLock<Result<tokio::runtime::Runtime, String>> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvxfer-tcp")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map(|rt| rt.handle().clone())
    .map_err(|e| BackendError::Io {
        backend: NAME,
        context: "starting a background tokio runtime".into(),
        detail: e.clone(),
    })
}

/// A TCP endpoint: listens for peers that write into its registered regions, and connects to
/// peers to write into theirs.
pub struct TcpBackend {
    shared: Arc<Shared>,
    opts: TcpOptions,
    advertised: String,
    peers: PeerTable<Link>,
    accept: AbortHandle,
    rt: tokio::runtime::Handle,
}

impl std::fmt::Debug for TcpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBackend").field("identity", &self.shared.identity).field("addr", &self.advertised).finish()
    }
}

impl TcpBackend {
    /// `post_ordered` of `n` writes (each checked before anything is queued; an `Err` item is
    /// returned as it is, nothing posted).
    fn post_writes(
        &self,
        peer: PeerId,
        n: usize,
        ops: impl Iterator<Item = Result<WriteOp, BackendError>>,
        notify: Option<&Notification>,
        order: kvxfer_core::GpuOrder,
    ) -> Result<Transfer, BackendError> {
        // The send's GPU order, captured now: no source byte is read before it completed.
        let gate = kvxfer_cuda::order::send_gate(NAME, order)?;
        let link = self.peers.get(peer)?;
        link.state.check()?;
        let note = notify
            .map(Notification::encode)
            .transpose()
            .map_err(|source| BackendError::Codec { backend: NAME, source })?;
        CAPABILITIES.check_post(NAME, n, note.as_ref().map_or(0, Vec::len))?;
        // Check every op before queueing a byte; hold the source regions until the transfer is final.
        let mut srcs = Vec::new();
        let mut slots: HashMap<RegionId, usize> = HashMap::new();
        let mut items = Vec::with_capacity(n);
        let mut total = 0u64;
        for op in ops {
            let op = op?;
            let slot = match slots.get(&op.src) {
                Some(s) => *s,
                None => {
                    srcs.push(self.shared.regions.get(op.src, None)?);
                    slots.insert(op.src, srcs.len() - 1);
                    srcs.len() - 1
                }
            };
            op.check_src(NAME, None, srcs[slot].len())?;
            let dst_len = *link.regions.get(&op.dst).ok_or(BackendError::UnknownRegion {
                backend: NAME,
                region: op.dst,
                peer: Some(peer),
            })?;
            op.check_dst(NAME, Some(peer), dst_len)?;
            if op.len == 0 {
                continue;
            }
            if op.count > 1 && op.dst_stride < op.len {
                return Err(BackendError::Unsupported {
                    backend: NAME,
                    what: format!(
                        "a destination stride ({}) smaller than the range length ({}): the op's ranges overlap",
                        op.dst_stride, op.len
                    ),
                });
            }
            total += op.bytes();
            let src = SrcOp { slot, offset: op.src_offset, stride: op.src_stride, len: op.len, count: op.count };
            items.push(Item { src, dst: OpDesc::of(&op) });
        }
        let descs: Vec<OpDesc> = items.iter().map(|i| i.dst).collect();
        wire::check_disjoint(&descs).map_err(|e| BackendError::Unsupported {
            backend: NAME,
            what: format!("overlapping destination ranges in one post ({e})"),
        })?;
        if items.is_empty() && note.is_none() {
            return Ok(Transfer::finished(NAME, peer, TransferStatus::Done, 0));
        }
        let frames = send::plan(items, link.streams(), total);
        let xfer = link.send(TransferState::new(NAME, peer), srcs, frames, note, gate)?;
        Ok(Transfer::new(Arc::clone(&xfer.state), xfer, total))
    }

    /// Binds the listener and starts accepting.
    pub fn new(config: &BackendConfig) -> Result<Self, BackendError> {
        let opts = TcpOptions::from_config(config)?;
        let tls = opts.load_tls()?;
        let rt = match tokio::runtime::Handle::try_current() {
            Ok(h) => h,
            Err(_) => fallback_runtime()?,
        };
        let io_err =
            |context: String, e: std::io::Error| BackendError::Io { backend: NAME, context, detail: e.to_string() };
        let listener = {
            let _guard = rt.enter();
            sock::listen(opts.listen, opts.socket_buffer).map_err(|e| io_err(format!("binding {}", opts.listen), e))?
        };
        let local = listener.local_addr().map_err(|e| io_err("reading the listen address".into(), e))?;
        let host = match &opts.advertise {
            Some(h) => h.clone(),
            None if local.ip().is_unspecified() => "127.0.0.1".into(),
            None => local.ip().to_string(),
        };
        let advertised = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{}", local.port())
        } else {
            format!("{host}:{}", local.port())
        };
        let shared = Arc::new(
            Shared::new(
                config.identity,
                random_bytes()?,
                u64::from_le_bytes(random_bytes()?),
                RegionTable::new(NAME, CAPABILITIES.limits.max_regions),
                Arc::new(EventQueue::new()),
                opts.timeout,
            )
            .with_poll(opts.poll)
            .with_auth(config.secret.clone(), opts.handshake_timeout)
            .with_limits(opts.max_handshakes, opts.max_handshakes_per_source)
            .with_tls(tls),
        );
        let accept = rt.spawn(recv::accept_loop(Arc::clone(&shared), listener)).abort_handle();
        Ok(Self { shared, opts, advertised, peers: PeerTable::new(NAME), accept, rt })
    }

    /// The options in effect.
    pub fn options(&self) -> &TcpOptions {
        &self.opts
    }

    /// The `host:port` peers connect to.
    pub fn address(&self) -> &str {
        &self.advertised
    }

    /// This endpoint's instance: drawn at creation, published in the metadata and carried in every
    /// HELLO, so that a peer that cut this endpoint off refuses it while a restarted process (a new
    /// endpoint) is admitted.
    pub fn instance(&self) -> u64 {
        self.shared.instance
    }

    /// Whether this endpoint has a cluster secret (authenticates every stream and binds
    /// notifications to the identity each stream proved).
    pub fn authenticates(&self) -> bool {
        self.shared.secret.is_some()
    }

    /// Whether every stream of this endpoint runs TLS (`tls=on`).
    pub fn encrypts(&self) -> bool {
        self.shared.tls.is_some()
    }

    /// Notifications refused so far because their key was not the identity their stream proved
    /// (each failed its link, reported as `PeerLost`).
    pub fn forged_notifications(&self) -> u64 {
        self.shared.forged.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Incoming handshakes refused so far: malformed, wrong token, failed authentication, a misused
    /// link id, none complete within the handshake deadline, or beyond `max_handshakes` or
    /// `max_handshakes_per_source` (see [`Self::handshake_refusals`] for the breakdown).
    pub fn refused_handshakes(&self) -> u64 {
        self.shared.refusals.snapshot().total()
    }

    /// Incoming handshakes refused so far, by reason.
    pub fn handshake_refusals(&self) -> HandshakeRefusals {
        self.shared.refusals.snapshot()
    }

    /// Opens one stream of a link: connect, TLS when this endpoint has it, then the handshake
    /// (CHALLENGE, HELLO, reply) inside it, each step awaited for at most the handshake deadline.
    async fn open_stream(&self, m: &TcpMetadata, expect_identity: u64, hello: Hello) -> Result<Conn, BackendError> {
        let conn = |detail: String| BackendError::Connect { backend: NAME, peer: m.addr.clone(), detail };
        let protocol = |e: wire::WireError| BackendError::Protocol { backend: NAME, peer: m.addr.clone(), detail: e.0 };
        let (t, hs) = (self.opts.timeout, self.opts.handshake_timeout);
        let tcp = tokio::time::timeout(t, sock::connect(&m.addr, self.opts.socket_buffer))
            .await
            .map_err(|_| conn(format!("no connection within {t:?}")))?
            .map_err(|e| conn(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let mut s = match &self.shared.tls {
            None => Conn::Plain(tcp),
            Some(tls) => {
                let t = tls.connect_over(Sock::new(tcp), &m.addr, hs).await.map_err(|e| {
                    conn(format!(
                        "{e} (a TLS listener also closes a connection at once beyond its max_handshakes or \
                         max_handshakes_per_source limit: its log names the limit)"
                    ))
                })?;
                Conn::Tls(Box::new(t.into()))
            }
        };
        // What a failure before the challenge may mean, by this end's setting.
        let hint = if s.is_tls() {
            "; TLS: the peer may have refused this endpoint's certificate (both need certificates of one cluster CA)"
        } else {
            "; an endpoint with tls=on never answers a plaintext client (does its metadata say tls?)"
        };
        let mut cb = [0u8; wire::CHALLENGE_LEN];
        tokio::time::timeout(hs, s.read_exact(&mut cb))
            .await
            .map_err(|_| conn(format!("no handshake challenge within {hs:?} (handshake_timeout_s){hint}")))?
            .map_err(|e| conn(format!("handshake: reading the challenge: {e}{hint}")))?;
        let challenge = wire::Challenge::decode(&cb).map_err(protocol)?;
        if challenge.identity != expect_identity {
            return Err(conn(format!(
                "metadata names identity {expect_identity:#x} but the endpoint at this address is {:#x} (stale metadata?)",
                challenge.identity
            )));
        }
        let secret = self.shared.secret.as_ref();
        if secret.is_some() && !challenge.secret {
            return Err(conn(wire::AuthFailure::PeerHasNoSecret.to_string()));
        }
        let hello = match secret {
            Some(sec) => hello.sign(sec, &cb),
            None => hello,
        };
        let hb = hello.encode();
        let exchange = async {
            s.send(&hb).await?;
            let mut rep = [0u8; wire::HELLO_REPLY_LEN];
            s.read_exact(&mut rep).await?;
            Ok::<_, std::io::Error>(rep)
        };
        let rep = tokio::time::timeout(hs, exchange)
            .await
            .map_err(|_| conn(format!("no handshake answer within {hs:?} (handshake_timeout_s)")))?
            .map_err(|e| conn(format!("handshake: {e}")))?;
        let head = wire::decode_hello_reply(&rep).map_err(protocol)?;
        if head.rejected {
            let mut reason = vec![0u8; head.reason_len as usize];
            let _ = tokio::time::timeout(hs, s.read_exact(&mut reason)).await;
            return Err(conn(format!("handshake rejected by the peer: {}", String::from_utf8_lossy(&reason))));
        }
        if head.identity != challenge.identity {
            return Err(protocol(wire::WireError(format!(
                "handshake reply names identity {:#x}, its challenge {:#x}",
                head.identity, challenge.identity
            ))));
        }
        if let Some(sec) = secret {
            if !wire::verify_reply(sec, &cb, &hb, &rep) {
                return Err(conn(wire::AuthFailure::PeerProofInvalid.to_string()));
            }
        }
        Ok(s)
    }
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.abort_tasks();
        for (_, l) in self.peers.drain() {
            l.state.closing();
            l.state.fail(BackendError::Closed { backend: NAME });
        }
    }
}

/// Closes a registration: the region leaves the table (new frames and posts naming it fail), then
/// the close waits until no frame or transfer holds it. Every byte a peer sends lands through this
/// endpoint's receiver tasks, which hold the region for the whole frame, so this also covers remote
/// writers.
struct Closer {
    shared: Arc<Shared>,
    id: RegionId,
    rt: tokio::runtime::Handle,
}

impl CloseRegistration for Closer {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        let drained = self.shared.regions.remove(self.id);
        Box::pin(async move {
            drained?.wait().await;
            Ok(())
        })
    }

    fn close_detached(self: Box<Self>) {
        if let Ok(d) = self.shared.regions.remove(self.id) {
            self.rt.spawn(d.wait());
        }
    }
}

#[async_trait::async_trait]
impl KvTransferBackend for TcpBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        // CUDA memory (through pinned staging slots) where a driver sees a device.
        CAPABILITIES.with_memory(kvxfer_cuda::memory_kinds())
    }

    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        kvxfer_cuda::check_register(NAME, &mem)?;
        self.shared.regions.insert(id, mem.clone())?;
        let closer = Closer { shared: Arc::clone(&self.shared), id, rt: self.rt.clone() };
        Ok(Registration::new(NAME, id, &mem, Box::new(closer)))
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let m = TcpMetadata {
            protocol: wire::PROTOCOL_VERSION,
            addr: self.advertised.clone(),
            token: hex(&self.shared.token),
            regions: self.shared.regions.snapshot().into_iter().map(|(k, v)| (k.0, v)).collect(),
            tls: self.shared.tls.is_some(),
            instance: self.shared.instance,
        };
        Ok(EndpointMetadata::new(NAME, self.shared.identity, serde_json::to_vec(&m).expect("metadata serializes")))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        let m = TcpMetadata::from_envelope(peer)?;
        let token = m.token_bytes()?;
        let refuse = |detail: String| BackendError::Connect { backend: NAME, peer: m.addr.clone(), detail };
        match (self.shared.tls.is_some(), m.tls) {
            (false, true) => {
                return Err(refuse(
                    "the peer requires TLS (tls=on in its metadata) and this endpoint has tls=off: create it with \
                     tls=on and a certificate of the peer's cluster CA (tls_cert, tls_key, tls_ca)"
                        .into(),
                ))
            }
            (true, false) => {
                return Err(refuse(
                    "this endpoint has tls=on and the peer does not speak TLS (tls=off in its metadata): refusing \
                     to send in plaintext; turn TLS on at both ends or off at both"
                        .into(),
                ))
            }
            _ => {}
        }
        if self.shared.is_cut_off(peer.identity, m.instance) {
            return Err(refuse(format!(
                "this endpoint cut off identity {:#x} instance {:#x} (it gave up on that peer); connect to the \
                 metadata of its restarted process",
                peer.identity, m.instance
            )));
        }
        let link_id = u64::from_le_bytes(random_bytes()?);
        let n = self.opts.connections as usize;
        let mut streams = Vec::with_capacity(n + 1);
        for i in 0..=n {
            let kind = if i < n { StreamKind::Data } else { StreamKind::Control };
            let nonce = kvxfer_core::secret::nonce().map_err(|e| BackendError::Io {
                backend: NAME,
                context: "drawing a handshake nonce".into(),
                detail: e.to_string(),
            })?;
            let hello = Hello {
                kind,
                index: i as u8,
                token,
                link: link_id,
                identity: self.shared.identity,
                streams: n as u32,
                nonce,
                instance: self.shared.instance,
                proof: None,
            };
            streams.push(self.open_stream(&m, peer.identity, hello).await?);
        }
        let regions = m.regions.iter().map(|(k, v)| (RegionId(*k), *v)).collect();
        let desc = format!("{} (identity {:#x})", m.addr, peer.identity);
        let link = Link::start(
            streams,
            regions,
            (peer.identity, m.instance),
            Arc::clone(&self.shared.events),
            desc,
            self.opts.timeout,
            self.opts.poll,
        );
        Ok(self.peers.insert(link))
    }

    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.post_ordered(peer, ops, notify, kvxfer_core::GpuOrder::Ready)
    }

    fn post_ordered(
        &self,
        peer: PeerId,
        ops: &[WriteOp],
        notify: Option<&Notification>,
        order: kvxfer_core::GpuOrder,
    ) -> Result<Transfer, BackendError> {
        self.post_writes(peer, ops.len(), ops.iter().map(|op| Ok(*op)), notify, order)
    }

    /// Native: the runs become the WRITE frames' op descriptors directly (no [`WriteOp`] list in
    /// between); the receiver places each range where its descriptor says, as for any op.
    fn post_indexed(
        &self,
        peer: PeerId,
        ops: &[kvxfer_core::IndexedOp],
        notify: Option<&Notification>,
    ) -> Result<Transfer, BackendError> {
        let n = ops.iter().map(kvxfer_core::IndexedOp::write_ops).sum();
        let writes = ops.iter().flat_map(|op| op.writes(NAME, Some(peer)));
        self.post_writes(peer, n, writes, notify, kvxfer_core::GpuOrder::Ready)
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        let link = self.peers.get(peer)?;
        let body = notification.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        CAPABILITIES.check_post(NAME, 0, body.len())?;
        link.notify(body).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        Ok(self.shared.events.recv(max_wait).await)
    }

    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        let link = self.peers.remove(peer)?;
        let (identity, instance) = link.peer;
        // No BYE, no wait for acknowledgements: the writer tasks stop (a write blocked on a full
        // socket is dropped with them) and every transfer fails.
        let live = link.state.closing();
        link.state.fail(BackendError::PeerLost {
            backend: NAME,
            peer: format!("{peer}"),
            detail: format!("cut off: {reason}"),
        });
        let deadline = Instant::now() + self.opts.timeout.min(Duration::from_secs(30));
        let streams =
            self.shared.cut_off(identity, instance, deadline).await.map_err(|open| BackendError::Timeout {
                backend: NAME,
                what: if open == 0 {
                    format!(
                        "waiting for copies into CUDA memory of bytes from the cut-off {peer} (identity \
                         {identity:#x}): one outlived its wait and may still land"
                    )
                } else {
                    format!("stopping {open} incoming stream(s) of the cut-off {peer} (identity {identity:#x})")
                },
                after: self.opts.timeout.min(Duration::from_secs(30)),
            })?;
        for x in &live {
            x.state.settled(deadline).await;
        }
        let failed = live.iter().filter(|x| matches!(x.state.status(), TransferStatus::Failed(_))).count();
        if live.iter().any(|x| !x.state.status().is_final()) {
            return Err(BackendError::Timeout {
                backend: NAME,
                what: format!("failing the transfers to the cut-off {peer}"),
                after: self.opts.timeout.min(Duration::from_secs(30)),
            });
        }
        Ok(CutOff {
            closed: streams + link.streams() + 1,
            failed_transfers: failed,
            how: "outgoing link failed; incoming streams of the instance stopped; instance refused",
        })
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        let link = self.peers.remove(peer)?;
        let live = link.state.closing();
        link.bye();
        let deadline = Instant::now() + self.opts.timeout;
        for x in &live {
            x.state.settled(deadline).await;
        }
        if live.iter().any(|x| !x.state.status().is_final()) {
            link.state.fail(BackendError::PeerLost {
                backend: NAME,
                peer: format!("{peer}"),
                detail: format!("disconnected with transfers still in flight after {:?}", self.opts.timeout),
            });
            let deadline = Instant::now() + Duration::from_secs(5);
            for x in &live {
                x.state.settled(deadline).await;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every option whose documented default is a value parses, set to it, to what leaving it unset
    /// gives (the others' defaults are phrases: computed, or another variable's).
    #[test]
    fn documented_defaults_are_the_defaults() {
        let phrases = ["advertise", "tls_cert", "tls_key", "tls_ca"];
        kvxfer_core::check_documented_defaults(OPTIONS, &phrases, TcpOptions::from_config);
        assert!(OPTIONS.iter().any(|d| d.name == "poll_us" && d.default == "200"));
    }

    #[test]
    fn options_parse_and_reject() {
        let o = TcpOptions::from_config(&BackendConfig::new(1)).unwrap();
        assert_eq!(o.connections, 1);
        assert_eq!(o.poll, Duration::from_micros(200));
        assert_eq!(o.listen.to_string(), "127.0.0.1:0");
        let c = BackendConfig::new(1).with("connections", "0");
        assert!(TcpOptions::from_config(&c).unwrap_err().to_string().contains("connections=0"));
        let c = BackendConfig::new(1).with("listen", "nowhere");
        assert!(TcpOptions::from_config(&c).is_err());
        let c = BackendConfig::new(1).with("timeout_s", "-1");
        assert!(TcpOptions::from_config(&c).is_err());
        assert_eq!(o.handshake_timeout, Duration::from_secs(5));
        let c = BackendConfig::new(1).with("handshake_timeout_s", "0.5");
        assert_eq!(TcpOptions::from_config(&c).unwrap().handshake_timeout, Duration::from_millis(500));
        let c = BackendConfig::new(1).with("tls_mode", "tcp");
        let e = TcpOptions::from_config(&c).unwrap_err().to_string();
        assert!(e.contains("unknown option") && e.contains("connections") && e.contains("tls_ca"), "{e}");
        assert!(e.contains("max_handshakes_per_source"), "{e}");
        assert_eq!((o.max_handshakes, o.max_handshakes_per_source), (256, 64));
        let c = BackendConfig::new(1).with("max_handshakes", "8").with("max_handshakes_per_source", "2");
        let o = TcpOptions::from_config(&c).unwrap();
        assert_eq!((o.max_handshakes, o.max_handshakes_per_source), (8, 2));
        let c = BackendConfig::new(1).with("max_handshakes", "0");
        assert!(TcpOptions::from_config(&c).unwrap_err().to_string().contains("max_handshakes=0"));
        let c = BackendConfig::new(1).with("max_handshakes_per_source", "many");
        assert!(TcpOptions::from_config(&c).unwrap_err().to_string().contains("max_handshakes_per_source"));
    }

    #[test]
    fn endpoints_can_be_created_outside_a_runtime() {
        let b = create(&BackendConfig::new(3)).unwrap();
        assert_eq!(b.capabilities(), CAPABILITIES.with_memory(kvxfer_cuda::memory_kinds()));
        assert!(b.metadata().unwrap().payload.len() > 10);
        assert!(kvxfer_core::backend::lookup(NAME).is_ok());
    }

    #[test]
    fn hex_roundtrip() {
        let t = [0xabu8; 16];
        assert_eq!(from_hex(&hex(&t)), Some(t));
        assert_eq!(from_hex("zz"), None);
    }
}

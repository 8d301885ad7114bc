//! kvxfer TCP backend: a pure-Rust tokio transport between KV pools of different processes and hosts.
//!
//! - **Data path without staging copies.** The sender writes frame headers plus payload straight from
//!   registered source memory with vectored writes; the receiver validates a frame's op descriptors,
//!   then reads the payload straight into the registered destination ranges with vectored reads.
//!   A strided op travels as one descriptor.
//! - **Both notification styles.** Attached notifications ride on data stream 0 after the data and
//!   are delivered only once every stream's part of the batch is placed; out-of-band notifications
//!   use a separate control stream. `write` returns after the receiver acknowledged placing every
//!   byte (remote completion), so an out-of-band notification is never early.
//! - **Several streams per peer** (`connections`), ops striped over them by bytes.
//! - **Wire safety.** A random per-endpoint token, carried only in the endpoint metadata, is checked
//!   in the handshake. Every WRITE frame is checked against the receiver's registered regions (every
//!   stride step, overlaps, payload length) before one byte is placed; a violation answers an ERROR
//!   frame and closes the stream, nothing written. Malformed frames are protocol errors, never panics.
//! - **Peer loss** fails pending writes on the sender (error naming the peer and the cause) and
//!   reports [`BackendEvent::PeerLost`] with the peer's identity on the receiver.
//!
//! The wire protocol is in [`wire`] and the crate README. Options (`BackendConfig::options`, with
//! environment fallbacks `KVXFER_TCP_<OPTION>`): `listen` (default `127.0.0.1:0`), `advertise`
//! (host put in the metadata; default: the listen address, or 127.0.0.1 when it is unspecified),
//! `connections` (data streams per peer, default 2), `timeout_s` (connect, handshake, frame and
//! write-completion deadline, default 120).

pub mod wire;

mod io;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kvxfer_core::{
    BackendConfig, BackendDescriptor, BackendError, BackendEvent, Capabilities, EndpointMetadata, KvTransferBackend,
    MemRegion, Notification, PeerId, RegionId, WriteOp,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use crate::io::SrcOp;
use crate::wire::{FrameType, Header, Hello, OpDesc, StreamKind, WireError};

/// Registry name.
pub const NAME: &str = "tcp";

/// What the TCP backend supports.
pub const CAPABILITIES: Capabilities =
    Capabilities { attached: true, out_of_band: true, cross_process: true, cross_host: true };

kvxfer_core::inventory::submit! {
    BackendDescriptor {
        name: NAME,
        description: "pure-Rust TCP (tokio): vectored zero-copy frames, token-checked handshake, both notification styles",
        capabilities: CAPABILITIES,
        create,
    }
}

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
    /// Deadline for connect, handshake, a frame's body, and a write's completion.
    pub timeout: Duration,
}

impl TcpOptions {
    /// Parses `config.options`, falling back to `KVXFER_TCP_<OPTION>` environment variables, then
    /// to the defaults. Unknown options are an error that lists the known ones.
    pub fn from_config(config: &BackendConfig) -> Result<Self, BackendError> {
        const KNOWN: [&str; 4] = ["listen", "advertise", "connections", "timeout_s"];
        if let Some(k) = config.options.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(cfg_err(format!("unknown option {k:?}; known options: {}", KNOWN.join(", "))));
        }
        let get = |key: &str| {
            config
                .options
                .get(key)
                .cloned()
                .or_else(|| std::env::var(format!("KVXFER_TCP_{}", key.to_uppercase())).ok())
        };
        let listen = get("listen").unwrap_or_else(|| "127.0.0.1:0".into());
        let listen: SocketAddr =
            listen.parse().map_err(|_| cfg_err(format!("listen={listen} is not an address like 127.0.0.1:0")))?;
        let connections = match get("connections") {
            None => 2,
            Some(v) => v
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=64).contains(n))
                .ok_or_else(|| cfg_err(format!("connections={v} must be an integer in 1..=64")))?,
        };
        let timeout = match get("timeout_s") {
            None => Duration::from_secs(120),
            Some(v) => v
                .parse::<f64>()
                .ok()
                .filter(|s| *s > 0.0 && s.is_finite())
                .map(Duration::from_secs_f64)
                .ok_or_else(|| cfg_err(format!("timeout_s={v} must be a positive number of seconds")))?,
        };
        Ok(Self { listen, advertise: get("advertise"), connections, timeout })
    }
}

fn cfg_err(detail: String) -> BackendError {
    BackendError::Config { backend: NAME, detail }
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
    if s.len() != 2 * wire::TOKEN_LEN {
        return None;
    }
    let mut out = [0u8; wire::TOKEN_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Random bytes from the OS (`/dev/urandom`).
fn random_bytes<const N: usize>() -> Result<[u8; N], BackendError> {
    use std::io::Read;
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).map_err(|e| BackendError::Io {
        backend: NAME,
        context: "reading /dev/urandom for the access token".into(),
        detail: e.to_string(),
    })?;
    Ok(b)
}

fn tokens_equal(a: &[u8; wire::TOKEN_LEN], b: &[u8; wire::TOKEN_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---------------------------------------------------------------------------------------------
// Receiving side state.

/// Per incoming link: attached notifications waiting for data parts on other streams.
#[derive(Default)]
struct InLink {
    identity: u64,
    placed: HashMap<u64, u32>,
    parked: HashMap<u64, (u32, Notification)>,
    lost: bool,
    open: u32,
}

/// Most batches an incoming link may keep half-announced (placed parts or parked notes).
const MAX_PENDING_BATCHES: usize = 1 << 16;

struct Shared {
    identity: u64,
    token: [u8; wire::TOKEN_LEN],
    regions: RwLock<HashMap<RegionId, MemRegion>>,
    events: mpsc::UnboundedSender<BackendEvent>,
    links: Mutex<HashMap<u64, InLink>>,
    tasks: Mutex<Vec<AbortHandle>>,
    timeout: Duration,
}

impl Shared {
    fn emit(&self, e: BackendEvent) {
        // The receiver lives in the backend; after it is dropped nobody listens, which is fine.
        let _ = self.events.send(e);
    }

    fn lost(&self, link: u64, reason: String) {
        let mut links = self.links.lock().expect("links lock");
        if let Some(l) = links.get_mut(&link) {
            if !l.lost {
                l.lost = true;
                tracing::warn!(identity = l.identity, %reason, "tcp: lost incoming peer");
                self.emit(BackendEvent::PeerLost { identity: l.identity, reason });
            }
        }
    }

    fn stream_closed(&self, link: u64) {
        let mut links = self.links.lock().expect("links lock");
        if let Some(l) = links.get_mut(&link) {
            l.open = l.open.saturating_sub(1);
            if l.open == 0 {
                links.remove(&link);
            }
        }
    }

    /// A batch part with NOTE_FOLLOWS was placed.
    fn part_placed(&self, link: u64, batch: u64) -> Result<(), WireError> {
        let mut links = self.links.lock().expect("links lock");
        let l = links.get_mut(&link).ok_or_else(|| WireError("link state missing".into()))?;
        let placed = l.placed.entry(batch).or_insert(0);
        *placed += 1;
        let placed = *placed;
        if let Some((parts, _)) = l.parked.get(&batch) {
            if placed >= *parts {
                let (_, n) = l.parked.remove(&batch).expect("present");
                l.placed.remove(&batch);
                self.emit(BackendEvent::Notification(n));
            }
        } else if l.placed.len() > MAX_PENDING_BATCHES {
            return Err(WireError(format!(
                "more than {MAX_PENDING_BATCHES} batches announce notifications that never came"
            )));
        }
        Ok(())
    }

    /// An attached (parts > 0) or out-of-band (parts == 0) notification arrived.
    fn note(&self, link: u64, batch: u64, parts: u32, n: Notification) -> Result<(), WireError> {
        if parts == 0 {
            self.emit(BackendEvent::Notification(n));
            return Ok(());
        }
        let mut links = self.links.lock().expect("links lock");
        let l = links.get_mut(&link).ok_or_else(|| WireError("link state missing".into()))?;
        if l.placed.get(&batch).copied().unwrap_or(0) >= parts {
            l.placed.remove(&batch);
            self.emit(BackendEvent::Notification(n));
        } else {
            if l.parked.len() >= MAX_PENDING_BATCHES {
                return Err(WireError(format!("more than {MAX_PENDING_BATCHES} notifications wait for data")));
            }
            if l.parked.insert(batch, (parts, n)).is_some() {
                return Err(WireError(format!("two notifications for batch {batch}")));
            }
        }
        Ok(())
    }

    fn track(&self, h: AbortHandle) {
        let mut t = self.tasks.lock().expect("tasks lock");
        t.retain(|h| !h.is_finished());
        t.push(h);
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, addr)) => {
                let s = Arc::clone(&shared);
                let h = tokio::spawn(async move { serve(s, stream, addr).await });
                shared.track(h.abort_handle());
            }
            Err(e) => {
                tracing::warn!(error = %e, "tcp: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Handshake, then frames, for one incoming stream.
async fn serve(shared: Arc<Shared>, stream: TcpStream, addr: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let (mut r, mut w) = stream.into_split();
    let mut hello = [0u8; wire::HELLO_LEN];
    let hello = match tokio::time::timeout(shared.timeout, r.read_exact(&mut hello)).await {
        Ok(Ok(_)) => Hello::decode(&hello),
        Ok(Err(e)) => {
            tracing::debug!(%addr, error = %e, "tcp: connection closed before the handshake");
            return;
        }
        Err(_) => {
            tracing::warn!(%addr, "tcp: no handshake within the deadline; closing");
            return;
        }
    };
    let hello = match hello {
        Ok(h) if tokens_equal(&h.token, &shared.token) => h,
        Ok(_) => {
            tracing::warn!(%addr, "tcp: rejected a connection with a wrong access token");
            let _ = w.write_all(&wire::encode_hello_reply(shared.identity, Some("access token rejected"))).await;
            return;
        }
        Err(e) => {
            tracing::warn!(%addr, error = %e, "tcp: rejected a malformed handshake");
            let _ = w.write_all(&wire::encode_hello_reply(shared.identity, Some(&e.0))).await;
            return;
        }
    };
    if w.write_all(&wire::encode_hello_reply(shared.identity, None)).await.is_err() {
        return;
    }
    {
        let mut links = shared.links.lock().expect("links lock");
        let l = links.entry(hello.link).or_insert_with(|| InLink { identity: hello.identity, ..Default::default() });
        l.open += 1;
    }
    let peer = format!("{addr} (identity {:#x}, stream {})", hello.identity, hello.index);
    match serve_frames(&shared, &hello, &mut r, &mut w).await {
        Ok(()) => {}
        Err(Ending::Lost(reason)) => shared.lost(hello.link, format!("{peer}: {reason}")),
        Err(Ending::Protocol(e)) => {
            tracing::warn!(%peer, error = %e, "tcp: protocol violation; closing the stream");
            let msg = wire::truncate(&e.0, wire::MAX_MESSAGE as usize);
            let mut h = Header::new(FrameType::Error, 0);
            h.n = msg.len() as u32;
            let mut buf = h.encode().to_vec();
            buf.extend_from_slice(msg.as_bytes());
            let _ = tokio::time::timeout(Duration::from_secs(1), w.write_all(&buf)).await;
            shared.lost(hello.link, format!("{peer}: protocol error: {e}"));
        }
    }
    let _ = w.shutdown().await;
    shared.stream_closed(hello.link);
}

enum Ending {
    Lost(String),
    Protocol(WireError),
}

impl From<WireError> for Ending {
    fn from(e: WireError) -> Self {
        Ending::Protocol(e)
    }
}

async fn within<T>(
    t: Duration,
    what: &str,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, Ending> {
    match tokio::time::timeout(t, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Ending::Lost(format!("{what}: {e}"))),
        Err(_) => Err(Ending::Lost(format!("{what}: stalled for {t:?}"))),
    }
}

async fn serve_frames(
    shared: &Shared,
    hello: &Hello,
    r: &mut OwnedReadHalf,
    w: &mut OwnedWriteHalf,
) -> Result<(), Ending> {
    let t = shared.timeout;
    loop {
        let mut hb = [0u8; wire::HEADER_LEN];
        // Waiting for the next frame has no deadline: an idle peer is fine; a dead one closes the socket.
        if let Err(e) = r.read_exact(&mut hb).await {
            return Err(Ending::Lost(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "connection closed without BYE".into()
            } else {
                format!("reading a frame header: {e}")
            }));
        }
        let h = Header::decode(&hb)?;
        match h.ty {
            FrameType::Write => {
                let mut descs = vec![0u8; h.n as usize * wire::OP_LEN];
                within(t, "reading op descriptors", r.read_exact(&mut descs)).await?;
                let ops = descs.chunks_exact(wire::OP_LEN).map(OpDesc::decode).collect::<Result<Vec<_>, _>>()?;
                let mems = {
                    let regions = shared.regions.read().expect("regions lock");
                    wire::validate_write(&ops, h.payload, &regions)?
                };
                within(t, "reading a WRITE payload", io::read_payload(r, &ops, &mems)).await?;
                if h.flags & wire::FLAG_LAST != 0 {
                    if h.flags & wire::FLAG_NOTE_FOLLOWS != 0 {
                        shared.part_placed(hello.link, h.batch)?;
                    }
                    within(t, "sending an ACK", w.write_all(&Header::new(FrameType::Ack, h.batch).encode())).await?;
                }
            }
            FrameType::Note => {
                let mut body = vec![0u8; h.n as usize];
                within(t, "reading a NOTE", r.read_exact(&mut body)).await?;
                let n = Notification::decode(&body).map_err(|e| WireError(format!("bad notification: {e}")))?;
                shared.note(hello.link, h.batch, h.parts, n)?;
            }
            FrameType::Bye => return Ok(()),
            FrameType::Ack | FrameType::Error => {
                return Err(WireError(format!("{:?} frames only travel from receiver to sender", h.ty)).into())
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sending side state.

enum Job {
    Frame { head: Vec<u8>, ops: Vec<SrcOp>, done: Option<oneshot::Sender<()>> },
    Bye,
}

type Wait = oneshot::Sender<Result<(), BackendError>>;

#[derive(Default)]
struct LinkInner {
    dead: Option<BackendError>,
    closing: bool,
    waits: HashMap<(u64, usize), Wait>,
}

struct LinkState {
    inner: Mutex<LinkInner>,
    tasks: Mutex<Vec<AbortHandle>>,
    /// The peer's identity and the local endpoint's event queue: an outgoing link that fails is
    /// reported as [`BackendEvent::PeerLost`] too, so a sender learns of it without writing.
    identity: u64,
    events: mpsc::UnboundedSender<BackendEvent>,
}

impl LinkState {
    fn fail(&self, err: BackendError) {
        let waits = {
            let mut i = self.inner.lock().expect("link lock");
            if i.closing && i.dead.is_none() && i.waits.is_empty() {
                return;
            }
            if i.dead.is_none() {
                tracing::warn!(error = %err, "tcp: link failed");
                i.dead = Some(err.clone());
                if !i.closing {
                    let _ =
                        self.events.send(BackendEvent::PeerLost { identity: self.identity, reason: err.to_string() });
                }
            }
            std::mem::take(&mut i.waits)
        };
        let err = self.inner.lock().expect("link lock").dead.clone().unwrap_or(err);
        for (_, w) in waits {
            let _ = w.send(Err(err.clone()));
        }
        for t in self.tasks.lock().expect("tasks lock").iter() {
            t.abort();
        }
    }

    fn check(&self) -> Result<(), BackendError> {
        match &self.inner.lock().expect("link lock").dead {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

struct Link {
    peer: String,
    regions: HashMap<RegionId, u64>,
    data: Vec<mpsc::UnboundedSender<Job>>,
    control: mpsc::UnboundedSender<Job>,
    state: Arc<LinkState>,
    next_batch: AtomicU64,
}

impl Link {
    fn lost(&self, detail: &str) -> BackendError {
        BackendError::PeerLost { backend: NAME, peer: self.peer.clone(), detail: detail.into() }
    }

    fn enqueue(&self, tx: &mpsc::UnboundedSender<Job>, job: Job) -> Result<(), BackendError> {
        tx.send(job).map_err(|_| {
            let e = self.lost("the stream's writer has stopped");
            self.state.fail(e.clone());
            self.state.check().err().unwrap_or(e)
        })
    }
}

async fn writer(mut w: OwnedWriteHalf, mut jobs: mpsc::UnboundedReceiver<Job>, state: Arc<LinkState>, peer: String) {
    while let Some(job) = jobs.recv().await {
        match job {
            Job::Frame { head, ops, done } => {
                if let Err(e) = io::write_frame(&mut w, &head, &ops).await {
                    state.fail(BackendError::PeerLost { backend: NAME, peer, detail: format!("sending: {e}") });
                    return;
                }
                if let Some(d) = done {
                    let _ = d.send(());
                }
            }
            Job::Bye => {
                let _ = w.write_all(&Header::new(FrameType::Bye, 0).encode()).await;
                let _ = w.shutdown().await;
                return;
            }
        }
    }
}

async fn reader(mut r: OwnedReadHalf, index: usize, state: Arc<LinkState>, peer: String) {
    let err = |detail: String| BackendError::PeerLost { backend: NAME, peer: peer.clone(), detail };
    loop {
        let mut hb = [0u8; wire::HEADER_LEN];
        if let Err(e) = r.read_exact(&mut hb).await {
            let closing = state.inner.lock().expect("link lock").closing;
            if !closing {
                state.fail(err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    "connection closed by the peer".into()
                } else {
                    format!("receiving: {e}")
                }));
            }
            return;
        }
        let h = match Header::decode(&hb) {
            Ok(h) => h,
            Err(e) => {
                state.fail(BackendError::Protocol { backend: NAME, peer: peer.clone(), detail: e.0 });
                return;
            }
        };
        match h.ty {
            FrameType::Ack => {
                let w = state.inner.lock().expect("link lock").waits.remove(&(h.batch, index));
                if let Some(w) = w {
                    let _ = w.send(Ok(()));
                }
            }
            FrameType::Error => {
                let mut msg = vec![0u8; h.n as usize];
                let _ = tokio::time::timeout(Duration::from_secs(5), r.read_exact(&mut msg)).await;
                let msg = String::from_utf8_lossy(&msg).into_owned();
                state.fail(BackendError::Protocol {
                    backend: NAME,
                    peer: peer.clone(),
                    detail: format!("peer rejected a frame: {msg}"),
                });
                return;
            }
            other => {
                state.fail(BackendError::Protocol {
                    backend: NAME,
                    peer: peer.clone(),
                    detail: format!("unexpected {other:?} frame from the receiver"),
                });
                return;
            }
        }
    }
}

/// Splits ops into pieces of about `piece` bytes (contiguous ops by length, strided ops by count)
/// and deals them to the least-loaded stream, keeping each stream's order.
fn stripe(items: Vec<(SrcOp, OpDesc)>, streams: usize, total: u64) -> Vec<Vec<(SrcOp, OpDesc)>> {
    let mut out: Vec<Vec<(SrcOp, OpDesc)>> = (0..streams).map(|_| Vec::new()).collect();
    if streams == 1 {
        out[0] = items;
        return out;
    }
    let piece = (total / (streams as u64 * 4)).clamp(64 << 10, 16 << 20);
    let mut load = vec![0u64; streams];
    let mut put = |s: SrcOp, d: OpDesc| {
        let i = (0..streams).min_by_key(|i| load[*i]).expect("at least one stream");
        load[i] += s.len * s.count;
        out[i].push((s, d));
    };
    for (s, d) in items {
        let bytes = s.len * s.count;
        if bytes <= piece {
            put(s, d);
        } else if s.count == 1 {
            let mut off = 0;
            while off < s.len {
                let len = piece.min(s.len - off);
                put(
                    SrcOp { offset: s.offset + off, len, stride: len, ..s.clone() },
                    OpDesc { offset: d.offset + off, len, stride: len, ..d },
                );
                off += len;
            }
        } else {
            let per = (piece / s.len).max(1);
            let mut i = 0;
            while i < s.count {
                let count = per.min(s.count - i);
                put(
                    SrcOp { offset: s.offset + i * s.stride, count, ..s.clone() },
                    OpDesc { offset: d.offset + i * d.stride, count, ..d },
                );
                i += count;
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The endpoint.

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
    events: tokio::sync::Mutex<mpsc::UnboundedReceiver<BackendEvent>>,
    peers: Mutex<HashMap<PeerId, Arc<Link>>>,
    next_peer: AtomicU64,
    accept: AbortHandle,
    closed: AtomicBool,
}

impl std::fmt::Debug for TcpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBackend").field("identity", &self.shared.identity).field("addr", &self.advertised).finish()
    }
}

impl TcpBackend {
    /// Binds the listener and starts accepting. Needs a tokio runtime.
    pub fn new(config: &BackendConfig) -> Result<Self, BackendError> {
        let opts = TcpOptions::from_config(config)?;
        let rt = match tokio::runtime::Handle::try_current() {
            Ok(h) => h,
            Err(_) => fallback_runtime()?,
        };
        let std_listener = std::net::TcpListener::bind(opts.listen).map_err(|e| BackendError::Io {
            backend: NAME,
            context: format!("binding {}", opts.listen),
            detail: e.to_string(),
        })?;
        let io_err = |context: &str, e: std::io::Error| BackendError::Io {
            backend: NAME,
            context: context.into(),
            detail: e.to_string(),
        };
        std_listener.set_nonblocking(true).map_err(|e| io_err("making the listener non-blocking", e))?;
        let local = std_listener.local_addr().map_err(|e| io_err("reading the listen address", e))?;
        let listener = {
            let _guard = rt.enter();
            TcpListener::from_std(std_listener).map_err(|e| io_err("registering the listener", e))?
        };
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
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            identity: config.identity,
            token: random_bytes()?,
            regions: RwLock::new(HashMap::new()),
            events: tx,
            links: Mutex::new(HashMap::new()),
            tasks: Mutex::new(Vec::new()),
            timeout: opts.timeout,
        });
        let accept = rt.spawn(accept_loop(Arc::clone(&shared), listener)).abort_handle();
        Ok(Self {
            shared,
            opts,
            advertised,
            events: tokio::sync::Mutex::new(rx),
            peers: Mutex::new(HashMap::new()),
            next_peer: AtomicU64::new(1),
            accept,
            closed: AtomicBool::new(false),
        })
    }

    /// The options in effect.
    pub fn options(&self) -> &TcpOptions {
        &self.opts
    }

    /// The `host:port` peers connect to.
    pub fn address(&self) -> &str {
        &self.advertised
    }

    fn link(&self, peer: PeerId) -> Result<Arc<Link>, BackendError> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(BackendError::Closed { backend: NAME });
        }
        self.peers
            .lock()
            .expect("peers lock")
            .get(&peer)
            .cloned()
            .ok_or(BackendError::UnknownPeer { backend: NAME, peer })
    }

    async fn open_stream(
        &self,
        m: &TcpMetadata,
        token: [u8; wire::TOKEN_LEN],
        expect_identity: u64,
        hello: Hello,
    ) -> Result<TcpStream, BackendError> {
        let conn = |detail: String| BackendError::Connect { backend: NAME, peer: m.addr.clone(), detail };
        let t = self.opts.timeout;
        let mut s = tokio::time::timeout(t, TcpStream::connect(&m.addr))
            .await
            .map_err(|_| conn(format!("no connection within {t:?}")))?
            .map_err(|e| conn(e.to_string()))?;
        let _ = s.set_nodelay(true);
        let hello = Hello { token, ..hello };
        let exchange = async {
            s.write_all(&hello.encode()).await?;
            let mut rep = [0u8; wire::HELLO_REPLY_LEN];
            s.read_exact(&mut rep).await?;
            Ok::<_, std::io::Error>(rep)
        };
        let rep = tokio::time::timeout(t, exchange)
            .await
            .map_err(|_| conn(format!("no handshake answer within {t:?}")))?
            .map_err(|e| conn(format!("handshake: {e}")))?;
        let (identity, rejected, len) = wire::decode_hello_reply(&rep).map_err(|e| BackendError::Protocol {
            backend: NAME,
            peer: m.addr.clone(),
            detail: e.0,
        })?;
        if rejected {
            let mut reason = vec![0u8; len as usize];
            let _ = tokio::time::timeout(t, s.read_exact(&mut reason)).await;
            return Err(conn(format!("handshake rejected: {}", String::from_utf8_lossy(&reason))));
        }
        if identity != expect_identity {
            return Err(conn(format!(
                "metadata names identity {expect_identity:#x} but the endpoint at this address is {identity:#x} (stale metadata?)"
            )));
        }
        Ok(s)
    }
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        self.accept.abort();
        for t in self.shared.tasks.lock().expect("tasks lock").iter() {
            t.abort();
        }
        for (_, l) in self.peers.lock().expect("peers lock").drain() {
            for t in l.state.tasks.lock().expect("tasks lock").iter() {
                t.abort();
            }
        }
    }
}

#[async_trait::async_trait]
impl KvTransferBackend for TcpBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn register(&self, id: RegionId, mem: MemRegion) -> Result<(), BackendError> {
        let mut r = self.shared.regions.write().expect("regions lock");
        if r.contains_key(&id) {
            return Err(BackendError::RegionInUse { backend: NAME, region: id });
        }
        r.insert(id, mem);
        Ok(())
    }

    fn deregister(&self, id: RegionId) -> Result<(), BackendError> {
        match self.shared.regions.write().expect("regions lock").remove(&id) {
            Some(_) => Ok(()),
            None => Err(BackendError::UnknownRegion { backend: NAME, region: id, peer: None }),
        }
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let mut regions: Vec<(u32, u64)> =
            self.shared.regions.read().expect("regions lock").iter().map(|(k, v)| (k.0, v.len() as u64)).collect();
        regions.sort_unstable();
        let m = TcpMetadata {
            protocol: wire::PROTOCOL_VERSION,
            addr: self.advertised.clone(),
            token: hex(&self.shared.token),
            regions,
        };
        Ok(EndpointMetadata::new(NAME, self.shared.identity, serde_json::to_vec(&m).expect("metadata serializes")))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(BackendError::Closed { backend: NAME });
        }
        let m = TcpMetadata::from_envelope(peer)?;
        let token = m.token_bytes()?;
        let link_id = u64::from_le_bytes(random_bytes()?);
        let n = self.opts.connections as usize;
        let desc = format!("{} (identity {:#x})", m.addr, peer.identity);
        let mut streams = Vec::with_capacity(n + 1);
        for i in 0..=n {
            let kind = if i < n { StreamKind::Data } else { StreamKind::Control };
            let hello =
                Hello { kind, index: i as u8, token, link: link_id, identity: self.shared.identity, streams: n as u32 };
            streams.push(self.open_stream(&m, token, peer.identity, hello).await?);
        }
        let state = Arc::new(LinkState {
            inner: Mutex::new(LinkInner::default()),
            tasks: Mutex::new(Vec::new()),
            identity: peer.identity,
            events: self.shared.events.clone(),
        });
        let mut senders = Vec::with_capacity(n + 1);
        for (i, s) in streams.into_iter().enumerate() {
            let (r, w) = s.into_split();
            let (tx, rx) = mpsc::unbounded_channel();
            let wt = tokio::spawn(writer(w, rx, Arc::clone(&state), desc.clone()));
            let rt = tokio::spawn(reader(r, i, Arc::clone(&state), desc.clone()));
            state.tasks.lock().expect("tasks lock").extend([wt.abort_handle(), rt.abort_handle()]);
            senders.push(tx);
        }
        let control = senders.pop().expect("control stream");
        let link = Link {
            peer: desc,
            regions: m.regions.iter().map(|(k, v)| (RegionId(*k), *v)).collect(),
            data: senders,
            control,
            state,
            next_batch: AtomicU64::new(1),
        };
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        self.peers.lock().expect("peers lock").insert(id, Arc::new(link));
        Ok(id)
    }

    async fn write(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<(), BackendError> {
        let link = self.link(peer)?;
        link.state.check()?;
        // Check the whole batch before queueing a byte.
        let mut items = Vec::with_capacity(ops.len());
        let mut total = 0u64;
        {
            let regions = self.shared.regions.read().expect("regions lock");
            for op in ops {
                let src = regions.get(&op.src).ok_or(BackendError::UnknownRegion {
                    backend: NAME,
                    region: op.src,
                    peer: None,
                })?;
                op.check_src(NAME, None, src.len() as u64)?;
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
                items.push((
                    SrcOp {
                        mem: src.clone(),
                        offset: op.src_offset,
                        stride: op.src_stride,
                        len: op.len,
                        count: op.count,
                    },
                    OpDesc::of(op),
                ));
            }
        }
        let descs: Vec<OpDesc> = items.iter().map(|(_, d)| *d).collect();
        wire::check_disjoint(&descs).map_err(|e| BackendError::Unsupported {
            backend: NAME,
            what: format!("overlapping destination ranges in one write ({e})"),
        })?;
        drop(descs);

        let streams = link.data.len();
        let per_stream = stripe(items, streams, total);
        let batch = link.next_batch.fetch_add(1, Ordering::Relaxed);
        let mut waits = Vec::new();
        {
            let mut inner = link.state.inner.lock().expect("link lock");
            if let Some(e) = &inner.dead {
                return Err(e.clone());
            }
            for (s, items) in per_stream.iter().enumerate() {
                if !items.is_empty() {
                    let (tx, rx) = oneshot::channel();
                    inner.waits.insert((batch, s), tx);
                    waits.push(rx);
                }
            }
        }
        let parts = waits.len() as u32;
        for (s, items) in per_stream.into_iter().enumerate() {
            let frames = items.len().div_ceil(wire::MAX_OPS as usize);
            let mut it = items.into_iter();
            for f in 0..frames {
                let chunk: Vec<(SrcOp, OpDesc)> = it.by_ref().take(wire::MAX_OPS as usize).collect();
                let mut h = Header::new(FrameType::Write, batch);
                h.n = chunk.len() as u32;
                h.payload = chunk.iter().map(|(s, _)| s.len * s.count).sum();
                if f + 1 == frames {
                    h.flags = wire::FLAG_LAST | if notify.is_some() { wire::FLAG_NOTE_FOLLOWS } else { 0 };
                }
                let mut head = Vec::with_capacity(wire::HEADER_LEN + chunk.len() * wire::OP_LEN);
                head.extend_from_slice(&h.encode());
                let mut srcs = Vec::with_capacity(chunk.len());
                for (src, d) in chunk {
                    d.encode_into(&mut head);
                    srcs.push(src);
                }
                link.enqueue(&link.data[s], Job::Frame { head, ops: srcs, done: None })?;
            }
        }
        let mut note_sent = None;
        if let Some(n) = notify {
            let body = n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
            let mut h = Header::new(FrameType::Note, batch);
            h.n = body.len() as u32;
            h.parts = parts;
            let mut head = h.encode().to_vec();
            head.extend_from_slice(&body);
            let (tx, rx) = oneshot::channel();
            link.enqueue(&link.data[0], Job::Frame { head, ops: Vec::new(), done: Some(tx) })?;
            note_sent = Some(rx);
        }
        let t = self.opts.timeout;
        let all = async {
            // The attached notification is on the wire (in the socket) before `write` returns, so a
            // sender that exits right after cannot lose it.
            if let Some(rx) = note_sent {
                if rx.await.is_err() {
                    return Err(link.state.check().err().unwrap_or_else(|| link.lost("link closed")));
                }
            }
            for w in waits {
                match w.await {
                    Ok(r) => r?,
                    Err(_) => return Err(link.state.check().err().unwrap_or_else(|| link.lost("link closed"))),
                }
            }
            Ok(())
        };
        match tokio::time::timeout(t, all).await {
            Ok(r) => r,
            Err(_) => Err(BackendError::Timeout {
                backend: NAME,
                what: format!("write of {total} bytes to {} (waiting for its acknowledgement)", link.peer),
                after: t,
            }),
        }
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        let link = self.link(peer)?;
        link.state.check()?;
        let body = notification.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        let mut h = Header::new(FrameType::Note, 0);
        h.n = body.len() as u32;
        let mut head = h.encode().to_vec();
        head.extend_from_slice(&body);
        let (tx, rx) = oneshot::channel();
        link.enqueue(&link.control, Job::Frame { head, ops: Vec::new(), done: Some(tx) })?;
        let t = self.opts.timeout;
        match tokio::time::timeout(t, rx).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(link.state.check().err().unwrap_or_else(|| link.lost("link closed"))),
            Err(_) => {
                Err(BackendError::Timeout { backend: NAME, what: format!("notification to {}", link.peer), after: t })
            }
        }
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        let mut rx = match tokio::time::timeout(max_wait, self.events.lock()).await {
            Ok(rx) => rx,
            Err(_) => return Ok(Vec::new()),
        };
        let mut out = Vec::new();
        match tokio::time::timeout(max_wait, rx.recv()).await {
            Ok(Some(e)) => out.push(e),
            Ok(None) => return Err(BackendError::Closed { backend: NAME }),
            Err(_) => return Ok(out),
        }
        while out.len() < 4096 {
            match rx.try_recv() {
                Ok(e) => out.push(e),
                Err(_) => break,
            }
        }
        Ok(out)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        let link = self
            .peers
            .lock()
            .expect("peers lock")
            .remove(&peer)
            .ok_or(BackendError::UnknownPeer { backend: NAME, peer })?;
        link.state.inner.lock().expect("link lock").closing = true;
        for tx in link.data.iter().chain(std::iter::once(&link.control)) {
            let _ = tx.send(Job::Bye);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_reject() {
        let o = TcpOptions::from_config(&BackendConfig::new(1)).unwrap();
        assert_eq!(o.connections, 2);
        assert_eq!(o.listen.to_string(), "127.0.0.1:0");
        let c = BackendConfig::new(1).with("connections", "0");
        assert!(TcpOptions::from_config(&c).unwrap_err().to_string().contains("connections=0"));
        let c = BackendConfig::new(1).with("listen", "nowhere");
        assert!(TcpOptions::from_config(&c).is_err());
        let c = BackendConfig::new(1).with("tls", "tcp");
        assert!(TcpOptions::from_config(&c).unwrap_err().to_string().contains("unknown option"));
    }

    #[test]
    fn endpoints_can_be_created_outside_a_runtime() {
        let b = create(&BackendConfig::new(3)).unwrap();
        assert_eq!(b.capabilities(), CAPABILITIES);
        assert!(b.metadata().unwrap().payload.len() > 10);
    }

    #[test]
    fn hex_roundtrip() {
        let t = [0xabu8; 16];
        assert_eq!(from_hex(&hex(&t)), Some(t));
        assert_eq!(from_hex("zz"), None);
    }

    #[test]
    fn striping_covers_every_byte_once() {
        let mem = kvxfer_core::HostBuffer::zeroed(1 << 22).region();
        let items = vec![
            (
                SrcOp { mem: mem.clone(), offset: 0, stride: 3 << 20, len: 3 << 20, count: 1 },
                OpDesc { region: RegionId(0), offset: 0, len: 3 << 20, count: 1, stride: 3 << 20 },
            ),
            (
                SrcOp { mem: mem.clone(), offset: 0, stride: 512, len: 256, count: 2000 },
                OpDesc { region: RegionId(1), offset: 8, len: 256, count: 2000, stride: 1024 },
            ),
        ];
        let total = (3 << 20) + 256 * 2000;
        let out = stripe(items, 3, total);
        assert!(out.iter().all(|v| !v.is_empty()));
        let sum: u64 = out
            .iter()
            .flatten()
            .map(|(s, d)| {
                assert_eq!(s.len * s.count, d.len * d.count);
                s.len * s.count
            })
            .sum();
        assert_eq!(sum, total);
        let mut strided: Vec<(u64, u64)> =
            out.iter().flatten().filter(|(_, d)| d.region == RegionId(1)).map(|(s, d)| (d.offset, s.offset)).collect();
        strided.sort_unstable();
        assert_eq!(strided[0], (8, 0));
        assert!(strided.windows(2).all(|w| (w[1].0 - 8) / 1024 * 512 == w[1].1));
    }
}

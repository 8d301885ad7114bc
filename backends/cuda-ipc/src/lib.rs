//! kvxfer `cuda-ipc` backend: same-node transfers between GPU pools of different processes (e.g. 4
//! prefill and 4 decode GPUs in one host), device to device, with no copy through the host.
//!
//! - **Registration.** Every CUDA region is exported with a legacy CUDA IPC handle of the
//!   allocation under it (a PyTorch tensor lies inside a caching-allocator block: the metadata
//!   carries the region's offset in it). Host memory is refused (tcp and local take it); a region
//!   whose allocation has no legacy handle (VMM, PyTorch's `expandable_segments`) is registered as a
//!   source only, and a peer's write into it is refused naming why.
//! - **Connect.** The prefill side checks the peer is on this node (boot id), opens the control
//!   connection (TCP, normally loopback; token, and with a cluster secret the mutual
//!   challenge-response of [`kvxfer_core::secret::Exchange`]), and imports each of the peer's
//!   allocations once per process ([`kvxfer_cuda::ipc::import`]), on the device with the same UUID.
//! - **Post.** Checks every op, reserves the source ranges and queues device-to-device copies
//!   (strided ops as 2-D copies) into the imported mappings on the peer's own CUDA stream, at once;
//!   the transfer is done when the copies completed (remote completion: the bytes are in the peer's
//!   memory). The attached notification is sent on the control connection only after the copies
//!   completed, in post order; out-of-band notifications go on the same connection.
//! - **Close.** Closing a region sends REVOKE to every connected writer; each stops using it, lets
//!   its queued copies complete, drops its mapping and answers REVOKED; the close resolves once all
//!   answered or their connections ended (a writer whose connection ends drops its mappings once
//!   its queued copies completed). Abort cannot recall queued copies: it resolves when they
//!   completed, and the attached notification is then not sent.
//! - CUDA is loaded at run time ([`kvxfer_cuda`]): on a host without a driver the endpoint is made,
//!   claims no memory kind, and refuses CUDA registrations naming the missing library.
//!
//! Options (`BackendConfig::options`, environment fallbacks `KVXFER_CUDA_IPC_<OPTION>`): `listen`
//! (control listener, default `127.0.0.1:0`), `advertise` (host put in the metadata), `timeout_s`
//! (connect, copy completion, revoke and disconnect deadline, default 60), `handshake_timeout_s`
//! (default 5).

mod control;
pub mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::{Options, PeerTable, RegionRef, RegionTable};
use kvxfer_core::{
    AbortTransfer, BackendConfig, BackendError, BackendEvent, BoxFuture, Capabilities, CloseRegistration, Completion,
    CutOff, EndpointMetadata, GpuOrder, KvTransferBackend, Limits, MemDesc, MemKind, MemKinds, Notification, OptionDoc,
    PeerId, RegionId, Registration, Transfer, TransferState, TransferStatus, WriteOp,
};
use kvxfer_cuda::ipc::{self, Export, IpcMapping};
use kvxfer_cuda::{context, CopyPlan, CudaError, Event, Pending, Shape, Stream};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::control::{lock, Shared};

/// Registry name.
pub const NAME: &str = "cuda-ipc";

/// Most ops one post takes.
pub const MAX_OPS_PER_POST: u64 = 1 << 20;

/// What a cuda-ipc endpoint supports where a CUDA driver sees a device: both styles, across
/// processes of one node, CUDA memory, remote completion. Without a driver it takes no memory.
pub const CAPABILITIES: Capabilities = Capabilities::new(true, true, true, false)
    .with_memory(MemKinds::CUDA)
    .with_limits(Limits::new(MAX_OPS_PER_POST, wire::MAX_PAYLOAD as u64, 1 << 16))
    .with_completion(Completion::Remote)
    .with_cut_off_live(false);

/// Every option, with its default and what it does: the list [`IpcOptions::from_config`] checks
/// keys against and `kvxfer backends` prints.
pub const OPTIONS: &[OptionDoc] = &[
    OptionDoc::new("listen", "127.0.0.1:0", "control listener address"),
    OptionDoc::new(
        "advertise",
        "the listen address (127.0.0.1 if unspecified)",
        "host put in the metadata for peers to connect to",
    ),
    OptionDoc::new("timeout_s", "60", "seconds for connect, copy completion, revoke and disconnect (up to 86400)"),
    OptionDoc::new("handshake_timeout_s", "5", "seconds a control connection's handshake may take (up to 3600)"),
];

kvxfer_core::register_backend!(
    NAME,
    "same-node CUDA IPC: device-to-device copies into the peer's imported pool, notifications after the copies completed",
    CAPABILITIES,
    OPTIONS,
    create,
);

/// Builds an endpoint. Inside a tokio runtime its listener runs there; outside one, on a small
/// process-wide background runtime.
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    Ok(Arc::new(CudaIpcBackend::new(config)?))
}

/// Parsed options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcOptions {
    /// Control listener address.
    pub listen: SocketAddr,
    /// Host put in the metadata (default: the listen address, or 127.0.0.1 when unspecified).
    pub advertise: Option<String>,
    /// Connect, copy completion, revoke and disconnect deadline.
    pub timeout: Duration,
    /// A control connection's handshake deadline.
    pub handshake_timeout: Duration,
}

impl IpcOptions {
    /// Parses `config.options` (environment fallbacks `KVXFER_CUDA_IPC_<OPTION>`); an unknown
    /// option is an error listing the known ones.
    pub fn from_config(config: &BackendConfig) -> Result<Self, BackendError> {
        let o = Options::new(NAME, config, OPTIONS)?;
        Ok(Self {
            listen: o.parse("listen", SocketAddr::from(([127, 0, 0, 1], 0)), "an address like 127.0.0.1:0")?,
            advertise: o.get("advertise"),
            timeout: o.seconds("timeout_s", Duration::from_secs(60), 86_400.0)?,
            handshake_timeout: o.seconds("handshake_timeout_s", Duration::from_secs(5), 3_600.0)?,
        })
    }
}

/// The metadata payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Meta {
    protocol: u16,
    addr: String,
    token: String,
    pid: u32,
    boot_id: String,
    host: String,
    regions: Vec<MetaRegion>,
}

/// A region in the metadata: where it lies in which exported allocation, or why it is not exported.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct MetaRegion {
    id: u32,
    len: u64,
    device_uuid: String,
    handle: Option<String>,
    offset: u64,
    alloc_len: u64,
    why: Option<String>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// This boot of this machine (empty where unknown: then the same-node check is skipped).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_owned()).unwrap_or_default()
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_owned()).unwrap_or_default()
}

fn cuda(context: impl Into<String>) -> impl Fn(CudaError) -> BackendError {
    let context = context.into();
    move |e| match e {
        CudaError::Call { call, code, name, description, context: c } => BackendError::Ffi {
            backend: NAME,
            call,
            code: i64::from(code),
            detail: format!("{name}: {description}{c}; {context}"),
        },
        other => BackendError::Io { backend: NAME, context: context.clone(), detail: other.to_string() },
    }
}

/// A background runtime for endpoints created outside any tokio runtime.
fn fallback_runtime() -> Result<tokio::runtime::Handle, BackendError> {
    static RT: std::sync::OnceLock<Result<tokio::runtime::Runtime, String>> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvxfer-cuda-ipc")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map(|rt| rt.handle().clone())
    .map_err(|e| BackendError::Io {
        backend: NAME,
        context: "starting a background runtime".into(),
        detail: e.clone(),
    })
}

/// Registered regions: their export (none when the allocation has no legacy handle) and metadata.
type Exports = HashMap<RegionId, (Option<Export>, MetaRegion)>;

/// A region of a connected peer, imported.
struct PeerRegion {
    len: u64,
    /// The mapping of its allocation and the region's offset in it; `Err`: why it cannot be written.
    target: Result<(Arc<IpcMapping>, u64), String>,
}

/// What the completion task of a peer works through, in post order.
enum Item {
    Transfer {
        state: Arc<TransferState>,
        copies: Option<(Pending, Arc<Stream>)>,
        note: Option<Vec<u8>>,
    },
    /// The peer revoked a region (already out of the books): answer once everything before it completed.
    Revoked {
        seq: u64,
    },
}

/// The books of a connected peer that posts and revokes change under one lock (so a revoke is
/// answered only after every copy into the region that was queued before it completed).
struct Book {
    regions: HashMap<RegionId, PeerRegion>,
    queue: mpsc::UnboundedSender<Item>,
}

struct Peer {
    identity: u64,
    addr: String,
    /// The peer's process (same node): its CUDA IPC mappings of our pool live as long as it does.
    pid: u32,
    book: Arc<Mutex<Book>>,
    ctrl: mpsc::UnboundedSender<Vec<u8>>,
    /// The CUDA stream its copies run on (made with the first post, on that post's source device).
    stream: Mutex<Option<Arc<Stream>>>,
    dead: Arc<Mutex<Option<BackendError>>>,
    inflight: Mutex<Vec<Arc<TransferState>>>,
    tasks: Vec<AbortHandle>,
}

impl Peer {
    fn stream(&self, device: u32) -> Result<Arc<Stream>, BackendError> {
        let mut s = lock(&self.stream);
        if let Some(x) = s.as_ref() {
            return Ok(Arc::clone(x));
        }
        let ctx = context(device).map_err(cuda("a CUDA context for the copies"))?;
        let x = Arc::new(Stream::new(&ctx).map_err(cuda("a CUDA stream for the copies"))?);
        *s = Some(Arc::clone(&x));
        Ok(x)
    }

    fn check(&self) -> Result<(), BackendError> {
        lock(&self.dead).clone().map_or(Ok(()), Err)
    }
}

/// Abort cannot recall copies the GPU was given: the transfer ends once they completed, as aborted
/// (the completion task sees the request).
struct NoRecall;

impl AbortTransfer for NoRecall {
    fn abort(&self, _state: &Arc<TransferState>) {}
}

/// A cuda-ipc endpoint.
pub struct CudaIpcBackend {
    shared: Arc<Shared>,
    opts: IpcOptions,
    advertised: String,
    exports: Arc<Mutex<Exports>>,
    uuids: Mutex<HashMap<u32, String>>,
    peers: PeerTable<Peer>,
    accept: AbortHandle,
    rt: tokio::runtime::Handle,
}

impl std::fmt::Debug for CudaIpcBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaIpcBackend")
            .field("identity", &self.shared.identity)
            .field("addr", &self.advertised)
            .finish()
    }
}

impl CudaIpcBackend {
    /// Binds the control listener and starts accepting.
    pub fn new(config: &BackendConfig) -> Result<Self, BackendError> {
        let opts = IpcOptions::from_config(config)?;
        let rt = match tokio::runtime::Handle::try_current() {
            Ok(h) => h,
            Err(_) => fallback_runtime()?,
        };
        let io =
            |context: String, e: std::io::Error| BackendError::Io { backend: NAME, context, detail: e.to_string() };
        let listener = {
            let _g = rt.enter();
            let std =
                std::net::TcpListener::bind(opts.listen).map_err(|e| io(format!("binding {}", opts.listen), e))?;
            std.set_nonblocking(true).map_err(|e| io("a non-blocking listener".into(), e))?;
            tokio::net::TcpListener::from_std(std).map_err(|e| io("registering the listener".into(), e))?
        };
        let local = listener.local_addr().map_err(|e| io("reading the listen address".into(), e))?;
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
        let mut token = [0u8; wire::TOKEN_LEN];
        let n = kvxfer_core::secret::nonce().map_err(|e| BackendError::Io {
            backend: NAME,
            context: "drawing the access token".into(),
            detail: e.to_string(),
        })?;
        token.copy_from_slice(&n[..wire::TOKEN_LEN]);
        let shared = Arc::new(Shared::new(
            config.identity,
            token,
            config.secret.clone(),
            RegionTable::new(NAME, CAPABILITIES.limits.max_regions),
            opts.timeout,
            opts.handshake_timeout,
        ));
        let accept = rt.spawn(control::accept_loop(Arc::clone(&shared), listener)).abort_handle();
        Ok(Self {
            shared,
            opts,
            advertised,
            exports: Arc::new(Mutex::new(HashMap::new())),
            uuids: Mutex::new(HashMap::new()),
            peers: PeerTable::new(NAME),
            accept,
            rt,
        })
    }

    /// The `host:port` of the control listener.
    pub fn address(&self) -> &str {
        &self.advertised
    }

    /// Notifications refused because their key was not the identity their connection proved.
    pub fn forged_notifications(&self) -> u64 {
        self.shared.forged.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn uuid(&self, device: u32) -> Result<String, BackendError> {
        if let Some(u) = lock(&self.uuids).get(&device) {
            return Ok(u.clone());
        }
        let d = kvxfer_cuda::driver().map_err(cuda("loading the CUDA driver"))?;
        let u = hex(&d.device_info(device).map_err(cuda(format!("describing device {device}")))?.uuid);
        lock(&self.uuids).insert(device, u.clone());
        Ok(u)
    }

    /// This process's ordinal of the device with `uuid`.
    fn device_of_uuid(&self, uuid: &str) -> Result<u32, BackendError> {
        let d = kvxfer_cuda::driver().map_err(cuda("loading the CUDA driver"))?;
        let n = d.device_count().map_err(cuda("counting devices"))?;
        for i in 0..n {
            if self.uuid(i)? == uuid {
                return Ok(i);
            }
        }
        Err(BackendError::NoDevice {
            backend: NAME,
            detail: format!(
                "the peer's pool is on GPU {uuid}, which this process does not see ({n} visible): make it visible \
                 (CUDA_VISIBLE_DEVICES) or use tcp"
            ),
        })
    }
}

impl Drop for CudaIpcBackend {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.abort_tasks();
        for (_, p) in self.peers.drain() {
            p.tasks.iter().for_each(AbortHandle::abort);
            for s in lock(&p.inflight).drain(..) {
                s.fail(BackendError::Closed { backend: NAME });
            }
        }
    }
}

/// Closes a registration: out of the table and the metadata at once, then every connected writer is
/// told to stop and answers, then local use drains, then the export goes.
struct Closer {
    shared: Arc<Shared>,
    exports: Arc<Mutex<Exports>>,
    id: RegionId,
    rt: tokio::runtime::Handle,
}

impl Closer {
    async fn run(self) -> Result<(), BackendError> {
        let drained = self.shared.regions.remove(self.id)?;
        let export = lock(&self.exports).remove(&self.id);
        if export.as_ref().is_some_and(|(e, _)| e.is_some()) {
            self.shared.revoke(self.id.0, Instant::now() + self.shared.timeout).await?;
        }
        drained.wait().await;
        drop(export);
        Ok(())
    }
}

impl CloseRegistration for Closer {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(self.run())
    }

    fn close_detached(self: Box<Self>) {
        let rt = self.rt.clone();
        rt.spawn(async move {
            if let Err(e) = self.run().await {
                tracing::warn!(error = %e, "cuda-ipc: closing a dropped registration");
            }
        });
    }
}

/// A peer's completion task: each transfer's copies complete, then its notification goes, then it is
/// done; revokes are answered in order.
async fn complete(
    mut rx: mpsc::UnboundedReceiver<Item>,
    ctrl: mpsc::UnboundedSender<Vec<u8>>,
    dead: Arc<Mutex<Option<BackendError>>>,
    peer: String,
    timeout: Duration,
) {
    while let Some(item) = rx.recv().await {
        match item {
            Item::Transfer { state, copies, note } => {
                if let Some((p, stream)) = copies {
                    if let Err(e) = p.wait(&stream, Instant::now() + timeout).await {
                        state.fail(cuda(format!("copies to {peer}"))(e));
                        continue;
                    }
                    drop(p.finish());
                }
                if let Some(e) = lock(&dead).clone() {
                    state.fail(e);
                    continue;
                }
                if state.abort_requested() {
                    // Every copy completed (nothing more can land); the notification is not sent.
                    state.aborted();
                    continue;
                }
                if let Some(n) = note {
                    if ctrl.send(wire::frame(wire::Type::Note, &n)).is_err() {
                        state.fail(BackendError::PeerLost {
                            backend: NAME,
                            peer: peer.clone(),
                            detail: "the control connection closed before the notification".into(),
                        });
                        continue;
                    }
                }
                state.complete();
            }
            Item::Revoked { seq } => {
                let _ = ctrl.send(wire::revoked(seq));
            }
        }
    }
}

#[async_trait::async_trait]
impl KvTransferBackend for CudaIpcBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        let memory = if kvxfer_cuda::available() { MemKinds::CUDA } else { MemKinds::NONE };
        CAPABILITIES.with_memory(memory)
    }

    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        let MemKind::Cuda { device } = mem.kind() else {
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "registering {} (cuda-ipc moves CUDA device memory only; tcp and local take host memory)",
                    mem.kind()
                ),
            });
        };
        kvxfer_cuda::check_register(NAME, &mem)?;
        let uuid = self.uuid(device)?;
        self.shared.regions.insert(id, mem.clone())?;
        let meta = match ipc::export(&mem) {
            Ok(e) => {
                let m = MetaRegion {
                    id: id.0,
                    len: mem.len() as u64,
                    device_uuid: uuid,
                    handle: Some(hex(&e.handle)),
                    offset: e.offset,
                    alloc_len: e.alloc_len,
                    why: None,
                };
                (Some(e), m)
            }
            Err(e) => {
                tracing::warn!(region = id.0, error = %e, "cuda-ipc: region not exported (usable as a source only)");
                let m = MetaRegion {
                    id: id.0,
                    len: mem.len() as u64,
                    device_uuid: uuid,
                    handle: None,
                    offset: 0,
                    alloc_len: 0,
                    why: Some(e.to_string()),
                };
                (None, m)
            }
        };
        lock(&self.exports).insert(id, meta);
        let closer =
            Closer { shared: Arc::clone(&self.shared), exports: Arc::clone(&self.exports), id, rt: self.rt.clone() };
        Ok(Registration::new(NAME, id, &mem, Box::new(closer)))
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let mut regions: Vec<MetaRegion> = lock(&self.exports).values().map(|(_, m)| m.clone()).collect();
        regions.sort_by_key(|r| r.id);
        let m = Meta {
            protocol: wire::VERSION,
            addr: self.advertised.clone(),
            token: hex(&self.shared.token),
            pid: std::process::id(),
            boot_id: boot_id(),
            host: host_name(),
            regions,
        };
        Ok(EndpointMetadata::new(NAME, self.shared.identity, serde_json::to_vec(&m).expect("metadata serializes")))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        peer.check(NAME)?;
        let bad = |detail: String| BackendError::BadMetadata { backend: NAME, detail };
        let m: Meta = serde_json::from_slice(&peer.payload).map_err(|e| bad(format!("payload: {e}")))?;
        if m.protocol != wire::VERSION {
            return Err(bad(format!("the peer speaks cuda-ipc version {}, this build {}", m.protocol, wire::VERSION)));
        }
        let token: [u8; wire::TOKEN_LEN] = from_hex(&m.token).ok_or_else(|| bad("token is not hex".into()))?;
        let mine = boot_id();
        if !mine.is_empty() && !m.boot_id.is_empty() && mine != m.boot_id {
            return Err(BackendError::Connect {
                backend: NAME,
                peer: format!("{} ({})", m.addr, m.host),
                detail: format!(
                    "cuda-ipc connects peers on the same node only: the peer runs on {} (boot id {}), this endpoint on \
                     {} (boot id {mine}); use tcp, ucx or verbs across hosts",
                    m.host,
                    m.boot_id,
                    host_name()
                ),
            });
        }
        // Import first: a peer whose pool cannot be mapped here is refused before any connection.
        let mut regions = HashMap::new();
        for r in &m.regions {
            let target = match (&r.handle, &r.why) {
                (Some(h), _) => {
                    let handle: [u8; ipc::HANDLE_BYTES] =
                        from_hex(h).ok_or_else(|| bad(format!("region {} handle", r.id)))?;
                    let dev = self.device_of_uuid(&r.device_uuid)?;
                    let ctx = context(dev).map_err(cuda(format!("a context on device {dev}")))?;
                    let map = ipc::import(&ctx, handle, r.alloc_len, m.pid).map_err(|e| BackendError::Connect {
                        backend: NAME,
                        peer: m.addr.clone(),
                        detail: format!("importing region {} (process {} on {}): {e}", r.id, m.pid, m.host),
                    })?;
                    if !r.offset.checked_add(r.len).is_some_and(|e| e <= map.len()) {
                        return Err(bad(format!(
                            "region {} ({} bytes at {}) lies outside its {}-byte allocation",
                            r.id,
                            r.len,
                            r.offset,
                            map.len()
                        )));
                    }
                    Ok((map, r.offset))
                }
                (None, why) => Err(why.clone().unwrap_or_else(|| "not exported".into())),
            };
            regions.insert(RegionId(r.id), PeerRegion { len: r.len, target });
        }
        let (r, mut w) = control::connect(
            &m.addr,
            self.shared.identity,
            peer.identity,
            token,
            self.shared.secret.as_ref(),
            self.opts.timeout,
        )
        .await?;
        let desc = format!("{} (identity {:#x})", m.addr, peer.identity);
        let (ctrl, mut ctrl_rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let (queue, queue_rx) = mpsc::unbounded_channel::<Item>();
        let book = Arc::new(Mutex::new(Book { regions, queue }));
        let dead: Arc<Mutex<Option<BackendError>>> = Arc::new(Mutex::new(None));
        let lost = {
            let (dead, events, identity, desc) =
                (Arc::clone(&dead), Arc::clone(&self.shared.events), peer.identity, desc.clone());
            move |why: String| {
                let mut d = lock(&dead);
                if d.is_none() {
                    tracing::info!(peer = %desc, reason = %why, "cuda-ipc: lost a peer");
                    *d = Some(BackendError::PeerLost { backend: NAME, peer: desc.clone(), detail: why.clone() });
                    events.push(BackendEvent::PeerLost { identity, reason: why });
                }
            }
        };
        let writer = {
            let lost = lost.clone();
            self.rt.spawn(async move {
                while let Some(f) = ctrl_rx.recv().await {
                    let bye = f.first() == Some(&(wire::Type::Bye as u8));
                    if let Err(e) = w.write_all(&f).await {
                        return lost(format!("sending on the control connection: {e}"));
                    }
                    if bye {
                        let _ = w.shutdown().await;
                        return;
                    }
                }
            })
        };
        let reader = {
            let (book, lost) = (Arc::clone(&book), lost.clone());
            self.rt.spawn(async move {
                let why = control::read_revokes(r, |region, seq| {
                    // Out of the books at once (no later post can name it), answered once every
                    // copy queued before completed.
                    let mut b = lock(&book);
                    b.regions.remove(&RegionId(region));
                    let _ = b.queue.send(Item::Revoked { seq });
                })
                .await;
                lost(why);
            })
        };
        let completer =
            self.rt.spawn(complete(queue_rx, ctrl.clone(), Arc::clone(&dead), desc.clone(), self.opts.timeout));
        let tasks = vec![writer.abort_handle(), reader.abort_handle(), completer.abort_handle()];
        Ok(self.peers.insert(Peer {
            identity: peer.identity,
            addr: desc,
            pid: m.pid,
            book,
            ctrl,
            stream: Mutex::new(None),
            dead,
            inflight: Mutex::new(Vec::new()),
            tasks,
        }))
    }

    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.post_gated(peer, ops, notify, None)
    }

    fn post_ordered(
        &self,
        peer: PeerId,
        ops: &[WriteOp],
        notify: Option<&Notification>,
        order: GpuOrder,
    ) -> Result<Transfer, BackendError> {
        let gate = kvxfer_cuda::order::gate(order).map_err(cuda("the send's GPU order"))?;
        self.post_gated(peer, ops, notify, gate)
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        self.notify_now(peer, notification)
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        Ok(self.shared.events.recv(max_wait).await)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        self.disconnect_now(peer).await
    }

    /// Legacy CUDA IPC cannot revoke a mapping another process holds: a peer process that imported
    /// this endpoint's pool can write into it for as long as it lives. So the cut-off is confirmed
    /// only once that process is gone (its mappings and its CUDA context go with it): the control
    /// connection is closed and transfers to it end, then the call waits (bounded by `timeout_s`,
    /// at most 8 s) for the process to exit. A peer process that is alive (stopped, or merely
    /// unreachable) is refused with an error, and the engine keeps the pages it could write
    /// quarantined.
    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        let p = self.peers.remove(peer)?;
        *lock(&p.dead) =
            Some(BackendError::PeerLost { backend: NAME, peer: p.addr.clone(), detail: format!("cut off: {reason}") });
        let _ = p.ctrl.send(wire::frame(wire::Type::Bye, &[]));
        let live: Vec<_> = lock(&p.inflight).clone();
        let bound = self.opts.timeout.min(Duration::from_secs(8));
        let deadline = Instant::now() + bound;
        loop {
            if !process_alive(p.pid) {
                for s in &live {
                    s.settled(deadline).await;
                }
                let failed = live.iter().filter(|s| !matches!(s.status(), TransferStatus::Done)).count();
                return Ok(CutOff {
                    closed: 1,
                    failed_transfers: failed,
                    how: "the peer process exited: its CUDA IPC mappings of this pool went with it",
                });
            }
            if Instant::now() >= deadline {
                return Err(BackendError::Unsupported {
                    backend: NAME,
                    what: format!(
                        "cutting off the live process {} ({}): legacy CUDA IPC mappings cannot be revoked, and it \
                         is still running after {bound:?}; the pages it could write stay quarantined",
                        p.pid, p.addr
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether process `pid` of this node still runs (a zombie has released its memory and devices).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) != Some("Z"),
        Err(_) => false,
    }
}

impl CudaIpcBackend {
    /// Posts `ops`, their copies queued after `gate` (a send's GPU order) when there is one.
    fn post_gated(
        &self,
        peer: PeerId,
        ops: &[WriteOp],
        notify: Option<&Notification>,
        gate: Option<Arc<Event>>,
    ) -> Result<Transfer, BackendError> {
        let p = self.peers.get(peer)?;
        p.check()?;
        let note = notify
            .map(Notification::encode)
            .transpose()
            .map_err(|source| BackendError::Codec { backend: NAME, source })?;
        CAPABILITIES.check_post(NAME, ops.len(), note.as_ref().map_or(0, Vec::len))?;
        let book = lock(&p.book);
        let mut refs: Vec<RegionRef> = Vec::new();
        let mut plan = CopyPlan::new();
        let mut total = 0u64;
        let mut device = None;
        for op in ops {
            let src = match refs.iter().find(|r| r.id() == op.src) {
                Some(r) => r.clone(),
                None => {
                    let r = self.shared.regions.get(op.src, None)?;
                    refs.push(r.clone());
                    r
                }
            };
            op.check_src(NAME, None, src.len())?;
            let dst = book.regions.get(&op.dst).ok_or(BackendError::UnknownRegion {
                backend: NAME,
                region: op.dst,
                peer: Some(peer),
            })?;
            op.check_dst(NAME, Some(peer), dst.len)?;
            if op.len == 0 {
                continue;
            }
            let (map, base) = dst.target.as_ref().map_err(|why| BackendError::Unsupported {
                backend: NAME,
                what: format!("writing {} of {peer}: it was not exported ({why})", op.dst),
            })?;
            if op.count > 1 && op.dst_stride < op.len {
                return Err(BackendError::Unsupported {
                    backend: NAME,
                    what: format!(
                        "a destination stride ({}) smaller than the range length ({}): the op's ranges overlap",
                        op.dst_stride, op.len
                    ),
                });
            }
            let (len, count, ss, ds) = if op.src_stride == op.len && op.dst_stride == op.len {
                (op.len * op.count, 1, op.len * op.count, op.len * op.count)
            } else {
                (op.len, op.count, op.src_stride, op.dst_stride)
            };
            let span = (count - 1) * ss + len;
            let res = src.desc().reserve(op.src_offset, span, 1, span, false).map_err(|e| BackendError::Io {
                backend: NAME,
                context: format!("reading source {}", op.src),
                detail: format!("{e} (a transfer into this endpoint is writing a source range)"),
            })?;
            device = device.or(match src.desc().kind() {
                MemKind::Cuda { device } => Some(device),
                _ => None,
            });
            plan.to_mapping(res, Shape { offset: 0, len, count, stride: ss }, map, base + op.dst_offset, ds)
                .map_err(cuda(format!("copying into {} of {peer}", op.dst)))?;
            total += op.bytes();
        }
        if plan.is_empty() && note.is_none() {
            return Ok(Transfer::finished(NAME, peer, TransferStatus::Done, 0));
        }
        plan.keep(refs);
        let copies = match device {
            Some(d) if !plan.is_empty() => {
                let stream = p.stream(d)?;
                if let Some(g) = gate {
                    // No byte is read before the engine's work completed; the host does not wait.
                    stream.wait_event(&g).map_err(cuda("waiting for the send's GPU order"))?;
                    plan.keep(g);
                }
                let pending = stream.submit(plan).map_err(cuda(format!("queueing copies to {peer}")))?;
                Some((pending, stream))
            }
            _ => None,
        };
        let state = TransferState::new(NAME, peer);
        {
            let mut inflight = lock(&p.inflight);
            inflight.retain(|s| !s.status().is_final());
            inflight.push(Arc::clone(&state));
        }
        if book.queue.send(Item::Transfer { state: Arc::clone(&state), copies, note }).is_err() {
            // The completion task ended (endpoint dropping): the copies still complete; the
            // transfer fails.
            state.fail(BackendError::Closed { backend: NAME });
        }
        drop(book);
        Ok(Transfer::new(state, Arc::new(NoRecall), total))
    }

    fn notify_now(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        let p = self.peers.get(peer)?;
        p.check()?;
        let body = notification.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        CAPABILITIES.check_post(NAME, 0, body.len())?;
        p.ctrl.send(wire::frame(wire::Type::Note, &body)).map_err(|_| BackendError::PeerLost {
            backend: NAME,
            peer: p.addr.clone(),
            detail: "the control connection is closed".into(),
        })
    }

    async fn disconnect_now(&self, peer: PeerId) -> Result<(), BackendError> {
        let p = self.peers.remove(peer)?;
        let live: Vec<_> = lock(&p.inflight).clone();
        let deadline = Instant::now() + self.opts.timeout;
        for s in &live {
            s.settled(deadline).await;
        }
        let _ = p.ctrl.send(wire::frame(wire::Type::Bye, &[]));
        // The writer sends BYE and ends; the reader sees the connection close.
        tokio::time::sleep(Duration::from_millis(1)).await;
        if live.iter().any(|s| !s.status().is_final()) {
            return Err(BackendError::Timeout {
                backend: NAME,
                what: format!("copies to {} (identity {:#x})", p.addr, p.identity),
                after: self.opts.timeout,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_reject() {
        let o = IpcOptions::from_config(&BackendConfig::new(1)).unwrap();
        assert_eq!((o.listen.to_string(), o.timeout), ("127.0.0.1:0".to_owned(), Duration::from_secs(60)));
        let e = IpcOptions::from_config(&BackendConfig::new(1).with("connections", "2")).unwrap_err().to_string();
        assert!(e.contains("unknown option") && e.contains("listen, advertise"), "{e}");
        assert!(IpcOptions::from_config(&BackendConfig::new(1).with("timeout_s", "0")).is_err());
    }

    /// Every option whose documented default is a value parses, set to it, to what leaving it unset
    /// gives (`advertise`'s default is computed).
    #[test]
    fn documented_defaults_are_the_defaults() {
        kvxfer_core::check_documented_defaults(OPTIONS, &["advertise"], IpcOptions::from_config);
    }

    #[test]
    fn hex_round_trips() {
        let t = [0xa5u8; 64];
        assert_eq!(from_hex::<64>(&hex(&t)), Some(t));
        assert_eq!(from_hex::<2>("+f00"), None);
    }
}

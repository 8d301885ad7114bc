//! kvxfer's UCX backend: one-sided puts with remote keys, active-message notifications.
//!
//! # How it works
//! - Each endpoint owns a UCP context and one worker, driven by a dedicated progress thread (the
//!   worker is `UCS_THREAD_MODE_SINGLE` and only that thread touches it). The API sends the thread
//!   commands over a channel; async calls await a oneshot answer, [`KvTransferBackend::post`]
//!   returns a [`Transfer`] at once and the thread completes its state.
//! - [`KvTransferBackend::metadata`] publishes the worker address and, per registered region, its
//!   address, length and packed remote key. Peers create their endpoint from the worker address, so
//!   UCX picks the best lane both share: shared memory on one host (posix/sysv; UCX 1.13 emulates
//!   puts into registered user memory there with active messages through the peer's FIFO, see
//!   the crate README), tcp or RDMA between hosts. A connecting endpoint says hello; the peer
//!   answers with a welcome listing the regions registered now (stale keys are dropped), on the
//!   endpoint it later sends revokes on.
//! - Put path (`data=put`): `post` checks every op, the thread posts `ucp_put_nbx` per contiguous
//!   segment (at most [`PIECE`] bytes, [`progress`]'s window of requests in flight), then a flush; the
//!   transfer is done when the flush completed (remote completion), and its attached notification
//!   is an active message posted after that flush, in post order per peer.
//! - Active-message path (`data=am`, the default over tcp): UCX 1.13 emulates puts over tcp with
//!   active messages whose acknowledgement path aborts the *receiving* process when the sender dies
//!   mid-transfer (`ucp_put_handler` -> `Fatal: unexpected error: Endpoint timeout`). So the sender
//!   packs the segments into eager active messages (up to 1 MiB), then a commit carrying the
//!   notification; the receiver checks every segment against the region registered now, places
//!   it, and acknowledges the commit on the same endpoint pair; the transfer is done on that
//!   acknowledgement (remote completion).
//! - Peer loss: endpoints use `UCP_ERR_HANDLING_MODE_PEER` where the transports support it; UCX
//!   1.13's shared-memory transports do not, so there the backend watches the peer process through
//!   `/proc` (boot id, pid, start time) every `keepalive_ms`. Clean shutdowns say goodbye.
//!
//! # Authentication
//! With a cluster secret ([`BackendConfig::secret`]) every connection authenticates, mutually, at
//! connect: the hello carries the connector's fresh nonce, the acceptor answers with its own nonce
//! and a proof, the connector verifies it and proves the secret back, and only then does the
//! acceptor send the welcome (the connect's answer). Each proof is an HMAC over both nonces and both
//! endpoints' identities and instances. A mismatch (different secrets, or one side without) fails
//! `connect` with an error naming authentication. Until a peer has authenticated, the acceptor
//! applies none of its messages (no notification, no data placed, no commit, revoke or goodbye).
//! Every notification must carry the identity its sender proved as its key
//! ([`Notification::is_from`]); one that does not is dropped, counted
//! ([`UcxBackend::forged_notifications`]), the sender told and refused for the endpoint's lifetime,
//! and `PeerLost` reported with the proved identity. Limits: see the crate README.
//!
//! # Cutting a peer off
//! [`KvTransferBackend::cut_off`] records the peer's instance as cut off on the progress thread:
//! from then on every active message carrying it is dropped before it is decoded (no data placed,
//! nothing delivered, a reconnect refused), every endpoint to it is closed and every transfer to it
//! fails. It is confirmed only for an instance that writes with active messages (`data=am`, which
//! its hello says), because this endpoint places those bytes itself; an instance that writes with
//! `ucp_put_nbx` is cut off the same way but answered `Unsupported`: UCX 1.13 places its emulated
//! puts in `ucp_put_handler` without a check the receiver can make fail (no remote key is checked,
//! and a closed endpoint still takes puts). See the crate README for the UCX source behind this.
//!
//! # Memory lifetime and abort
//! - Closing a [`Registration`] removes the region from the table (new posts naming it fail with
//!   `UnknownRegion`, the active-message receiver refuses data for it), waits until no local
//!   transfer holds it, then sends a revoke to every connected peer and resolves when each one
//!   acknowledged or is known lost. A peer acknowledges after it forgot the remote key, stopped
//!   posting into the region, and a flush of its endpoint completed: cma (`process_vm_writev`)
//!   and emulated puts are not checked by the receiving NIC, so this handshake is what guarantees
//!   no write lands after `close`. Only then is the memory unmapped. Dropping a registration does
//!   the same on the progress thread; dropping the endpoint closes every region the same way
//!   (bounded by two seconds).
//! - Abort stops posting the transfer's remaining pieces, cancels outstanding requests where UCX
//!   can (`ucp_request_cancel`), and fences: the put path waits for a flush of the endpoint; the
//!   active-message path sends an aborted commit and waits for the receiver's acknowledgement on
//!   the same ordered endpoint, so every earlier data message was placed (or refused) before it.
//!   Only then is the transfer `Aborted`.
//!
//! # Options
//! See the crate README; every option has a `KVXFER_UCX_<OPTION>` environment fallback.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer_core::backend::BoxFuture;
use kvxfer_core::toolkit::{segments, EventQueue, Options, PeerTable, RegionTable};
use kvxfer_core::{
    AbortTransfer, BackendConfig, BackendError, BackendEvent, Capabilities, CloseRegistration, Completion, CutOff,
    EndpointMetadata, KvTransferBackend, Limits, MemDesc, MemKinds, Notification, OptionDoc, PeerId, RegionId,
    Registration, Transfer, TransferState, WriteOp,
};
use tokio::sync::oneshot;

#[cfg(any(fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod liveness;
pub mod mmseg;
mod progress;
mod ucp;
mod wire;

use progress::{Cmd, ErrMode, PeerShared, Post, Settings, Shared};

/// Registry name.
pub const NAME: &str = "ucx";

/// Largest contiguous piece one put or data segment carries (abort granularity).
pub const PIECE: u64 = 4 << 20;
/// Most ops one post takes.
pub const MAX_OPS_PER_POST: u64 = 1 << 16;
/// Largest encoded notification (an eager active message carries it whole).
pub const MAX_NOTIFICATION_BYTES: u64 = (kvxfer_core::notify::MAX_PAYLOAD + 4096) as u64;
/// Most regions registered at once.
pub const MAX_REGIONS: u64 = 1 << 16;

/// Capabilities of an endpoint with default options (instances report their own: shared-memory
/// transports only means no cross-host, CUDA memory only where UCX reports it).
pub const CAPABILITIES: Capabilities = Capabilities::new(true, true, true, true)
    .with_limits(Limits::new(MAX_OPS_PER_POST, MAX_NOTIFICATION_BYTES, MAX_REGIONS))
    .with_completion(Completion::Remote);

/// Every option of a UCX endpoint, with its default and what it does: the list the endpoint checks
/// keys against and `kvxfer backends` prints. `ucx.<NAME>` stands for every key starting with
/// `ucx.`, passed to UCX as its setting `NAME`.
pub const OPTIONS: &[OptionDoc] = &[
    OptionDoc::new(
        "tls",
        "UCX's (all)",
        "UCX transports (UCX_TLS): tcp, posix,sysv,cma,self (shared memory), rc,ud,...",
    ),
    OptionDoc::new("net_devices", "UCX's", "UCX_NET_DEVICES, e.g. lo for loopback-only tests"),
    OptionDoc::new(
        "timeout_ms",
        "30000",
        "deadline of connect, notify, disconnect and the revoke acknowledgements of a close (1..=3600000)",
    ),
    OptionDoc::new(
        "keepalive_ms",
        "1000",
        "UCX keepalive and the backend's own liveness check of shared-memory peers (1..=3600000)",
    ),
    OptionDoc::new(
        "err_mode",
        "auto",
        "UCX endpoint error mode: peer, none, auto (none for shared-memory-only transports, else peer)",
    ),
    OptionDoc::new(
        "data",
        "auto",
        "put (one-sided puts), am (active messages), auto (am when tcp may be used or cma is not allowed)",
    ),
    OptionDoc::new(
        "idle",
        "poll",
        "how an idle progress thread waits: poll (naps 1 ms between polls), event (sleeps on the worker's event descriptor, woken by arriving messages and commands)",
    ),
    OptionDoc::new("ucx.<NAME>", "UCX's", "any other UCX setting NAME, e.g. ucx.RNDV_THRESH=64k"),
];

kvxfer_core::register_backend!(
    NAME,
    "UCX: ucp_put_nbx with remote keys, active-message notifications (tcp, shared memory, RDMA)",
    CAPABILITIES,
    OPTIONS,
    create
);

/// The version of the UCX library this process loaded.
pub fn ucx_version() -> String {
    ucp::version()
}

/// Creates an endpoint (see the crate docs for options).
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    Ok(Arc::new(UcxBackend::new(config)?))
}

fn settings(config: &BackendConfig) -> Result<Settings, BackendError> {
    // `ucx.NAME` options pass through to UCX; the rest go through the toolkit's parser.
    let mut plain = config.clone();
    plain.options.retain(|k, _| !k.starts_with("ucx."));
    let o = Options::new(NAME, &plain, OPTIONS)?;
    let nonempty = |k: &str| o.get(k).filter(|v| !v.trim().is_empty());
    let mut ucx = Vec::new();
    let tls = nonempty("tls");
    if let Some(t) = &tls {
        ucx.push(("TLS".to_owned(), t.clone()));
    }
    if let Some(d) = nonempty("net_devices") {
        ucx.push(("NET_DEVICES".to_owned(), d));
    }
    let keepalive: u64 = o.int_in("keepalive_ms", 1_000, 1..=3_600_000)?;
    ucx.push(("KEEPALIVE_INTERVAL".to_owned(), format!("{keepalive}ms")));
    for (k, v) in &config.options {
        if let Some(name) = k.strip_prefix("ucx.") {
            ucx.push((name.to_owned(), v.clone()));
        }
    }
    let timeout: u64 = o.int_in("timeout_ms", 30_000, 1..=3_600_000)?;
    let err_mode = match o.choice("err_mode", "auto", &["auto", "peer", "none"])? {
        "peer" => ErrMode::Peer,
        "none" => ErrMode::None,
        _ => ErrMode::Auto,
    };
    let effective_tls = tls.or_else(|| std::env::var("UCX_TLS").ok().filter(|t| !t.is_empty()));
    // The segment size only where a shared-memory transport opens (UCX warns on stdout about a
    // setting no transport takes); 0 publishes "no shared memory here".
    let (mut mm_seg, set_mm_seg) = mmseg::resolve(&ucx, |k| std::env::var(k).ok())?;
    if !mmseg::uses_mm(effective_tls.as_deref()) {
        mm_seg = 0;
    } else if set_mm_seg {
        ucx.push(("MM_SEG_SIZE".to_owned(), mm_seg.to_string()));
    }
    let am_data = match o.choice("data", "auto", &["auto", "put", "am"])? {
        "put" => false,
        "am" => true,
        _ => match effective_tls.as_deref() {
            None => true,
            Some(t) => {
                t.split(',').any(|x| matches!(x.trim().trim_start_matches('^'), "tcp" | "all"))
                    || t.starts_with('^')
                    || !cma_allowed()
            }
        },
    };
    let wakeup = o.choice("idle", "poll", &["poll", "event"])? == "event";
    Ok(Settings {
        ucx,
        wakeup,
        op_timeout: Duration::from_millis(timeout),
        identity: config.identity,
        instance: rand::random(),
        err_mode,
        keepalive: Duration::from_millis(keepalive),
        proc: liveness::ProcId::current(),
        shm_only: shm_only(effective_tls.as_deref()),
        am_data,
        secret: config.secret.clone(),
        mm_seg,
    })
}

/// Whether cma (`process_vm_writev` between sibling processes) is allowed: Yama's `ptrace_scope`
/// absent or 0. Otherwise `data=auto` takes the active-message path. (UCX 1.13 does not use cma
/// for `ucp_put_nbx` either way: its RMA lanes need `put_short`/`put_bcopy`, which cma lacks, so
/// puts into user memory on shared memory are emulated over posix/sysv active messages.)
fn cma_allowed() -> bool {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Err(_) => true,
        Ok(v) => v.trim() == "0",
    }
}

/// Whether a `UCX_TLS` value names only shared-memory transports.
fn shm_only(tls: Option<&str>) -> bool {
    const SHM: [&str; 9] = ["posix", "sysv", "cma", "self", "shm", "mm", "sm", "xpmem", "knem"];
    match tls {
        None => false,
        Some(t) if t.starts_with('^') => false,
        Some(t) => t.split(',').map(str::trim).filter(|s| !s.is_empty()).all(|s| SHM.contains(&s)),
    }
}

/// A UCX endpoint. Dropping it closes every region (peers acknowledge), says goodbye to its peers
/// and releases every UCX handle, on its progress thread, bounded by a few seconds.
pub struct UcxBackend {
    identity: u64,
    instance: u64,
    proc: liveness::ProcId,
    /// Shared-memory segment size in effect ([`mmseg`]).
    mm_seg: u64,
    caps: Capabilities,
    shared: Arc<Shared>,
    peers: PeerTable<Arc<PeerShared>>,
    next_job: AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for UcxBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxBackend").field("identity", &self.identity).field("instance", &self.instance).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl UcxBackend {
    /// Creates an endpoint: a UCX context and worker with the configured transports, and the
    /// progress thread that owns them.
    pub fn new(config: &BackendConfig) -> Result<Self, BackendError> {
        let s = settings(config)?;
        let (identity, instance, proc, mm_seg) = (s.identity, s.instance, s.proc.clone(), s.mm_seg);
        let (shm, am_data) = (s.shm_only, s.am_data);
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            regions: RegionTable::new(NAME, MAX_REGIONS),
            events: EventQueue::new(),
            worker: Mutex::new(Vec::new()),
            meta: Mutex::new(Default::default()),
            cmds: Mutex::new(tx),
            closed: AtomicBool::new(false),
            forged: AtomicU64::new(0),
            unauthenticated: AtomicU64::new(0),
            cut_dropped: AtomicU64::new(0),
            parked: AtomicBool::new(false),
            waker: std::sync::OnceLock::new(),
        });
        let (thread, cuda) = progress::start(s, rx, shared.clone())?;
        // Device memory only where UCX can register it and the data path never reads it from
        // the host (the active-message path copies through host guards).
        let memory = if cuda && !am_data { MemKinds::HOST.union(MemKinds::CUDA) } else { MemKinds::HOST };
        // A cut-off is confirmable for peers that write with active messages (placed by this
        // endpoint, which drops a cut instance's); UCX 1.13's emulated puts cannot be refused here.
        // Peers of one cluster run the same `data` setting.
        let caps = Capabilities::new(true, true, true, !shm)
            .with_cut_off_live(am_data)
            .with_memory(memory)
            .with_limits(Limits::new(MAX_OPS_PER_POST, MAX_NOTIFICATION_BYTES, MAX_REGIONS))
            .with_completion(Completion::Remote);
        Ok(Self {
            identity,
            instance,
            proc,
            mm_seg,
            caps,
            shared,
            peers: PeerTable::new(NAME),
            next_job: AtomicU64::new(1),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The shared-memory segment size this endpoint runs with (UCX's `MM_SEG_SIZE`, see
    /// [`mmseg`]): [`mmseg::DEFAULT`] unless the operator set one, 0 when the configured
    /// transports include no shared memory. Peers on the same host that both use shared memory
    /// must use the same size; `connect` refuses one that does not.
    pub fn mm_seg_size(&self) -> u64 {
        self.mm_seg
    }

    /// Notifications refused because their key was not the identity their sender's connection
    /// proved (with a cluster secret; each one failed that connection).
    pub fn forged_notifications(&self) -> u64 {
        self.shared.forged.load(Ordering::Relaxed)
    }

    /// Messages dropped because their sender had not authenticated (with a cluster secret).
    pub fn unauthenticated_messages(&self) -> u64 {
        self.shared.unauthenticated.load(Ordering::Relaxed)
    }

    /// Messages dropped because their sender's instance was cut off ([`KvTransferBackend::cut_off`]).
    pub fn cut_off_messages(&self) -> u64 {
        self.shared.cut_dropped.load(Ordering::Relaxed)
    }

    /// This endpoint's instance (random, drawn at creation; in its metadata and every message).
    pub fn instance(&self) -> u64 {
        self.instance
    }

    async fn call(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<(), BackendError>>) -> Cmd,
    ) -> Result<(), BackendError> {
        let (tx, rx) = oneshot::channel();
        self.shared.send(make(tx))?;
        // The progress thread answers every command by its deadline (or drops the sender on exit).
        rx.await.map_err(|_| BackendError::Closed { backend: NAME })?
    }
}

impl Drop for UcxBackend {
    fn drop(&mut self) {
        let _ = self.shared.send(Cmd::Shutdown);
        if let Some(t) = lock(&self.thread).take() {
            // Bounded: shutdown waits at most a few seconds for closes, transfers and goodbyes.
            let _ = t.join();
        }
    }
}

/// Closes one region through the progress thread (see the crate docs).
struct Closer {
    id: RegionId,
    shared: Arc<Shared>,
}

impl Closer {
    fn start(&self, reply: Option<oneshot::Sender<Result<(), BackendError>>>) -> Result<(), BackendError> {
        let drained = match self.shared.regions.remove(self.id) {
            Ok(d) => d,
            // The endpoint shut down, which closed every region already.
            Err(_) if self.shared.closed.load(Ordering::Acquire) => return Ok(()),
            Err(e) => return Err(e),
        };
        lock(&self.shared.meta).remove(&self.id);
        self.shared.send(Cmd::Close { id: self.id, drained, reply })
    }
}

impl CloseRegistration for Closer {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            match self.start(Some(tx)) {
                Err(BackendError::Closed { .. }) => Ok(()),
                Err(e) => Err(e),
                Ok(()) => rx.await.unwrap_or(Ok(())),
            }
        })
    }

    fn close_detached(self: Box<Self>) {
        if let Err(e) = self.start(None) {
            tracing::debug!("ucx: closing {} in the background: {e}", self.id);
        }
    }
}

/// Aborts one transfer through the progress thread.
struct Aborter {
    peer: PeerId,
    job: u64,
    shared: Arc<Shared>,
}

impl AbortTransfer for Aborter {
    fn abort(&self, state: &Arc<TransferState>) {
        if self.shared.send(Cmd::Abort { peer: self.peer, job: self.job }).is_err() {
            // The thread is gone: it failed every transfer on its way out.
            state.aborted();
        }
    }
}

fn encode(n: &Notification) -> Result<Vec<u8>, BackendError> {
    n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })
}

#[async_trait::async_trait]
impl KvTransferBackend for UcxBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }

    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        if matches!(mem.kind(), kvxfer_core::MemKind::Cuda { .. }) && !self.caps.memory.contains(&mem.kind()) {
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "registering {} (UCX {} reports no CUDA memory type: it was built without CUDA, as Debian's is; \
                     a UCX built --with-cuda, e.g. NVIDIA HPC-X or conda-forge's ucx with CUDA, with UCX_TLS including \
                     cuda_copy (and cuda_ipc on one node) registers it, with the put data path: am_data=off; or use \
                     the tcp backend, which stages CUDA memory through pinned buffers, or cuda-ipc on one node)",
                    mem.kind(),
                    ucp::version()
                ),
            });
        }
        self.caps.check_memory(NAME, &mem.kind())?;
        let desc = mem.clone();
        self.call(|reply| Cmd::Register { id, desc, reply }).await?;
        Ok(Registration::new(NAME, id, &mem, Box::new(Closer { id, shared: self.shared.clone() })))
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let payload = wire::Payload {
            v: wire::PAYLOAD_VERSION,
            instance: self.instance,
            ucx: ucp::version(),
            worker: wire::hex(&lock(&self.shared.worker)),
            regions: lock(&self.shared.meta).values().cloned().collect(),
            proc: self.proc.clone(),
            mm_seg: self.mm_seg,
        };
        let payload = serde_json::to_vec(&payload)
            .map_err(|e| BackendError::BadMetadata { backend: NAME, detail: format!("encoding the payload: {e}") })?;
        Ok(EndpointMetadata::new(NAME, self.identity, payload))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        peer.check(NAME)?;
        let payload: wire::Payload = serde_json::from_slice(&peer.payload)
            .map_err(|e| BackendError::BadMetadata { backend: NAME, detail: format!("payload: {e}") })?;
        if payload.v != wire::PAYLOAD_VERSION {
            return Err(BackendError::BadMetadata {
                backend: NAME,
                detail: format!("payload version {}, this build speaks {}", payload.v, wire::PAYLOAD_VERSION),
            });
        }
        let identity = peer.identity;
        let pid = self.peers.reserve();
        let shared = Arc::new(PeerShared { identity, regions: Mutex::new(HashMap::new()), lost: Mutex::new(None) });
        let s = shared.clone();
        self.call(|reply| Cmd::Connect { pid, shared: s, identity, payload, reply }).await?;
        self.peers.insert_at(pid, shared);
        Ok(pid)
    }

    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        let p = self.peers.get(peer)?;
        if let Some(reason) = lock(&p.lost).clone() {
            let peer = format!("{peer} (identity {:#x})", p.identity);
            return Err(BackendError::PeerLost { backend: NAME, peer, detail: reason });
        }
        let notify = notify.map(encode).transpose()?;
        self.caps.check_post(NAME, ops.len(), notify.as_ref().map_or(0, Vec::len))?;
        let mut srcs: HashMap<RegionId, _> = HashMap::new();
        {
            let theirs = lock(&p.regions);
            for op in ops {
                if let std::collections::hash_map::Entry::Vacant(v) = srcs.entry(op.src) {
                    v.insert(self.shared.regions.get(op.src, None)?);
                }
                op.check_src(NAME, None, srcs[&op.src].len())?;
                let dst = theirs.get(&op.dst).ok_or(BackendError::UnknownRegion {
                    backend: NAME,
                    region: op.dst,
                    peer: Some(peer),
                })?;
                op.check_dst(NAME, Some(peer), *dst)?;
            }
        }
        let bytes = ops.iter().map(WriteOp::bytes).sum();
        let state = TransferState::new(NAME, peer);
        let job = self.next_job.fetch_add(1, Ordering::Relaxed);
        let segs = segments(ops, PIECE).collect();
        let srcs = srcs.into_values().collect();
        self.shared.send(Cmd::Post(Box::new(Post { peer, job, segs, srcs, notify, state: state.clone() })))?;
        let aborter = Arc::new(Aborter { peer, job, shared: self.shared.clone() });
        Ok(Transfer::new(state, aborter, bytes))
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        self.peers.get(peer)?;
        let bytes = encode(notification)?;
        self.caps.check_post(NAME, 0, bytes.len())?;
        self.call(|reply| Cmd::Notify { peer, bytes, reply }).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        Ok(self.shared.events.recv(max_wait).await)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        self.peers.remove(peer)?;
        self.call(|reply| Cmd::Disconnect { peer, reply }).await
    }

    /// See the crate README, "Cutting a peer off": confirmed (`Ok`) when the peer instance writes
    /// with active messages (`data=am`), which this endpoint places itself and drops from a cut-off
    /// instance; `Unsupported` when it writes with `ucp_put_nbx` (the cut-off is done, but UCX 1.13
    /// gives the receiver no way to refuse those writes).
    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        let (tx, rx) = oneshot::channel();
        self.shared.send(Cmd::CutOff { peer, reason: reason.to_owned(), reply: tx })?;
        // The progress thread answers by the cut-off's deadline (or drops the sender on exit).
        let r = rx.await.map_err(|_| BackendError::Closed { backend: NAME })?;
        if !matches!(r, Err(BackendError::UnknownPeer { .. })) {
            // Cut off either way (confirmed or not): the id is gone.
            let _ = self.peers.remove(peer);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// UCX settings, operation timeout, keepalive, error mode, active-message data, shared memory
    /// only, segment size.
    type Parsed = (Vec<(String, String)>, Duration, Duration, ErrMode, bool, bool, u64, bool);

    fn parsed(c: &BackendConfig) -> Parsed {
        let s = settings(c).unwrap();
        (s.ucx, s.op_timeout, s.keepalive, s.err_mode, s.am_data, s.shm_only, s.mm_seg, s.wakeup)
    }

    /// Every option whose documented default is a value parses, set to it, to what leaving it unset
    /// gives (the others' defaults are UCX's).
    #[test]
    fn documented_defaults_are_the_defaults() {
        let ucxs: Vec<&str> = OPTIONS
            .iter()
            .filter(|d| d.default == "UCX's" || d.default.starts_with("UCX's "))
            .map(|d| d.name)
            .collect();
        kvxfer_core::check_documented_defaults(OPTIONS, &ucxs, |c| settings(c).map(|_| parsed(c)));
    }

    #[test]
    fn ucx_settings_pass_through_and_unknown_options_name_the_known_ones() {
        let c = BackendConfig::new(1).with("ucx.RNDV_THRESH", "64k");
        assert!(parsed(&c).0.contains(&("RNDV_THRESH".to_owned(), "64k".to_owned())));
        let e = settings(&BackendConfig::new(1).with("tls_mode", "tcp")).err().unwrap().to_string();
        let known = "known options: tls, net_devices, timeout_ms, keepalive_ms, err_mode, data, idle, ucx.<NAME>";
        assert!(e.contains(&format!("unknown option \"tls_mode\"; {known}")), "{e}");
    }
}

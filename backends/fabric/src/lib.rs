//! kvxfer's libfabric backend.
//!
//! One libfabric RDM endpoint per backend instance (`FI_EP_RDM`, `FI_MSG | FI_RMA`), tested with the
//! `tcp;ofi_rxm` and `shm` providers of libfabric 1.17:
//!
//! - data: `fi_writemsg` RMA writes from registered regions into the peer's registered regions
//!   (pieces that follow each other on both sides coalesced, up to the provider's `iov_limit` ranges
//!   per post), with `FI_DELIVERY_COMPLETE` where the provider grants it: only then does the endpoint
//!   report [`kvxfer_core::Completion::Remote`] (and the out-of-band style); otherwise `Local`;
//! - `post` returns a [`kvxfer_core::Transfer`] at once; abort stops posting and waits for the
//!   completions of what was posted (libfabric 1.17's tcp and shm providers cannot cancel writes);
//! - attached notifications: remote CQ data on the transfer's last write (`FI_REMOTE_CQ_DATA`),
//!   paired at the receiver with a staged message carrying the notification; or, where the provider
//!   has no CQ data, a message sent after the writes completed;
//! - out-of-band notifications: `fi_send` messages into receive buffers each endpoint keeps posted,
//!   fragmented with the toolkit's `Fragmenter` to the receiver's buffer size;
//! - memory registration follows the provider's `mr_mode` bits; a region is registered for local
//!   use, and once more for each peer instance that connects, whose keys it gets in the connect's
//!   answer; closing a registration revokes it at every peer that connected here (acknowledged
//!   after their writes into it completed) before `fi_close` of the MRs;
//! - cutting a peer off ([`kvxfer_core::KvTransferBackend::cut_off`]) closes that instance's keys,
//!   drops its messages, refuses its hellos, and over `tcp;ofi_rxm` closes the connection
//!   (`fi_av_remove` with `FI_AV_REMOVE_CLEANUP=1`, which stops a write already past the key check);
//!   confirmed only where that is known to stop every write (see the README);
//! - progress: a dedicated thread polls the completion queue; every wait has a deadline;
//! - liveness: hello on connect, heartbeats, "gone" on drop; receivers report silent peers lost.
//! - authentication: with a cluster secret ([`kvxfer_core::BackendConfig::secret`]) the hello starts
//!   a mutual challenge-response (both sides' fresh nonces, both identities; a mismatch fails
//!   `connect` naming authentication), nothing of a peer is applied before it proved the secret, and
//!   every notification must carry the identity its sender proved as its key (a forged one is
//!   dropped, counted in [`FabricBackend::forged_notifications`], the sender refused and reported
//!   lost). Limits in the README.
//!
//! # How the endpoint works
//!
//! The [`KvTransferBackend`] over one libfabric RDM endpoint:
//!
//! - `post` validates everything under the endpoint lock, turns the ops into `fi_writemsg` posts
//!   (contiguous pieces coalesced, at most `iov_limit` ranges and `max_msg_size` bytes each) and
//!   queues them as a job; the caller's thread posts what the queue takes at once, the progress
//!   thread the rest. Writes carry `FI_DELIVERY_COMPLETE` where the provider grants it, so a job's
//!   completion means the bytes are in the peer's memory ([`Completion::Remote`]).
//! - A job runs in phases separated by barriers (every completion of a phase before the next is
//!   posted): the writes; then the attached notification, either a "staged" message plus the last
//!   write carrying remote CQ data (the receiver delivers when both arrived) or, without CQ data, a
//!   plain message. Notification phases of one peer go out in post order.
//! - Abort and failure stop posting the job's remaining pieces, then wait for the completions of
//!   what the provider already has (the providers of libfabric 1.17 cannot cancel writes), then make
//!   the transfer final.
//! - Closing a registration: out of the region table, wait for local jobs that hold it, revoke it at
//!   every peer that said hello (they acknowledge once their jobs writing into it are final), then
//!   `fi_close` the MR.
//! - Progress: a dedicated thread polls the completion queue; every call on the endpoint holds one
//!   mutex, which is what `FI_THREAD_DOMAIN` asks of the application.
//!
//! # Modules
//!
//! This file holds [`FabricBackend`], its constructor and its [`KvTransferBackend`] impl; the
//! other modules are the rooms every backend has: `options` (the option table, its parsing and
//! the limits), `peers` (peer records, the connect exchange and its authentication, liveness,
//! cutting a peer off), `regions` (registrations, the keys handed to writers, revokes, closing a
//! registration), `progress` (the state behind the endpoint mutex, posting jobs, polling the
//! completion queue, the progress thread), `wire` (the messages) and `ffi` (the libfabric calls).
//!
//! See README.md in this crate for the options, the provider findings and the shm workarounds.
//! The `baseline` module (cargo feature `baseline`, off by default; `kvxfer bench` and
//! `examples/fabric_bench.rs` turn it on) measures plain `fi_write` loops, the reference the bench
//! compares the backend with; `tests/completion.rs` probes what a write completion means on each
//! provider.

#[cfg(feature = "baseline")]
pub mod baseline;
pub mod ffi;
#[cfg(any(fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod options;
mod peers;
mod progress;
mod regions;
pub mod wire;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::{self, EventQueue, PeerTable, Reassembler, RegionTable};
use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, Capabilities, Completion, CutOff, EndpointMetadata, KvTransferBackend,
    Limits, MemDesc, Notification, PeerId, RegionId, Registration, Transfer, TransferState, TransferStatus, WriteOp,
};

use crate::ffi::{env_flag, Hints, ProviderInfo, RdmEndpoint, Waker};
use crate::options::config_err;
use crate::peers::{av_remove_cleanup, closed_set, Attempt, CutInfo};
use crate::progress::{progress_loop, Aborter, Inner, Item, Phase, State};
use crate::regions::Closer;
use crate::wire::{Kind, Payload, RegionMeta, Staged, WIRE_VERSION};

pub use options::{capabilities_for, AttachedMode, Options, MAX_IN_FLIGHT, MAX_NOTIFICATION, OPTIONS};

/// Registry name.
pub const NAME: &str = "fabric";

/// Capabilities of the default (`tcp;ofi_rxm`) endpoint, which grants `FI_DELIVERY_COMPLETE` on
/// libfabric 1.17; every instance reports its own ([`capabilities_for`] its provider).
pub const CAPABILITIES: Capabilities = Capabilities::new(true, true, true, true)
    .with_limits(Limits::new(u64::MAX, MAX_NOTIFICATION as u64, u64::MAX))
    .with_completion(Completion::Remote);

/// Builds an endpoint from a config (see README.md for the options).
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    create_backend(config)
}

kvxfer_core::register_backend!(
    NAME,
    "libfabric RDM endpoint (FI_RMA writes, remote CQ data; providers tcp;ofi_rxm, shm, ...)",
    CAPABILITIES,
    OPTIONS,
    create
);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock leaves plain bookkeeping behind; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The libfabric backend endpoint.
pub struct FabricBackend {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for FabricBackend {
    fn drop(&mut self) {
        let inner = &self.inner;
        let name = inner.lock().ep.name().to_vec();
        closed_set().get_or_insert_with(HashSet::new).insert((inner.info.provider.clone(), name, inner.nonce));
        inner.stop.store(true, Ordering::Release);
        inner.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Tell the peers this endpoint connected to that it is going away, and give those messages a
        // moment to leave (bounded) before the endpoint closes.
        let mut st = inner.lock();
        let before = st.ep.tx_in_flight();
        for (_, p) in inner.peers.drain() {
            if !p.lost.load(Ordering::Acquire) && p.gone().is_none() {
                st.queue(p.fi_addr, wire::message(Kind::Gone, inner.nonce, p.nonce, inner.identity, &[]));
            }
        }
        let end = Instant::now() + Duration::from_millis(200);
        while (!st.control.is_empty() || st.ep.tx_in_flight() > before) && Instant::now() < end {
            st.flush_control(Instant::now());
            st.pump(inner);
            std::thread::yield_now();
        }
        for (_, j) in std::mem::take(&mut st.jobs) {
            j.state.fail(BackendError::Closed { backend: NAME });
        }
        st.revokes.clear();
    }
}

fn nonce() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.write_u32(std::process::id());
    h.finish() as u32
}

impl FabricBackend {
    /// Opens an endpoint with the given options.
    pub fn new(config: &BackendConfig) -> Result<Self, BackendError> {
        let opts = Options::from_config(config)?;
        // Before libfabric starts (it reads the variable once).
        av_remove_cleanup();
        let hints = Hints { provider: Some(opts.provider.clone()), node: opts.addr.clone(), wait_fd: opts.wait_fd };
        let mut ep = RdmEndpoint::open(&hints)?;
        let info = ep.info().clone();
        let cq_data_local = match opts.attached {
            AttachedMode::Message => false,
            // Not on tcp;ofi_rxm: see `CQ_DATA_CUT_OFF`.
            AttachedMode::Auto => info.cq_data_size >= 8 && info.provider != "tcp;ofi_rxm",
            AttachedMode::CqData if info.cq_data_size >= 8 => true,
            AttachedMode::CqData => {
                return Err(config_err(format!(
                    "attached=cq-data, but provider {} carries {} bytes of remote CQ data (need 8)",
                    info.provider, info.cq_data_size
                )))
            }
        };
        ep.post_receives(opts.recv_buffers, opts.recv_buf_size)?;
        // A cut-off of a live peer is confirmable on tcp;ofi_rxm with FI_AV_REMOVE_CLEANUP=1 (its
        // connection is closed) and on shm without what lets a write bypass the key check here;
        // elsewhere it is refused and the engine quarantines (see `stop_accepted_writes`).
        let cut_off_live = match info.provider.as_str() {
            "tcp;ofi_rxm" => av_remove_cleanup() && !cq_data_local,
            "shm" => !(env_flag("FI_SHM_DISABLE_CMA") || env_flag("FI_SHM_USE_DSA_SAR")),
            _ => false,
        };
        let caps = capabilities_for(&info, cq_data_local, opts.recv_buf_size).with_cut_off_live(cut_off_live);
        tracing::debug!(
            target: "kvxfer_fabric",
            "opened {} ({} / {}): mr_mode {}, delivery_complete {}, order_saw {}, order_waw {}, cq_data {} bytes, rma_event {}, rx_cq_data {}, iov_limit {} -> {:?}",
            info.provider, info.fabric, info.domain, info.mr_mode, info.delivery_complete, info.order_saw,
            info.order_waw, info.cq_data_size, info.rma_event, info.rx_cq_data, info.iov_limit, caps
        );
        let nonce = nonce();
        let events = Arc::new(EventQueue::new());
        let hot_pings = (!ep.has_wait_fd()).then(HashMap::new);
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                ep,
                mrs: HashMap::new(),
                addrs: HashMap::new(),
                jobs: BTreeMap::new(),
                next_job: 1,
                next_seq: 1,
                staged: Staged::default(),
                reasm: Reassembler::new(MAX_NOTIFICATION, 4096),
                scratch: Vec::new(),
                dropped_messages: 0,
                stale_messages: 0,
                nonce,
                identity: config.identity,
                events: events.clone(),
                live: HashMap::new(),
                control: VecDeque::new(),
                control_ttl: opts.timeout,
                revokes: HashMap::new(),
                acks_due: Vec::new(),
                in_flight: 0,
                secret: config.secret.clone(),
                pending: HashMap::new(),
                connecting: HashMap::new(),
                banned: HashSet::new(),
                forged: 0,
                unauthenticated: 0,
                hot_pings,
                transfer_timeout: opts.timeout,
                remote_mrs: HashMap::new(),
                writer_caps: HashMap::new(),
                cut: HashMap::new(),
                cut_ids: HashMap::new(),
                cut_dropped: 0,
            }),
            events,
            regions: RegionTable::new(NAME, caps.limits.max_regions),
            peers: PeerTable::new(NAME),
            frags: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            waker: Waker::new()?,
            sleeping: AtomicBool::new(false),
            thread: OnceLock::new(),
            opts,
            info,
            caps,
            cq_data_local,
            nonce,
            identity: config.identity,
        });
        let i2 = inner.clone();
        let thread = std::thread::Builder::new()
            .name("kvxfer-fabric-progress".into())
            .spawn(move || progress_loop(i2))
            .map_err(|e| BackendError::Io {
                backend: NAME,
                context: "spawning the progress thread".into(),
                detail: e.to_string(),
            })?;
        let _ = inner.thread.set(thread.thread().clone());
        Ok(Self { inner, thread: Some(thread) })
    }

    /// What the provider offers (name, mr_mode, completion semantics, limits).
    pub fn provider_info(&self) -> &ProviderInfo {
        &self.inner.info
    }

    /// Whether attached notifications use remote CQ data on this endpoint (towards peers that accept it).
    pub fn attached_uses_cq_data(&self) -> bool {
        self.inner.cq_data_local
    }

    /// Messages dropped because they were malformed, undecodable, or their receive failed.
    pub fn dropped_messages(&self) -> u64 {
        self.inner.lock().dropped_messages
    }

    /// Notifications refused because their key was not the identity their sender's connection
    /// proved (with a cluster secret; each one failed that connection).
    pub fn forged_notifications(&self) -> u64 {
        self.inner.lock().forged
    }

    /// Messages dropped because their sender had not authenticated (with a cluster secret).
    pub fn unauthenticated_messages(&self) -> u64 {
        self.inner.lock().unauthenticated
    }

    /// Messages addressed to an earlier owner of this endpoint's (recycled) address, dropped.
    pub fn stale_messages(&self) -> u64 {
        self.inner.lock().stale_messages
    }

    /// Messages dropped because their sender was cut off ([`KvTransferBackend::cut_off`]).
    pub fn cut_off_messages(&self) -> u64 {
        self.inner.lock().cut_dropped
    }

    /// Test hook: holds the endpoint lock for `d`, so the progress thread reads nothing from the
    /// provider meanwhile (a receiver that falls behind: the writer's socket fills and a write stays
    /// half sent). Blocks the calling thread.
    #[doc(hidden)]
    pub fn stall_progress(&self, d: Duration) {
        let _st = self.inner.lock();
        std::thread::sleep(d);
    }

    /// Waits for a job's state; the error of a job that did not finish by the deadline.
    async fn settle(&self, state: &TransferState, peer: PeerId, what: &str) -> Result<(), BackendError> {
        // The job has the same deadline and stops itself; allow its completions a moment beyond it.
        let deadline = Instant::now() + self.inner.opts.timeout + Duration::from_secs(1);
        match state.settled(deadline).await {
            TransferStatus::Done => Ok(()),
            TransferStatus::Failed(e) => Err(e),
            TransferStatus::Aborted => Err(BackendError::Aborted { backend: NAME, peer }),
            TransferStatus::InFlight => {
                Err(BackendError::Timeout { backend: NAME, what: what.to_owned(), after: self.inner.opts.timeout })
            }
        }
    }
}

/// Builds a backend endpoint (the registry's constructor).
fn create_backend(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    Ok(Arc::new(FabricBackend::new(config)?))
}

#[async_trait::async_trait]
impl KvTransferBackend for FabricBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }

    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        if let kvxfer_core::MemKind::Cuda { device } = mem.kind() {
            // FI_HMEM registration is not implemented: say what is needed and what to use.
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "registering {} (FI_HMEM_CUDA registration with fi_mr_regattr needs a libfabric built with CUDA \
                     and a provider that reports FI_HMEM (verbs;ofi_rxm, efa, cxi; provider here: {}), and is not \
                     implemented in this build; on this host: {}; use the tcp backend, which stages CUDA memory \
                     through pinned buffers, or cuda-ipc between processes of one node)",
                    mem.kind(),
                    self.inner.info.provider,
                    kvxfer_cuda::dmabuf::gpudirect_status(device)
                ),
            });
        }
        self.inner.caps.check_memory(NAME, &mem.kind())?;
        {
            let mut st = self.inner.lock();
            if st.mrs.contains_key(&id) {
                // Still closing: the id is taken until its MR is closed.
                return Err(BackendError::RegionInUse { backend: NAME, region: id });
            }
            // For our own writes only: peers get registrations of their own (see `answer_welcome`).
            let (mr, info) = st.ep.reg_local(&mem)?;
            if let Err(e) = self.inner.regions.insert(id, mem.clone()) {
                st.ep.dereg(mr);
                return Err(e);
            }
            st.mrs.insert(id, (mr, info));
        }
        Ok(Registration::new(NAME, id, &mem, Box::new(Closer { inner: Arc::downgrade(&self.inner), id })))
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let st = self.inner.lock();
        let regions: Vec<RegionMeta> = self
            .inner
            .regions
            .snapshot()
            .into_iter()
            .filter_map(|(id, len)| {
                st.mrs.get(&id).map(|(_, i)| RegionMeta { id: id.0, len, key: i.key, base: i.base })
            })
            .collect();
        let payload = Payload {
            wire: WIRE_VERSION,
            provider: self.inner.info.provider.clone(),
            addr: st.ep.name().to_vec(),
            recv_buf: st.ep.recv_buf_size() as u32,
            cq_data: self.inner.cq_data_local,
            nonce: self.inner.nonce,
            pid: std::process::id(),
            regions,
        };
        let payload = serde_json::to_vec(&payload).map_err(|e| BackendError::Io {
            backend: NAME,
            context: "encoding metadata".into(),
            detail: e.to_string(),
        })?;
        Ok(EndpointMetadata::new(NAME, self.inner.identity, payload))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        let bad = |detail: String| BackendError::BadMetadata { backend: NAME, detail };
        peer.check(NAME)?;
        let p: Payload =
            serde_json::from_slice(&peer.payload).map_err(|e| bad(format!("payload does not parse: {e}")))?;
        if p.wire != WIRE_VERSION {
            return Err(bad(format!("wire version {}, this build speaks {WIRE_VERSION}", p.wire)));
        }
        if p.provider != self.inner.info.provider {
            return Err(bad(format!(
                "peer uses provider {:?}, this endpoint {:?}; set the same provider on both",
                p.provider, self.inner.info.provider
            )));
        }
        let min_buf = 4 * (wire::HEADER + toolkit::FRAGMENT_HEADER);
        if p.addr.is_empty() || (p.recv_buf as usize) < min_buf {
            return Err(bad(format!("empty address or receive buffers of {} bytes", p.recv_buf)));
        }
        // A hello that went out on a connection the peer had closed (it cut this instance off, or
        // closed its side of the link) can fail with a connection error before ofi_rxm has taken
        // the close in; sent again, it opens a new connection and gets the peer's real answer (a
        // welcome, or a refusal that says why).
        match self.connect_once(peer, p.clone()).await {
            Err(Attempt::LinkClosed(e)) => {
                tracing::debug!(target: "kvxfer_fabric", "the hello met a closed connection ({e}); sending it again");
                tokio::time::sleep(Duration::from_millis(50)).await;
                self.connect_once(peer, p).await.map_err(Attempt::into_error)
            }
            other => other.map_err(Attempt::into_error),
        }
    }

    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        let inner = &self.inner;
        let body = notify.map(|n| inner.encode(n, ops.len())).transpose()?;
        if body.is_none() {
            inner.caps.check_post(NAME, ops.len(), 0)?;
        }
        let target = inner.target(peer)?;
        let bytes: u64 = ops.iter().map(WriteOp::bytes).sum();
        let mut st = inner.lock();
        // Validated under the endpoint lock: a revoke from the peer changes its regions under it too.
        let (refs, dst, mut items) = inner.plan(&st, peer, &target, ops)?;
        let mut phases = Vec::new();
        match body {
            None if items.is_empty() => {
                return Ok(Transfer::finished(NAME, peer, TransferStatus::Done, 0));
            }
            None => phases.push(Phase { items: items.into(), ordered: false }),
            Some(body) if inner.cq_data_local && target.cq_data && !items.is_empty() => {
                let mut last = items.pop().expect("non-empty");
                let token = (u64::from(inner.nonce) << 32) | (st.next_seq & 0xffff_ffff);
                st.next_seq += 1;
                if let Item::Write { data, .. } = &mut last {
                    *data = Some(token);
                }
                let mut tail: VecDeque<Item> = inner.frames(&target, Kind::Staged, token, &body)?.into();
                tail.push_back(last);
                phases.push(Phase { items: items.into(), ordered: false });
                phases.push(Phase { items: tail, ordered: true });
            }
            Some(body) => {
                let frames = inner.frames(&target, Kind::Notify, 0, &body)?;
                phases.push(Phase { items: items.into(), ordered: false });
                phases.push(Phase { items: frames.into(), ordered: true });
            }
        }
        let state = inner.submit(&mut st, peer, target, phases, refs, dst);
        Ok(Transfer::new(state, Arc::new(Aborter(Arc::downgrade(inner))), bytes))
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        let body = self.inner.encode(notification, 0)?;
        let target = self.inner.target(peer)?;
        let frames = self.inner.frames(&target, Kind::Notify, 0, &body)?;
        let phases = vec![Phase { items: frames.into(), ordered: true }];
        let state = {
            let mut st = self.inner.lock();
            self.inner.submit(&mut st, peer, target, phases, Vec::new(), Vec::new())
        };
        self.settle(&state, peer, &format!("a notification to {peer}")).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        Ok(self.inner.events.recv(max_wait).await)
    }

    /// See the crate README, "Cutting a peer off".
    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        let inner = &self.inner;
        let cut = {
            let mut st = inner.lock();
            // Take in what already arrived first (its announcements, a hello under way).
            st.advance(inner);
            match inner.peers.get(peer) {
                Ok(p) => st.cut_instance(inner, p.nonce, reason),
                Err(e) => {
                    return match st.cut_ids.get(&peer).and_then(|n| st.cut.get(n)) {
                        Some(CutInfo { unconfirmed: None, .. }) => {
                            Ok(CutOff { closed: 0, failed_transfers: 0, how: "already cut off" })
                        }
                        Some(CutInfo { unconfirmed: Some(why), .. }) => Err(unconfirmed(why)),
                        None => Err(e),
                    }
                }
            }
        };
        inner.wake();
        tracing::info!(target: "kvxfer_fabric", %peer, %reason, "cut off (closed {}, failing {})", cut.closed, cut.failed);
        // Our transfers to it: final once every completion of what was posted arrived (until then
        // the provider may still read their source memory).
        let wait = inner.opts.timeout.min(Duration::from_secs(30));
        let deadline = Instant::now() + wait;
        for s in &cut.states {
            s.settled(deadline).await;
        }
        let open = cut.states.iter().filter(|s| !s.status().is_final()).count();
        if open > 0 {
            return Err(BackendError::Timeout {
                backend: NAME,
                what: format!(
                    "{open} transfer(s) to the cut-off {peer} completing (the provider may still read their source)"
                ),
                after: wait,
            });
        }
        if let Some(why) = &cut.unconfirmed {
            return Err(unconfirmed(why));
        }
        let how = if cut.provider == "tcp;ofi_rxm" {
            "per-peer keys closed, connection closed (fi_av_remove with FI_AV_REMOVE_CLEANUP), instance refused"
        } else {
            "per-peer keys closed (every later command fails the target's key check), instance refused"
        };
        Ok(CutOff { closed: cut.closed, failed_transfers: cut.failed, how })
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        let p = self.inner.peers.remove(peer)?;
        let states: Vec<Arc<TransferState>> =
            self.inner.lock().jobs.values().filter(|j| j.peer == peer).map(|j| j.state.clone()).collect();
        // Let them finish (each has its deadline, after which it stops and waits for what it posted).
        let deadline = Instant::now() + self.inner.opts.timeout + Duration::from_secs(1);
        for s in &states {
            if !s.settled(deadline).await.is_final() {
                return Err(BackendError::Timeout {
                    backend: NAME,
                    what: format!("disconnecting {}: its transfers becoming final", p.describe(peer)),
                    after: self.inner.opts.timeout,
                });
            }
        }
        let shared = self.inner.peers.all().iter().any(|(_, q)| q.fi_addr == p.fi_addr);
        if !shared && !p.lost.load(Ordering::Acquire) && p.gone().is_none() {
            let mut st = self.inner.lock();
            st.queue(p.fi_addr, wire::message(Kind::Bye, self.inner.nonce, p.nonce, self.inner.identity, &[]));
            st.flush_control(Instant::now());
        }
        self.inner.wake();
        Ok(())
    }
}

fn unconfirmed(why: &str) -> BackendError {
    BackendError::Unsupported {
        backend: NAME,
        what: format!(
            "confirming a cut-off: the peer's keys are closed and it is refused, but {why}; the memory it could \
             write must stay quarantined (see the crate README, \"Cutting a peer off\")"
        ),
    }
}

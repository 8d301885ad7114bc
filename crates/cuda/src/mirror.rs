//! [`Mirror`]: a backend adapter for the conformance suite on device memory (feature `mirror`).
//!
//! The conformance suite fills and checks host buffers. A [`Mirror`] endpoint takes those host
//! registrations, gives the backend under test a device copy of each instead (a [`DeviceBuffer`]
//! registered as `Cuda` memory), and keeps the two in step: before every post and after every
//! `recv` that returned events (and when a registration closes) it compares host, device and the
//! bytes it last saw on both, and carries each change across (host changes to the device, device
//! changes, the peer's writes, to the host). Ranges a transfer holds at that moment are skipped
//! and picked up at the next step. So every claim the suite checks (bytes in place when a
//! notification arrives or a transfer is done, sentinels untouched, fences) is checked against
//! what the backend did in device memory. Everything else passes through to the backend.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use kvxfer_core::{
    AbortTransfer, BackendError, BackendEvent, BoxFuture, Capabilities, CloseRegistration, EndpointMetadata,
    HostBuffer, KvTransferBackend, MemDesc, MemKind, MemKinds, Notification, PeerId, RegionId, Registration, Transfer,
    TransferState, TransferStatus, WriteOp,
};

use crate::{context, Context, CopyPlan, CudaError, DeviceBuffer, Shape, Stream};

const SYNC_DEADLINE: Duration = Duration::from_secs(30);
/// How long a forwarded transfer is followed.
const FORWARD: Duration = Duration::from_secs(120);

/// The final status of a backend transfer (waited for at most [`FORWARD`]).
async fn settle(t: &Transfer) -> TransferStatus {
    let _ = t.wait(Instant::now() + FORWARD).await;
    t.status()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Region {
    host: MemDesc,
    dev: MemDesc,
    /// The bytes host and device last agreed on.
    shadow: Vec<u8>,
}

/// The mirrored regions of one endpoint (what its registrations need; it does not keep the
/// backend endpoint alive, so dropping the endpoint is seen by its peers as with the bare backend).
struct Inner {
    ctx: Arc<Context>,
    stream: Stream,
    regions: Mutex<HashMap<RegionId, Region>>,
}

/// A backend endpoint whose registered host memory lives on a CUDA device (see the module docs).
pub struct Mirror {
    backend: Arc<dyn KvTransferBackend>,
    inner: Arc<Inner>,
    /// The mirrors of connected peers in this process: a transfer to one is done only once its
    /// bytes were mirrored back to the peer's host memory.
    peers: Mutex<HashMap<PeerId, Weak<Inner>>>,
    /// The tasks that settle this endpoint's forwarded transfers, by peer: `cut_off` returns only
    /// once those to the cut-off peer ended, so the transfers it hands out are final by then, as the
    /// backend's own are.
    forwards: Mutex<HashMap<PeerId, Vec<tokio::task::JoinHandle<()>>>>,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mirror({} on device {})", self.backend.name(), self.inner.ctx.device())
    }
}

/// Every mirror of the process, by a metadata payload it published.
fn published() -> &'static Mutex<HashMap<Vec<u8>, Weak<Inner>>> {
    static P: OnceLock<Mutex<HashMap<Vec<u8>, Weak<Inner>>>> = OnceLock::new();
    P.get_or_init(Default::default)
}

impl Mirror {
    /// Wraps `backend`, whose regions will be device copies on `device`.
    pub fn wrap(backend: Arc<dyn KvTransferBackend>, device: u32) -> Result<Arc<dyn KvTransferBackend>, CudaError> {
        let ctx = context(device)?;
        let stream = Stream::new(&ctx)?;
        let inner = Arc::new(Inner { ctx, stream, regions: Mutex::new(HashMap::new()) });
        Ok(Arc::new(Mirror { backend, inner, peers: Mutex::new(HashMap::new()), forwards: Mutex::new(HashMap::new()) }))
    }
}

/// Forwards an abort to the backend's transfer.
struct Forward(Arc<Transfer>);

impl AbortTransfer for Forward {
    fn abort(&self, _state: &Arc<TransferState>) {
        let t = Arc::clone(&self.0);
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move {
                let _ = t.abort(Instant::now() + Duration::from_secs(60)).await;
            });
        }
    }
}

fn err(what: &str) -> impl Fn(CudaError) -> BackendError + '_ {
    move |e| BackendError::Io { backend: "mirror", context: what.to_owned(), detail: e.to_string() }
}

/// Maximal runs of indices where `f` holds.
fn runs(n: usize, f: impl Fn(usize) -> bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        if f(i) {
            let s = i;
            while i < n && f(i) {
                i += 1;
            }
            out.push((s, i - s));
        } else {
            i += 1;
        }
    }
    out
}

impl Inner {
    fn run(&self, plan: CopyPlan) -> Result<(), CudaError> {
        if plan.is_empty() {
            return Ok(());
        }
        let p = self.stream.submit(plan)?;
        p.wait_blocking(&self.stream, Instant::now() + SYNC_DEADLINE)
    }

    /// Carries changes across, both ways (see the module docs).
    fn sync_region(&self, r: &mut Region) -> Result<(), CudaError> {
        let len = r.shadow.len();
        // The device's bytes (read without a reservation: a transfer may be writing some of them;
        // what it writes later is picked up by a later sync, which its completion triggers).
        let mut snap = HostBuffer::zeroed(len);
        let sd = snap.desc();
        let mut plan = CopyPlan::new();
        if len > 0 {
            let l = len as u64;
            let dst = sd.reserve(0, l, 1, l, true).map_err(|e| CudaError::invalid(e.to_string()))?;
            plan.snapshot(&r.dev, 0, l, dst)?;
        }
        self.run(plan)?;
        drop(sd);
        let dev = snap.to_vec().map_err(|e| CudaError::invalid(e.to_string()))?;
        let host = match r.host.read_guard(0, len as u64) {
            Ok(g) => g.as_slice().to_vec(),
            Err(_) => return Ok(()), // the test holds a write guard: next time
        };
        // Host changes go to the device; device changes (where the host did not change) come back.
        let mut plan = CopyPlan::new();
        let mut pushed = Vec::new();
        for (s, l) in runs(len, |i| host[i] != r.shadow[i]) {
            let (s, l) = (s as u64, l as u64);
            let (Ok(src), Ok(dst)) = (r.host.reserve(s, l, 1, l, false), r.dev.reserve(s, l, 1, l, true)) else {
                continue;
            };
            plan.copy(src, Shape::contiguous(0, l), dst, Shape::contiguous(0, l))?;
            pushed.push((s as usize, l as usize));
        }
        self.run(plan)?;
        for (s, l) in pushed {
            r.shadow[s..s + l].copy_from_slice(&host[s..s + l]);
        }
        for (s, l) in runs(len, |i| host[i] == r.shadow[i] && dev[i] != r.shadow[i]) {
            if let Ok(mut g) = r.host.write_guard(s as u64, l as u64) {
                g.as_mut_slice().copy_from_slice(&dev[s..s + l]);
                r.shadow[s..s + l].copy_from_slice(&dev[s..s + l]);
            }
        }
        Ok(())
    }

    fn sync_all(&self) -> Result<(), BackendError> {
        let mut regions = lock(&self.regions);
        for r in regions.values_mut() {
            self.sync_region(r).map_err(err("mirroring host and device memory"))?;
        }
        Ok(())
    }
}

struct Closer {
    inner: Arc<Inner>,
    id: RegionId,
    reg: Registration,
}

impl CloseRegistration for Closer {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(async move {
            let Closer { inner, id, reg } = *self;
            reg.close(Instant::now() + Duration::from_secs(60)).await?;
            // Nothing writes the device copy any more: the last bytes come back, then it goes.
            let region = lock(&inner.regions).remove(&id);
            if let Some(mut r) = region {
                inner.sync_region(&mut r).map_err(err("mirroring a closed region back"))?;
            }
            Ok(())
        })
    }

    fn close_detached(self: Box<Self>) {
        // The same close in the background: the host memory is let go only once the backend's
        // close completed (no writer can reach the device copy any more), as for the bare backend.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn(async move {
                if let Err(e) = self.close().await {
                    tracing::warn!(error = %e, "mirror: closing a dropped registration");
                }
            })),
            Err(_) => {
                lock(&self.inner.regions).remove(&self.id);
                drop(self.reg);
            }
        }
    }
}

#[async_trait::async_trait]
impl KvTransferBackend for Mirror {
    fn name(&self) -> &'static str {
        self.backend.name()
    }

    fn capabilities(&self) -> Capabilities {
        // The suite hands it host memory; the backend gets device memory.
        self.backend.capabilities().with_memory(MemKinds::HOST)
    }

    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        if mem.kind() != MemKind::Host {
            return Err(BackendError::Unsupported {
                backend: self.name(),
                what: format!(
                    "registering {} through the device mirror (it takes host memory and registers a device copy)",
                    mem.kind()
                ),
            });
        }
        let len = mem.len();
        let host = mem.read_guard(0, len as u64).map_err(|e| BackendError::Io {
            backend: "mirror",
            context: "reading host memory to mirror".into(),
            detail: e.to_string(),
        })?;
        let shadow = host.as_slice().to_vec();
        drop(host);
        let dev = DeviceBuffer::new(&self.inner.ctx, len).map_err(err("allocating device memory"))?.into_desc();
        let mut plan = CopyPlan::new();
        if len > 0 {
            let l = len as u64;
            let src = mem.reserve(0, l, 1, l, false).map_err(|e| BackendError::Io {
                backend: "mirror",
                context: "reserving host memory".into(),
                detail: e.to_string(),
            })?;
            let dst = dev.reserve(0, l, 1, l, true).map_err(|e| BackendError::Io {
                backend: "mirror",
                context: "reserving device memory".into(),
                detail: e.to_string(),
            })?;
            plan.copy(src, Shape::contiguous(0, l), dst, Shape::contiguous(0, l)).map_err(err("mirroring"))?;
        }
        self.inner.run(plan).map_err(err("copying host memory to the device"))?;
        let reg = self.backend.register(id, dev.clone()).await?;
        lock(&self.inner.regions).insert(id, Region { host: mem.clone(), dev, shadow });
        Ok(Registration::new(self.name(), id, &mem, Box::new(Closer { inner: Arc::clone(&self.inner), id, reg })))
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let m = self.backend.metadata()?;
        let mut p = lock(published());
        p.retain(|_, w| w.strong_count() > 0);
        p.insert(m.payload.clone(), Arc::downgrade(&self.inner));
        Ok(m)
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        let id = self.backend.connect(peer).await?;
        if let Some(w) = lock(published()).get(&peer.payload) {
            lock(&self.peers).insert(id, w.clone());
        }
        Ok(id)
    }

    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.inner.sync_all()?;
        let t = self.backend.post(peer, ops, notify)?;
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return Ok(t) };
        // Done only once the bytes are back in the peer's host memory (when the peer is a mirror
        // of this process), so "remote completion" is checked against what landed on the device.
        let bytes = t.bytes();
        let t = Arc::new(t);
        let state = TransferState::new(self.name(), peer);
        let (s, inner, target) = (Arc::clone(&state), Arc::clone(&t), lock(&self.peers).get(&peer).cloned());
        let task = rt.spawn(async move {
            let end = settle(&inner).await;
            match end {
                TransferStatus::Done => {
                    if let Some(p) = target.and_then(|w| w.upgrade()) {
                        if let Err(e) = p.sync_all() {
                            s.fail(e);
                            return;
                        }
                    }
                    s.complete();
                }
                TransferStatus::Failed(e) => {
                    s.fail(e);
                }
                TransferStatus::Aborted => {
                    s.aborted();
                }
                TransferStatus::InFlight => {
                    s.fail(BackendError::Timeout {
                        backend: "mirror",
                        what: "a mirrored transfer".into(),
                        after: FORWARD,
                    });
                }
            }
        });
        let mut forwards = lock(&self.forwards);
        let tasks = forwards.entry(peer).or_default();
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
        drop(forwards);
        Ok(Transfer::new(state, Arc::new(Forward(t)), bytes))
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        self.backend.notify(peer, notification).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        let events = self.backend.recv(max_wait).await?;
        if !events.is_empty() {
            self.inner.sync_all()?;
        }
        Ok(events)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        self.backend.disconnect(peer).await
    }

    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<kvxfer_core::CutOff, BackendError> {
        let cut = self.backend.cut_off(peer, reason).await?;
        // The backend's transfers to the peer are final now; so are ours once their tasks saw it
        // (each ends as soon as its transfer is final: bounded well below FORWARD).
        let tasks = lock(&self.forwards).remove(&peer).unwrap_or_default();
        let deadline = Instant::now() + SYNC_DEADLINE;
        for t in tasks {
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, t).await.is_err() {
                return Err(BackendError::Timeout {
                    backend: "mirror",
                    what: "the mirrored transfers to a cut-off peer".into(),
                    after: SYNC_DEADLINE,
                });
            }
        }
        Ok(cut)
    }
}

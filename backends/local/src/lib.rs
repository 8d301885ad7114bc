//! The in-process reference backend: endpoints in one process copy between each other's registered
//! regions with `memcpy`. It implements the whole [`KvTransferBackend`] contract (bounds checks before
//! any byte moves, tokens, both notification styles, peer loss when an endpoint is dropped) and is the
//! yardstick the other backends are measured against in the conformance suite.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use kvxfer_core::backend::{BackendDescriptor, Capabilities, EndpointMetadata};
use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, KvTransferBackend, MemRegion, Notification, PeerId, RegionId, WriteOp,
};
use serde::{Deserialize, Serialize};

/// Registry name.
pub const NAME: &str = "local";

/// What the local backend supports.
pub const CAPABILITIES: Capabilities =
    Capabilities { attached: true, out_of_band: true, cross_process: false, cross_host: false };

kvxfer_core::inventory::submit! {
    BackendDescriptor {
        name: NAME,
        description: "in-process reference backend (memcpy between registered regions)",
        capabilities: CAPABILITIES,
        create,
    }
}

/// Creates an endpoint. No options.
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    if let Some(k) = config.options.keys().next() {
        return Err(BackendError::Config { backend: NAME, detail: format!("unknown option {k:?} (local takes none)") });
    }
    Ok(Arc::new(LocalBackend::new(config.identity)))
}

fn endpoints() -> &'static Mutex<HashMap<u64, Weak<Endpoint>>> {
    static E: OnceLock<Mutex<HashMap<u64, Weak<Endpoint>>>> = OnceLock::new();
    E.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Serialize, Deserialize)]
struct Payload {
    endpoint: u64,
    token: u64,
}

struct Endpoint {
    id: u64,
    identity: u64,
    token: u64,
    regions: Mutex<HashMap<RegionId, MemRegion>>,
    inbox: Mutex<VecDeque<BackendEvent>>,
    wake: tokio::sync::Notify,
    /// Endpoints that connected to us, or that we connected to: told when we go away.
    linked: Mutex<Vec<Weak<Endpoint>>>,
}

impl Endpoint {
    fn deliver(&self, e: BackendEvent) {
        lock(&self.inbox).push_back(e);
        self.wake.notify_one();
    }
}

/// An in-process endpoint.
pub struct LocalBackend {
    ep: Arc<Endpoint>,
    peers: Mutex<HashMap<PeerId, Weak<Endpoint>>>,
    next_peer: AtomicU64,
}

impl LocalBackend {
    /// A new endpoint with the given identity.
    pub fn new(identity: u64) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let ep = Arc::new(Endpoint {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            identity,
            token: rand::random(),
            regions: Mutex::new(HashMap::new()),
            inbox: Mutex::new(VecDeque::new()),
            wake: tokio::sync::Notify::new(),
            linked: Mutex::new(Vec::new()),
        });
        lock(endpoints()).insert(ep.id, Arc::downgrade(&ep));
        Self { ep, peers: Mutex::new(HashMap::new()), next_peer: AtomicU64::new(1) }
    }

    fn peer(&self, peer: PeerId) -> Result<Arc<Endpoint>, BackendError> {
        let w = lock(&self.peers).get(&peer).cloned().ok_or(BackendError::UnknownPeer { backend: NAME, peer })?;
        w.upgrade().ok_or_else(|| BackendError::PeerLost {
            backend: NAME,
            peer: peer.to_string(),
            detail: "the peer endpoint was dropped".into(),
        })
    }
}

impl Drop for LocalBackend {
    fn drop(&mut self) {
        lock(endpoints()).remove(&self.ep.id);
        for w in lock(&self.ep.linked).drain(..) {
            if let Some(other) = w.upgrade() {
                other.deliver(BackendEvent::PeerLost {
                    identity: self.ep.identity,
                    reason: format!("local endpoint {} was dropped", self.ep.id),
                });
            }
        }
    }
}

fn region(map: &HashMap<RegionId, MemRegion>, id: RegionId, peer: Option<PeerId>) -> Result<MemRegion, BackendError> {
    map.get(&id).cloned().ok_or(BackendError::UnknownRegion { backend: NAME, region: id, peer })
}

#[async_trait::async_trait]
impl KvTransferBackend for LocalBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn register(&self, id: RegionId, mem: MemRegion) -> Result<(), BackendError> {
        let mut r = lock(&self.ep.regions);
        if r.contains_key(&id) {
            return Err(BackendError::RegionInUse { backend: NAME, region: id });
        }
        r.insert(id, mem);
        Ok(())
    }

    fn deregister(&self, id: RegionId) -> Result<(), BackendError> {
        lock(&self.ep.regions).remove(&id).map(|_| ()).ok_or(BackendError::UnknownRegion {
            backend: NAME,
            region: id,
            peer: None,
        })
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let payload = serde_json::to_vec(&Payload { endpoint: self.ep.id, token: self.ep.token })
            .map_err(|e| BackendError::BadMetadata { backend: NAME, detail: e.to_string() })?;
        Ok(EndpointMetadata::new(NAME, self.ep.identity, payload))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        peer.check(NAME)?;
        let p: Payload = serde_json::from_slice(&peer.payload)
            .map_err(|e| BackendError::BadMetadata { backend: NAME, detail: format!("payload: {e}") })?;
        let other =
            lock(endpoints()).get(&p.endpoint).and_then(Weak::upgrade).ok_or_else(|| BackendError::Connect {
                backend: NAME,
                peer: format!("local endpoint {}", p.endpoint),
                detail: "no such endpoint in this process (the local backend cannot cross processes)".into(),
            })?;
        if other.token != p.token {
            return Err(BackendError::Connect {
                backend: NAME,
                peer: format!("local endpoint {}", p.endpoint),
                detail: "access token does not match the endpoint's".into(),
            });
        }
        lock(&other.linked).push(Arc::downgrade(&self.ep));
        lock(&self.ep.linked).push(Arc::downgrade(&other));
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        lock(&self.peers).insert(id, Arc::downgrade(&other));
        Ok(id)
    }

    async fn write(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<(), BackendError> {
        let other = self.peer(peer)?;
        // Resolve and check every op before moving a byte.
        let mut resolved = Vec::with_capacity(ops.len());
        {
            let mine = lock(&self.ep.regions);
            let theirs = lock(&other.regions);
            for op in ops {
                let s = region(&mine, op.src, None)?;
                let d = region(&theirs, op.dst, Some(peer))?;
                op.check_src(NAME, None, s.len() as u64)?;
                op.check_dst(NAME, Some(peer), d.len() as u64)?;
                resolved.push((s, d, *op));
            }
        }
        for (s, d, op) in &resolved {
            for (so, dso, len) in op.ranges() {
                s.copy_to(so, d, dso, len).expect("bounds checked above");
            }
        }
        if let Some(n) = notify {
            other.deliver(BackendEvent::Notification(n.clone()));
        }
        Ok(())
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        self.peer(peer)?.deliver(BackendEvent::Notification(notification.clone()));
        Ok(())
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        let deadline = tokio::time::Instant::now() + max_wait;
        loop {
            let notified = self.ep.wake.notified();
            {
                let mut q = lock(&self.ep.inbox);
                if !q.is_empty() {
                    return Ok(q.drain(..).collect());
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Ok(Vec::new());
            }
        }
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        lock(&self.peers).remove(&peer).map(|_| ()).ok_or(BackendError::UnknownPeer { backend: NAME, peer })
    }
}

//! Issue 30, end-to-end integrity: the opt-in digest (`AgentConfig::digest` on the decode side)
//! through the engine API, in one process, over every backend compiled in (tcp and local; ucx and
//! fabric with their features: CI's facade step runs this file with every feature).
//!
//! - on: every request succeeds, each side hashed exactly the request's bytes once;
//! - off: nothing is hashed on either side (the cost of the option is zero when it is off);
//! - a test backend (`flip`: local, whose decode endpoint flips one landed byte written by prefill
//!   rank 0) makes the request fail, naming that prefill rank and the layer and kind of the byte,
//!   with its pages reusable; the failure is counted under cause `digest`;
//! - a decode pool in device memory is refused at start (the digest hashes on the host).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::bootstrap::BootstrapServer;
use kvxfer::engine::{from_identity, Agent, AgentConfig, KvMemory, Phase};
use kvxfer::metadata::MetadataAddr;
use kvxfer_core::{
    Attention, BackendConfig, BackendError, BackendEvent, BufferRef, EndpointMetadata, HostBuffer, KvKind, KvSpec,
    KvTransferBackend, Layout, MemDesc, MemKind, Notification, NotificationBody, NotifyStyle, Parallel, PeerId, RankId,
    RegionId, Registration, RequestId, Side, SideSpec, Topology, Transfer, WriteOp,
};

const PAGES: u32 = 32;

/// Prefill TP `p` -> decode TP `d`, 2 KV heads (so TP 1 -> 2 replicates nothing and 2 -> 1 gathers).
fn topo(p: u32, d: u32, kv_heads: u32) -> Topology {
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads, head_dim_k: 8, head_dim_v: 8 },
        layers: 3,
        dtype_bytes: 2,
        page_size: 4,
        layout: Layout::Nhd,
    };
    Topology::new(&SideSpec { kv, parallel: Parallel::new(p, 1) }, &SideSpec { kv, parallel: Parallel::new(d, 1) })
        .unwrap()
}

fn config(role: Side, tp: u32, t: &Topology, addr: &str, backend: &str, digest: bool) -> AgentConfig {
    let mut c = AgentConfig::new(role, RankId::new(tp, 0), *t, MetadataAddr::parse(addr).unwrap());
    c.backend = backend.into();
    let option = match backend {
        "tcp" => Some(("listen", "127.0.0.1:0")),
        "fabric" => Some(("addr", "127.0.0.1")),
        _ => None,
    };
    if let Some((k, v)) = option {
        c.backend_options.insert(k.into(), v.into());
    }
    c.notify = NotifyStyle::Attached;
    c.lease_ttl = Duration::from_secs(2);
    c.connect_timeout = Duration::from_secs(20);
    c.request_timeout = Duration::from_secs(20);
    c.digest = digest && role == Side::Decode;
    c
}

struct Cluster {
    _server: BootstrapServer,
    prefill: Vec<Agent>,
    decode: Vec<Agent>,
}

async fn cluster(t: Topology, backend: &str, digest: bool) -> Cluster {
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let addr = server.addr().to_string();
    let mut prefill = Vec::new();
    for tp in 0..t.parallel(Side::Prefill).tp {
        let c = config(Side::Prefill, tp, &t, &addr, backend, digest);
        prefill.push(Agent::start(c, KvMemory::Host { pages: PAGES, fill: 0 }).await.unwrap());
    }
    let mut decode = Vec::new();
    for tp in 0..t.parallel(Side::Decode).tp {
        let c = config(Side::Decode, tp, &t, &addr, backend, digest);
        decode.push(Agent::start(c, KvMemory::Host { pages: PAGES, fill: 0xee }).await.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for a in prefill.iter().chain(&decode) {
        a.wait_connected(deadline).await.unwrap();
    }
    for (r, a) in prefill.iter().enumerate() {
        for (bi, m) in a.host_memory().iter().enumerate() {
            let data: Vec<u8> = (0..m.len()).map(|i| ((i as usize * 31) ^ (r * 7 + bi * 13)) as u8 | 1).collect();
            m.write(0, &data).unwrap();
        }
    }
    Cluster { _server: server, prefill, decode }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// One request of `pages.len()` pages through every rank, in two chunks; returns the decode statuses.
async fn request(c: &Cluster, room: RequestId, src: &[u32], dst: &[u32]) -> Vec<kvxfer::engine::RequestStatus> {
    let rxs: Vec<_> = c.decode.iter().map(|a| a.receiver(room).unwrap()).collect();
    for rx in &rxs {
        rx.send_metadata(dst, None).unwrap();
    }
    let txs: Vec<_> = c.prefill.iter().map(|a| a.sender(room).unwrap()).collect();
    for tx in &txs {
        tx.init(src.len() as u32).unwrap();
    }
    for tx in &txs {
        let until = Instant::now() + Duration::from_secs(20);
        while tx.status().phase != Phase::WaitingForInput {
            assert!(Instant::now() < until, "no handoff: {:?}", tx.status());
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tx.send(&src[..2]).unwrap();
        tx.send(&src[2..]).unwrap();
    }
    let mut out = Vec::new();
    for rx in rxs {
        out.push(rx.wait(soon()).await.unwrap());
        rx.release().unwrap();
    }
    for tx in txs {
        let s = tx.wait(soon()).await.unwrap();
        assert_eq!(s.phase, Phase::Success, "prefill: {s:?}");
        tx.release().unwrap();
    }
    out
}

async fn shutdown(c: Cluster) {
    for a in c.prefill.into_iter().chain(c.decode) {
        a.shutdown(soon()).await.unwrap();
    }
}

/// tcp, local, and ucx and fabric where compiled in (verbs needs an RDMA device, cuda-ipc a GPU).
fn backends() -> Vec<&'static str> {
    let linked: Vec<&str> = kvxfer::backends::linked().iter().map(|(n, _)| *n).collect();
    ["tcp", "local", "ucx", "fabric"].into_iter().filter(|b| linked.contains(b)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_digests_every_request_succeeds_and_each_side_hashes_its_bytes_once() {
    for backend in backends() {
        for (p, d, heads) in [(2, 1, 2), (1, 2, 2), (2, 2, 1)] {
            let t = topo(p, d, heads);
            let c = cluster(t, backend, true).await;
            let (src, dst) = ([1u32, 2, 30, 31, 7], [9u32, 3, 17, 4, 20]);
            for room in [RequestId(1), RequestId(2)] {
                for s in request(&c, room, &src, &dst).await {
                    assert_eq!(s.phase, Phase::Success, "{backend} {p}->{d}: {s:?}");
                }
            }
            // Two requests of 5 pages: each decode rank hashed what landed there; the prefill
            // ranks together hashed what they wrote (replicated heads are written once).
            let pool_page: u64 = t.kv().kinds().iter().map(|k| t.buffer_bytes(Side::Decode, *k, 1)).sum::<u64>() * 3;
            let landed = 2 * 5 * pool_page;
            for a in &c.decode {
                let st = a.stats();
                assert_eq!((st.digest_bytes, st.digest_mismatches), (landed, 0), "{backend} {p}->{d}: {st:?}");
                assert!(a.metrics().contains("kvxfer_digest_bytes_total{role=\"decode\""));
            }
            let written: u64 = c.prefill.iter().map(|a| a.stats().digest_bytes).sum();
            assert_eq!(written, landed * u64::from(d), "{backend} {p}->{d}");
            shutdown(c).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_option_nothing_is_hashed() {
    for backend in ["tcp", "local"] {
        let c = cluster(topo(2, 1, 2), backend, false).await;
        for s in request(&c, RequestId(3), &[1, 2, 3, 4], &[5, 6, 7, 8]).await {
            assert_eq!(s.phase, Phase::Success, "{backend}: {s:?}");
        }
        for a in c.prefill.iter().chain(&c.decode) {
            assert_eq!(a.stats().digest_bytes, 0, "{backend}: {:?}", a.stats());
        }
        shutdown(c).await;
    }
}

/// The `local` backend whose decode endpoint flips one byte that prefill rank 0 wrote: the first
/// byte of layer 0's K in the first destination page (`FLIP_PAGE`), once that rank's digest
/// arrived (so its writes have landed and cannot overwrite the flip).
struct Flip {
    inner: Arc<dyn KvTransferBackend>,
    decode: bool,
    regions: Mutex<HashMap<RegionId, MemDesc>>,
    page_bytes: u64,
}

const FLIP_PAGE: u32 = 9;

#[async_trait::async_trait]
impl KvTransferBackend for Flip {
    fn name(&self) -> &'static str {
        "flip"
    }
    fn capabilities(&self) -> kvxfer_core::Capabilities {
        self.inner.capabilities()
    }
    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        self.regions.lock().unwrap().insert(id, mem.clone());
        self.inner.register(id, mem).await
    }
    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        self.inner.metadata()
    }
    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        self.inner.connect(peer).await
    }
    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.inner.post(peer, ops, notify)
    }
    async fn notify(&self, peer: PeerId, n: &Notification) -> Result<(), BackendError> {
        self.inner.notify(peer, n).await
    }
    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        let events = self.inner.recv(max_wait).await?;
        if self.decode {
            for e in &events {
                if let BackendEvent::Notification(n) = e {
                    if matches!(n.body, NotificationBody::Digest(_)) && n.sender.tp == 0 {
                        let region = kvxfer::session::region_id(BufferRef { layer: 0, kind: KvKind::K });
                        let m = self.regions.lock().unwrap()[&region].clone();
                        let mut g = m.write_guard(u64::from(FLIP_PAGE) * self.page_bytes, 1).unwrap();
                        g.as_mut_slice()[0] ^= 0x10;
                    }
                }
            }
        }
        Ok(events)
    }
    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        self.inner.disconnect(peer).await
    }
    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<kvxfer_core::CutOff, BackendError> {
        self.inner.cut_off(peer, reason).await
    }
}

fn flip(cfg: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    let (side, _) = from_identity(cfg.identity);
    let t = topo(2, 1, 2);
    Ok(Arc::new(Flip {
        inner: kvxfer_local::create(cfg)?,
        decode: side == Side::Decode,
        regions: Mutex::new(HashMap::new()),
        page_bytes: t.buffer_bytes(Side::Decode, KvKind::K, 1),
    }))
}

kvxfer_core::register_backend!("flip", "test: local, flipping a landed byte", kvxfer_local::CAPABILITIES, flip);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_fails_the_request_naming_the_sender_and_the_range() {
    let c = cluster(topo(2, 1, 2), "flip", true).await;
    let s = request(&c, RequestId(4), &[1, 2, 3, 4], &[FLIP_PAGE, 6, 7, 8]).await.remove(0);
    assert_eq!(s.phase, Phase::Failed, "{s:?}");
    assert!(s.pages_reusable, "every sender finished: {s:?}");
    let why = s.reason.unwrap();
    assert!(why.contains("digest mismatch") && why.contains("prefill rank 0/0"), "{why}");
    assert!(why.contains("layer 0 k,") && why.contains("heads 0..1"), "{why}");
    let st = c.decode[0].stats();
    assert_eq!((st.digest_mismatches, st.failed), (1, 1), "{st:?}");
    assert!(
        c.decode[0]
            .metrics()
            .contains("kvxfer_request_failures_total{role=\"decode\",tp=\"0\",pp=\"0\",cause=\"digest\"} 1"),
        "{}",
        c.decode[0].metrics()
    );
    // Without the flip (another page), the next request on the same agents succeeds.
    let s = request(&c, RequestId(5), &[1, 2, 3, 4], &[10, 11, 12, 13]).await.remove(0);
    assert_eq!(s.phase, Phase::Success, "{s:?}");
    shutdown(c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_pool_with_digests_is_refused_at_start() {
    let t = topo(1, 1, 2);
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let c = config(Side::Decode, 0, &t, &server.addr().to_string(), "local", true);
    let mut hosts = Vec::new();
    let mut buffers = Vec::new();
    for layer in 0..3 {
        for &kind in t.kv().kinds() {
            let mut h = HostBuffer::zeroed(t.buffer_bytes(Side::Decode, kind, PAGES) as usize);
            buffers.push((BufferRef { layer, kind }, h.desc_labelled(MemKind::Cuda { device: 0 })));
            hosts.push(h);
        }
    }
    let e = Agent::start(c, KvMemory::Buffers { pages: PAGES, buffers }).await.unwrap_err().to_string();
    assert!(e.contains("digest") && e.contains("host memory") && e.contains("CUDA memory of device 0"), "{e}");
}

//! The conformance suite: one scenario matrix that every backend must pass, byte for byte.
//!
//! A backend's test target (`harness = false`) implements [`BackendFactory`] and calls [`run_main`].
//! Every case is a named, filterable libtest-mimic trial. A transfer case builds real prefill and
//! decode endpoints (one per rank), fills prefill KV with the [`pattern`] (which encodes global layer,
//! K/V, global head, token and byte) and decode KV with a sentinel, runs requests through the
//! sender and receiver sessions, and checks every decode byte against the oracle written from head
//! ownership, not from the planner; bytes outside the request keep the sentinel.
//!
//! Families: `matrix` (P and D over {1,2,3,4,6,8}, H over {1,2,4,6,8,12}, both layouts, page sizes 1
//! and 16, hk != hv on half, shuffled pages, two chunks, both styles), `styles`, `pp`, `mla`,
//! `chunks`, `concurrent`, `notify` (duplicated, reordered, unknown request, unknown key, failure,
//! missing sender, lost sender), `bounds` (out-of-range writes, unknown regions, bad metadata),
//! `invalid` (every configuration error), and the contract families of the backend interface:
//! `lifetime` (closing a registration while writes land, writing to a closed one, dropping one
//! without closing), `abort` (abort mid-way then reuse the pages, abort of a finished transfer, abort
//! on both sides at once), `capabilities` (every claim exercised, every unclaimed feature refused),
//! `selfconnect`, `bidirectional` and `indexed` (page lists through `post_indexed`, byte for byte,
//! refused out of range and over the ops limit); `presumed_dead` (a peer cut off stays cut off: nothing it
//! sends after `cut_off` returned lands, a new instance of it is admitted); and `lifecycle` (a request's life through the engine API's
//! agents: early handoffs, generations and room reuse, abort from either side, release,
//! heterogeneous TP); and `auth` (with the cluster secret: one secret connects, a wrong or missing
//! one is refused naming authentication, a forged notification is never delivered and its connection
//! is reported lost; skipped for backends that do not authenticate).
//!
//! Feature `cuda`: the `cuda` module, the suite with every pool in CUDA memory behind the device
//! mirror (`cuda::run_main_cuda`) and the GPU-ordered send check (`cuda::gpu_order_check`).

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::session::{Chunk, ExpectOptions, KvPool, PoolMemory, ReceiverSession, SenderSession, SessionError};
use kvxfer_core::oracle::{BufferGeom, SENTINEL};
use kvxfer_core::{
    Attention, BackendError, BufferRef, ConfigError, Failure, HostBuffer, KvSpec, KvTransferBackend, Layout,
    Notification, NotifyStyle, Parallel, PlanError, RankId, RegionId, RequestId, SenderKey, Side, SideSpec, Topology,
    WriteOp,
};
use libtest_mimic::{Arguments, Failed, Trial};

mod auth;
mod contract;
#[cfg(feature = "cuda")]
pub mod cuda;
mod lifecycle;
mod presumed_dead;

/// The oracle's pattern and buffer geometry (re-exported from `kvxfer_core::oracle`).
pub use kvxfer_core::oracle as pattern;

/// Builds endpoints of the backend under test.
pub trait BackendFactory: Send + Sync + 'static {
    /// A name for the report, e.g. `ucx(tcp)`.
    fn name(&self) -> String;
    /// A new endpoint (one per rank) with the given identity.
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError>;
    /// `Some(reason)`: every case is reported skipped with this reason (e.g. no RDMA device).
    fn skip_reason(&self) -> Option<String> {
        None
    }
    /// The registry name and options of the endpoints [`BackendFactory::create`] builds (the
    /// identity aside): the `lifecycle` family starts `kvxfer::engine::Agent`s, which create their
    /// endpoints through the backend registry by name. `None` (the default): that family is skipped.
    fn agent_backend(&self) -> Option<(String, std::collections::BTreeMap<String, String>)> {
        None
    }
    /// A new endpoint as [`BackendFactory::create`], configured with the cluster secret `secret`
    /// ([`kvxfer_core::BackendConfig::secret`]). `None` (the default) says the backend does not
    /// authenticate its connections: the `auth` family is then skipped with that reason.
    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<kvxfer_core::Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        let _ = (identity, secret);
        None
    }
}

/// A transfer scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Prefill side.
    pub prefill: SideSpec,
    /// Decode side.
    pub decode: SideSpec,
    /// Chunks per request.
    pub chunks: u32,
    /// Pages per chunk.
    pub pages_per_chunk: u32,
    /// Concurrent requests.
    pub requests: u32,
    /// Notification style.
    pub style: NotifyStyle,
    /// Send chunks last-first (reordered notifications).
    pub reverse_chunks: bool,
    /// Seed of the page shuffles.
    pub seed: u64,
}

/// Decode endpoints' identities (not sender keys: the top bit marks them); the one encoding lives in
/// [`kvxfer::engine::identity`].
fn decode_identity(r: RankId) -> u64 {
    kvxfer::engine::identity(Side::Decode, r)
}

fn permutation(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// One request's pages: source and destination, in token order, split into chunks.
#[derive(Debug, Clone)]
struct RequestPages {
    id: RequestId,
    src: Vec<u32>,
    dst: Vec<u32>,
}

/// Token base of request `k`: far apart so requests never share token numbers.
fn token_base(k: usize) -> u64 {
    k as u64 * (1 << 24)
}

struct Rig {
    topo: Topology,
    pool_pages: u32,
    senders: HashMap<RankId, Arc<SenderSession>>,
    receivers: HashMap<RankId, Arc<ReceiverSession>>,
    dst_buffers: HashMap<RankId, Vec<PoolMemory>>,
    _src_buffers: Vec<PoolMemory>,
    requests: Vec<RequestPages>,
}

fn tokens_of(requests: &[RequestPages], dst: bool, page_size: u32) -> HashMap<u32, u64> {
    let mut m = HashMap::new();
    for (k, r) in requests.iter().enumerate() {
        let pages = if dst { &r.dst } else { &r.src };
        for (i, p) in pages.iter().enumerate() {
            m.insert(*p, token_base(k) + i as u64 * u64::from(page_size));
        }
    }
    m
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

impl Rig {
    async fn build(f: &dyn BackendFactory, sc: &Scenario) -> Result<Rig, String> {
        let topo = Topology::new(&sc.prefill, &sc.decode).map_err(err)?;
        let per_req = sc.chunks * sc.pages_per_chunk;
        let pool_pages = per_req * sc.requests + 3;
        let src_perm = permutation(pool_pages, sc.seed);
        let dst_perm = permutation(pool_pages, sc.seed ^ 0x5555);
        let requests: Vec<RequestPages> = (0..sc.requests)
            .map(|k| {
                let r = (k * per_req) as usize..((k + 1) * per_req) as usize;
                RequestPages {
                    id: RequestId(1000 + u64::from(k)),
                    src: src_perm[r.clone()].to_vec(),
                    dst: dst_perm[r].to_vec(),
                }
            })
            .collect();
        let page_size = topo.kv().page_size;
        let src_tokens = tokens_of(&requests, false, page_size);
        let mut senders = HashMap::new();
        let mut src_buffers = Vec::new();
        for r in topo.ranks(Side::Prefill) {
            let be = f.create(SenderKey::of(r).to_u64()).map_err(err)?;
            let fill = |b: BufferRef, bytes: &mut [u8]| {
                let g = BufferGeom::new(&topo, Side::Prefill, r, b.layer, b.kind, pool_pages);
                g.fill(bytes, &|p| src_tokens.get(&p).copied());
            };
            let (pool, bufs) =
                KvPool::allocate(&topo, Side::Prefill, r, pool_pages, be.as_ref(), &fill).await.map_err(err)?;
            src_buffers.extend(bufs);
            senders.insert(r, Arc::new(SenderSession::new(be, topo, r, pool, sc.style).map_err(err)?));
        }
        let mut receivers = HashMap::new();
        let mut dst_buffers = HashMap::new();
        for r in topo.ranks(Side::Decode) {
            let be = f.create(decode_identity(r)).map_err(err)?;
            let fill = |_: BufferRef, bytes: &mut [u8]| bytes.fill(SENTINEL);
            let (pool, bufs) =
                KvPool::allocate(&topo, Side::Decode, r, pool_pages, be.as_ref(), &fill).await.map_err(err)?;
            dst_buffers.insert(r, bufs);
            receivers.insert(r, Arc::new(ReceiverSession::new(be, topo, r, pool).map_err(err)?));
        }
        for (r, s) in &senders {
            for d in s.receivers() {
                let rx = &receivers[&d];
                let meta = rx.backend().metadata().map_err(err)?;
                s.connect(d, &meta, rx.pool().clone()).await.map_err(|e| format!("connect {r} -> {d}: {e}"))?;
            }
        }
        Ok(Rig { topo, pool_pages, senders, receivers, dst_buffers, _src_buffers: src_buffers, requests })
    }

    fn expect_all(&self, deadline: Instant) -> Result<(), String> {
        for rx in self.receivers.values() {
            for r in &self.requests {
                rx.expect(r.id, &r.dst, ExpectOptions::default(), deadline).map_err(err)?;
            }
        }
        Ok(())
    }

    fn chunk(&self, req: &RequestPages, sc: &Scenario, c: u32) -> Chunk {
        let n = sc.pages_per_chunk as usize;
        let r = c as usize * n..(c as usize + 1) * n;
        Chunk {
            index: c,
            last: c + 1 == sc.chunks,
            src_pages: req.src[r.clone()].to_vec(),
            dst_pages: req.dst[r].to_vec(),
        }
    }

    /// Every sender sends every chunk of every request, concurrently over ranks and requests.
    async fn send_all(&self, sc: &Scenario, deadline: Instant, skip: Option<RankId>) -> Result<(), String> {
        let mut tasks = Vec::new();
        for (rank, s) in &self.senders {
            if Some(*rank) == skip {
                continue;
            }
            for req in &self.requests {
                let order: Vec<u32> =
                    if sc.reverse_chunks { (0..sc.chunks).rev().collect() } else { (0..sc.chunks).collect() };
                let chunks: Vec<Chunk> = order.iter().map(|c| self.chunk(req, sc, *c)).collect();
                let (s, id) = (Arc::clone(s), req.id);
                tasks.push(tokio::spawn(async move {
                    for c in &chunks {
                        s.send_chunk(id, c, deadline).await?;
                    }
                    Ok::<_, SessionError>(())
                }));
            }
        }
        for t in tasks {
            t.await.map_err(err)?.map_err(err)?;
        }
        Ok(())
    }

    async fn wait_all(&self) -> Result<(), String> {
        for rx in self.receivers.values() {
            for r in &self.requests {
                rx.wait(r.id).await.map_err(err)?;
            }
        }
        Ok(())
    }

    fn verify(&self) -> Result<(), String> {
        let tokens = tokens_of(&self.requests, true, self.topo.kv().page_size);
        for (rank, bufs) in &self.dst_buffers {
            for m in bufs {
                let b = m.buffer;
                let g = BufferGeom::new(&self.topo, Side::Decode, *rank, b.layer, b.kind, self.pool_pages);
                g.verify(0, read_all(m)?.as_slice(), &|p| tokens.get(&p).copied())
                    .map_err(|e| format!("decode rank {rank} layer {} {}: {e}", b.layer, b.kind))?;
            }
        }
        Ok(())
    }

    fn all_sentinel(&self) -> Result<(), String> {
        for (rank, bufs) in &self.dst_buffers {
            for m in bufs {
                if let Some(i) = read_all(m)?.as_slice().iter().position(|x| *x != SENTINEL) {
                    return Err(format!(
                        "decode rank {rank} layer {} {} byte {i} changed",
                        m.buffer.layer, m.buffer.kind
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A read view of a whole pool buffer (its requests are complete, so nothing writes it any more).
fn read_all(m: &PoolMemory) -> Result<kvxfer_core::ReadGuard, String> {
    m.desc().read_guard(0, m.desc().len() as u64).map_err(|e| format!("reading decode memory: {e}"))
}

/// Runs one transfer scenario end to end and verifies every decode byte.
pub async fn run_transfer(f: &dyn BackendFactory, sc: &Scenario) -> Result<(), String> {
    let rig = Rig::build(f, sc).await?;
    rig.expect_all(Instant::now() + Duration::from_secs(20))?;
    rig.send_all(sc, Instant::now() + Duration::from_secs(20), None).await?;
    rig.wait_all().await?;
    rig.verify()
}

fn gqa(h: u32, hk: u32, hv: u32, layers: u32, page: u32, layout: Layout, tp: u32, pp: u32) -> SideSpec {
    SideSpec {
        kv: KvSpec {
            attention: Attention::Gqa { kv_heads: h, head_dim_k: hk, head_dim_v: hv },
            layers,
            dtype_bytes: 2,
            page_size: page,
            layout,
        },
        parallel: Parallel::new(tp, pp),
    }
}

fn mla(latent: u32, layers: u32, page: u32, tp: u32, pp: u32) -> SideSpec {
    SideSpec {
        kv: KvSpec {
            attention: Attention::Mla { latent_dim: latent },
            layers,
            dtype_bytes: 2,
            page_size: page,
            layout: Layout::Nhd,
        },
        parallel: Parallel::new(tp, pp),
    }
}

const SIZES: [u32; 6] = [1, 2, 3, 4, 6, 8];
const HEADS: [u32; 6] = [1, 2, 4, 6, 8, 12];

fn style_name(s: NotifyStyle) -> &'static str {
    match s {
        NotifyStyle::Attached => "attached",
        NotifyStyle::OutOfBand => "oob",
    }
}

fn layout_name(l: Layout) -> &'static str {
    match l {
        Layout::Nhd => "nhd",
        Layout::Hnd => "hnd",
    }
}

fn base(prefill: SideSpec, decode: SideSpec, style: NotifyStyle, seed: u64) -> Scenario {
    Scenario { prefill, decode, chunks: 2, pages_per_chunk: 3, requests: 1, style, reverse_chunks: false, seed }
}

/// Every transfer scenario of the suite, named.
pub fn scenarios() -> Vec<(String, Scenario)> {
    use NotifyStyle::{Attached, OutOfBand};
    let mut out = Vec::new();
    let valid = |a: &SideSpec, b: &SideSpec| Topology::new(a, b).is_ok();
    // matrix: every valid (P, D, H), both layouts; page size, hk != hv and style vary across cases.
    let mut i = 0u64;
    for p in SIZES {
        for d in SIZES {
            for h in HEADS {
                for layout in [Layout::Nhd, Layout::Hnd] {
                    let page = if (p + d + h) % 2 == 0 { 16 } else { 1 };
                    let (hk, hv) = if (p * d + h) % 2 == 0 { (4, 2) } else { (4, 4) };
                    let style = if (i / 2 + u64::from(h)) % 2 == 0 { Attached } else { OutOfBand };
                    let (a, b) = (gqa(h, hk, hv, 2, page, layout, p, 1), gqa(h, hk, hv, 2, page, layout, d, 1));
                    if valid(&a, &b) {
                        i += 1;
                        let name = format!(
                            "matrix::p{p}_d{d}_h{h}_{}_s{page}_k{hk}v{hv}_{}",
                            layout_name(layout),
                            style_name(style)
                        );
                        out.push((name, base(a, b, style, i)));
                    }
                }
            }
        }
    }
    // styles: both styles on representative configurations, both layouts.
    for (p, d, h) in [(1, 1, 2), (2, 2, 8), (8, 2, 8), (2, 8, 8), (8, 2, 2), (4, 8, 2), (2, 4, 12), (8, 4, 4)] {
        for layout in [Layout::Nhd, Layout::Hnd] {
            for style in [Attached, OutOfBand] {
                let (a, b) = (gqa(h, 8, 4, 2, 16, layout, p, 1), gqa(h, 8, 4, 2, 16, layout, d, 1));
                let name = format!("styles::p{p}_d{d}_h{h}_{}_{}", layout_name(layout), style_name(style));
                out.push((name, base(a, b, style, u64::from(p * 100 + d * 10 + h))));
            }
        }
    }
    // pp: prefill PP 2 and 4 into decode PP 1, and equal PP.
    for (pp, dpp) in [(2, 1), (4, 1), (2, 2), (4, 4)] {
        for (p, d, h) in [(2, 4, 8), (4, 2, 2), (8, 2, 4), (2, 2, 2), (4, 1, 4)] {
            for style in [Attached, OutOfBand] {
                let layout = if (p + d) % 4 == 0 { Layout::Hnd } else { Layout::Nhd };
                let (a, b) = (gqa(h, 4, 2, 8, 4, layout, p, pp), gqa(h, 4, 2, 8, 4, layout, d, dpp));
                let name = format!("pp::pp{pp}_dpp{dpp}_p{p}_d{d}_h{h}_{}_{}", layout_name(layout), style_name(style));
                out.push((name, base(a, b, style, u64::from(pp * 7 + p))));
            }
        }
    }
    // pp, uneven stages (explicit layer partitions): into decode PP 1, which holds every layer, and into
    // equal PP with the same partition.
    for (stages, dpp) in [(&[3u32, 2][..], 1), (&[2, 3], 2), (&[1, 3, 2], 1), (&[1, 3, 2], 3)] {
        for (p, d, h) in [(2, 4, 8), (4, 2, 2), (2, 1, 2)] {
            for style in [Attached, OutOfBand] {
                let layout = if (p + d + dpp) % 2 == 0 { Layout::Hnd } else { Layout::Nhd };
                let layers: u32 = stages.iter().sum();
                let mut a = gqa(h, 4, 2, layers, 4, layout, p, stages.len() as u32);
                a.parallel = Parallel::with_stage_layers(p, stages).expect("a few stages");
                let mut b = gqa(h, 4, 2, layers, 4, layout, d, dpp);
                if dpp > 1 {
                    b.parallel = Parallel::with_stage_layers(d, stages).expect("a few stages");
                }
                let split = stages.iter().map(u32::to_string).collect::<Vec<_>>().join("-");
                let name =
                    format!("pp::split{split}_dpp{dpp}_p{p}_d{d}_h{h}_{}_{}", layout_name(layout), style_name(style));
                out.push((name, base(a, b, style, u64::from(layers * 7 + p))));
            }
        }
    }
    // mla: every valid TP pair, one latent, single sender; PP 2 into 1 on some.
    for p in SIZES {
        for d in SIZES {
            if p.max(d) % p.min(d) != 0 {
                continue;
            }
            let pp = if (p + d) % 3 == 0 { 2 } else { 1 };
            let style = if (p + d) % 2 == 0 { Attached } else { OutOfBand };
            let name = format!("mla::p{p}_d{d}_pp{pp}_{}", style_name(style));
            out.push((name, base(mla(18, 4, 16, p, pp), mla(18, 4, 16, d, 1), style, u64::from(p + d))));
        }
    }
    // chunks: many chunks, in order and reversed (reordered notifications), page size 1 and 16.
    for (p, d, h) in [(2, 4, 4), (4, 2, 8), (3, 6, 6)] {
        for reverse in [false, true] {
            for style in [Attached, OutOfBand] {
                let page = if reverse { 1 } else { 16 };
                let (a, b) = (gqa(h, 4, 4, 2, page, Layout::Nhd, p, 1), gqa(h, 4, 4, 2, page, Layout::Nhd, d, 1));
                let mut sc = base(a, b, style, u64::from(p + d + h));
                sc.chunks = 5;
                sc.pages_per_chunk = 2;
                sc.reverse_chunks = reverse;
                let name = format!(
                    "chunks::p{p}_d{d}_h{h}_{}_{}",
                    if reverse { "reversed" } else { "ordered" },
                    style_name(style)
                );
                out.push((name, sc));
            }
        }
    }
    // concurrent: several requests at once.
    for (p, d, h, layout) in [(4, 2, 8, Layout::Nhd), (2, 4, 2, Layout::Hnd), (6, 3, 6, Layout::Nhd)] {
        for style in [Attached, OutOfBand] {
            let (a, b) = (gqa(h, 4, 2, 2, 4, layout, p, 1), gqa(h, 4, 2, 2, 4, layout, d, 1));
            let mut sc = base(a, b, style, u64::from(p * d + h));
            sc.requests = 4;
            let name = format!("concurrent::p{p}_d{d}_h{h}_{}_{}", layout_name(layout), style_name(style));
            out.push((name, sc));
        }
    }
    out
}

type CaseFn = fn(Arc<dyn BackendFactory>, NotifyStyle) -> futures::future::BoxFuture<'static, Result<(), String>>;

fn small(p: u32, d: u32, h: u32) -> Scenario {
    base(gqa(h, 4, 2, 2, 4, Layout::Nhd, p, 1), gqa(h, 4, 2, 2, 4, Layout::Nhd, d, 1), NotifyStyle::Attached, 3)
}

fn expect_failure(r: Result<(), SessionError>, want: impl Fn(&Failure) -> bool, what: &str) -> Result<(), String> {
    match r {
        Err(SessionError::Failed { failure, .. }) if want(&failure) => Ok(()),
        Err(e) => Err(format!("expected {what}, got error: {e}")),
        Ok(()) => Err(format!("expected {what}, but the request completed")),
    }
}

async fn notify_duplicated(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let sc = Scenario { style, ..small(2, 1, 2) };
    let rig = Rig::build(f.as_ref(), &sc).await?;
    rig.expect_all(Instant::now() + Duration::from_secs(20))?;
    rig.send_all(&sc, Instant::now() + Duration::from_secs(20), None).await?;
    // Replay every sender's chunk notifications.
    let req = rig.requests[0].id;
    for s in rig.senders.values() {
        for c in 0..sc.chunks {
            let n = Notification::chunk(req, s.key(), c, c + 1 == sc.chunks);
            resend(s, &n).await?;
        }
    }
    rig.wait_all().await?;
    rig.verify()
}

async fn resend(s: &SenderSession, n: &Notification) -> Result<(), String> {
    s.notify_receivers(n).await.map_err(err)
}

async fn notify_unknown_request(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let sc = Scenario { style, ..small(1, 2, 2) };
    let rig = Rig::build(f.as_ref(), &sc).await?;
    let s = rig.senders.values().next().expect("one sender");
    // Before anything is expected: a notification for a request nobody tracks (kept as early, never
    // applied, and it must not disturb the real request).
    resend(s, &Notification::chunk(RequestId(999_999), s.key(), 0, true)).await?;
    rig.expect_all(Instant::now() + Duration::from_secs(20))?;
    rig.send_all(&sc, Instant::now() + Duration::from_secs(20), None).await?;
    rig.wait_all().await?;
    rig.verify()?;
    // The stray notification went out of band, on another connection than the request's own
    // (attached) ones, so it may be taken in after the request completed: pump until it is
    // counted, bounded.
    let counted = || rig.receivers.values().map(|r| r.stats().early_kept).sum::<u64>();
    let until = Instant::now() + Duration::from_secs(5);
    while counted() < 2 && Instant::now() < until {
        for r in rig.receivers.values() {
            r.pump(Duration::from_millis(20)).await.map_err(err)?;
        }
    }
    let dropped = counted();
    if dropped != 2 {
        return Err(format!(
            "expected 2 kept early notifications for the unknown request (one per decode rank, SEMANTICS §5), counted {dropped}"
        ));
    }
    Ok(())
}

async fn notify_unknown_key(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let sc = Scenario { style, ..small(2, 2, 2) };
    let rig = Rig::build(f.as_ref(), &sc).await?;
    rig.expect_all(Instant::now() + Duration::from_secs(20))?;
    let req = rig.requests[0].id;
    // Prefill rank 0 feeds only decode rank 0: a notification under rank 1's key reaches decode 0.
    let s0 = &rig.senders[&RankId::new(0, 0)];
    let stranger = SenderKey { tp: 1, ..s0.key() };
    resend(s0, &Notification::chunk(req, stranger, 0, true)).await?;
    let rx = &rig.receivers[&RankId::new(0, 0)];
    expect_failure(
        rx.wait(req).await,
        |f| matches!(f, Failure::UnexpectedKey { key } if *key == stranger),
        "an unexpected-key failure",
    )
}

async fn notify_failure(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let sc = Scenario { style, ..small(4, 2, 4) };
    let rig = Rig::build(f.as_ref(), &sc).await?;
    rig.expect_all(Instant::now() + Duration::from_secs(20))?;
    let req = rig.requests[0].id;
    let s = &rig.senders[&RankId::new(1, 0)];
    s.fail(req, "prefill OOM").await;
    let rx = &rig.receivers[&RankId::new(0, 0)];
    let key = s.key();
    let t0 = Instant::now();
    expect_failure(
        rx.wait(req).await,
        |f| matches!(f, Failure::Notified { key: k, reason } if *k == key && reason.contains("prefill OOM")),
        "the sender's failure",
    )?;
    if t0.elapsed() > Duration::from_secs(10) {
        return Err("failure was learned by timeout, not by notification".into());
    }
    Ok(())
}

async fn notify_missing_sender(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let sc = Scenario { style, ..small(2, 1, 2) };
    let rig = Rig::build(f.as_ref(), &sc).await?;
    let deadline = Instant::now() + Duration::from_millis(1500);
    rig.expect_all(deadline)?;
    rig.send_all(&sc, Instant::now() + Duration::from_secs(20), Some(RankId::new(1, 0))).await?;
    let rx = &rig.receivers[&RankId::new(0, 0)];
    let missing = SenderKey::of(RankId::new(1, 0));
    let r = tokio::time::timeout(Duration::from_secs(10), rx.wait(rig.requests[0].id))
        .await
        .map_err(|_| "wait hung past its deadline".to_string())?;
    expect_failure(
        r,
        |f| matches!(f, Failure::DeadlineExceeded { missing: m, .. } if m == &vec![missing]),
        "a deadline naming tp1.pp0",
    )
}

async fn notify_sender_lost(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let sc = Scenario { style, ..small(2, 1, 2) };
    let mut rig = Rig::build(f.as_ref(), &sc).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    rig.expect_all(deadline)?;
    // Rank 0 sends; rank 1 goes away without sending.
    rig.send_all(&sc, Instant::now() + Duration::from_secs(20), Some(RankId::new(1, 0))).await?;
    let gone = rig.senders.remove(&RankId::new(1, 0)).expect("rank 1");
    drop(gone);
    let rx = &rig.receivers[&RankId::new(0, 0)];
    let key = SenderKey::of(RankId::new(1, 0));
    let r = tokio::time::timeout(Duration::from_secs(20), rx.wait(rig.requests[0].id))
        .await
        .map_err(|_| "no failure within 20 s of the sender going away".to_string())?;
    expect_failure(
        r,
        |f| matches!(f, Failure::PeerLost { key: k, .. } if *k == key),
        "a lost-sender failure naming tp1.pp0",
    )
}

async fn bounds_rejected(f: Arc<dyn BackendFactory>, _style: NotifyStyle) -> Result<(), String> {
    let sender = f.create(1).map_err(err)?;
    let receiver = f.create(2).map_err(err)?;
    let mut src = HostBuffer::filled(4096, 7);
    let mut dst = HostBuffer::filled(4096, SENTINEL);
    let src_reg = sender.register(RegionId(1), src.desc()).await.map_err(err)?;
    let dst_view = dst.desc();
    let dst_reg = receiver.register(RegionId(5), dst_view.clone()).await.map_err(err)?;
    match sender.register(RegionId(1), src.desc()).await {
        Err(BackendError::RegionInUse { .. }) => {}
        other => return Err(format!("registering a region id twice: expected RegionInUse, got {other:?}")),
    }
    let peer = sender.connect(&receiver.metadata().map_err(err)?).await.map_err(err)?;
    let good = WriteOp::contiguous(RegionId(1), 0, RegionId(5), 0, 64);
    let bad: Vec<(&str, Vec<WriteOp>)> = vec![
        ("destination past the end", vec![WriteOp::contiguous(RegionId(1), 0, RegionId(5), 4090, 64)]),
        ("source past the end", vec![WriteOp::contiguous(RegionId(1), 4090, RegionId(5), 0, 64)]),
        ("last stride step past the end", vec![WriteOp { count: 64, src_stride: 64, dst_stride: 65, ..good }]),
        ("offset overflow", vec![WriteOp::contiguous(RegionId(1), 0, RegionId(5), u64::MAX - 8, 64)]),
        ("stride overflow", vec![WriteOp { count: 3, src_stride: 1, dst_stride: u64::MAX / 2, len: 1, ..good }]),
        ("unknown destination region", vec![WriteOp { dst: RegionId(77), ..good }]),
        ("unknown source region", vec![WriteOp { src: RegionId(77), ..good }]),
        ("a good op then a bad one", vec![good, WriteOp::contiguous(RegionId(1), 0, RegionId(5), 4095, 2)]),
    ];
    let deadline = || Instant::now() + Duration::from_secs(20);
    for (what, ops) in bad {
        let r = match sender.post(peer, &ops, None) {
            Ok(t) => t.wait(deadline()).await,
            Err(e) => Err(e),
        };
        match r {
            Ok(()) => return Err(format!("{what}: write succeeded")),
            Err(
                BackendError::OutOfBounds { .. } | BackendError::UnknownRegion { .. } | BackendError::Protocol { .. },
            ) => {}
            Err(e) => return Err(format!("{what}: unexpected error kind: {e}")),
        }
        let now = dst_view.read_guard(0, 4096).map_err(err)?;
        if let Some(i) = now.as_slice().iter().position(|b| *b != SENTINEL) {
            return Err(format!("{what}: decode byte {i} changed although the write was rejected"));
        }
    }
    // The connection still works (or reconnects) after rejections; a good write lands exactly.
    let write = |p| {
        let s = Arc::clone(&sender);
        async move { s.post(p, &[good], None)?.wait(deadline()).await }
    };
    if write(peer).await.is_err() {
        let p = sender.connect(&receiver.metadata().map_err(err)?).await.map_err(err)?;
        write(p).await.map_err(err)?;
    }
    drop(dst_view);
    dst_reg.close(deadline()).await.map_err(err)?;
    let got = dst.to_vec().map_err(|e| format!("after close: {e}"))?;
    if got[..64].iter().any(|b| *b != 7) || got[64..].iter().any(|b| *b != SENTINEL) {
        return Err("a good 64-byte write did not land exactly".into());
    }
    src_reg.close(deadline()).await.map_err(err)?;
    src.as_mut_slice().map_err(|e| format!("source after close: {e}"))?;
    Ok(())
}

async fn bad_metadata(f: Arc<dyn BackendFactory>, _style: NotifyStyle) -> Result<(), String> {
    let a = f.create(1).map_err(err)?;
    let b = f.create(2).map_err(err)?;
    let mut meta = b.metadata().map_err(err)?;
    meta.backend = "not-a-backend".into();
    match a.connect(&meta).await {
        Err(BackendError::BadMetadata { .. }) => {}
        other => return Err(format!("metadata of another backend: expected BadMetadata, got {other:?}")),
    }
    let mut meta = b.metadata().map_err(err)?;
    meta.payload = vec![0xff; 3];
    match a.connect(&meta).await {
        Err(BackendError::BadMetadata { .. } | BackendError::Connect { .. }) => Ok(()),
        other => Err(format!("garbage payload: expected BadMetadata, got {other:?}")),
    }
}

async fn invalid_session_inputs(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let sc = Scenario { style, ..small(2, 2, 2) };
    let rig = Rig::build(f.as_ref(), &sc).await?;
    let s = &rig.senders[&RankId::new(0, 0)];
    let rx = &rig.receivers[&RankId::new(0, 0)];
    let deadline = Instant::now() + Duration::from_secs(5);
    let req = RequestId(5);
    let cases: Vec<(Chunk, PlanError)> = vec![
        (
            Chunk { index: 0, last: true, src_pages: vec![0, 1], dst_pages: vec![2] },
            PlanError::PageCountMismatch { src: 2, dst: 1 },
        ),
        (
            Chunk { index: 0, last: true, src_pages: vec![0, 1], dst_pages: vec![2, 2] },
            PlanError::DuplicateDestinationPage { page: 2 },
        ),
        (
            Chunk { index: 0, last: true, src_pages: vec![0, rig.pool_pages], dst_pages: vec![2, 3] },
            PlanError::PageOutOfRange {
                side: Side::Prefill,
                rank: RankId::new(0, 0),
                page: rig.pool_pages,
                capacity: rig.pool_pages,
            },
        ),
        (
            Chunk { index: 0, last: true, src_pages: vec![0, 1], dst_pages: vec![2, rig.pool_pages + 4] },
            PlanError::PageOutOfRange {
                side: Side::Decode,
                rank: RankId::new(0, 0),
                page: rig.pool_pages + 4,
                capacity: rig.pool_pages,
            },
        ),
    ];
    for (chunk, want) in cases {
        match s.send_chunk(req, &chunk, deadline).await {
            Err(SessionError::Plan { source, .. }) if source == want => {}
            other => return Err(format!("{chunk:?}: expected {want}, got {other:?}")),
        }
    }
    rig.all_sentinel()?;
    match rx.expect(req, &[rig.pool_pages], ExpectOptions::default(), deadline) {
        Err(SessionError::Plan { source: PlanError::PageOutOfRange { .. }, .. }) => {}
        other => return Err(format!("expect with an out-of-range page: {other:?}")),
    }
    rx.expect(req, &[1], ExpectOptions::default(), deadline).map_err(err)?;
    match rx.expect(req, &[1], ExpectOptions::default(), deadline) {
        Err(SessionError::Tracker { .. }) => {}
        other => return Err(format!("expecting a request twice: {other:?}")),
    }
    // A pool that does not match the topology is refused at connect.
    let mut bad_pool = rx.pool().clone();
    bad_pool.buffers.pop();
    let meta = rx.backend().metadata().map_err(err)?;
    match s.connect(RankId::new(0, 0), &meta, bad_pool).await {
        Err(SessionError::Pool { .. }) => Ok(()),
        other => Err(format!("connect with a pool missing a buffer: {other:?}")),
    }
}

fn invalid_configs() -> Result<(), String> {
    let ok = gqa(8, 128, 128, 8, 16, Layout::Nhd, 2, 1);
    let cases: Vec<(&str, SideSpec, SideSpec, ConfigError)> = vec![
        (
            "heads_tp",
            gqa(8, 128, 128, 8, 16, Layout::Nhd, 3, 1),
            ok,
            ConfigError::HeadsNotDivisible { side: Side::Prefill, kv_heads: 8, tp: 3 },
        ),
        (
            "tp_ratio",
            gqa(12, 8, 8, 8, 16, Layout::Nhd, 4, 1),
            gqa(12, 8, 8, 8, 16, Layout::Nhd, 6, 1),
            ConfigError::TpRatio { prefill_tp: 4, decode_tp: 6 },
        ),
        (
            "decode_pp",
            gqa(8, 128, 128, 8, 16, Layout::Nhd, 2, 2),
            gqa(8, 128, 128, 8, 16, Layout::Nhd, 2, 4),
            ConfigError::PpMismatch { prefill_pp: 2, decode_pp: 4 },
        ),
        (
            "layers_pp",
            gqa(8, 128, 128, 6, 16, Layout::Nhd, 2, 4),
            gqa(8, 128, 128, 6, 16, Layout::Nhd, 2, 1),
            ConfigError::LayersNotDivisible { side: Side::Prefill, layers: 6, pp: 4 },
        ),
    ];
    for (name, a, b, want) in cases {
        match Topology::new(&a, &b) {
            Err(e) if e == want => {}
            other => return Err(format!("{name}: expected {want}, got {other:?}")),
        }
    }
    let mismatched = [
        ("page_size", gqa(8, 128, 128, 8, 32, Layout::Nhd, 2, 1)),
        ("dtype_bytes", SideSpec { kv: KvSpec { dtype_bytes: 1, ..ok.kv }, ..ok }),
        ("head_dim_k", gqa(8, 64, 128, 8, 16, Layout::Nhd, 2, 1)),
        ("head_dim_v", gqa(8, 128, 64, 8, 16, Layout::Nhd, 2, 1)),
        ("layers", gqa(8, 128, 128, 16, 16, Layout::Nhd, 2, 1)),
        ("kv_heads", gqa(4, 128, 128, 8, 16, Layout::Nhd, 2, 1)),
        ("layout", gqa(8, 128, 128, 8, 16, Layout::Hnd, 2, 1)),
        ("attention", mla(576, 8, 16, 2, 1)),
    ];
    for (field, d) in mismatched {
        match Topology::new(&ok, &d) {
            Err(ConfigError::Mismatch(ms)) if ms.len() == 1 && ms[0].field == field => {}
            other => return Err(format!("{field}: expected one mismatch naming it, got {other:?}")),
        }
    }
    Ok(())
}

impl std::fmt::Debug for Rig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Rig({:?})", self.topo)
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime")
}

/// The whole suite as libtest-mimic trials, with capability-based skips.
pub fn trials(factory: Arc<dyn BackendFactory>) -> (Vec<Trial>, Vec<(String, usize)>) {
    let mut trials = Vec::new();
    let mut skips: HashMap<String, usize> = HashMap::new();
    let global_skip = factory.skip_reason();
    let caps = factory.create(u64::MAX - 1).map(|b| b.capabilities());
    let style_skip = |style: NotifyStyle| -> Option<String> {
        if let Some(r) = &global_skip {
            return Some(r.clone());
        }
        match &caps {
            Ok(c) if !c.supports(style) => Some(format!("backend does not support {style} notifications")),
            // Capabilities decide skips; an endpoint that cannot be created is not a skip (only
            // the factory's declared `skip_reason` is, e.g. no RDMA device): every case runs and
            // fails naming the error, so a misconfigured run (`KVXFER_TCP_TLS=on` without its
            // files) cannot pass with its cases skipped.
            Ok(_) | Err(_) => None,
        }
    };
    let mut add = |name: String, skip: Option<String>, t: Box<dyn FnOnce() -> Result<(), String> + Send>| {
        let ignored = skip.is_some();
        if let Some(r) = skip {
            *skips.entry(r).or_default() += 1;
        }
        trials.push(Trial::test(name, move || t().map_err(Failed::from)).with_ignored_flag(ignored));
    };
    for (name, sc) in scenarios() {
        let f = Arc::clone(&factory);
        let skip = style_skip(sc.style);
        add(name, skip, Box::new(move || block(async move { run_transfer(f.as_ref(), &sc).await })));
    }
    let cases: Vec<(&str, CaseFn)> = vec![
        ("notify::duplicated", |f, s| Box::pin(notify_duplicated(f, s))),
        ("notify::unknown_request", |f, s| Box::pin(notify_unknown_request(f, s))),
        ("notify::unknown_key", |f, s| Box::pin(notify_unknown_key(f, s))),
        ("notify::failure", |f, s| Box::pin(notify_failure(f, s))),
        ("notify::missing_sender", |f, s| Box::pin(notify_missing_sender(f, s))),
        ("notify::sender_lost", |f, s| Box::pin(notify_sender_lost(f, s))),
        ("invalid::session_inputs", |f, s| Box::pin(invalid_session_inputs(f, s))),
    ];
    for (name, case) in cases {
        for style in [NotifyStyle::Attached, NotifyStyle::OutOfBand] {
            let f = Arc::clone(&factory);
            add(format!("{name}_{}", style_name(style)), style_skip(style), Box::new(move || block(case(f, style))));
        }
    }
    let f = Arc::clone(&factory);
    add(
        "bounds::rejected_and_nothing_written".into(),
        global_skip.clone(),
        Box::new(move || block(bounds_rejected(f, NotifyStyle::Attached))),
    );
    let f = Arc::clone(&factory);
    add(
        "bounds::bad_metadata".into(),
        global_skip.clone(),
        Box::new(move || block(bad_metadata(f, NotifyStyle::Attached))),
    );
    add("invalid::configurations".into(), None, Box::new(invalid_configs));
    let contract: Vec<(&str, CaseFn)> = vec![
        ("lifetime::close_waits_for_writes", |f, s| Box::pin(contract::lifetime_close_waits(f, s))),
        ("lifetime::closed_region_refused", |f, s| Box::pin(contract::lifetime_closed_refused(f, s))),
        ("lifetime::drop_without_close", |f, s| Box::pin(contract::lifetime_drop_without_close(f, s))),
        ("abort::mid_transfer_then_reuse", |f, s| Box::pin(contract::abort_then_reuse(f, s))),
        ("abort::finished_is_noop", |f, s| Box::pin(contract::abort_finished_noop(f, s))),
        ("abort::both_sides_at_once", |f, s| Box::pin(contract::abort_both_sides(f, s))),
        ("capabilities::claims_exercised", |f, s| Box::pin(contract::capabilities(f, s))),
        ("selfconnect::write_and_notify", |f, s| Box::pin(contract::self_connect(f, s))),
        ("bidirectional::ten_rounds", |f, s| Box::pin(contract::bidirectional(f, s))),
        ("indexed::page_lists_byte_for_byte", |f, s| Box::pin(contract::indexed_page_lists(f, s))),
        ("presumed_dead::nothing_lands_after_cut_off", |f, s| {
            Box::pin(presumed_dead::nothing_lands_after_cut_off(f, s))
        }),
        ("presumed_dead::cut_off_is_idempotent_and_bounded", |f, s| {
            Box::pin(presumed_dead::cut_off_is_idempotent_and_bounded(f, s))
        }),
    ];
    for (name, case) in contract {
        let f = Arc::clone(&factory);
        add(name.into(), global_skip.clone(), Box::new(move || block(case(f, NotifyStyle::Attached))));
    }
    for (name, case) in lifecycle::cases() {
        for style in [NotifyStyle::Attached, NotifyStyle::OutOfBand] {
            let f = Arc::clone(&factory);
            let skip = style_skip(style).or_else(|| lifecycle::skip_reason(f.as_ref()));
            add(format!("{name}_{}", style_name(style)), skip, Box::new(move || block(case(f, style))));
        }
    }
    let auth_skip = global_skip.clone().or_else(|| auth::skip_reason(factory.as_ref()));
    for (name, case) in auth::cases() {
        let f = Arc::clone(&factory);
        add(name.into(), auth_skip.clone(), Box::new(move || block(case(f))));
    }
    let mut skips: Vec<(String, usize)> = skips.into_iter().collect();
    skips.sort();
    (trials, skips)
}

/// Runs a case future on a fresh runtime, bounded to 90 seconds: a hang is a failure, never a stall.
fn block(fut: impl std::future::Future<Output = Result<(), String>>) -> Result<(), String> {
    runtime().block_on(async {
        tokio::time::timeout(Duration::from_secs(90), fut)
            .await
            .unwrap_or_else(|_| Err("case did not finish within 90 s".into()))
    })
}

/// The main function of a backend's conformance target: parses libtest arguments, runs the suite,
/// prints the skip reasons with counts, and returns the exit code.
pub fn run_main(factory: Arc<dyn BackendFactory>) -> ExitCode {
    let args = Arguments::from_args();
    let name = factory.name();
    let (trials, skips) = trials(factory);
    let total = trials.len();
    if !args.list {
        for (reason, n) in &skips {
            println!("conformance[{name}]: {n} of {total} cases skipped: {reason}");
        }
    }
    let conclusion = libtest_mimic::run(&args, trials);
    if !args.list {
        println!(
            "conformance[{name}] summary: passed {}, failed {}, skipped {}, filtered out {}",
            conclusion.num_passed, conclusion.num_failed, conclusion.num_ignored, conclusion.num_filtered_out
        );
    }
    conclusion.exit_code()
}

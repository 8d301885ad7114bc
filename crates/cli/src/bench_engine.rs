//! `kvxfer bench --through engine`: what an engine feels. Requests go through the engine API
//! (`Agent`, `Sender`, `Receiver`: the handoff, the planner, the window, the attached
//! notifications and the decode tracker), every rank of a `--prefill-tp` x `--decode-tp` cluster
//! an [`Agent`] in this process on a runtime of its own (2 worker threads, as the Python bindings
//! give each agent), over the chosen backend on loopback; the same
//! bytes are then moved raw (the planner's ops of every pair posted at once on plain endpoints of
//! the same backend, registered on the same memory) in the same run, so `engine_vs_raw` compares
//! like with like.
//!
//! Measured, in this order:
//! - `start_ms`: starting every agent (registration of its pool, store, background connect) until
//!   all are connected;
//! - the first request after that (one page) and `--small-requests` more: handoff -> success
//!   latency percentiles; `first_vs_steady` is the first one's latency over the median; the fixed
//!   overhead is the median minus the page's bytes at the raw contiguous rate;
//! - the model-shaped request (`--tokens`) on contiguous pages, and with `--fragmented` on a
//!   shuffled pool: one warm-up, then `--runs` timed runs through the engine and raw; per run the
//!   latency from the first handoff to the last decode rank's success (engine) or from the first
//!   post to the last transfer's completion (raw), and the time each `Sender::send` call took
//!   (post); every destination byte the plan names is compared with its source after a run into
//!   a cleared pool, for each path (memcpy too); and, as the baseline of the same run, `memcpy`: every range
//!   the plan names copied from the prefill pools into the decode pools by one thread of this
//!   process, no transport (`memcpy_fragmented_vs_contiguous` is what the shuffled pool's memory
//!   pattern alone costs; a backend's `fragmented_vs_contiguous` is read against it);
//! - `register_ms_per_gib`: one `register` call of `--register-size` of touched host memory on a
//!   fresh endpoint, per GiB.
//!
//! The requests are one at a time: latency, not throughput under concurrency.

use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::bootstrap::BootstrapServer;
use kvxfer::engine::{Agent, AgentConfig, KvMemory, Phase, Sender};
use kvxfer::metadata::MetadataAddr;
use kvxfer::session::region_id;
use kvxfer_core::plan::{plan_chunk, ChunkPlan};
use kvxfer_core::{
    BackendConfig, HostBuffer, IndexedOp, KvTransferBackend, PeerId, RankId, RegionId, Registration, RequestId, Side,
    Topology, Transfer,
};
use serde::Serialize;
use tokio::runtime::Handle;

use crate::bench::{fill_pattern, BenchArgs};
use crate::model::{request_pages, Preset};
use crate::plan::Format;

/// The decode pools' fill byte (touched at start, so no run pays first-touch page faults; and
/// after each verification run the pools are refilled with it).
const DECODE_FILL: u8 = 0x5a;
/// Deadline of one request (engine) or one raw post.
const REQUEST_DEADLINE: Duration = Duration::from_secs(120);

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Percentiles {
    /// Mean.
    pub avg_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile (the largest sample with fewer than 100 samples).
    pub p99_us: f64,
}

impl Percentiles {
    /// Of `samples` (at least one).
    pub fn of(samples: &[Duration]) -> Percentiles {
        let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        us.sort_by(f64::total_cmp);
        let n = us.len();
        let at = |q: f64| us[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        Percentiles { avg_us: us.iter().sum::<f64>() / n as f64, p50_us: us[n / 2], p99_us: at(0.99) }
    }
}

/// One path's timings of a case.
#[derive(Debug, Clone, Serialize)]
pub struct PathTiming {
    /// GB/s (1e9 bytes per second) of the median run.
    pub median_gbps: f64,
    /// GB/s of the best run.
    pub best_gbps: f64,
    /// Per run: handoff -> success (engine), first post -> last completion (raw).
    pub latency: Percentiles,
    /// Engine: how long `Sender::send` took to return (the slowest prefill rank's call per run).
    pub post: Option<Percentiles>,
}

impl PathTiming {
    fn of(bytes: u64, latency: &[Duration], post: Option<&[Duration]>) -> Self {
        let l = Percentiles::of(latency);
        let best = latency.iter().min().copied().unwrap_or_default().as_secs_f64();
        Self {
            median_gbps: bytes as f64 / (l.p50_us / 1e6) / 1e9,
            best_gbps: bytes as f64 / best / 1e9,
            latency: l,
            post: post.map(Percentiles::of),
        }
    }
}

/// One model-shaped case.
#[derive(Debug, Clone, Serialize)]
pub struct EngineCase {
    /// `contiguous` or `fragmented`, with the model and parallelism.
    pub name: String,
    /// Bytes of the request (every pair).
    pub bytes: u64,
    /// Pages of the request.
    pub pages: u32,
    /// Communicating (prefill, decode) pairs.
    pub pairs: usize,
    /// Ops per pair (the most of any pair): what the backend is handed, indexed ops (a page list
    /// against a template, one per layer and kv kind, cut at the sessions' batch of
    /// [`kvxfer::session::WRITE_BATCH`] writes).
    pub ops_per_pair: u64,
    /// Strided writes per pair (the most of any pair): one per page run, what the ops stand for.
    pub writes_per_pair: u64,
    /// Mean bytes per strided write (a page run's ranges).
    pub bytes_per_write: u64,
    /// Timed runs per path.
    pub runs: u32,
    /// Through the engine API.
    pub engine: PathTiming,
    /// Raw: the same ops posted on plain endpoints.
    pub raw: PathTiming,
    /// Engine median GB/s / raw median GB/s.
    pub engine_vs_raw: f64,
    /// Raw median GB/s of the fragmented request / of the contiguous one (`None` without
    /// `--fragmented`): what a shuffled pool costs the backend.
    pub fragmented_vs_contiguous: Option<f64>,
    /// The same ratio through the engine.
    pub engine_fragmented_vs_contiguous: Option<f64>,
    /// memcpy of the same ranges (every range the plan names, prefill pools into decode pools,
    /// one thread, no transport): the baseline of this run.
    pub memcpy: PathTiming,
    /// Raw median GB/s / memcpy median GB/s.
    pub raw_vs_memcpy: f64,
    /// memcpy median GB/s of the fragmented request / of the contiguous one (`None` without
    /// `--fragmented`): what the shuffled pool's memory pattern costs without a transport.
    pub memcpy_fragmented_vs_contiguous: Option<f64>,
    /// From the run's small requests (repeated on every case for scripts).
    pub small_request_overhead_us: f64,
    /// From the run's registration (repeated on every case).
    pub register_ms_per_gib: f64,
    /// From the run's first request (repeated on every case).
    pub first_vs_steady: f64,
    /// Every byte the plan names landed, through each path (engine, raw, memcpy).
    pub verified: bool,
}

/// One-page requests.
#[derive(Debug, Clone, Serialize)]
pub struct SmallRequests {
    /// Bytes of one request (every pair).
    pub bytes: u64,
    /// Timed requests (after the first).
    pub requests: u32,
    /// Handoff -> success.
    pub latency: Percentiles,
    /// `Sender::send` call times.
    pub post: Percentiles,
    /// The first request after every agent connected.
    pub first_us: f64,
    /// `first_us` / median.
    pub first_vs_steady: f64,
    /// Median latency minus the request's bytes at the raw contiguous median rate (the fixed
    /// overhead as issue 31 defines it; below zero when the page moves faster than the large
    /// request's average rate).
    pub overhead_us: f64,
    /// The same page moved raw (its ops posted, until their completion), one at a time.
    pub raw_latency: Percentiles,
    /// Engine median minus raw median of the same page: what the engine path adds to a request
    /// (handoff, notification, tracker, status wake-ups).
    pub engine_added_us: f64,
}

/// One registration call.
#[derive(Debug, Clone, Serialize)]
pub struct RegisterFigure {
    /// Bytes registered in one call.
    pub bytes: u64,
    /// How long the call took.
    pub ms: f64,
    /// ms per GiB.
    pub ms_per_gib: f64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct EngineReport {
    /// Backend registry name.
    pub backend: String,
    /// Always `engine`.
    pub through: &'static str,
    /// Starting every agent until all were connected, ms.
    pub start_ms: f64,
    /// The one-page requests.
    pub small: SmallRequests,
    /// Registration.
    pub register: RegisterFigure,
    /// Model-shaped cases.
    pub cases: Vec<EngineCase>,
}

/// Entry point of `kvxfer bench --through engine`.
pub fn run(args: &BenchArgs) -> ExitCode {
    match bench(args) {
        Ok(r) => {
            match args.format {
                Format::Json => println!("{}", serde_json::to_string_pretty(&r).expect("json")),
                Format::Table => print_table(&r),
            }
            if r.cases.iter().all(|c| c.verified) {
                ExitCode::SUCCESS
            } else {
                eprintln!("kvxfer bench: verification FAILED: a destination byte differs from its source");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("kvxfer bench --through engine: {e}");
            ExitCode::FAILURE
        }
    }
}

fn options(a: &BenchArgs) -> BTreeMap<String, String> {
    let mut o: BTreeMap<String, String> = a.backend_opts.iter().cloned().collect();
    if a.backend == "tcp" {
        o.entry("listen".into()).or_insert_with(|| "127.0.0.1:0".into());
    }
    o
}

struct Cluster {
    _server: BootstrapServer,
    prefill: Vec<Agent>,
    decode: Vec<Agent>,
    next_room: u64,
}

/// Starts every agent on its own runtime (`rts`: prefill ranks, then decode ranks), as each rank
/// of a deployment runs in its own process with its own runtime (the Python bindings give each
/// agent one of 2 worker threads): one rank's tasks never wait behind another's.
async fn start(a: &BenchArgs, topo: Topology, pages: u32, rts: &[Handle]) -> Result<Cluster, String> {
    let server = BootstrapServer::start("127.0.0.1:0").await.map_err(|e| format!("bootstrap service: {e}"))?;
    let addr = MetadataAddr::parse(&server.addr().to_string()).map_err(|e| e.to_string())?;
    let config = |role: Side, tp: u32| {
        let mut c = AgentConfig::new(role, RankId::new(tp, 0), topo, addr.clone());
        c.backend = a.backend.clone();
        c.backend_options = options(a);
        c.request_timeout = REQUEST_DEADLINE;
        c.label = format!("kvxfer bench {role} {tp}");
        c.warm_up = !a.no_warm_up;
        c
    };
    let on = |rt: &Handle, cfg: AgentConfig, memory: KvMemory| {
        let started = rt.spawn(Agent::start(cfg, memory));
        async move { started.await.map_err(|e| format!("starting an agent: {e}"))?.map_err(|e| e.to_string()) }
    };
    let ptp = topo.parallel(Side::Prefill).tp;
    let mut prefill = Vec::new();
    for tp in 0..ptp {
        let memory = KvMemory::Host { pages, fill: 0 };
        prefill.push(on(&rts[tp as usize], config(Side::Prefill, tp), memory).await?);
    }
    let mut decode = Vec::new();
    for tp in 0..topo.parallel(Side::Decode).tp {
        let memory = KvMemory::Host { pages, fill: DECODE_FILL };
        decode.push(on(&rts[(ptp + tp) as usize], config(Side::Decode, tp), memory).await?);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for agent in prefill.iter().chain(&decode) {
        agent.wait_connected(deadline).await.map_err(|e| e.to_string())?;
    }
    Ok(Cluster { _server: server, prefill, decode, next_room: 1 })
}

/// One request: every prefill rank's sender is made and `init`ed first (the engine knows the
/// request before decode hands off), then every decode rank hands off; each prefill rank sends as
/// soon as it is ready. Returns (handoff -> last decode success, slowest `send` call).
async fn engine_request(c: &mut Cluster, src: &Arc<[u32]>, dst: &[u32]) -> Result<(Duration, Duration), String> {
    let room = RequestId(c.next_room);
    c.next_room += 1;
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let mut txs: Vec<Sender> = Vec::new();
    for a in &c.prefill {
        let tx = a.sender(room).map_err(|e| e.to_string())?;
        tx.init(src.len() as u32).map_err(|e| e.to_string())?;
        txs.push(tx);
    }
    let t0 = Instant::now();
    let mut rxs = Vec::new();
    for a in &c.decode {
        let rx = a.receiver(room).map_err(|e| e.to_string())?;
        rx.send_metadata(dst, None).map_err(|e| e.to_string())?;
        rxs.push(rx);
    }
    let sends: Vec<_> = txs
        .into_iter()
        .map(|tx| {
            let src = Arc::clone(src);
            tokio::spawn(async move {
                let s = tx.wait_ready(deadline).await.map_err(|e| e.to_string())?;
                if s.phase != Phase::WaitingForInput {
                    return Err(format!("request {room}: prefill {}: {:?}", s.phase, s.reason));
                }
                let p0 = Instant::now();
                tx.send(&src).map_err(|e| e.to_string())?;
                let post = p0.elapsed();
                let s = tx.wait(deadline).await.map_err(|e| e.to_string())?;
                if s.phase != Phase::Success {
                    return Err(format!("request {room}: prefill {}: {:?}", s.phase, s.reason));
                }
                tx.release().map_err(|e| e.to_string())?;
                Ok(post)
            })
        })
        .collect();
    let mut failure = None;
    for rx in &rxs {
        match rx.wait(deadline).await {
            Ok(s) if s.phase == Phase::Success => {}
            Ok(s) => {
                failure.get_or_insert(format!("request {room}: decode {}: {:?}", s.phase, s.reason));
            }
            Err(e) => {
                failure.get_or_insert(e.to_string());
            }
        }
    }
    let latency = t0.elapsed();
    let mut post = Duration::ZERO;
    for s in sends {
        match s.await.map_err(|e| format!("request {room}: prefill task: {e}"))? {
            Ok(p) => post = post.max(p),
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    for rx in rxs {
        rx.release().map_err(|e| e.to_string())?;
    }
    match failure {
        Some(f) => Err(f),
        None => Ok((latency, post)),
    }
}

/// Plain endpoints of the same backend, one per rank, registered on the agents' pools.
struct Raw {
    prefill: Vec<Arc<dyn KvTransferBackend>>,
    peers: HashMap<(u32, u32), PeerId>,
    _regs: Vec<Registration>,
    _decode: Vec<Arc<dyn KvTransferBackend>>,
}

/// Each rank's raw endpoint runs on that rank's runtime (`rts`, as in [`start`]).
async fn raw_endpoints(a: &BenchArgs, c: &Cluster, rts: &[Handle]) -> Result<Raw, String> {
    let mut regs = Vec::new();
    let make = |rts: &[Handle], base: u64| -> Result<Vec<_>, String> {
        rts.iter()
            .zip(base..)
            .map(|(rt, identity)| {
                let _on = rt.enter();
                let config = BackendConfig { identity, options: options(a), secret: None };
                kvxfer::backends::create(&a.backend, &config).map_err(|e| e.to_string())
            })
            .collect()
    };
    let prefill = make(&rts[..c.prefill.len()], 1 << 40)?;
    let decode = make(&rts[c.prefill.len()..], 2 << 40)?;
    for (agents, bes) in [(&c.prefill, &prefill), (&c.decode, &decode)] {
        for (agent, be) in agents.iter().zip(bes.iter()) {
            for m in agent.host_memory() {
                regs.push(be.register(region_id(m.buffer), m.desc().clone()).await.map_err(|e| e.to_string())?);
            }
        }
    }
    let mut peers = HashMap::new();
    for (p, be) in prefill.iter().enumerate() {
        for (d, peer) in decode.iter().enumerate() {
            let meta = peer.metadata().map_err(|e| e.to_string())?;
            peers.insert((p as u32, d as u32), be.connect(&meta).await.map_err(|e| e.to_string())?);
        }
    }
    Ok(Raw { prefill, peers, _regs: regs, _decode: decode })
}

/// The plan's indexed ops per (prefill tp, decode tp), one per (layer, slice) as the sessions build
/// them, cut into posts as the sessions cut them (at most `per_post` writes, about a quarter of
/// the default window's bytes).
fn pair_ops(plan: &ChunkPlan, per_post: usize) -> Vec<(u32, u32, Vec<Vec<IndexedOp>>)> {
    plan.pairs
        .iter()
        .filter(|pair| pair.writes())
        .map(|pair| {
            let ops = (0..pair.layers).flat_map(|l| {
                pair.slices.iter().map(move |s| {
                    IndexedOp::new(crate::bench::write_op(&pair.page_template(l, s)), Arc::clone(&pair.runs))
                })
            });
            let max_bytes = kvxfer::session::Window::default().batch_bytes();
            (pair.src.tp, pair.dst.tp, IndexedOp::batches(ops, per_post, max_bytes))
        })
        .collect()
}

/// What the sessions hand a backend per post: [`kvxfer::session::WRITE_BATCH`] writes, fewer under
/// a lower limit.
fn per_post(raw: &Raw) -> usize {
    let limit = raw.prefill.first().map_or(u64::MAX, |be| be.capabilities().limits.max_ops_per_post);
    (kvxfer::session::WRITE_BATCH as u64).min(limit).max(1) as usize
}

async fn raw_request(raw: &Raw, ops: &[(u32, u32, Vec<Vec<IndexedOp>>)]) -> Result<Duration, String> {
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let t0 = Instant::now();
    let mut ts: Vec<Transfer> = Vec::new();
    for (p, d, batches) in ops {
        let be = &raw.prefill[*p as usize];
        let peer = raw.peers[&(*p, *d)];
        for batch in batches {
            ts.push(be.post_indexed(peer, batch, None).map_err(|e| e.to_string())?);
        }
    }
    for t in &ts {
        t.wait(deadline).await.map_err(|e| e.to_string())?;
    }
    Ok(t0.elapsed())
}

fn fill_sources(c: &Cluster, seed: u64) -> Result<(), String> {
    for (r, agent) in c.prefill.iter().enumerate() {
        for (i, m) in agent.host_memory().iter().enumerate() {
            let mut g = m.desc().write_guard(0, m.len()).map_err(|e| e.to_string())?;
            fill_pattern(g.as_mut_slice(), seed ^ ((r as u64) << 32) ^ (i as u64 + 1));
        }
    }
    Ok(())
}

fn clear_destinations(c: &Cluster) -> Result<(), String> {
    for agent in &c.decode {
        for m in agent.host_memory() {
            m.desc().write_guard(0, m.len()).map_err(|e| e.to_string())?.as_mut_slice().fill(DECODE_FILL);
        }
    }
    Ok(())
}

/// Every range the plan names: destination bytes equal source bytes.
fn verify(c: &Cluster, plan: &ChunkPlan) -> Result<bool, String> {
    let find = |agents: &[Agent], tp: u32, b: kvxfer_core::BufferRef| {
        agents[tp as usize].host_memory().iter().find(|m| m.buffer == b).map(|m| m.desc().clone())
    };
    for pair in &plan.pairs {
        for op in pair.ops() {
            let (Some(s), Some(d)) =
                (find(&c.prefill, pair.src.tp, op.src_region), find(&c.decode, pair.dst.tp, op.dst_region))
            else {
                return Err(format!("no pool buffer for {:?} / {:?}", op.src_region, op.dst_region));
            };
            let sg = s.read_guard(0, s.len() as u64).map_err(|e| e.to_string())?;
            let dg = d.read_guard(0, d.len() as u64).map_err(|e| e.to_string())?;
            let (sb, db) = (sg.as_slice(), dg.as_slice());
            for i in 0..op.count {
                let (so, do_) =
                    ((op.src_offset + i * op.src_stride) as usize, (op.dst_offset + i * op.dst_stride) as usize);
                if sb[so..so + op.len as usize] != db[do_..do_ + op.len as usize] {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}

/// `--inject-wrong-byte`: the first byte of the plan's first write, flipped on its decode rank.
fn flip_first_landed_byte(c: &Cluster, plan: &ChunkPlan) -> Result<(), String> {
    let (pair, op) =
        plan.pairs.iter().find_map(|p| p.ops().next().map(|op| (p, op))).ok_or("the plan writes nothing")?;
    let m = c.decode[pair.dst.tp as usize]
        .host_memory()
        .iter()
        .find(|m| m.buffer == op.dst_region)
        .ok_or("no pool buffer for the first write")?;
    let mut g = m.desc().write_guard(op.dst_offset, 1).map_err(|e| e.to_string())?;
    g.as_mut_slice()[0] ^= 0x5a;
    Ok(())
}

/// memcpy of every range `plan` names, from the prefill pools into the decode pools, in this
/// thread: the request's bytes in its memory pattern without a transport. The guards (one per
/// pool buffer) are taken before the clock starts.
fn memcpy_request(c: &Cluster, plan: &ChunkPlan) -> Result<Duration, String> {
    let desc = |agents: &[Agent], tp: u32, b: kvxfer_core::BufferRef| {
        agents[tp as usize]
            .host_memory()
            .iter()
            .find(|m| m.buffer == b)
            .map(|m| m.desc().clone())
            .ok_or_else(|| format!("no pool buffer for {b:?} on rank {tp}"))
    };
    // One guard per buffer, found by index; the timed loop looks a buffer up only when the op's
    // buffer differs from the previous op's (consecutive ops share a layer's buffers), so the copy
    // is timed without a map lookup per op.
    let (mut srcs, mut dsts) = (Vec::new(), Vec::new());
    let (mut src_at, mut dst_at) = (HashMap::new(), HashMap::new());
    for pair in plan.pairs.iter().filter(|p| p.writes()) {
        for op in pair.ops() {
            if let std::collections::hash_map::Entry::Vacant(e) = src_at.entry((pair.src.tp, op.src_region)) {
                let d = desc(&c.prefill, pair.src.tp, op.src_region)?;
                srcs.push(d.read_guard(0, d.len() as u64).map_err(|e| e.to_string())?);
                e.insert(srcs.len() - 1);
            }
            if let std::collections::hash_map::Entry::Vacant(e) = dst_at.entry((pair.dst.tp, op.dst_region)) {
                let d = desc(&c.decode, pair.dst.tp, op.dst_region)?;
                dsts.push(d.write_guard(0, d.len() as u64).map_err(|e| e.to_string())?);
                e.insert(dsts.len() - 1);
            }
        }
    }
    let t0 = Instant::now();
    for pair in plan.pairs.iter().filter(|p| p.writes()) {
        let (mut src_key, mut dst_key) = (None, None);
        let (mut si, mut di) = (0, 0);
        for op in pair.ops() {
            if src_key != Some(op.src_region) {
                si = src_at[&(pair.src.tp, op.src_region)];
                src_key = Some(op.src_region);
            }
            if dst_key != Some(op.dst_region) {
                di = dst_at[&(pair.dst.tp, op.dst_region)];
                dst_key = Some(op.dst_region);
            }
            let (sb, db) = (srcs[si].as_slice(), dsts[di].as_mut_slice());
            for (so, d, len) in crate::bench::write_op(&op).ranges() {
                let (so, d, len) = (so as usize, d as usize, len as usize);
                db[d..d + len].copy_from_slice(&sb[so..so + len]);
            }
        }
    }
    Ok(t0.elapsed())
}

struct Measured {
    engine: Vec<Duration>,
    post: Vec<Duration>,
    raw: Vec<Duration>,
    memcpy: Vec<Duration>,
    verified: bool,
    /// Indexed ops handed to the backend per pair (the most of any pair).
    ops_per_pair: u64,
}

async fn measure_case(
    a: &BenchArgs,
    c: &mut Cluster,
    raw: &Raw,
    topo: &Topology,
    src: &[u32],
    dst: &[u32],
) -> Result<(Measured, ChunkPlan), String> {
    let plan = plan_chunk(topo, src, dst).map_err(|e| e.to_string())?;
    let ops = pair_ops(&plan, per_post(raw));
    let src: Arc<[u32]> = src.into();
    let ops_per_pair = ops.iter().map(|(_, _, b)| b.iter().map(Vec::len).sum::<usize>() as u64).max().unwrap_or(0);
    let mut m = Measured {
        engine: Vec::new(),
        post: Vec::new(),
        raw: Vec::new(),
        memcpy: Vec::new(),
        verified: true,
        ops_per_pair,
    };
    // Verification runs into cleared pools first (they double as warm-ups), then the timed runs.
    clear_destinations(c)?;
    engine_request(c, &src, dst).await?;
    if a.inject_wrong_byte {
        flip_first_landed_byte(c, &plan)?;
    }
    m.verified &= verify(c, &plan)?;
    clear_destinations(c)?;
    raw_request(raw, &ops).await?;
    m.verified &= verify(c, &plan)?;
    clear_destinations(c)?;
    memcpy_request(c, &plan)?;
    m.verified &= verify(c, &plan)?;
    for _ in 0..a.runs {
        let (l, p) = engine_request(c, &src, dst).await?;
        m.engine.push(l);
        m.post.push(p);
        m.raw.push(raw_request(raw, &ops).await?);
        m.memcpy.push(memcpy_request(c, &plan)?);
    }
    Ok((m, plan))
}

async fn register_figure(a: &BenchArgs) -> Result<RegisterFigure, String> {
    let config = BackendConfig { identity: 3 << 40, options: options(a), secret: None };
    let be = kvxfer::backends::create(&a.backend, &config).map_err(|e| e.to_string())?;
    let len = usize::try_from(a.register_size).map_err(|_| "--register-size too large".to_owned())?;
    let mut host = HostBuffer::zeroed(len);
    // Touched, as an engine's pool is once allocated (the registration must not be the first touch).
    host.as_mut_slice().map_err(|e| e.to_string())?.fill(1);
    let t = Instant::now();
    let reg = be.register(RegionId(0), host.desc()).await.map_err(|e| format!("registering {len} bytes: {e}"))?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    drop(reg);
    Ok(RegisterFigure { bytes: a.register_size, ms, ms_per_gib: ms / (a.register_size as f64 / (1u64 << 30) as f64) })
}

fn bench(a: &BenchArgs) -> Result<EngineReport, String> {
    if a.runs == 0 || a.small_requests == 0 {
        return Err("--runs and --small-requests must be at least 1".into());
    }
    if a.register_size == 0 {
        return Err("--register-size must be at least 1 byte".into());
    }
    kvxfer_core::backend::lookup(&a.backend).map_err(|e| e.to_string())?;
    let preset = a.model.unwrap_or(Preset::Llama3_8b);
    let w = crate::bench::model_shape(a, preset, REQUEST_DEADLINE.as_secs_f64());
    let topo = w.topology()?;
    let n = w.pages_per_request();
    let pool = w.pool_pages();
    let build = |threads: usize, name: String| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(name)
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start a runtime: {e}"))
    };
    // The driver (this bench, the bootstrap service), then one runtime per rank. Dropped after
    // the driver's `block_on` returned (a runtime cannot be dropped inside another).
    let rt = build(2, "kvxfer-bench".into())?;
    let ranks: Vec<tokio::runtime::Runtime> = (0..a.prefill_tp)
        .map(|tp| build(2, format!("kvxfer-prefill{tp}")))
        .chain((0..a.decode_tp).map(|tp| build(2, format!("kvxfer-decode{tp}"))))
        .collect::<Result<_, _>>()?;
    let rts: Vec<Handle> = ranks.iter().map(|r| r.handle().clone()).collect();
    rt.block_on(async {
        let t0 = Instant::now();
        let mut c = start(a, topo, pool, &rts).await?;
        let start_ms = t0.elapsed().as_secs_f64() * 1e3;
        fill_sources(&c, a.seed)?;
        let raw = raw_endpoints(a, &c, &rts).await?;

        // The first request after every agent connected, then the small ones.
        let one: Arc<[u32]> = vec![0u32].into();
        let (first, _) = engine_request(&mut c, &one, &[0]).await?;
        let (mut lat, mut post) = (Vec::new(), Vec::new());
        for _ in 0..a.small_requests {
            let (l, p) = engine_request(&mut c, &one, &[0]).await?;
            lat.push(l);
            post.push(p);
        }
        let small_plan = plan_chunk(&topo, &[0], &[0]).map_err(|e| e.to_string())?;
        let small_bytes: u64 = small_plan.pairs.iter().map(|p| p.bytes()).sum();
        let small_ops = pair_ops(&small_plan, per_post(&raw));
        raw_request(&raw, &small_ops).await?;
        let mut small_raw = Vec::new();
        for _ in 0..a.small_requests {
            small_raw.push(raw_request(&raw, &small_ops).await?);
        }
        let small_raw = Percentiles::of(&small_raw);

        let contiguous: Vec<u32> = (0..n).collect();
        let mut cases = vec![("contiguous", measure_case(a, &mut c, &raw, &topo, &contiguous, &contiguous).await?)];
        if a.fragmented {
            let (src, dst) =
                (request_pages(&w, 0, crate::worker::SALT_PREFILL), request_pages(&w, 0, crate::worker::SALT_DECODE));
            cases.push(("fragmented", measure_case(a, &mut c, &raw, &topo, &src, &dst).await?));
        }
        let register = register_figure(a).await?;
        drop(raw);
        let shutdown = Instant::now() + Duration::from_secs(20);
        for agent in c.prefill.drain(..).chain(c.decode.drain(..)) {
            agent.shutdown(shutdown).await.map_err(|e| e.to_string())?;
        }

        let small_lat = Percentiles::of(&lat);
        let contiguous_raw = {
            let (m, plan) = &cases[0].1;
            PathTiming::of(plan.pairs.iter().map(|p| p.bytes()).sum(), &m.raw, None)
        };
        let overhead_us = small_lat.p50_us - small_bytes as f64 / (contiguous_raw.median_gbps * 1e9) * 1e6;
        let first_us = first.as_secs_f64() * 1e6;
        let small = SmallRequests {
            bytes: small_bytes,
            requests: a.small_requests,
            latency: small_lat,
            post: Percentiles::of(&post),
            first_us,
            first_vs_steady: first_us / small_lat.p50_us,
            overhead_us,
            raw_latency: small_raw,
            engine_added_us: small_lat.p50_us - small_raw.p50_us,
        };
        // (name, bytes, plan, engine, raw, verified, ops per pair, memcpy) per case.
        let timed: Vec<_> = cases
            .iter()
            .map(|(name, (m, plan))| {
                let bytes: u64 = plan.pairs.iter().map(|p| p.bytes()).sum();
                let engine = PathTiming::of(bytes, &m.engine, Some(&m.post));
                let memcpy = PathTiming::of(bytes, &m.memcpy, None);
                (*name, bytes, plan, engine, PathTiming::of(bytes, &m.raw, None), m.verified, m.ops_per_pair, memcpy)
            })
            .collect();
        let (frag_raw, frag_engine, frag_memcpy) = match timed.as_slice() {
            [c, f] => (
                Some(f.4.median_gbps / c.4.median_gbps),
                Some(f.3.median_gbps / c.3.median_gbps),
                Some(f.7.median_gbps / c.7.median_gbps),
            ),
            _ => (None, None, None),
        };
        let layout = w.layout_name();
        let cases = timed
            .into_iter()
            .map(|(name, bytes, plan, engine, raw, verified, ops_per_pair, memcpy)| EngineCase {
                name: format!(
                    "{name}: {} {layout} P{}->D{} {} tokens",
                    preset.name(),
                    a.prefill_tp,
                    a.decode_tp,
                    a.tokens
                ),
                bytes,
                pages: n,
                pairs: plan.pairs.iter().filter(|p| p.writes()).count(),
                ops_per_pair,
                writes_per_pair: plan.pairs.iter().map(|p| p.op_count()).max().unwrap_or(0),
                bytes_per_write: bytes / plan.op_count().max(1),
                runs: a.runs,
                engine_vs_raw: engine.median_gbps / raw.median_gbps,
                raw_vs_memcpy: raw.median_gbps / memcpy.median_gbps,
                engine,
                raw,
                memcpy,
                memcpy_fragmented_vs_contiguous: frag_memcpy,
                fragmented_vs_contiguous: frag_raw,
                engine_fragmented_vs_contiguous: frag_engine,
                small_request_overhead_us: small.overhead_us,
                register_ms_per_gib: register.ms_per_gib,
                first_vs_steady: small.first_vs_steady,
                verified,
            })
            .collect();
        Ok(EngineReport { backend: a.backend.clone(), through: "engine", start_ms, small, register, cases })
    })
}

fn print_table(r: &EngineReport) {
    println!(
        "kvxfer bench --through engine, backend {}: agents started and connected in {:.0} ms",
        r.backend, r.start_ms
    );
    println!(
        "{:<34} {:>9} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10}",
        "case / path", "block", "batch", "B/W GB/s", "avg lat us", "p99 lat us", "avg post", "p99 post"
    );
    let s = &r.small;
    println!(
        "{:<34} {:>9} {:>8} {:>9.3} {:>10.0} {:>10.0} {:>10.1} {:>10.1}",
        "one page / engine",
        crate::bench::human(s.bytes),
        1,
        s.bytes as f64 / (s.latency.p50_us / 1e6) / 1e9,
        s.latency.avg_us,
        s.latency.p99_us,
        s.post.avg_us,
        s.post.p99_us
    );
    for c in &r.cases {
        let label = c.name.split(':').next().unwrap_or("");
        for (path, t) in [("engine", &c.engine), ("raw", &c.raw), ("memcpy", &c.memcpy)] {
            let (ap, pp) = t
                .post
                .map_or(("-".to_owned(), "-".to_owned()), |p| (format!("{:.1}", p.avg_us), format!("{:.1}", p.p99_us)));
            println!(
                "{:<34} {:>9} {:>8} {:>9.3} {:>10.0} {:>10.0} {:>10} {:>10}",
                format!("{label} / {path}"),
                crate::bench::human(c.bytes_per_write),
                c.ops_per_pair,
                t.median_gbps,
                t.latency.avg_us,
                t.latency.p99_us,
                ap,
                pp
            );
        }
    }
    if let Some(c) = r.cases.first() {
        println!("{}", c.name.split_once(": ").map_or("", |x| x.1));
    }
    for c in &r.cases {
        println!(
            "  {}: {} in {} pairs, {} ops per pair ({} page-run writes); engine / raw = {:.2}; raw / memcpy = {:.2}; verified: {}",
            c.name.split(':').next().unwrap_or(""),
            crate::bench::human(c.bytes),
            c.pairs,
            c.ops_per_pair,
            c.writes_per_pair,
            c.engine_vs_raw,
            c.raw_vs_memcpy,
            if c.verified { "every byte" } else { "FAILED" }
        );
    }
    if let Some(c) = r.cases.first() {
        if let (Some(raw), Some(engine), Some(memcpy)) =
            (c.fragmented_vs_contiguous, c.engine_fragmented_vs_contiguous, c.memcpy_fragmented_vs_contiguous)
        {
            println!("  fragmented / contiguous: raw {raw:.2}, engine {engine:.2}, memcpy {memcpy:.2}");
        }
    }
    println!(
        "  one-page request ({}): p50 {:.0} us, p99 {:.0} us; raw p50 {:.0} us; engine adds {:.0} us; fixed overhead {:.0} us; first request {:.0} us ({:.2}x the median)",
        crate::bench::human(s.bytes),
        s.latency.p50_us,
        s.latency.p99_us,
        s.raw_latency.p50_us,
        s.engine_added_us,
        s.overhead_us,
        s.first_us,
        s.first_vs_steady
    );
    println!(
        "  register {} in one call: {:.2} ms ({:.2} ms per GiB)",
        crate::bench::human(r.register.bytes),
        r.register.ms,
        r.register.ms_per_gib
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_known_samples() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let p = Percentiles::of(&s);
        assert_eq!(p.p50_us.round(), 51.0);
        assert_eq!(p.p99_us.round(), 99.0);
        assert!((p.avg_us - 50.5).abs() < 1e-6);
        let one = Percentiles::of(&[Duration::from_micros(7)]);
        assert_eq!((one.p50_us.round(), one.p99_us.round()), (7.0, 7.0));
        let ten: Vec<Duration> = (1..=10).map(Duration::from_micros).collect();
        assert_eq!(Percentiles::of(&ten).p99_us.round(), 10.0, "under 100 samples p99 is the largest");
    }
}

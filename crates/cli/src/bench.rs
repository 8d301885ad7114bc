//! `kvxfer bench`: bandwidth of a backend between two processes, next to the machine's own limits
//! measured in the same run (memcpy of the same ops, and a plain socket copy of the same bytes over
//! loopback).
//!
//! The bench process is the sender; it starts a peer process (`kvxfer bench-peer`, the receiver)
//! and drives it over the peer's stdin/stdout with JSON lines. Workloads:
//! - raw: `--block SIZE --total SIZE [--shuffle]`: TOTAL/BLOCK ops posted at once (split only where
//!   the backend's ops-per-post limit says), destination blocks in a seeded permutation with
//!   `--shuffle`;
//! - model-shaped: `--model PRESET` (+ TP sizes, layout, tokens): prefill rank 0/0's share of one
//!   request with shuffled pages, into every decode rank it feeds (one peer endpoint each). It is
//!   measured twice: raw (the planner's ops posted at once per decode rank) and through the
//!   sessions (`SenderSession::send_chunk`: planner, batching in a window, the attached
//!   notification, and the decode side's tracker, which must report the request complete), with
//!   `session_vs_raw` the ratio of the two medians.
//!
//! Each case: a warm-up, then `--runs` timed runs of each of backend, memcpy (the same ops,
//! locally) and plain socket (the same byte count, one busy-polling stream with 1 MiB writes);
//! median and best. After the timed runs every byte of the peer's regions is compared (64-bit hash
//! of each region) with the memcpy result, which applied the same ops to the same source.
//!
//! `--plot FILE.svg` (raw workloads) also writes the medians as an SVG chart: GB/s against block
//! size (log scale), one series per measured thing ([`plot_svg`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::session::{region_id, Chunk, ExpectOptions, KvPool, PoolBuffer, ReceiverSession, SenderSession};
use kvxfer_core::plan::plan_sender;
use kvxfer_core::{
    BackendConfig, EndpointMetadata, HostBuffer, KvTransferBackend, MemDesc, NotifyStyle, PeerId, RankId, RegionId,
    Registration, RequestId, SenderKey, Side, Topology, Transfer, WriteOp,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::model::{parse_kv, Preset, SplitMix};
use crate::plan::{Format, LayoutArg};

/// Parses `4096`, `4K`, `4KiB`, `1M`, `256MiB`, `1G` (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("`{s}` is not a size like 4K, 1MiB or 4096"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        u => return Err(format!("unknown size unit `{u}` in `{s}` (use K, M or G)")),
    };
    n.checked_mul(mult).filter(|v| *v > 0).ok_or_else(|| format!("size `{s}` is 0 or too large"))
}

/// Arguments of `kvxfer bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Backend by registry name.
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Backend option `key=value` (repeatable), e.g. `connections=4`.
    #[arg(long = "backend-opt", value_parser = parse_kv)]
    pub backend_opts: Vec<(String, String)>,
    /// Raw workload block sizes, comma-separated (each is one case), e.g. `4K,64K,1M`.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "1M")]
    pub block: Vec<u64>,
    /// Raw workload bytes per request.
    #[arg(long, value_parser = parse_size, default_value = "256M")]
    pub total: u64,
    /// Destination blocks in a seeded random permutation of the source blocks.
    #[arg(long)]
    pub shuffle: bool,
    /// Model-shaped workload instead of the raw one.
    #[arg(long, value_enum)]
    pub model: Option<Preset>,
    /// Model-shaped: prefill TP.
    #[arg(long, default_value_t = 8)]
    pub prefill_tp: u32,
    /// Model-shaped: decode TP.
    #[arg(long, default_value_t = 2)]
    pub decode_tp: u32,
    /// Model-shaped: layout.
    #[arg(long, value_enum, default_value = "nhd")]
    pub layout: LayoutArg,
    /// Model-shaped: tokens of the request.
    #[arg(long, default_value_t = 8192)]
    pub tokens: u32,
    /// Model-shaped: tokens per page.
    #[arg(long, default_value_t = 16)]
    pub page_size: u32,
    /// Model-shaped: override the preset's layer count.
    #[arg(long)]
    pub layers: Option<u32>,
    /// Timed runs per measurement (after one warm-up run).
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// Seed of the permutations.
    #[arg(long, default_value_t = 11)]
    pub seed: u64,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    pub format: Format,
    /// Also write an SVG chart of the medians to FILE: GB/s against block size (log scale), one
    /// series per measured thing (the backend, memcpy, the plain socket, the library's own tool).
    /// Raw workloads only (a --model run has no block size).
    #[arg(long, value_name = "FILE.svg", conflicts_with = "model")]
    pub plot: Option<PathBuf>,
    /// What carries the bytes: `raw` (backend posts between two processes, the default) or
    /// `engine`: requests through the engine API (`Agent`s of every rank of the `--prefill-tp` x
    /// `--decode-tp` cluster in this process; `--model`, default llama3-8b), reported beside the
    /// same bytes moved raw in the same run, with latency percentiles, a one-page request's fixed
    /// overhead, first-request vs steady latency and registration time per GiB.
    #[arg(long, value_enum, default_value = "raw", conflicts_with = "plot")]
    pub through: Through,
    /// With `--through engine`: also the request on a fragmented pool (source and destination
    /// pages shuffled), beside the contiguous one.
    #[arg(long)]
    pub fragmented: bool,
    /// With `--through engine`: one-page requests timed for the latency percentiles.
    #[arg(long, default_value_t = 200)]
    pub small_requests: u32,
    /// With `--through engine`: host memory registered in one call for the registration figure.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    pub register_size: u64,
    /// With `--through engine`: prefill agents do not warm new connections
    /// (`AgentConfig::warm_up` off), to show what the first request costs without it.
    #[arg(long)]
    pub no_warm_up: bool,
    /// Test-only, with `--through engine`: flip one landed byte before the engine path's
    /// verification, so it fails and the bench exits non-zero.
    #[arg(long, hide = true)]
    pub inject_wrong_byte: bool,
}

/// What carries the bytes in `kvxfer bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Through {
    /// Backend posts (and the sessions, for model-shaped cases) between two processes.
    Raw,
    /// Requests through the engine API (`kvxfer::engine::Agent`), in one process.
    Engine,
}

/// Arguments of the hidden `kvxfer bench-peer` (the receiving process).
#[derive(Debug, Clone, clap::Args)]
pub struct PeerArgs {
    /// Backend by registry name.
    #[arg(long)]
    pub backend: String,
    /// Backend options.
    #[arg(long = "backend-opt", value_parser = parse_kv)]
    pub backend_opts: Vec<(String, String)>,
}

/// Median and best of timed runs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Rate {
    /// Median GB/s (1e9 bytes per second).
    pub median_gbps: f64,
    /// Best GB/s.
    pub best_gbps: f64,
}

fn rate(bytes: u64, secs: &mut [f64]) -> Rate {
    secs.sort_by(f64::total_cmp);
    let med = secs[secs.len() / 2];
    let best = secs[0];
    Rate { median_gbps: bytes as f64 / med / 1e9, best_gbps: bytes as f64 / best / 1e9 }
}

/// One case's result.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    /// What ran.
    pub name: String,
    /// The raw workload's block size (`None`: model-shaped); for `--plot`, not in the JSON.
    #[serde(skip)]
    pub block: Option<u64>,
    /// Bytes per request.
    pub bytes: u64,
    /// Ops per request (one `write`).
    pub ops: u64,
    /// Timed runs.
    pub runs: u32,
    /// The backend, raw: every op posted at once.
    pub backend: Rate,
    /// The backend through the sessions (model-shaped cases): one `send_chunk` of the whole
    /// request, until the decode side's tracker reports it complete.
    pub session: Option<Rate>,
    /// session median / raw median.
    pub session_vs_raw: Option<f64>,
    /// memcpy of the same ops in one process.
    pub memcpy: Rate,
    /// Plain socket copy of the same byte count over loopback, between the same two processes: one
    /// stream, 1 MiB writes and reads, both ends busy-polling (a tuned single socket).
    pub socket: Rate,
    /// backend median / socket median.
    pub ratio_vs_socket: f64,
    /// backend median / memcpy median.
    pub ratio_vs_memcpy: f64,
    /// Every byte of the peer's regions equals the memcpy result (after the raw runs, and after the
    /// session runs).
    pub verified: bool,
    /// Core-to-core round trip of a cache line ([`core_round_trip_ns`]) just before the case's
    /// backend runs and just after its socket runs, in ns; `None` where it could not be measured.
    /// Around 50-90 ns on the development VM when its two vCPUs sit close, 330-410 ns when the
    /// host placed them apart: two-process rates measured then are 2-3x lower.
    pub core_rtt_ns: (Option<f64>, Option<f64>),
    /// The C library's own measurement at the same message size and transport, in the same run
    /// (ucx: `ucx_perftest -t ucp_put_bw`; fabric: a plain `fi_write` loop); raw cases only.
    pub native: Option<NativeBaseline>,
}

/// A baseline measured with the transport library itself, without kvxfer.
#[derive(Debug, Clone, Serialize)]
pub struct NativeBaseline {
    /// What ran.
    pub tool: String,
    /// Median GB/s (1e9 bytes per second) over `--runs` runs of the tool (each run its own figure,
    /// as the tool reports it), like the backend's median.
    pub median_gbps: Option<f64>,
    /// Best GB/s of those runs.
    pub best_gbps: Option<f64>,
    /// Why it could not run.
    pub error: Option<String>,
    /// Backend median / baseline.
    pub ratio: Option<f64>,
}

/// Runs the native baseline of `args.backend` (if it has one) at message size `block`, `args.runs`
/// times; returns what ran and the GB/s of each run.
#[allow(unused_variables)] // without the ucx and fabric features nothing uses the arguments
fn native_baseline(args: &BenchArgs, block: u64, total: u64) -> Option<(String, Result<Vec<f64>, String>)> {
    let opt = |k: &str| args.backend_opts.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.clone());
    let iters = (total / block.max(1)).clamp(16, 4096) as usize;
    match args.backend.as_str() {
        #[cfg(feature = "ucx")]
        "ucx" => {
            let tls = opt("tls").or_else(|| std::env::var("KVXFER_UCX_TLS").ok()).unwrap_or_else(|| "tcp".into());
            let r = (0..args.runs.max(1))
                .map(|_| {
                    crate::perftest::run(&tls, block as usize, iters, Duration::from_secs(120))
                        .map(|bytes_per_sec| bytes_per_sec / 1e9)
                        .map_err(|e| e.to_string())
                })
                .collect();
            Some((format!("ucx_perftest -t ucp_put_bw, UCX_TLS={tls}"), r))
        }
        #[cfg(feature = "fabric")]
        "fabric" => {
            let prov = opt("provider").or_else(|| std::env::var("FI_PROVIDER").ok()).unwrap_or_else(|| "tcp".into());
            // The backend's window: 16 MiB of writes in flight (at least 2 writes).
            let window = (kvxfer::backends::fabric::MAX_IN_FLIGHT / block.max(1)).max(2) as usize;
            let r = fabric_two_process(&prov, block, total, iters, window, args.runs.max(1));
            Some((format!("fi_write loop, two processes, provider {prov}, {window} in flight"), r))
        }
        _ => None,
    }
}

/// The two-process `fi_write` baseline: a `fabric-baseline-target` process registers `total` bytes
/// and publishes its address and key on stdout; this process writes `block`-sized writes into it,
/// `runs` timed loops (each from a fresh endpoint, with its own warm-up). Returns each loop's GB/s.
#[cfg(feature = "fabric")]
fn fabric_two_process(
    prov: &str,
    block: u64,
    total: u64,
    iters: usize,
    window: usize,
    runs: u32,
) -> Result<Vec<f64>, String> {
    use kvxfer_fabric::baseline;
    let addr = (prov == "tcp").then_some("127.0.0.1");
    let exe = std::env::current_exe().map_err(|e| format!("cannot find my own executable: {e}"))?;
    let mut child = Command::new(exe)
        .args(["fabric-baseline-target", "--provider", prov, "--len", &total.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start the baseline target process: {e}"))?;
    let mut stdin = child.stdin.take().expect("piped");
    let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
    let result = (|| {
        let mut line = String::new();
        stdout.read_line(&mut line).map_err(|e| format!("baseline target: {e}"))?;
        let target = baseline::TargetInfo::parse(line.trim()).map_err(|e| e.to_string())?;
        let mut gbps = Vec::new();
        for _ in 0..runs {
            let m =
                baseline::write_to_target(prov, addr, &target, block as usize, iters, window, Duration::from_secs(120))
                    .map_err(|e| e.to_string())?;
            gbps.push(m.bytes_per_sec() / 1e9);
        }
        writeln!(stdin, "done").map_err(|e| format!("baseline target: {e}"))?;
        let mut verdict = String::new();
        stdout.read_line(&mut verdict).map_err(|e| format!("baseline target: {e}"))?;
        match verdict.trim() {
            "ok" => Ok(gbps),
            v => Err(format!("baseline target: {v}")),
        }
    })();
    drop(stdin);
    // The target exits after its verdict (or when its stdin closes); bounded wait, then kill.
    let end = Instant::now() + Duration::from_secs(10);
    while child.try_wait().ok().flatten().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    if child.try_wait().ok().flatten().is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    result
}

/// Arguments of the two-process fabric baseline's target (started by `bench`).
#[cfg(feature = "fabric")]
#[derive(Debug, clap::Args)]
pub struct FabricTargetArgs {
    /// Provider (`tcp` means `tcp;ofi_rxm`).
    #[arg(long)]
    pub provider: String,
    /// Bytes to register.
    #[arg(long)]
    pub len: u64,
    /// Longest run, seconds.
    #[arg(long, default_value_t = 300)]
    pub limit_s: u64,
}

/// The target process of the two-process fabric baseline: prints its line, serves until `done` (or
/// the end of stdin), then prints `ok` or what went wrong.
#[cfg(feature = "fabric")]
pub fn fabric_target(args: &FabricTargetArgs) -> ExitCode {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
        s2.store(true, Ordering::Release);
    });
    let addr = (args.provider == "tcp").then_some("127.0.0.1");
    let mut out = std::io::stdout();
    let r = kvxfer_fabric::baseline::serve_target(
        &args.provider,
        addr,
        args.len as usize,
        &mut out,
        &stop,
        Duration::from_secs(args.limit_s),
    );
    let verdict = match r {
        Ok(true) => "ok".to_owned(),
        Ok(false) => "the destination does not hold the written bytes".to_owned(),
        Err(e) => e.to_string(),
    };
    println!("{verdict}");
    if verdict == "ok" {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// One decode endpoint's share of a workload.
struct PairWork {
    /// The decode rank (model-shaped) it stands for.
    rank: RankId,
    ops: Vec<WriteOp>,
}

struct Workload {
    name: String,
    /// Bytes per op of a raw workload (None for model-shaped ones).
    block: Option<u64>,
    src: Vec<(RegionId, u64)>,
    dst: Vec<(RegionId, u64)>,
    pairs: Vec<PairWork>,
    /// Model-shaped: the topology and the request's pages, for the session runs.
    model: Option<(Topology, Vec<u32>, Vec<u32>, u32)>,
}

impl Workload {
    fn ops(&self) -> usize {
        self.pairs.iter().map(|p| p.ops.len()).sum()
    }
    fn bytes(&self) -> u64 {
        self.pairs.iter().flat_map(|p| &p.ops).map(WriteOp::bytes).sum()
    }
}

fn raw_workload(block: u64, total: u64, shuffle: bool, seed: u64) -> Result<Workload, String> {
    if total % block != 0 {
        return Err(format!("--total {total} is not a multiple of --block {block}"));
    }
    let n = total / block;
    let mut perm: Vec<u64> = (0..n).collect();
    if shuffle {
        SplitMix(seed).shuffle(&mut perm);
    }
    let ops = (0..n)
        .map(|i| WriteOp::contiguous(RegionId(0), i * block, RegionId(0), perm[i as usize] * block, block))
        .collect();
    Ok(Workload {
        name: format!("block {}{}", human(block), if shuffle { " shuffled" } else { "" }),
        block: Some(block),
        src: vec![(RegionId(0), total)],
        dst: vec![(RegionId(0), total)],
        pairs: vec![PairWork { rank: RankId::new(0, 0), ops }],
        model: None,
    })
}

/// The model-shaped workload of `a` (one request, one slot), with requests timing out after
/// `timeout_s`.
pub(crate) fn model_shape(a: &BenchArgs, preset: Preset, timeout_s: f64) -> crate::model::Workload {
    crate::model::Workload {
        model: preset,
        layers: a.layers,
        prefill_tp: a.prefill_tp,
        decode_tp: a.decode_tp,
        prefill_pp: 1,
        decode_pp: 1,
        stage_layers: Default::default(),
        layout: a.layout,
        page_size: a.page_size,
        dtype_bytes: 2,
        tokens: a.tokens,
        requests: 1,
        chunk_pages: 0,
        inflight: 1,
        backend: a.backend.clone(),
        backend_opts: a.backend_opts.clone(),
        notify: crate::model::NotifyArg::Attached,
        seed: a.seed,
        request_timeout_s: timeout_s,
    }
}

/// The backend op of a planned op (regions named by [`region_id`]).
pub(crate) fn write_op(op: &kvxfer_core::PlannedOp) -> WriteOp {
    WriteOp {
        src: region_id(op.src_region),
        src_offset: op.src_offset,
        dst: region_id(op.dst_region),
        dst_offset: op.dst_offset,
        len: op.len,
        count: op.count,
        src_stride: op.src_stride,
        dst_stride: op.dst_stride,
    }
}

fn model_workload(a: &BenchArgs, preset: Preset) -> Result<Workload, String> {
    let w = model_shape(a, preset, 60.0);
    let topo = w.topology()?;
    let pages = w.pool_pages();
    let src_pages = crate::model::request_pages(&w, 0, 1);
    let dst_pages = crate::model::request_pages(&w, 0, 2);
    let me = RankId::new(0, 0);
    let plan = plan_sender(&topo, me, &src_pages, &dst_pages).map_err(|e| e.to_string())?;
    if plan.is_empty() {
        return Err("prefill rank 0 has no receiver".into());
    }
    let regions = |side: Side| -> Vec<(RegionId, u64)> {
        (0..topo.stage_layers(side, me.pp))
            .flat_map(|layer| {
                topo.kv().kinds().iter().map(move |&kind| {
                    (region_id(kvxfer_core::BufferRef { layer, kind }), topo.buffer_bytes(side, kind, pages))
                })
            })
            .collect()
    };
    let pairs = plan
        .iter()
        .map(|pair| PairWork { rank: pair.dst, ops: pair.ops().map(|op| write_op(&op)).collect() })
        .collect::<Vec<_>>();
    let ranks: Vec<String> = plan.iter().map(|p| p.dst.to_string()).collect();
    Ok(Workload {
        block: None,
        name: format!(
            "{} {} P{}->D{} {} tokens: prefill 0/0 -> decode {}",
            preset.name(),
            w.layout_name(),
            a.prefill_tp,
            a.decode_tp,
            a.tokens,
            ranks.join(",")
        ),
        src: regions(Side::Prefill),
        dst: regions(Side::Decode),
        pairs,
        model: Some((topo, src_pages, dst_pages, pages)),
    })
}

impl crate::model::Workload {
    pub(crate) fn layout_name(&self) -> &'static str {
        match self.layout {
            LayoutArg::Nhd => "nhd",
            LayoutArg::Hnd => "hnd",
        }
    }
}

pub(crate) fn human(b: u64) -> String {
    if b % (1 << 30) == 0 {
        format!("{} GiB", b >> 30)
    } else if b % (1 << 20) == 0 {
        format!("{} MiB", b >> 20)
    } else if b % (1 << 10) == 0 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

/// A 64-bit hash of a buffer (word-wise multiply-xorshift; every byte contributes).
fn hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0x243F_6A88_85A3_08D3 ^ bytes.len() as u64;
    for c in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^= h >> 29;
    }
    h
}

/// A hash of registered memory no transfer is writing.
fn hash_desc(d: &MemDesc) -> Result<u64, String> {
    let g = d.read_guard(0, d.len() as u64).map_err(|e| format!("reading a region to hash it: {e}"))?;
    Ok(hash(g.as_slice()))
}

pub(crate) fn fill_pattern(bytes: &mut [u8], seed: u64) {
    let mut g = SplitMix(seed);
    for c in bytes.chunks_mut(8) {
        let w = g.next_u64().to_le_bytes();
        c.copy_from_slice(&w[..c.len()]);
    }
}

/// A registered buffer: the registration, and a descriptor to read it when nothing writes it.
struct Region {
    id: RegionId,
    view: MemDesc,
    _reg: Registration,
    _host: HostBuffer,
}

async fn register_regions(
    backend: &dyn KvTransferBackend,
    regions: &[(RegionId, u64)],
    fill: impl Fn(usize, &mut [u8]),
) -> Result<Vec<Region>, String> {
    let mut out = Vec::new();
    for (i, (id, len)) in regions.iter().enumerate() {
        let mut host = HostBuffer::zeroed(*len as usize);
        fill(i, host.as_mut_slice().map_err(|e| e.to_string())?);
        let view = host.desc();
        let reg = backend.register(*id, view.clone()).await.map_err(|e| format!("registering {id}: {e}"))?;
        out.push(Region { id: *id, view, _reg: reg, _host: host });
    }
    Ok(out)
}

/// Posts every op of every pair at once (split only at the backend's ops-per-post limit) and waits.
async fn post_and_wait(
    backend: &dyn KvTransferBackend,
    pairs: &[(PeerId, &[WriteOp])],
    deadline: Instant,
) -> Result<(), String> {
    let per = backend.capabilities().limits.max_ops_per_post.clamp(1, 1 << 20) as usize;
    let mut ts: Vec<Transfer> = Vec::new();
    for (peer, ops) in pairs {
        for c in ops.chunks(per) {
            ts.push(backend.post(*peer, c, None).map_err(|e| e.to_string())?);
        }
    }
    for t in &ts {
        t.wait(deadline).await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

// ----- the peer process ---------------------------------------------------------------------

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
enum PeerCmd {
    /// One endpoint per entry of `ranks`, each with `regions`; with `topology`, each also runs a
    /// decode session for its rank.
    Setup {
        regions: Vec<(u32, u64)>,
        ranks: Vec<RankId>,
        topology: Option<Box<Topology>>,
        pages: u32,
    },
    /// Expect `request` on every decode session, landing in `pages`.
    Expect {
        request: u64,
        pages: Vec<u32>,
    },
    /// Wait until `request` is complete on every decode session, then release it.
    Wait {
        request: u64,
    },
    Clear,
    Hash,
    Quit,
}

/// The receiving process: registers regions, answers clear/hash, runs decode sessions for the
/// model-shaped session runs, and serves the plain-socket baseline.
pub fn peer(args: &PeerArgs) -> ExitCode {
    match peer_main(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvxfer bench-peer: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The plain-socket baseline is the fastest single stream found on the development machine
/// (`benches/socket/loopback_poll.py`, 2026-12-02/03): 1 MiB per write and per read, both ends
/// non-blocking and spinning on `EAGAIN` (busy-polling, as NIXL's UCX tcp lanes and the tcp
/// backend's `poll_us` do; a blocking socket moved 0.6-0.8 of it), kernel-autotuned socket
/// buffers, `TCP_NODELAY`. Unlike iperf3 (which rereads one 1 MiB buffer) it sends from and
/// receives into buffers of the whole request, allocated like the backend's (`HostBuffer`).
const PLAIN_SOCKET_IO: usize = 1 << 20;
/// A spinning end of the plain baseline gives up after this long without moving a byte.
const PLAIN_SOCKET_STALL: Duration = Duration::from_secs(30);

/// A socket for the plain baseline (listener or client).
fn plain_socket() -> std::io::Result<tokio::net::TcpSocket> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// The peer's end of the plain baseline: binds (inside the peer's runtime: a tokio listener turned
/// into a blocking one for the accept).
fn plain_listener() -> std::io::Result<TcpListener> {
    let s = plain_socket()?;
    s.bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let l = s.listen(1)?.into_std()?;
    l.set_nonblocking(false)?;
    Ok(l)
}

/// Calls `io` until it moves at least one byte (a non-blocking socket that would block is tried
/// again at once); an error after [`PLAIN_SOCKET_STALL`] without progress.
fn spin_io(mut io: impl FnMut() -> std::io::Result<usize>) -> std::io::Result<usize> {
    let start = Instant::now();
    loop {
        match io() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::Interrupted => {
                if start.elapsed() > PLAIN_SOCKET_STALL {
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no progress for 30 s"));
                }
                std::hint::spin_loop();
            }
            r => return r,
        }
    }
}

/// Writes all of `buf` in calls of at most [`PLAIN_SOCKET_IO`] bytes, spinning.
fn spin_write_all(s: &mut TcpStream, buf: &[u8]) -> std::io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let end = (off + PLAIN_SOCKET_IO).min(buf.len());
        match spin_io(|| s.write(&buf[off..end]))? {
            0 => return Err(std::io::ErrorKind::WriteZero.into()),
            n => off += n,
        }
    }
    Ok(())
}

/// Fills all of `buf` in calls of at most [`PLAIN_SOCKET_IO`] bytes, spinning.
fn spin_read_exact(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let end = (off + PLAIN_SOCKET_IO).min(buf.len());
        match spin_io(|| s.read(&mut buf[off..end]))? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => off += n,
        }
    }
    Ok(())
}

fn plain_server(l: TcpListener) {
    let Ok((mut s, _)) = l.accept() else { return };
    if s.set_nonblocking(true).is_err() || s.set_nodelay(true).is_err() {
        return;
    }
    let mut buf = HostBuffer::zeroed(0);
    loop {
        let mut len = [0u8; 8];
        // Between runs the bench does other work for seconds: wait for the next run without
        // spinning, then spin through it.
        if s.set_nonblocking(false).is_err() || s.read_exact(&mut len).is_err() || s.set_nonblocking(true).is_err() {
            return;
        }
        let len = u64::from_le_bytes(len) as usize;
        if buf.len() < len {
            buf = HostBuffer::zeroed(len);
        }
        let Ok(dst) = buf.as_mut_slice() else { return };
        if spin_read_exact(&mut s, &mut dst[..len]).is_err() || spin_write_all(&mut s, &[1]).is_err() {
            return;
        }
    }
}

/// One endpoint of the peer process.
struct PeerEnd {
    backend: Arc<dyn KvTransferBackend>,
    regions: Vec<Region>,
    session: Option<Arc<ReceiverSession>>,
}

fn pool_of(regions: &[(u32, u64)], topo: &Topology, pages: u32) -> KvPool {
    let mut buffers = Vec::new();
    for layer in 0..topo.stage_layers(Side::Decode, 0) {
        for &kind in topo.kv().kinds() {
            let b = kvxfer_core::BufferRef { layer, kind };
            let id = region_id(b);
            if let Some((_, len)) = regions.iter().find(|(r, _)| *r == id.0) {
                buffers.push(PoolBuffer { buffer: b, region: id, offset: 0, len: *len });
            }
        }
    }
    KvPool { pages, buffers }
}

fn peer_main(args: &PeerArgs) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    let _g = rt.enter();
    let plain = plain_listener().map_err(|e| format!("plain socket: {e}"))?;
    let addr = plain.local_addr().map_err(|e| e.to_string())?;
    std::thread::spawn(move || plain_server(plain));
    let out = std::io::stdout();
    let say = |v: serde_json::Value| {
        let mut o = out.lock();
        let _ = writeln!(o, "{v}");
        let _ = o.flush();
    };
    say(json!({"plain": addr.to_string()}));
    let mut ends: Vec<PeerEnd> = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let reply = match serde_json::from_str::<PeerCmd>(&line).map_err(|e| format!("bad command {line:?}: {e}"))? {
            PeerCmd::Setup { regions, ranks, topology, pages } => {
                let mut metas = Vec::new();
                for (i, rank) in ranks.iter().enumerate() {
                    let identity = kvxfer::engine::identity(Side::Decode, *rank) | ((i as u64) << 32);
                    let config =
                        BackendConfig { identity, options: args.backend_opts.iter().cloned().collect(), secret: None };
                    let backend = kvxfer::backends::create(&args.backend, &config).map_err(|e| e.to_string())?;
                    let ids: Vec<(RegionId, u64)> = regions.iter().map(|(r, l)| (RegionId(*r), *l)).collect();
                    let regs = rt.block_on(register_regions(backend.as_ref(), &ids, |_, _| {}))?;
                    let (session, pool) = match &topology {
                        Some(t) => {
                            let pool = pool_of(&regions, t, pages);
                            let s = ReceiverSession::new(Arc::clone(&backend), **t, *rank, pool.clone())
                                .map_err(|e| e.to_string())?;
                            (Some(Arc::new(s)), Some(pool))
                        }
                        None => (None, None),
                    };
                    metas.push(json!({"meta": backend.metadata().map_err(|e| e.to_string())?, "pool": pool}));
                    ends.push(PeerEnd { backend, regions: regs, session });
                }
                json!({"endpoints": metas})
            }
            PeerCmd::Expect { request, pages } => {
                let deadline = Instant::now() + Duration::from_secs(120);
                for e in &ends {
                    if let Some(s) = &e.session {
                        // Only prefill rank 0 runs in the bench: its key is the one to wait for.
                        let only = ExpectOptions {
                            only_senders: Some(vec![SenderKey::of(RankId::new(0, 0))]),
                            ..ExpectOptions::default()
                        };
                        s.expect(RequestId(request), &pages, only, deadline).map_err(|e| e.to_string())?;
                    }
                }
                json!({"ok": true})
            }
            PeerCmd::Wait { request } => {
                let mut failed = None;
                for e in &ends {
                    if let Some(s) = &e.session {
                        if let Err(err) = rt.block_on(s.wait(RequestId(request))) {
                            failed.get_or_insert(err.to_string());
                        }
                        s.release(RequestId(request));
                    }
                }
                match failed {
                    None => json!({"ok": true}),
                    Some(e) => json!({"error": e}),
                }
            }
            PeerCmd::Clear => {
                for r in ends.iter().flat_map(|e| &e.regions) {
                    let mut g = r.view.write_guard(0, r.view.len() as u64).map_err(|e| e.to_string())?;
                    g.as_mut_slice().fill(0);
                }
                json!({"ok": true})
            }
            PeerCmd::Hash => {
                let mut hs = Vec::new();
                for (i, e) in ends.iter().enumerate() {
                    for r in &e.regions {
                        hs.push((i, r.id.0, hash_desc(&r.view)?));
                    }
                }
                json!({"hashes": hs})
            }
            PeerCmd::Quit => break,
        };
        say(reply);
    }
    // Give the sender's streams time to close before the endpoints go.
    std::thread::sleep(Duration::from_millis(50));
    for e in ends {
        drop(e.session);
        drop(e.regions);
        drop(e.backend);
    }
    Ok(())
}

// ----- the bench process --------------------------------------------------------------------

struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn send(&mut self, v: serde_json::Value) -> Result<serde_json::Value, String> {
        writeln!(self.stdin, "{v}").and_then(|_| self.stdin.flush()).map_err(|e| format!("peer: {e}"))?;
        let r = self.read()?;
        match r.get("error") {
            Some(e) => Err(format!("peer: {e}")),
            None => Ok(r),
        }
    }
    fn read(&mut self) -> Result<serde_json::Value, String> {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(0) | Err(_) => Err("the peer process exited (see its error above)".into()),
            Ok(_) => serde_json::from_str(&line).map_err(|e| format!("peer said {line:?}: {e}")),
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "quit"}));
        let _ = self.stdin.flush();
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Refuses a `--plot` path that cannot be written, before the bench runs for minutes.
fn check_plot_path(path: &Path) -> Result<(), String> {
    if path.is_dir() {
        return Err(format!("--plot {}: is a directory; give a file name such as bench.svg", path.display()));
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(format!(
            "--plot {}: the directory {} does not exist; create it first",
            path.display(),
            parent.display()
        ));
    }
    Ok(())
}

/// Runs the bench.
pub fn run(args: &BenchArgs) -> ExitCode {
    if args.through == Through::Engine {
        return crate::bench_engine::run(args);
    }
    if let Some(path) = &args.plot {
        if let Err(e) = check_plot_path(path) {
            eprintln!("kvxfer bench: {e}");
            return ExitCode::FAILURE;
        }
    }
    match bench(args) {
        Ok(results) => {
            let ok = results.iter().all(|r| r.verified);
            if let Some(path) = &args.plot {
                if !ok {
                    eprintln!("kvxfer bench: not writing {}: the bytes did not verify", path.display());
                } else if let Err(e) = plot_svg(args, &results).and_then(|svg| {
                    std::fs::write(path, svg).map_err(|e| format!("cannot write --plot {}: {e}", path.display()))
                }) {
                    eprintln!("kvxfer bench: {e}");
                    return ExitCode::FAILURE;
                }
            }
            match args.format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({"backend": args.backend, "cases": results})).expect("json")
                ),
                Format::Table => print_table(&args.backend, &results),
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                eprintln!("kvxfer bench: verification FAILED: the peer's bytes differ from the memcpy result");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("kvxfer bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Round trip of one cache line between two threads, in nanoseconds: the median of 3 probes of
/// up to 20,000 ping-pongs each, every probe bounded by 200 ms; `None` with a single CPU or when
/// no probe finished.
///
/// Why the bench measures it: every two-process path (a loopback socket, a shared-memory FIFO, a
/// transport's progress threads) hands cache lines from one core to the other, memcpy does not.
/// On the 2-core development VM this round trip is bimodal: 50-90 ns most of the time, 330-410
/// ns for seconds at a time (the host places the two vCPUs apart), and a two-process rate falls
/// 2-3x with it while memcpy does not move. A ratio measured next to a slow round trip says more
/// about the host than about the backend.
pub fn core_round_trip_ns() -> Option<f64> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    if std::thread::available_parallelism().map_or(true, |n| n.get() < 2) {
        return None;
    }
    const ROUNDS: u64 = 20_000;
    let mut probes: Vec<f64> = Vec::new();
    for _ in 0..3 {
        let line = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (l2, s2) = (Arc::clone(&line), Arc::clone(&stop));
        let pong = std::thread::spawn(move || {
            for i in 0..ROUNDS {
                while l2.load(Ordering::Acquire) != 2 * i + 1 {
                    if s2.load(Ordering::Relaxed) {
                        return;
                    }
                    std::hint::spin_loop();
                }
                l2.store(2 * i + 2, Ordering::Release);
            }
        });
        let start = Instant::now();
        let limit = start + Duration::from_millis(200);
        let mut done = 0;
        'rounds: for i in 0..ROUNDS {
            line.store(2 * i + 1, Ordering::Release);
            let mut spins = 0u32;
            while line.load(Ordering::Acquire) != 2 * i + 2 {
                spins = spins.wrapping_add(1);
                if spins % 1024 == 0 && Instant::now() > limit {
                    break 'rounds;
                }
                std::hint::spin_loop();
            }
            done = i + 1;
        }
        let took = start.elapsed();
        stop.store(true, Ordering::Relaxed);
        let _ = pong.join();
        if done == ROUNDS {
            probes.push(took.as_secs_f64() * 1e9 / ROUNDS as f64);
        }
    }
    probes.sort_by(f64::total_cmp);
    probes.get(probes.len() / 2).copied()
}

fn timed<F: FnMut() -> Result<(), String>>(runs: u32, mut f: F) -> Result<Vec<f64>, String> {
    let mut t = Vec::new();
    for i in 0..=runs {
        let start = Instant::now();
        f()?;
        if i > 0 {
            t.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(t)
}

fn bench(args: &BenchArgs) -> Result<Vec<CaseResult>, String> {
    if args.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    kvxfer_core::backend::lookup(&args.backend).map_err(|e| e.to_string())?;
    let workloads: Vec<Workload> = match args.model {
        Some(p) => vec![model_workload(args, p)?],
        None => args
            .block
            .iter()
            .map(|b| raw_workload(*b, args.total, args.shuffle, args.seed))
            .collect::<Result<_, _>>()?,
    };
    // Every case shares the regions and peers of the first (raw cases all use region 0 of --total
    // bytes and one peer endpoint).
    let first = &workloads[0];
    let (src_regions, dst_regions) = (first.src.clone(), first.dst.clone());
    let ranks: Vec<RankId> = first.pairs.iter().map(|p| p.rank).collect();

    let exe = std::env::current_exe().map_err(|e| format!("cannot find my own executable: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.args(["bench-peer", "--backend", &args.backend]);
    for (k, v) in &args.backend_opts {
        cmd.args(["--backend-opt", &format!("{k}={v}")]);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start the peer process: {e}"))?;
    let mut peer = Peer {
        stdin: child.stdin.take().expect("piped"),
        stdout: BufReader::new(child.stdout.take().expect("piped")),
        child,
    };
    let plain_addr = peer.read()?["plain"].as_str().ok_or("peer did not report its socket address")?.to_owned();
    let setup = peer.send(json!({
        "cmd": "setup",
        "regions": dst_regions.iter().map(|(r, l)| (r.0, *l)).collect::<Vec<_>>(),
        "ranks": ranks,
        "topology": first.model.as_ref().map(|m| m.0),
        "pages": first.model.as_ref().map(|m| m.3).unwrap_or(0),
    }))?;
    let endpoints = setup["endpoints"].as_array().ok_or("peer did not describe its endpoints")?.clone();

    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    let _g = rt.enter();
    let config = BackendConfig { identity: 1, options: args.backend_opts.iter().cloned().collect(), secret: None };
    let backend: Arc<dyn KvTransferBackend> =
        kvxfer::backends::create(&args.backend, &config).map_err(|e| e.to_string())?;
    // Registered (and kept so) for every run; the sessions and the raw posts read them.
    let _src_bufs = rt.block_on(register_regions(backend.as_ref(), &src_regions, |i, b| {
        fill_pattern(b, args.seed ^ (i as u64 + 1))
    }))?;
    let mut peer_ids = Vec::new();
    let mut metas = Vec::new();
    for e in &endpoints {
        let meta: EndpointMetadata =
            serde_json::from_value(e["meta"].clone()).map_err(|e| format!("peer metadata: {e}"))?;
        peer_ids.push(rt.block_on(backend.connect(&meta)).map_err(|e| e.to_string())?);
        metas.push((meta, e["pool"].clone()));
    }
    let plain_addr: std::net::SocketAddr = plain_addr.parse().map_err(|e| format!("plain socket address: {e}"))?;
    let mut plain: TcpStream = plain_socket()
        .and_then(|s| rt.block_on(s.connect(plain_addr)))
        .and_then(|s| s.into_std())
        .and_then(|s| s.set_nonblocking(true).map(|()| s))
        .map_err(|e| format!("plain socket: {e}"))?;
    // memcpy baseline: the same ops between local copies of the same regions, one set per pair.
    let mut local_src: Vec<(RegionId, HostBuffer)> = Vec::new();
    for (i, (id, len)) in src_regions.iter().enumerate() {
        let mut h = HostBuffer::zeroed(*len as usize);
        fill_pattern(h.as_mut_slice().map_err(|e| e.to_string())?, args.seed ^ (i as u64 + 1));
        local_src.push((*id, h));
    }

    let mut results = Vec::new();
    // The plain socket's source: one buffer for every case (patterned: untouched memory would read
    // the zero page), allocated like the backend's.
    let mut payload = HostBuffer::zeroed(workloads.iter().map(|w| w.bytes()).max().unwrap_or(0) as usize);
    fill_pattern(payload.as_mut_slice().map_err(|e| e.to_string())?, args.seed);
    for wl in &workloads {
        let bytes = wl.bytes();
        let deadline = || Instant::now() + Duration::from_secs(300);
        let pairs: Vec<(PeerId, &[WriteOp])> =
            wl.pairs.iter().zip(&peer_ids).map(|(p, id)| (*id, p.ops.as_slice())).collect();
        peer.send(json!({"cmd": "clear"}))?;
        let rtt_before = core_round_trip_ns();
        // Backend, raw: warm-up, then timed runs of every op posted at once.
        let mut t_backend = timed(args.runs, || {
            rt.block_on(post_and_wait(backend.as_ref(), &pairs, deadline())).map_err(|e| format!("{}: {e}", wl.name))
        })?;
        let theirs_raw = peer.send(json!({"cmd": "hash"}))?;
        // memcpy: the same ops, locally.
        let mut local_dst: Vec<Vec<(RegionId, HostBuffer)>> = wl
            .pairs
            .iter()
            .map(|_| dst_regions.iter().map(|(id, len)| (*id, HostBuffer::zeroed(*len as usize))).collect())
            .collect();
        let mut t_memcpy = timed(args.runs, || {
            for (pair, dsts) in wl.pairs.iter().zip(local_dst.iter_mut()) {
                for op in &pair.ops {
                    let s = local_src.iter().find(|(r, _)| *r == op.src).ok_or("src region")?;
                    let d = dsts.iter_mut().find(|(r, _)| *r == op.dst).ok_or("dst region")?;
                    let (s, d) =
                        (s.1.as_slice().map_err(|e| e.to_string())?, d.1.as_mut_slice().map_err(|e| e.to_string())?);
                    for (so, dofs, len) in op.ranges() {
                        let (so, dofs, len) = (so as usize, dofs as usize, len as usize);
                        d[dofs..dofs + len].copy_from_slice(&s[so..so + len]);
                    }
                }
            }
            Ok(())
        })?;
        let mut ours = Vec::new();
        for (i, dsts) in local_dst.iter().enumerate() {
            for (id, h) in dsts {
                ours.push((i, id.0, hash(h.as_slice().map_err(|e| e.to_string())?)));
            }
        }
        let ours = json!(ours);
        let mut verified = theirs_raw["hashes"] == ours;
        // Through the sessions (model-shaped): one chunk of the whole request, to completion.
        let mut session = None;
        if let Some((topo, src_pages, dst_pages, pages)) = &wl.model {
            peer.send(json!({"cmd": "clear"}))?;
            let me = RankId::new(0, 0);
            let buffers = (0..topo.stage_layers(Side::Prefill, me.pp))
                .flat_map(|layer| {
                    topo.kv().kinds().iter().map(move |&kind| {
                        let b = kvxfer_core::BufferRef { layer, kind };
                        let len = topo.buffer_bytes(Side::Prefill, kind, *pages);
                        PoolBuffer { buffer: b, region: region_id(b), offset: 0, len }
                    })
                })
                .collect();
            let pool = KvPool { pages: *pages, buffers };
            let sender = SenderSession::new(Arc::clone(&backend), *topo, me, pool, NotifyStyle::Attached)
                .map_err(|e| e.to_string())?;
            for (pair, (meta, pool)) in wl.pairs.iter().zip(&metas) {
                let pool: KvPool = serde_json::from_value(pool.clone()).map_err(|e| format!("peer pool: {e}"))?;
                rt.block_on(sender.connect(pair.rank, meta, pool)).map_err(|e| e.to_string())?;
            }
            let chunk = Chunk { index: 0, last: true, src_pages: src_pages.clone(), dst_pages: dst_pages.clone() };
            let mut request = 0u64;
            let mut t_session = Vec::new();
            for i in 0..=args.runs {
                request += 1;
                peer.send(json!({"cmd": "expect", "request": request, "pages": dst_pages}))?;
                let start = Instant::now();
                let sent = rt.block_on(sender.send_chunk(RequestId(request), &chunk, deadline()));
                let took = start.elapsed().as_secs_f64();
                let sent = sent.map_err(|e| format!("{} through the sessions: {e}", wl.name))?;
                if sent.bytes != bytes {
                    return Err(format!("the session moved {} bytes, the raw ops {bytes}", sent.bytes));
                }
                peer.send(json!({"cmd": "wait", "request": request}))?;
                if i > 0 {
                    t_session.push(took);
                }
            }
            let theirs = peer.send(json!({"cmd": "hash"}))?;
            verified &= theirs["hashes"] == ours;
            session = Some(rate(bytes, &mut t_session));
        }
        // Plain socket: the same number of bytes, one busy-polling stream (1 MiB writes and reads).
        let mut t_socket = timed(args.runs, || {
            let src = &payload.as_slice().map_err(|e| e.to_string())?[..bytes as usize];
            let io = |e: std::io::Error| format!("plain socket: {e}");
            spin_write_all(&mut plain, &bytes.to_le_bytes()).map_err(io)?;
            spin_write_all(&mut plain, src).map_err(io)?;
            let mut ack = [0u8];
            spin_read_exact(&mut plain, &mut ack).map_err(io)
        })?;
        let rtt_after = core_round_trip_ns();
        let (b, m, s) = (rate(bytes, &mut t_backend), rate(bytes, &mut t_memcpy), rate(bytes, &mut t_socket));
        let native = wl.block.and_then(|block| native_baseline(args, block, bytes)).map(|(tool, runs)| {
            let (median, best) = match &runs {
                Ok(g) if !g.is_empty() => {
                    let mut g = g.clone();
                    g.sort_by(f64::total_cmp);
                    (Some(g[(g.len() - 1) / 2]), g.last().copied())
                }
                _ => (None, None),
            };
            NativeBaseline {
                ratio: median.map(|g| b.median_gbps / g),
                median_gbps: median,
                best_gbps: best,
                error: runs.err(),
                tool,
            }
        });
        results.push(CaseResult {
            name: wl.name.clone(),
            block: wl.block,
            bytes,
            ops: wl.ops() as u64,
            runs: args.runs,
            backend: b,
            session,
            session_vs_raw: session.map(|x| x.median_gbps / b.median_gbps),
            memcpy: m,
            socket: s,
            ratio_vs_socket: b.median_gbps / s.median_gbps,
            ratio_vs_memcpy: b.median_gbps / m.median_gbps,
            verified,
            core_rtt_ns: (rtt_before, rtt_after),
            native,
        });
    }
    drop(plain);
    drop(peer);
    Ok(results)
}

/// Block size in binary units for an axis label (`4 KiB`, `1.5 MiB`).
fn human_f(b: f64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let (mut v, mut u) = (b, 0);
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if (v - v.round()).abs() < 1e-6 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Series colours, in series order: the backend, the plain socket, memcpy, native tools.
const COLORS: [plotters::style::RGBColor; 6] = [
    plotters::style::RGBColor(0x1f, 0x5f, 0xa8),
    plotters::style::RGBColor(0xe0, 0x7b, 0x10),
    plotters::style::RGBColor(0x2c, 0x9a, 0x2c),
    plotters::style::RGBColor(0xc6, 0x28, 0x28),
    plotters::style::RGBColor(0x7b, 0x4f, 0xb0),
    plotters::style::RGBColor(0x55, 0x55, 0x55),
];

/// One line of the chart: a name and its (block size, median GB/s) points.
type Series = (String, Vec<(f64, f64)>);

/// The series of a run: the backend, memcpy, the plain socket, and each native tool that measured
/// at least one block size; cases without a block size (model-shaped) are left out.
fn plot_series(backend: &str, results: &[CaseResult]) -> Vec<Series> {
    let raw: Vec<(f64, &CaseResult)> = results.iter().filter_map(|r| r.block.map(|b| (b as f64, r))).collect();
    let mut series: Vec<Series> = vec![
        (format!("kvxfer {backend}"), raw.iter().map(|(b, r)| (*b, r.backend.median_gbps)).collect()),
        (
            "plain socket (loopback, busy-polling)".to_owned(),
            raw.iter().map(|(b, r)| (*b, r.socket.median_gbps)).collect(),
        ),
        ("memcpy (one process)".to_owned(), raw.iter().map(|(b, r)| (*b, r.memcpy.median_gbps)).collect()),
    ];
    for (b, r) in &raw {
        let Some(n) = &r.native else { continue };
        let Some(g) = n.median_gbps else { continue };
        match series.iter_mut().find(|(name, _)| *name == n.tool) {
            Some((_, pts)) => pts.push((*b, g)),
            None => series.push((n.tool.clone(), vec![(*b, g)])),
        }
    }
    series.retain(|(_, pts)| !pts.is_empty());
    series
}

/// The chart of a run as an SVG document: median GB/s (y) against block size (x, log scale, ticks
/// at the measured sizes), one line with points per series, a legend, axis labels.
pub fn plot_svg(args: &BenchArgs, results: &[CaseResult]) -> Result<String, String> {
    use plotters::prelude::*;

    let series = plot_series(&args.backend, results);
    let mut blocks: Vec<f64> = results.iter().filter_map(|r| r.block.map(|b| b as f64)).collect();
    blocks.sort_by(f64::total_cmp);
    blocks.dedup();
    let (Some(&lo), Some(&hi)) = (blocks.first(), blocks.last()) else {
        return Err("nothing to plot: no case has a block size (--plot draws raw --block workloads)".into());
    };
    let top = series.iter().flat_map(|(_, p)| p.iter().map(|x| x.1)).filter(|g| g.is_finite()).fold(0.0, f64::max);
    let top = if top > 0.0 { top * 1.25 } else { 1.0 };
    let runs = args.runs;
    let caption = format!(
        "kvxfer bench: {}, {} per case{}, two processes over loopback",
        args.backend,
        human(args.total),
        if args.shuffle { ", shuffled" } else { "" }
    );
    let e = |e: DrawingAreaErrorKind<_>| format!("drawing the chart: {e}");
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(e)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 20))
            .margin(18)
            .x_label_area_size(52)
            .y_label_area_size(70)
            // A factor of 2 of room on each side, so a single block size still has an axis.
            .build_cartesian_2d((lo / 2.0..hi * 2.0).log_scale().with_key_points(blocks.clone()), 0.0..top)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("block size (bytes per op; log scale)")
            .y_desc(format!("GB/s (1e9 bytes/s), median of {runs} run(s)"))
            .x_label_formatter(&|v| human_f(*v))
            .y_label_formatter(&|v| format!("{v:.1}"))
            .axis_desc_style(("sans-serif", 16))
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(e)?;
        for (i, (name, points)) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
                .map_err(e)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(e)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(e)?;
        root.present().map_err(e)?;
    }
    Ok(out)
}

fn print_table(backend: &str, results: &[CaseResult]) {
    println!("kvxfer bench: backend {backend}, between two processes over loopback; GB/s = 1e9 bytes/s, median (best)");
    println!(
        "  {:<44} {:>9} {:>7} {:>15} {:>15} {:>15} {:>8} {:>8} {:>8}",
        "case", "bytes", "ops", backend, "plain socket", "memcpy", "/socket", "/memcpy", "verified"
    );
    for r in results {
        let f = |x: &Rate| format!("{:.2} ({:.2})", x.median_gbps, x.best_gbps);
        println!(
            "  {:<44} {:>9} {:>7} {:>15} {:>15} {:>15} {:>8.2} {:>8.2} {:>8}",
            r.name,
            human(r.bytes),
            r.ops,
            f(&r.backend),
            f(&r.socket),
            f(&r.memcpy),
            r.ratio_vs_socket,
            r.ratio_vs_memcpy,
            if r.verified { "yes" } else { "NO" }
        );
        if let Some(n) = &r.native {
            match (&n.median_gbps, &n.error) {
                (Some(g), _) => println!(
                    "    native baseline: {} {g:.2} ({:.2}) GB/s; {backend} / native = {:.2}",
                    n.tool,
                    n.best_gbps.unwrap_or(f64::NAN),
                    n.ratio.unwrap_or(f64::NAN)
                ),
                (None, e) => println!("    native baseline: {} failed: {}", n.tool, e.as_deref().unwrap_or("?")),
            }
        }
        if let (Some(x), Some(ratio)) = (&r.session, r.session_vs_raw) {
            println!(
                "    through the sessions: {:.2} ({:.2}) GB/s; session / raw = {ratio:.2}",
                x.median_gbps, x.best_gbps
            );
        }
        let ns = |x: Option<f64>| x.map_or("-".to_owned(), |v| format!("{v:.0}"));
        println!("    core-to-core round trip before / after: {} / {} ns", ns(r.core_rtt_ns.0), ns(r.core_rtt_ns.1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_round_trip_is_bounded_and_plausible() {
        let two = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
        let start = Instant::now();
        let rtt = core_round_trip_ns();
        // Three probes of at most 200 ms each (a starved probe, under a loaded test run, gives up).
        assert!(start.elapsed() < Duration::from_secs(2), "took {:?}", start.elapsed());
        // None: one core, or no probe got two cores at once. A cache-line round trip takes more
        // than 1 ns; a finished probe at most 200 ms / 20,000.
        if let Some(ns) = rtt {
            assert!(two && ns > 1.0 && ns <= 10_000.0, "{ns} ns");
        }
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert!(parse_size("0").is_err());
        assert!(parse_size("1X").is_err());
        assert!(parse_size("M").is_err());
    }

    fn case(block: Option<u64>, gbps: f64, native: Option<NativeBaseline>) -> CaseResult {
        let r = Rate { median_gbps: gbps, best_gbps: gbps * 1.1 };
        CaseResult {
            name: "case".into(),
            block,
            bytes: 1 << 20,
            ops: 1,
            runs: 1,
            backend: r,
            session: None,
            session_vs_raw: None,
            memcpy: Rate { median_gbps: gbps * 10.0, best_gbps: gbps * 11.0 },
            socket: Rate { median_gbps: gbps * 2.0, best_gbps: gbps * 2.1 },
            ratio_vs_socket: 0.5,
            ratio_vs_memcpy: 0.1,
            verified: true,
            core_rtt_ns: (None, None),
            native,
        }
    }

    fn args(a: &[&str]) -> BenchArgs {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Cli {
            #[command(flatten)]
            a: BenchArgs,
        }
        Cli::try_parse_from(std::iter::once("bench").chain(a.iter().copied())).unwrap().a
    }

    #[test]
    fn plot_has_a_series_per_measured_thing() {
        let native = |g: Option<f64>| NativeBaseline {
            tool: "ucx_perftest <put>".into(),
            median_gbps: g,
            best_gbps: g,
            error: g.is_none().then(|| "no such tool".to_owned()),
            ratio: None,
        };
        let results = [case(Some(4096), 1.0, Some(native(None))), case(Some(1 << 20), 3.0, Some(native(Some(5.0))))];
        let svg = plot_svg(&args(&["--backend", "ucx", "--block", "4K,1M"]), &results).unwrap();
        for label in
            ["kvxfer ucx", "plain socket (loopback, busy-polling)", "memcpy (one process)", "ucx_perftest &lt;put&gt;"]
        {
            assert!(svg.contains(label), "{label} missing: {svg}");
        }
        // Two points for each of three series, one for the tool (its 4K run failed).
        assert_eq!(svg.matches("<circle").count(), 7, "{svg}");
        assert!(svg.contains("4 KiB") && svg.contains("1 MiB"), "{svg}");

        // One block size: still a chart with one point per series.
        let svg = plot_svg(&args(&[]), &[case(Some(1 << 20), 2.0, None)]).unwrap();
        assert_eq!(svg.matches("<circle").count(), 3, "{svg}");
        assert!(svg.contains("kvxfer tcp"));

        // Model-shaped cases have no block size.
        let e = plot_svg(&args(&[]), &[case(None, 2.0, None)]).unwrap_err();
        assert!(e.contains("no case has a block size"), "{e}");
    }

    #[test]
    fn human_axis_sizes() {
        assert_eq!(human_f(4096.0), "4 KiB");
        assert_eq!(human_f(1536.0), "1.5 KiB");
        assert_eq!(human_f(512.0), "512 B");
        assert_eq!(human_f(16.0 * 1024.0 * 1024.0), "16 MiB");
    }

    #[test]
    fn bench_has_no_svg_format_and_plot_paths_are_checked() {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Cli {
            #[command(flatten)]
            a: BenchArgs,
        }
        let e = Cli::try_parse_from(["bench", "--format", "svg"]).unwrap_err().to_string();
        assert!(e.contains("invalid value 'svg'"), "{e}");
        let e = Cli::try_parse_from(["bench", "--model", "llama3-8b", "--plot", "x.svg"]).unwrap_err().to_string();
        assert!(e.contains("cannot be used with"), "{e}");
        let dir = std::env::temp_dir();
        assert!(check_plot_path(&dir).unwrap_err().contains("is a directory"));
        let e = check_plot_path(&dir.join("kvxfer-no-such-dir").join("x.svg")).unwrap_err();
        assert!(e.contains("does not exist"), "{e}");
        check_plot_path(&dir.join("bench.svg")).unwrap();
        check_plot_path(Path::new("bench.svg")).unwrap();
    }

    #[test]
    fn raw_shuffle_is_a_permutation() {
        let w = raw_workload(4096, 1 << 20, true, 3).unwrap();
        let mut d: Vec<u64> = w.pairs[0].ops.iter().map(|o| o.dst_offset / 4096).collect();
        assert_ne!(d, (0..256).collect::<Vec<_>>());
        d.sort_unstable();
        assert_eq!(d, (0..256).collect::<Vec<_>>());
        assert!(raw_workload(3000, 1 << 20, false, 0).is_err());
    }
}

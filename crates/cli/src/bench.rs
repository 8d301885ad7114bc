//! `kvxfer bench`: bandwidth of a backend between two processes, next to the machine's own limits
//! measured in the same run (memcpy of the same ops, and a plain socket copy of the same bytes over
//! loopback).
//!
//! The bench process is the sender; it starts a peer process (`kvxfer bench-peer`, the receiver)
//! and drives it over the peer's stdin/stdout with JSON lines. Workloads:
//! - raw: `--block SIZE --total SIZE [--shuffle]`: TOTAL/BLOCK ops in one `write`, destination
//!   blocks in a seeded permutation with `--shuffle`;
//! - model-shaped: `--model PRESET` (+ TP sizes, layout, tokens): the ops prefill rank 0/0 writes
//!   into its first decode rank for one request with shuffled pages, exactly as the planner makes them.
//!
//! Each case: a warm-up, then `--runs` timed runs of each of backend write, memcpy (the same ops,
//! locally) and plain socket (the same byte count, one stream); median and best. After the timed
//! runs every byte of the peer's regions is compared (64-bit hash of each region) with the memcpy
//! result, which applied the same ops to the same source.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::session::region_id;
use kvxfer_core::plan::plan_sender;
use kvxfer_core::{
    BackendConfig, EndpointMetadata, HostBuffer, KvTransferBackend, MemRegion, RankId, RegionId, Side, WriteOp,
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
    /// Bytes per request.
    pub bytes: u64,
    /// Ops per request (one `write`).
    pub ops: u64,
    /// Timed runs.
    pub runs: u32,
    /// The backend.
    pub backend: Rate,
    /// memcpy of the same ops in one process.
    pub memcpy: Rate,
    /// Plain socket copy of the same byte count over loopback, between the same two processes.
    pub socket: Rate,
    /// backend median / socket median.
    pub ratio_vs_socket: f64,
    /// backend median / memcpy median.
    pub ratio_vs_memcpy: f64,
    /// Every byte of the peer's regions equals the memcpy result.
    pub verified: bool,
    /// The C library's own measurement at the same message size and transport, in the same run
    /// (ucx: `ucx_perftest -t ucp_put_bw`; fabric: a plain `fi_write` loop); raw cases only.
    pub native: Option<NativeBaseline>,
}

/// A baseline measured with the transport library itself, without kvxfer.
#[derive(Debug, Clone, Serialize)]
pub struct NativeBaseline {
    /// What ran.
    pub tool: String,
    /// GB/s (1e9 bytes per second), or the error that stopped it.
    pub gbps: Result<f64, String>,
    /// Backend median / baseline.
    pub ratio: Option<f64>,
}

/// Runs the native baseline of `args.backend` (if it has one) at message size `block`.
#[allow(unused_variables)] // without the ucx and fabric features nothing uses the arguments
fn native_baseline(args: &BenchArgs, block: u64, total: u64) -> Option<(String, Result<f64, String>)> {
    let opt = |k: &str| args.backend_opts.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.clone());
    let iters = (total / block.max(1)).clamp(16, 4096) as usize;
    match args.backend.as_str() {
        #[cfg(feature = "ucx")]
        "ucx" => {
            let tls = opt("tls").or_else(|| std::env::var("KVXFER_UCX_TLS").ok()).unwrap_or_else(|| "tcp".into());
            let r = kvxfer::backends::ucx::perftest::run(&tls, block as usize, iters, Duration::from_secs(120));
            Some((
                format!("ucx_perftest -t ucp_put_bw, UCX_TLS={tls}"),
                r.map(|r| r.bytes_per_sec / 1e9).map_err(|e| e.to_string()),
            ))
        }
        #[cfg(feature = "fabric")]
        "fabric" => {
            let prov = opt("provider").or_else(|| std::env::var("FI_PROVIDER").ok()).unwrap_or_else(|| "tcp".into());
            let addr = (prov == "tcp").then_some("127.0.0.1");
            let r = kvxfer::backends::fabric::baseline::write_bandwidth(
                &prov,
                addr,
                block as usize,
                iters,
                8,
                Duration::from_secs(120),
            );
            Some((
                format!("fi_write loop, provider {prov}, 8 in flight"),
                r.map(|m| m.bytes_per_sec() / 1e9).map_err(|e| e.to_string()),
            ))
        }
        _ => None,
    }
}

struct Workload {
    name: String,
    /// Bytes per op of a raw workload (None for model-shaped ones).
    block: Option<u64>,
    src: Vec<(RegionId, u64)>,
    dst: Vec<(RegionId, u64)>,
    ops: Vec<WriteOp>,
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
        ops,
    })
}

fn model_workload(a: &BenchArgs, preset: Preset) -> Result<Workload, String> {
    let w = crate::model::Workload {
        model: preset,
        layers: a.layers,
        prefill_tp: a.prefill_tp,
        decode_tp: a.decode_tp,
        prefill_pp: 1,
        decode_pp: 1,
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
        request_timeout_s: 60.0,
    };
    let topo = w.topology()?;
    let pages = w.pool_pages();
    let src_pages = crate::model::request_pages(&w, 0, 1);
    let dst_pages = crate::model::request_pages(&w, 0, 2);
    let me = RankId::new(0, 0);
    let pairs = plan_sender(&topo, me, &src_pages, &dst_pages).map_err(|e| e.to_string())?;
    let pair = pairs.first().ok_or("prefill rank 0 has no receiver")?;
    let regions = |side: Side| -> Vec<(RegionId, u64)> {
        (0..topo.stage_layers(side))
            .flat_map(|layer| {
                topo.kv().kinds().iter().map(move |&kind| {
                    (region_id(kvxfer_core::BufferRef { layer, kind }), topo.buffer_bytes(side, kind, pages))
                })
            })
            .collect()
    };
    let ops = pair
        .ops()
        .map(|op| WriteOp {
            src: region_id(op.src_region),
            src_offset: op.src_offset,
            dst: region_id(op.dst_region),
            dst_offset: op.dst_offset,
            len: op.len,
            count: op.count,
            src_stride: op.src_stride,
            dst_stride: op.dst_stride,
        })
        .collect();
    Ok(Workload {
        block: None,
        name: format!(
            "{} {} P{}->D{} {} tokens: prefill 0/0 -> decode {}",
            preset.name(),
            w.layout_name(),
            a.prefill_tp,
            a.decode_tp,
            a.tokens,
            pair.dst
        ),
        src: regions(Side::Prefill),
        dst: regions(Side::Decode),
        ops,
    })
}

impl crate::model::Workload {
    fn layout_name(&self) -> &'static str {
        match self.layout {
            LayoutArg::Nhd => "nhd",
            LayoutArg::Hnd => "hnd",
        }
    }
}

fn human(b: u64) -> String {
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
fn hash(r: &MemRegion) -> u64 {
    let mut buf = vec![0u8; 1 << 20];
    let mut h: u64 = 0x243F_6A88_85A3_08D3 ^ r.len() as u64;
    let mut off = 0u64;
    while off < r.len() as u64 {
        let n = (r.len() as u64 - off).min(buf.len() as u64) as usize;
        r.read(off, &mut buf[..n]).expect("in bounds");
        for c in buf[..n].chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            h ^= h >> 29;
        }
        off += n as u64;
    }
    h
}

fn fill_pattern(h: &HostBuffer, seed: u64) {
    let mut g = SplitMix(seed);
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < h.len() {
        let n = (h.len() - off).min(buf.len());
        for c in buf[..n].chunks_mut(8) {
            let w = g.next_u64().to_le_bytes();
            c.copy_from_slice(&w[..c.len()]);
        }
        h.region().write(off as u64, &buf[..n]).expect("in bounds");
        off += n;
    }
}

// ----- the peer process ---------------------------------------------------------------------

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
enum PeerCmd {
    Setup { regions: Vec<(u32, u64)> },
    Clear,
    Hash,
    Quit,
}

/// The receiving process: registers regions, answers clear/hash, and serves the plain-socket baseline.
pub fn peer(args: &PeerArgs) -> ExitCode {
    match peer_main(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvxfer bench-peer: {e}");
            ExitCode::FAILURE
        }
    }
}

fn plain_server(l: TcpListener) {
    let Ok((mut s, _)) = l.accept() else { return };
    let _ = s.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let mut len = [0u8; 8];
        if s.read_exact(&mut len).is_err() {
            return;
        }
        let len = u64::from_le_bytes(len) as usize;
        if buf.len() < len {
            buf.resize(len, 0);
        }
        if s.read_exact(&mut buf[..len]).is_err() || s.write_all(&[1]).is_err() {
            return;
        }
    }
}

fn peer_main(args: &PeerArgs) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    let _g = rt.enter();
    let config = BackendConfig { identity: 2, options: args.backend_opts.iter().cloned().collect() };
    let backend = kvxfer::backends::create(&args.backend, &config).map_err(|e| e.to_string())?;
    let plain = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = plain.local_addr().map_err(|e| e.to_string())?;
    std::thread::spawn(move || plain_server(plain));
    let out = std::io::stdout();
    let say = |v: serde_json::Value| {
        let mut o = out.lock();
        let _ = writeln!(o, "{v}");
        let _ = o.flush();
    };
    say(json!({"plain": addr.to_string()}));
    let mut bufs: BTreeMap<u32, HostBuffer> = BTreeMap::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        match serde_json::from_str::<PeerCmd>(&line).map_err(|e| format!("bad command {line:?}: {e}"))? {
            PeerCmd::Setup { regions } => {
                for (id, len) in regions {
                    let h = HostBuffer::zeroed(len as usize);
                    backend.register(RegionId(id), h.region()).map_err(|e| e.to_string())?;
                    bufs.insert(id, h);
                }
                say(json!({"meta": backend.metadata().map_err(|e| e.to_string())?}));
            }
            PeerCmd::Clear => {
                for h in bufs.values() {
                    h.region().write(0, &vec![0u8; h.len()]).expect("whole buffer");
                }
                say(json!({"ok": true}));
            }
            PeerCmd::Hash => {
                let hs: Vec<(u32, u64)> = bufs.iter().map(|(k, h)| (*k, hash(&h.region()))).collect();
                say(json!({"hashes": hs}));
            }
            PeerCmd::Quit => break,
        }
    }
    // Give the sender's streams time to close before the endpoint goes.
    std::thread::sleep(Duration::from_millis(50));
    drop(backend);
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
        self.read()
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

/// Runs the bench.
pub fn run(args: &BenchArgs) -> ExitCode {
    match bench(args) {
        Ok(results) => {
            let ok = results.iter().all(|r| r.verified);
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
    // Every case shares the regions of the first (raw cases all use region 0 of --total bytes).
    let (src_regions, dst_regions) = (workloads[0].src.clone(), workloads[0].dst.clone());

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
    let meta: EndpointMetadata = serde_json::from_value(
        peer.send(json!({"cmd": "setup", "regions": dst_regions.iter().map(|(r, l)| (r.0, *l)).collect::<Vec<_>>()}))?
            ["meta"]
            .clone(),
    )
    .map_err(|e| format!("peer metadata: {e}"))?;

    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    let _g = rt.enter();
    let config = BackendConfig { identity: 1, options: args.backend_opts.iter().cloned().collect() };
    let backend: Arc<dyn KvTransferBackend> =
        kvxfer::backends::create(&args.backend, &config).map_err(|e| e.to_string())?;
    let mut src_bufs = Vec::new();
    for (i, (id, len)) in src_regions.iter().enumerate() {
        let h = HostBuffer::zeroed(*len as usize);
        fill_pattern(&h, args.seed ^ (i as u64 + 1));
        backend.register(*id, h.region()).map_err(|e| e.to_string())?;
        src_bufs.push((*id, h));
    }
    let local_dst: Vec<(RegionId, HostBuffer)> =
        dst_regions.iter().map(|(id, len)| (*id, HostBuffer::zeroed(*len as usize))).collect();
    let peer_id = rt.block_on(backend.connect(&meta)).map_err(|e| e.to_string())?;
    let mut plain = TcpStream::connect(&plain_addr).map_err(|e| format!("plain socket: {e}"))?;
    let _ = plain.set_nodelay(true);

    let mut results = Vec::new();
    for wl in &workloads {
        let bytes: u64 = wl.ops.iter().map(WriteOp::bytes).sum();
        peer.send(json!({"cmd": "clear"}))?;
        // Backend: warm-up, then timed runs of one write of every op.
        let mut t_backend = Vec::new();
        for i in 0..=args.runs {
            let t = Instant::now();
            rt.block_on(backend.write(peer_id, &wl.ops, None)).map_err(|e| format!("{}: {e}", wl.name))?;
            if i > 0 {
                t_backend.push(t.elapsed().as_secs_f64());
            }
        }
        // memcpy: the same ops, locally.
        for (_, h) in &local_dst {
            h.region().write(0, &vec![0u8; h.len()]).expect("whole buffer");
        }
        let src_of = |id: RegionId| src_bufs.iter().find(|(r, _)| *r == id).map(|(_, h)| h.region());
        let dst_of = |id: RegionId| local_dst.iter().find(|(r, _)| *r == id).map(|(_, h)| h.region());
        let resolved: Vec<(MemRegion, MemRegion, WriteOp)> = wl
            .ops
            .iter()
            .map(|op| Ok((src_of(op.src).ok_or("src region")?, dst_of(op.dst).ok_or("dst region")?, *op)))
            .collect::<Result<_, &str>>()?;
        let mut t_memcpy = Vec::new();
        for i in 0..=args.runs {
            let t = Instant::now();
            for (s, d, op) in &resolved {
                for (so, dofs, len) in op.ranges() {
                    s.copy_to(so, d, dofs, len).map_err(|e| e.to_string())?;
                }
            }
            if i > 0 {
                t_memcpy.push(t.elapsed().as_secs_f64());
            }
        }
        // Plain socket: the same number of bytes, one stream.
        let payload = vec![0x5au8; bytes as usize];
        let mut t_socket = Vec::new();
        for i in 0..=args.runs {
            let t = Instant::now();
            plain.write_all(&bytes.to_le_bytes()).map_err(|e| format!("plain socket: {e}"))?;
            plain.write_all(&payload).map_err(|e| format!("plain socket: {e}"))?;
            let mut ack = [0u8];
            plain.read_exact(&mut ack).map_err(|e| format!("plain socket: {e}"))?;
            if i > 0 {
                t_socket.push(t.elapsed().as_secs_f64());
            }
        }
        drop(payload);
        // Verify every byte: the peer's regions against the memcpy result.
        let theirs = peer.send(json!({"cmd": "hash"}))?;
        let theirs: Vec<(u32, u64)> =
            serde_json::from_value(theirs["hashes"].clone()).map_err(|e| format!("peer hashes: {e}"))?;
        let ours: Vec<(u32, u64)> = local_dst.iter().map(|(id, h)| (id.0, hash(&h.region()))).collect();
        let (b, m, s) = (rate(bytes, &mut t_backend), rate(bytes, &mut t_memcpy), rate(bytes, &mut t_socket));
        let native = wl
            .block
            .and_then(|block| native_baseline(args, block, bytes))
            .map(|(tool, gbps)| NativeBaseline { ratio: gbps.as_ref().ok().map(|g| b.median_gbps / g), tool, gbps });
        results.push(CaseResult {
            name: wl.name.clone(),
            bytes,
            ops: wl.ops.len() as u64,
            runs: args.runs,
            backend: b,
            memcpy: m,
            socket: s,
            ratio_vs_socket: b.median_gbps / s.median_gbps,
            ratio_vs_memcpy: b.median_gbps / m.median_gbps,
            verified: theirs == ours,
            native,
        });
    }
    drop(plain);
    drop(peer);
    Ok(results)
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
            match &n.gbps {
                Ok(g) => println!(
                    "    native baseline: {} {g:.2} GB/s; {backend} / native = {:.2}",
                    n.tool,
                    n.ratio.unwrap_or(f64::NAN)
                ),
                Err(e) => println!("    native baseline: {} failed: {e}", n.tool),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn raw_shuffle_is_a_permutation() {
        let w = raw_workload(4096, 1 << 20, true, 3).unwrap();
        let mut d: Vec<u64> = w.ops.iter().map(|o| o.dst_offset / 4096).collect();
        assert_ne!(d, (0..256).collect::<Vec<_>>());
        d.sort_unstable();
        assert_eq!(d, (0..256).collect::<Vec<_>>());
        assert!(raw_workload(3000, 1 << 20, false, 0).is_err());
    }
}

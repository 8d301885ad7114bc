//! `kvxfer demo`, the main job: a bootstrap service, P prefill and D decode worker processes, a stream
//! of requests for a real model shape, every decode byte verified, a progress bar and a summary.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::bootstrap::{BootstrapServer, ServerConfig};
use kvxfer_core::plan::plan_chunk;
use kvxfer_core::secret::{Secret, SECRET_ENV};
use kvxfer_core::{Side, Topology};
use serde::Serialize;

use crate::model::{request_pages, Workload};
use crate::plan::Format;
use crate::worker::{RunArgs, WorkerSummary, SALT_DECODE, SALT_PREFILL};

/// Arguments of `kvxfer demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// The workload.
    #[command(flatten)]
    pub workload: Workload,
    /// Summary format.
    #[arg(long, value_enum, default_value = "table")]
    pub format: Format,
    /// Where the embedded bootstrap service listens.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub bootstrap_listen: String,
    /// Use this metadata store instead of the embedded bootstrap service:
    /// `etcd://host:port[,host:port...][/prefix]` (cargo feature `etcd`) or `bootstrap://host:port[/prefix]`.
    #[arg(long)]
    pub metadata: Option<String>,
    /// Lease time to live of each worker's rank record, seconds.
    #[arg(long, default_value_t = 5.0, value_parser = crate::model::parse_seconds)]
    pub lease_ttl_s: f64,
    /// Deadline of the whole run, in seconds (workers are killed after it).
    #[arg(long, default_value_t = 300.0, value_parser = crate::model::parse_seconds)]
    pub timeout_s: f64,
    /// Test-only: corrupt one source byte, so verification fails and the demo exits non-zero.
    #[arg(long, hide = true)]
    pub inject_wrong_byte: bool,
    /// `--abort-rate F`, `--layerwise` and `--digest`, passed on to every worker.
    #[command(flatten)]
    pub run: RunArgs,
    /// Serve the metrics of every worker, merged into one OpenMetrics exposition, at
    /// `http://ADDR/metrics` (`127.0.0.1:0` picks a port; the address is printed on stderr). A
    /// worker's metrics are scraped live while it runs and once more when it reports its summary
    /// (its final figures).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// With `--metrics-listen`: after the summary, keep serving the final metrics this many seconds,
    /// or until standard input is closed, whichever comes first.
    #[arg(long, default_value_t = 0.0, value_parser = crate::model::parse_seconds_or_zero, requires = "metrics_listen")]
    pub metrics_linger_s: f64,
}

/// What the demo knows of one worker's metrics: where it serves them and, once it reported its
/// summary, its final exposition.
#[derive(Debug, Clone, Default)]
struct WorkerMetrics {
    addr: Option<SocketAddr>,
    last: Option<String>,
}

/// How long one scrape of a worker may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// The merged exposition: final texts of the workers that finished, live scrapes of the others
/// (a worker that does not answer in time is left out of this scrape).
fn merged_metrics(board: &Mutex<Vec<WorkerMetrics>>) -> String {
    let board = board.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let texts: Vec<String> = board
        .iter()
        .filter_map(|m| m.last.clone().or_else(|| crate::metrics_http::scrape(m.addr?, SCRAPE_TIMEOUT).ok()))
        .collect();
    crate::metrics_http::merge(&texts)
}

/// One rank's line in the summary.
#[derive(Debug, Clone, Serialize)]
pub struct RankLine {
    /// prefill / decode.
    pub role: String,
    /// `tp/pp`.
    pub rank: String,
    /// Bytes sent or received.
    pub bytes: u64,
    /// Ops posted (prefill).
    pub ops: u64,
    /// Seconds of the request stream on this rank (fill and verification included).
    pub seconds: f64,
    /// Seconds with a transfer in flight (prefill: first chunk to final status; decode: handoff to success).
    pub transfer_seconds: f64,
    /// bytes / transfer_seconds / 1e9.
    pub gbps: f64,
    /// Requests that succeeded on this rank.
    pub completed: u32,
    /// Requests aborted (decode: by this rank; prefill: by a decode rank).
    pub aborted: u32,
}

/// The demo's summary (`--format json` prints it).
#[derive(Debug, Clone, Serialize)]
pub struct DemoSummary {
    /// Model preset.
    pub model: String,
    /// Layers, KV heads (1 for MLA), layout, page size.
    pub shape: String,
    /// Prefill TP x PP.
    pub prefill: String,
    /// Decode TP x PP.
    pub decode: String,
    /// Backend name.
    pub backend: String,
    /// Notification style.
    pub notify: String,
    /// Tokens per request.
    pub tokens: u32,
    /// Requests.
    pub requests: u32,
    /// The fraction of requests decode aborts (`--abort-rate`).
    pub abort_rate: f64,
    /// Whether prefill sent each chunk layer by layer (`--layerwise`).
    pub layerwise: bool,
    /// Whether decode ranks verified an end-to-end digest of every request (`--digest`).
    pub digest: bool,
    /// Bytes hashed for digests: prefill ranks (what they wrote), decode ranks (what landed).
    pub digest_bytes: [u64; 2],
    /// Requests whose digest check failed (decode ranks together).
    pub digest_mismatches: u64,
    /// Request x decode-rank transfers that succeeded.
    pub completed: u32,
    /// Request x decode-rank transfers aborted by decode (their pages reset after the fence and reused).
    pub aborted: u32,
    /// Request x decode-rank transfers that succeeded and matched the oracle byte for byte.
    pub verified: u32,
    /// KV bytes one request moves (all decode ranks together).
    pub bytes_per_request: u64,
    /// Strided ops the planner makes for one request (all pairs, all chunks).
    pub plan_ops_per_request: u64,
    /// Byte ranges the same request is with one op per token and head slice (SGLang's NHD count).
    pub per_token_ranges_per_request: u64,
    /// Per rank.
    pub ranks: Vec<RankLine>,
    /// Request completion latency (decode: handoff to success), microseconds.
    pub latency_us: Latency,
    /// Bytes verified against the oracle.
    pub verified_bytes: u64,
    /// Whether every byte verified and every worker succeeded.
    pub ok: bool,
    /// Every failure.
    pub errors: Vec<String>,
    /// Wall time of the whole run, seconds (process start to last exit).
    pub wall_seconds: f64,
    /// Bytes moved into decode over the longest decode rank's stream time (fill and verify included).
    pub aggregate_gbps: f64,
}

/// Latency percentiles.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Latency {
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Maximum.
    pub max: u64,
    /// Samples (requests x decode ranks).
    pub samples: usize,
}

/// Percentile `q` (0..=100) of sorted samples, nearest-rank.
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

struct Worker {
    name: String,
    decode: bool,
    child: Child,
    /// Its standard input (with `--metrics-listen`): closed once its final metrics were scraped.
    stdin: Option<ChildStdin>,
    status: Option<std::process::ExitStatus>,
    /// The demo killed it (after another worker failed, or at the run's deadline).
    stopped_by_demo: bool,
}

/// How a process ended, in words: `exit code 1`, `killed by signal 9 (SIGKILL)`.
pub fn describe_exit(st: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(c) = st.code() {
        return format!("exit code {c}");
    }
    match st.signal() {
        Some(sig) => {
            let name = match sig {
                1 => "SIGHUP",
                2 => "SIGINT",
                3 => "SIGQUIT",
                4 => "SIGILL",
                6 => "SIGABRT",
                7 => "SIGBUS",
                8 => "SIGFPE",
                9 => "SIGKILL",
                11 => "SIGSEGV",
                13 => "SIGPIPE",
                15 => "SIGTERM",
                _ => "",
            };
            let core = if st.core_dumped() { ", core dumped" } else { "" };
            if name.is_empty() {
                format!("killed by signal {sig}{core}")
            } else {
                format!("killed by signal {sig} ({name}){core}")
            }
        }
        None => format!("ended with {st}"),
    }
}

/// Runs the demo.
pub fn run(args: &DemoArgs) -> ExitCode {
    let w = &args.workload;
    let topo = match w.topology() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvxfer demo: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    match kvxfer_core::backend::lookup(&w.backend) {
        Err(e) => {
            eprintln!("kvxfer demo: {e}");
            return ExitCode::from(2);
        }
        Ok(d) if !d.capabilities.cross_process => {
            eprintln!(
                "kvxfer demo: backend {} only connects endpoints of one process, and the demo's workers are \
                 separate processes; choose a cross-process backend such as tcp",
                d.name
            );
            return ExitCode::from(2);
        }
        Ok(_) => {}
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvxfer demo: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The cluster secret (KVXFER_SECRET, never printed): the workers inherit it from the
    // environment, so the embedded service requires it too, and a named store is checked with it.
    let secret = match Secret::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvxfer demo: {SECRET_ENV}: {e}");
            return ExitCode::from(2);
        }
    };
    // The embedded bootstrap service, unless a store is named; then the store must be reachable
    // and hold no live rank under the prefix (another run, or one not yet expired).
    let config = ServerConfig { secret: secret.clone(), ..ServerConfig::default() };
    let (server, store_args) = match &args.metadata {
        None => match rt.block_on(BootstrapServer::start_with(&args.bootstrap_listen, config)) {
            Ok(s) => {
                let a = vec!["--bootstrap".to_string(), s.addr().to_string()];
                (Some(s), a)
            }
            Err(e) => {
                eprintln!("kvxfer demo: {e}");
                return ExitCode::FAILURE;
            }
        },
        Some(m) => match rt.block_on(check_store(m, secret)) {
            Ok(()) => (None, vec!["--metadata".to_string(), m.clone()]),
            Err(e) => {
                eprintln!("kvxfer demo: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let board: Arc<Mutex<Vec<WorkerMetrics>>> = Arc::default();
    if let Some(listen) = &args.metrics_listen {
        let b = Arc::clone(&board);
        match rt.block_on(crate::metrics_http::serve(listen, Arc::new(move || merged_metrics(&b)))) {
            Ok(a) => eprintln!("kvxfer demo: metrics of every worker at http://{a}/metrics"),
            Err(e) => {
                eprintln!("kvxfer demo: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvxfer demo: cannot find my own executable to start workers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let start = Instant::now();
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut workers: Vec<Worker> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    let ranks: Vec<(Side, kvxfer_core::RankId)> = topo
        .ranks(Side::Decode)
        .into_iter()
        .map(|r| (Side::Decode, r))
        .chain(topo.ranks(Side::Prefill).into_iter().map(|r| (Side::Prefill, r)))
        .collect();
    for (i, (side, rank)) in ranks.iter().enumerate() {
        let mut cmd = Command::new(&exe);
        cmd.arg("worker")
            .args(&store_args)
            .args(["--role", &side.to_string()])
            .args(["--lease-ttl-s", &args.lease_ttl_s.to_string()])
            .args(["--tp-rank", &rank.tp.to_string(), "--pp-stage", &rank.pp.to_string()])
            .args(["--timeout-s", &args.timeout_s.to_string()])
            .args(["--parent-pid", &std::process::id().to_string()])
            .args(w.to_args())
            .args(args.run.to_args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if args.inject_wrong_byte {
            cmd.arg("--inject-wrong-byte");
        }
        if args.metrics_listen.is_some() {
            // The worker serves its metrics on a port of its own and, after its summary, keeps
            // serving until the demo closes its standard input (once it took the final scrape).
            cmd.args(["--metrics-listen", "127.0.0.1:0", "--metrics-hold"]).stdin(Stdio::piped());
        }
        match cmd.spawn() {
            Ok(mut child) => {
                let out = child.stdout.take().expect("piped stdout");
                let stdin = child.stdin.take();
                board.lock().unwrap_or_else(|p| p.into_inner()).push(WorkerMetrics::default());
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(out).lines() {
                        let Ok(line) = line else { break };
                        if tx.send((i, line)).is_err() {
                            break;
                        }
                    }
                });
                workers.push(Worker {
                    name: format!("{side} {rank}"),
                    decode: *side == Side::Decode,
                    child,
                    stdin,
                    status: None,
                    stopped_by_demo: false,
                });
            }
            Err(e) => {
                errors.push(format!("cannot start worker {side} {rank}: {e}"));
                break;
            }
        }
    }
    drop(tx);

    let decode_ranks = topo.ranks(Side::Decode).len() as u64;
    let total = u64::from(w.requests) * decode_ranks;
    let pb = indicatif::ProgressBar::new(total);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} request x decode-rank transfers verified {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut summaries: Vec<WorkerSummary> = Vec::new();
    let deadline = start + Duration::from_secs_f64(args.timeout_s);
    let mut killed = false;
    let mut disconnected = false;
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok((i, line)) => match serde_json::from_str::<serde_json::Value>(&line) {
                Ok(v) => match v["kind"].as_str() {
                    Some("done") => pb.inc(1),
                    Some("aborted") if workers[i].decode => pb.inc(1),
                    Some("failed") => {
                        pb.inc(1);
                        pb.set_message("(failures)");
                    }
                    Some("summary") => {
                        match serde_json::from_value::<WorkerSummary>(v["summary"].clone()) {
                            Ok(s) => summaries.push(s),
                            Err(e) => errors.push(format!("{}: unreadable summary: {e}", workers[i].name)),
                        }
                        // Its final metrics, then let it go.
                        let addr = board.lock().unwrap_or_else(|p| p.into_inner())[i].addr;
                        if let Some(a) = addr {
                            match crate::metrics_http::scrape(a, SCRAPE_TIMEOUT) {
                                Ok(t) => board.lock().unwrap_or_else(|p| p.into_inner())[i].last = Some(t),
                                Err(e) => errors.push(format!("{}: final metrics: {e}", workers[i].name)),
                            }
                        }
                        workers[i].stdin.take();
                    }
                    Some("metrics") => match v["addr"].as_str().map(str::parse::<SocketAddr>) {
                        Some(Ok(a)) => board.lock().unwrap_or_else(|p| p.into_inner())[i].addr = Some(a),
                        _ => errors.push(format!("{}: unreadable metrics address in {line}", workers[i].name)),
                    },
                    Some("error") => {
                        errors.push(format!("{}: {}", workers[i].name, v["message"].as_str().unwrap_or("?")))
                    }
                    _ => {}
                },
                Err(_) => pb.println(format!("{}: {line}", workers[i].name)),
            },
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                disconnected = true;
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let mut failed = false;
        for wk in workers.iter_mut().filter(|w| w.status.is_none()) {
            if let Ok(Some(st)) = wk.child.try_wait() {
                wk.status = Some(st);
                if !st.success() && !wk.stopped_by_demo {
                    failed = true;
                    // Named at once: a worker killed by a signal prints nothing itself.
                    errors.push(format!("worker {} {}", wk.name, describe_exit(st)));
                }
            }
        }
        let all_done = workers.iter().all(|w| w.status.is_some());
        // Every worker exited and every line of their output was handled.
        if all_done && disconnected {
            break;
        }
        let late = Instant::now() >= deadline;
        if (failed || late || !errors.is_empty()) && !killed {
            if late {
                errors.push(format!("the run did not finish within {} s; workers killed", args.timeout_s));
            }
            // One worker failed: the others would wait for it until their deadlines. Give them a
            // moment to report, then stop them.
            std::thread::sleep(Duration::from_millis(500));
            for wk in workers.iter_mut().filter(|w| w.status.is_none()) {
                match wk.child.try_wait() {
                    // It ended by itself in the meantime: named below like any other.
                    Ok(Some(st)) => wk.status = Some(st),
                    _ => {
                        let _ = wk.child.kill();
                        wk.stopped_by_demo = true;
                    }
                }
            }
            killed = true;
        }
    }
    // Every worker that ended badly by itself was named in the loop (the loop ends once all ended).
    for wk in workers.iter_mut() {
        if wk.status.or_else(|| wk.child.wait().ok()).is_some() && wk.stopped_by_demo {
            errors.push(format!("worker {} stopped by the demo", wk.name));
        }
    }
    pb.finish_and_clear();
    drop(server);
    let wall = start.elapsed().as_secs_f64();
    let summary = summarize(w, &args.run, &topo, &summaries, errors, wall, workers.len());
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&summary).expect("summary serializes")),
        Format::Table => print_table(&summary),
    }
    if args.metrics_listen.is_some() && args.metrics_linger_s > 0.0 {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        crate::metrics_http::hold(Duration::from_secs_f64(args.metrics_linger_s));
    }
    if summary.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Connects to the store `addr` names and checks that no rank is registered under its prefix.
async fn check_store(addr: &str, secret: Option<Secret>) -> Result<(), String> {
    let a = kvxfer::metadata::MetadataAddr::parse(addr).map_err(|e| e.to_string())?;
    let store = kvxfer::metadata::connect_with(&a, kvxfer::metadata::DEFAULT_OP_TIMEOUT, secret)
        .await
        .map_err(|e| e.to_string())?;
    let (ranks, _) = store.list("ranks/").await.map_err(|e| e.to_string())?;
    if ranks.is_empty() {
        return Ok(());
    }
    let keys: Vec<&str> = ranks.iter().map(|e| e.key.as_str()).collect();
    Err(format!(
        "{} already holds {} rank records ({}): another run uses this prefix, or its leases have not expired yet; \
         use another prefix or wait for the lease TTL",
        store.name(),
        keys.len(),
        keys.join(", ")
    ))
}

fn summarize(
    w: &Workload,
    run: &RunArgs,
    topo: &Topology,
    summaries: &[WorkerSummary],
    mut errors: Vec<String>,
    wall: f64,
    workers: usize,
) -> DemoSummary {
    for s in summaries {
        errors.extend(s.errors.iter().map(|e| format!("{} {}: {e}", s.role, s.rank)));
    }
    if summaries.len() != workers {
        errors.push(format!("{} of {workers} workers reported a summary", summaries.len()));
    }
    let mut ranks: Vec<RankLine> = summaries
        .iter()
        .map(|s| RankLine {
            role: s.role.clone(),
            rank: s.rank.clone(),
            bytes: s.bytes,
            ops: s.ops,
            seconds: s.seconds,
            transfer_seconds: s.transfer_seconds,
            gbps: if s.transfer_seconds > 0.0 { s.bytes as f64 / s.transfer_seconds / 1e9 } else { 0.0 },
            completed: s.completed,
            aborted: s.aborted,
        })
        .collect();
    ranks.sort_by(|a, b| (&a.role, &a.rank).cmp(&(&b.role, &b.rank)).reverse());
    let mut lat: Vec<u64> = summaries.iter().flat_map(|s| s.latencies_us.iter().copied()).collect();
    lat.sort_unstable();
    let decode: Vec<&WorkerSummary> = summaries.iter().filter(|s| s.role == "decode").collect();
    let verified: u64 = decode.iter().map(|s| s.verified_bytes).sum();
    let decode_secs = decode.iter().map(|s| s.seconds).fold(0.0, f64::max);
    // Every decode rank handled every request, and verified exactly its share of the completed ones.
    let pages = w.pages_per_request();
    let share = |pp: u32| -> u64 {
        let layers = u64::from(topo.stage_layers(Side::Decode, pp));
        topo.kv().kinds().iter().map(|k| topo.buffer_bytes(Side::Decode, *k, pages)).sum::<u64>() * layers
    };
    let mut expected_total = 0;
    for s in &decode {
        let pp = s.rank.rsplit('/').next().and_then(|p| p.parse().ok()).unwrap_or(0);
        expected_total += u64::from(s.completed) * share(pp);
        if errors.is_empty() && s.completed + s.aborted != w.requests {
            errors.push(format!(
                "decode rank {}: {} requests completed and {} aborted, of {}",
                s.rank, s.completed, s.aborted, w.requests
            ));
        }
    }
    if errors.is_empty() && verified != expected_total {
        errors.push(format!("verified {verified} bytes but the completed requests carry {expected_total}"));
    }
    let (plan_ops, per_token) = plan_counts(w, topo);
    let kv = topo.kv();
    DemoSummary {
        model: w.model.name(),
        shape: format!(
            "{} layers, {}, {} layout, page size {}",
            kv.layers,
            match kv.attention {
                kvxfer_core::Attention::Gqa { kv_heads, head_dim_k, head_dim_v } =>
                    format!("{kv_heads} KV heads x {head_dim_k}/{head_dim_v}"),
                kvxfer_core::Attention::Mla { latent_dim } => format!("MLA latent {latent_dim}"),
            },
            kv.layout,
            kv.page_size
        ),
        prefill: format!("TP {} x PP {}", w.prefill_tp, w.prefill_pp),
        decode: format!("TP {} x PP {}", w.decode_tp, w.decode_pp),
        backend: w.backend.clone(),
        notify: format!("{}", kvxfer_core::NotifyStyle::from(w.notify)),
        tokens: w.tokens,
        requests: w.requests,
        abort_rate: run.abort_rate,
        layerwise: run.layerwise,
        digest: run.digest,
        digest_bytes: [
            summaries.iter().filter(|s| s.role == "prefill").map(|s| s.digest_bytes).sum(),
            decode.iter().map(|s| s.digest_bytes).sum(),
        ],
        digest_mismatches: decode.iter().map(|s| s.digest_mismatches).sum(),
        completed: decode.iter().map(|s| s.completed).sum(),
        aborted: decode.iter().map(|s| s.aborted).sum(),
        verified: decode.iter().map(|s| s.verified).sum(),
        bytes_per_request: bytes_per_request(w, topo),
        plan_ops_per_request: plan_ops,
        per_token_ranges_per_request: per_token,
        ranks,
        latency_us: Latency {
            p50: percentile(&lat, 50.0),
            p99: percentile(&lat, 99.0),
            max: lat.last().copied().unwrap_or(0),
            samples: lat.len(),
        },
        verified_bytes: verified,
        ok: errors.is_empty(),
        errors,
        wall_seconds: wall,
        aggregate_gbps: if decode_secs > 0.0 { verified as f64 / decode_secs / 1e9 } else { 0.0 },
    }
}

/// KV bytes of one request over all decode ranks (every decode byte of its pages, written once).
pub fn bytes_per_request(w: &Workload, topo: &Topology) -> u64 {
    let pages = w.pages_per_request();
    topo.ranks(Side::Decode)
        .iter()
        .map(|r| {
            let layers = u64::from(topo.stage_layers(Side::Decode, r.pp));
            topo.kv().kinds().iter().map(|k| topo.buffer_bytes(Side::Decode, *k, pages)).sum::<u64>() * layers
        })
        .sum()
}

/// The planner's op count for request 0 (all pairs and chunks), and the number of contiguous byte
/// ranges the same request is when every token's head slice is its own range.
fn plan_counts(w: &Workload, topo: &Topology) -> (u64, u64) {
    let src = request_pages(w, 0, SALT_PREFILL);
    let dst = request_pages(w, 0, SALT_DECODE);
    let n = if w.chunk_pages == 0 { src.len().max(1) } else { w.chunk_pages as usize };
    let mut ops = 0;
    let mut ranges = 0;
    for (s, d) in src.chunks(n).zip(dst.chunks(n)) {
        if let Ok(p) = plan_chunk(topo, s, d) {
            ops += p.op_count();
            ranges += p
                .pairs
                .iter()
                .map(|pair| {
                    let tokens = s.len() as u64 * u64::from(w.page_size);
                    u64::from(pair.layers) * pair.slices.len() as u64 * tokens
                })
                .sum::<u64>();
        }
    }
    (ops, ranges)
}

fn human(bytes: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", U[i])
}

fn print_table(s: &DemoSummary) {
    println!(
        "kvxfer demo: {} ({}), prefill {} -> decode {}, backend {}, {} notifications",
        s.model, s.shape, s.prefill, s.decode, s.backend, s.notify
    );
    println!(
        "  {} requests x {} tokens, {} per request; plan: {} strided ops per request ({} per-token ranges without striding)",
        s.requests,
        s.tokens,
        human(s.bytes_per_request),
        s.plan_ops_per_request,
        s.per_token_ranges_per_request
    );
    println!(
        "  {:<8} {:<6} {:>12} {:>10} {:>9} {:>10} {:>8}",
        "role", "rank", "bytes", "ops", "stream s", "transfer s", "GB/s"
    );
    for r in &s.ranks {
        println!(
            "  {:<8} {:<6} {:>12} {:>10} {:>9.3} {:>10.3} {:>8.2}",
            r.role,
            r.rank,
            human(r.bytes),
            if r.role == "prefill" { r.ops.to_string() } else { "-".into() },
            r.seconds,
            r.transfer_seconds,
            r.gbps
        );
    }
    println!("  (GB/s = bytes / transfer seconds: prefill from the first chunk to the final status, decode from handoff to success)");
    println!(
        "  request latency (handoff -> success): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms over {} samples",
        s.latency_us.p50 as f64 / 1e3,
        s.latency_us.p99 as f64 / 1e3,
        s.latency_us.max as f64 / 1e3,
        s.latency_us.samples
    );
    println!(
        "  end to end {:.2} GB/s into decode (stream incl. pattern fill and byte-wise verification); wall time {:.1} s",
        s.aggregate_gbps, s.wall_seconds
    );
    if s.aborted > 0 || s.abort_rate > 0.0 || s.layerwise {
        println!(
            "  {} of the request x decode-rank transfers completed and {} verified, {} aborted (--abort-rate {}){}",
            s.completed,
            s.verified,
            s.aborted,
            s.abort_rate,
            if s.layerwise { "; prefill sent layer by layer" } else { "" }
        );
    }
    if s.digest {
        println!(
            "  end-to-end digest: prefill ranks hashed {}, decode ranks {}; {} mismatches",
            human(s.digest_bytes[0]),
            human(s.digest_bytes[1]),
            s.digest_mismatches
        );
    }
    if s.ok {
        println!("  verification: OK, {} verified against the oracle, no stray writes", human(s.verified_bytes));
    } else {
        println!("  verification: FAILED");
        for e in &s.errors {
            println!("    - {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_is_named_by_code_or_signal() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(describe_exit(std::process::ExitStatus::from_raw(1 << 8)), "exit code 1");
        assert_eq!(describe_exit(std::process::ExitStatus::from_raw(9)), "killed by signal 9 (SIGKILL)");
        assert_eq!(
            describe_exit(std::process::ExitStatus::from_raw(11 | 0x80)),
            "killed by signal 11 (SIGSEGV), core dumped"
        );
        assert_eq!(describe_exit(std::process::ExitStatus::from_raw(40)), "killed by signal 40");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&[7], 99.0), 7);
        assert_eq!(percentile(&[], 50.0), 0);
    }
}

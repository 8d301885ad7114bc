//! `kvxfer soak` (hidden; the documented entry point is `scripts/soak.sh`): sustained load with a
//! prefill rank killed and restarted, memory and file descriptors sampled (issue 31, "Sustained
//! load").
//!
//! It starts a bootstrap service, one decode worker and `--prefill-tp` prefill workers (TP P -> 1)
//! on 127.0.0.1, all with `--keep-going --duration-s` and `--abort-rate`. Every `--kill-every` it
//! SIGKILLs the last prefill rank, waits (bounded) until the decode names it lost (its `peer_lost`
//! line), and restarts it (same rank, a new epoch). Every `--sample-every` it reads the RSS
//! (`/proc/PID/status` VmRSS) and the open fd count (`/proc/PID/fd`) of the long-lived processes:
//! the bootstrap, the decode worker and the prefill ranks never killed. At the end it prints a
//! summary (`--format table` or `json`) and exits non-zero if a check failed:
//!
//! - every long-lived process's RSS and fd count, from the first sample after `--warmup` to the last
//!   one and to the largest, grew by at most `--max-growth-pct`;
//! - no wrong byte: the decode counted every completed request verified, and its summary has no
//!   error (a wrong byte, a byte changed after a fence or outside any request, a request whose
//!   pages never became reusable, quarantined pages);
//! - every kill: the decode named the killed rank and epoch lost, and the restarted rank served
//!   requests again (it sent some, and the decode completed some after its restart);
//! - every worker exited 0 at the end.
//!
//! Every wait is bounded. Children are killed when the driver returns or panics; the workers also
//! stop by themselves if the driver dies (`--parent-pid`), and the bootstrap after the run's length
//! plus 10 minutes (`--for-s`). Ctrl-C in a terminal reaches the whole process group.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::plan::Format;
use crate::worker::parse_rate;

/// Arguments of `kvxfer soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// How long requests stream: `90s`, `30m`, `1h` or seconds.
    #[arg(long, default_value = "30m", value_parser = parse_span)]
    pub duration: Duration,
    /// SIGKILL the last prefill rank this often (and restart it); none closer than 20 s to the end.
    #[arg(long, default_value = "5m", value_parser = parse_span)]
    pub kill_every: Duration,
    /// Sample RSS and open fds this often.
    #[arg(long, default_value = "10s", value_parser = parse_span)]
    pub sample_every: Duration,
    /// Samples before this are warm-up: growth is measured from the first sample after it.
    #[arg(long, default_value = "2m", value_parser = parse_span)]
    pub warmup: Duration,
    /// Prefill ranks (TP), all feeding one decode rank; the last one is killed. With 1 no prefill
    /// process lives the whole run.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub prefill_tp: u32,
    /// The decode aborts this fraction of requests (`kvxfer worker --abort-rate`).
    #[arg(long, default_value_t = 0.3, value_parser = parse_rate)]
    pub abort_rate: f64,
    /// Tokens per request.
    #[arg(long, default_value_t = 256)]
    pub tokens: u32,
    /// Requests in flight at once per worker.
    #[arg(long, default_value_t = 4)]
    pub inflight: u32,
    /// Model layers (the default model's shape otherwise).
    #[arg(long, default_value_t = 4)]
    pub layers: u32,
    /// Transport (`kvxfer worker --backend`).
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Lease TTL of every rank, seconds: a killed rank is named lost within about this long (the
    /// worker's default; shorter leases may expire on a loaded machine).
    #[arg(long, default_value_t = 5.0, value_parser = crate::model::parse_seconds)]
    pub lease_ttl_s: f64,
    /// Request deadline of the workers, seconds.
    #[arg(long, default_value_t = 20.0, value_parser = crate::model::parse_seconds)]
    pub request_timeout_s: f64,
    /// Largest allowed growth of RSS and of the fd count after warm-up, percent.
    #[arg(long, default_value_t = 5.0)]
    pub max_growth_pct: f64,
    /// Keep the workers' logs here, and the JSON report (`report.json`) whatever the format
    /// (default: a new directory under the system's temp dir).
    #[arg(long)]
    pub logs: Option<PathBuf>,
    /// One more flag for every worker (repeatable), e.g. `--worker-arg=--digest`.
    #[arg(long, allow_hyphen_values = true)]
    pub worker_arg: Vec<String>,
    /// Output format of the summary.
    #[arg(long, value_enum, default_value = "table")]
    pub format: Format,
}

/// Parses `90s`, `30m`, `1h`, `1.5m` or plain seconds.
pub fn parse_span(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, unit) = match t.char_indices().last() {
        Some((i, 's')) => (&t[..i], 1.0),
        Some((i, 'm')) => (&t[..i], 60.0),
        Some((i, 'h')) => (&t[..i], 3600.0),
        _ => (t, 1.0),
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v * unit <= 86_400.0 => Ok(Duration::from_secs_f64(v * unit)),
        _ => Err(format!("`{s}` is not a duration such as 90s, 30m or 1h (at most 24h)")),
    }
}

/// No kill closer than this to the end of the run (the restarted rank must have time to serve).
const KILL_MARGIN: Duration = Duration::from_secs(20);
/// The prefill workers stream this much longer than the decode (its last handoffs are served).
const PREFILL_EXTRA: Duration = Duration::from_secs(5);
/// After the run, each worker must have exited within this.
const EXIT_BOUND: Duration = Duration::from_secs(180);
/// A restarted rank must print `registered` within this.
const START_BOUND: Duration = Duration::from_secs(60);

/// What the driver learned from one child's JSON lines.
#[derive(Default)]
struct Seen {
    epoch: Option<u64>,
    done: u64,
    sent: u64,
    /// `peer_lost` lines: (role, rank, epoch, when).
    lost: Vec<(String, String, u64, Instant)>,
    summary: Option<Value>,
    addr: Option<String>,
}

/// A child process, SIGKILLed (and reaped) when dropped.
struct Kid {
    name: String,
    child: Child,
    seen: Arc<Mutex<Seen>>,
    exit: Option<i32>,
}

impl Kid {
    /// Starts `cmd`; its stdout lines (less those of single requests) go to `logs/STEM.out`, its
    /// stderr to `logs/STEM.err`.
    fn spawn(name: &str, mut cmd: Command, logs: &Path, stem: &str) -> Result<Kid, String> {
        let file = logs.join(format!("{stem}.err"));
        let err = File::create(&file).map_err(|e| format!("cannot create {}: {e}", file.display()))?;
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(err);
        let mut child = cmd.spawn().map_err(|e| format!("cannot start {name}: {e}"))?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let out = child.stdout.take().expect("piped");
        let log = logs.join(format!("{stem}.out"));
        let mut log = File::create(&log).map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let s = Arc::clone(&seen);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
                let kind = v["kind"].as_str().unwrap_or("");
                if !matches!(kind, "done" | "sent") {
                    let _ = writeln!(log, "{line}");
                }
                let mut s = lock(&s);
                match kind {
                    "done" => s.done += 1,
                    "sent" => s.sent += 1,
                    "registered" => s.epoch = v["epoch"].as_u64(),
                    "summary" => s.summary = Some(v["summary"].clone()),
                    "peer_lost" => {
                        let p = &v["peer"];
                        let (role, rank) = (p["role"].as_str().unwrap_or(""), p["rank"].as_str().unwrap_or(""));
                        s.lost.push((
                            role.to_owned(),
                            rank.to_owned(),
                            p["epoch"].as_u64().unwrap_or(0),
                            Instant::now(),
                        ));
                    }
                    _ if line.starts_with("bootstrap listening on ") => {
                        s.addr = line.rsplit(' ').next().map(str::to_owned);
                    }
                    _ => {}
                }
            }
        });
        Ok(Kid { name: name.to_owned(), child, seen, exit: None })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit code once exited (-1: by a signal).
    fn exited(&mut self) -> Option<i32> {
        if self.exit.is_none() {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.exit = Some(st.code().unwrap_or(-1));
            }
        }
        self.exit
    }

    /// Waits at most `within` for the exit.
    fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        let end = Instant::now() + within;
        while self.exited().is_none() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.exited()
    }

    /// SIGKILL (std's `Child::kill`) and reap.
    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.exit.get_or_insert(-9);
    }

    /// Waits at most `within` until `f` holds of what the child printed.
    fn wait_seen(&self, within: Duration, f: impl Fn(&Seen) -> bool) -> bool {
        let end = Instant::now() + within;
        loop {
            if f(&lock(&self.seen)) {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.kill9();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// RSS (KiB) and open fds of a process now; `None` once it is gone.
fn sample_pid(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss, fds))
}

/// One sample of every long-lived process.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Seconds since the workers started.
    pub t_s: f64,
    /// Per process: RSS in KiB and open fds.
    pub procs: BTreeMap<String, (u64, u64)>,
}

/// Growth of one figure after warm-up.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Growth {
    /// The first sample after warm-up.
    pub first: u64,
    /// The last sample.
    pub last: u64,
    /// The largest sample after warm-up.
    pub max: u64,
    /// (last - first) / first, percent.
    pub last_pct: f64,
    /// (max - first) / first, percent.
    pub max_pct: f64,
}

impl Growth {
    fn of(v: &[u64]) -> Growth {
        let (Some(&first), Some(&last)) = (v.first(), v.last()) else { return Growth::default() };
        let max = v.iter().copied().max().unwrap_or(first);
        let pct = |x: u64| if first == 0 { 0.0 } else { (x as f64 - first as f64) * 100.0 / first as f64 };
        Growth { first, last, max, last_pct: pct(last), max_pct: pct(max) }
    }
}

/// A long-lived process's figures after warm-up.
#[derive(Debug, Clone, Serialize)]
pub struct ProcFigures {
    /// `bootstrap`, `decode 0/0`, `prefill 0/0`.
    pub name: String,
    /// Samples after warm-up.
    pub samples: usize,
    /// RSS, KiB.
    pub rss_kib: Growth,
    /// Open file descriptors.
    pub fds: Growth,
}

/// One kill and restart.
#[derive(Debug, Clone, Serialize)]
pub struct Kill {
    /// Seconds since the workers started.
    pub at_s: f64,
    /// The killed rank (`tp/pp`).
    pub rank: String,
    /// Its epoch (the killed instance).
    pub epoch: u64,
    /// Seconds from the kill to the decode's `peer_lost` line for that rank and epoch.
    pub named_after_s: Option<f64>,
    /// The restarted instance's epoch.
    pub restarted_epoch: Option<u64>,
    /// Requests the restarted instance sent (until the next kill or the end).
    pub restarted_sent: u64,
    /// Requests the decode completed (verified) after the restart, until the next kill or the end.
    pub decode_done_after: u64,
    /// Named, and the restarted instance served requests again.
    pub ok: bool,
    #[serde(skip)]
    done_at_restart: u64,
}

/// Request counts (the decode's summary; `abandoned` from the prefill ranks' summaries).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Requests {
    /// Completed on the decode.
    pub completed: u64,
    /// Completed and every byte matched the oracle.
    pub verified: u64,
    /// Bytes verified.
    pub verified_bytes: u64,
    /// Aborted by the decode (`--abort-rate`).
    pub aborted: u64,
    /// Failed (a lost peer, a deadline) and counted (`--keep-going`).
    pub failed: u64,
    /// Of those, requests whose pages never became reusable (the worker's `quarantined`).
    pub quarantined: u64,
    /// Requests prefill ranks gave up before their handoff (numbering moved on, end of run).
    pub prefill_abandoned: u64,
    /// Decode errors about bytes: a wrong byte, a byte changed after a fence or outside any
    /// request (each error is one request or one buffer; must be 0). Pages of a request that
    /// never became reusable are not checked (`quarantined` counts it).
    pub wrong_byte_errors: u64,
}

/// What `kvxfer soak` reports.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    /// `--duration`, seconds.
    pub duration_s: f64,
    /// `--kill-every`, seconds.
    pub kill_every_s: f64,
    /// `--sample-every`, seconds.
    pub sample_every_s: f64,
    /// `--warmup`, seconds.
    pub warmup_s: f64,
    /// Prefill TP (decode TP 1).
    pub prefill_tp: u32,
    /// `--abort-rate`.
    pub abort_rate: f64,
    /// Tokens per request, requests in flight, layers, backend.
    pub workload: String,
    /// `--max-growth-pct`.
    pub max_growth_pct: f64,
    /// Where the workers' logs are.
    pub logs: String,
    /// Per long-lived process.
    pub processes: Vec<ProcFigures>,
    /// Requests.
    pub requests: Requests,
    /// Kills.
    pub kills: Vec<Kill>,
    /// Worker exit codes (`name: code`; -1: by a signal, none: still running past the bound).
    pub exits: BTreeMap<String, Option<i32>>,
    /// Every failed check (empty: all passed).
    pub failed_checks: Vec<String>,
    /// Every sample.
    pub samples: Vec<Sample>,
}

/// Runs the soak; exit code 0 only if every check passed.
pub fn run(args: &SoakArgs) -> ExitCode {
    match soak(args) {
        Ok(r) => {
            let file = Path::new(&r.logs).join("report.json");
            let json = serde_json::to_string_pretty(&r).expect("report serializes");
            if let Err(e) = std::fs::write(&file, json + "\n") {
                eprintln!("kvxfer soak: cannot write {}: {e}", file.display());
            }
            match args.format {
                Format::Json => println!("{}", serde_json::to_string_pretty(&r).expect("report serializes")),
                Format::Table => print_table(&r),
            }
            if r.failed_checks.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("kvxfer soak: {e}");
            ExitCode::FAILURE
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{}", d.as_secs_f64())
}

fn soak(a: &SoakArgs) -> Result<SoakReport, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the kvxfer executable: {e}"))?;
    let logs =
        a.logs.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("kvxfer-soak-{}", std::process::id())));
    std::fs::create_dir_all(&logs).map_err(|e| format!("cannot create the log directory {}: {e}", logs.display()))?;
    eprintln!("kvxfer soak: logs in {}", logs.display());
    let mut boot_cmd = Command::new(&exe);
    boot_cmd.args(["bootstrap", "--listen", "127.0.0.1:0", "--for-s"]).arg(secs(a.duration + Duration::from_secs(600)));
    let boot = Kid::spawn("bootstrap", boot_cmd, &logs, "bootstrap")?;
    if !boot.wait_seen(Duration::from_secs(20), |s| s.addr.is_some()) {
        return Err(format!("the bootstrap printed no address within 20 s (see {})", logs.display()));
    }
    let addr = lock(&boot.seen).addr.clone().expect("seen");
    let victim = a.prefill_tp - 1;
    let worker = |role: &str, tp: u32, run: Duration| {
        let mut c = Command::new(&exe);
        c.args(["worker", "--bootstrap", &addr, "--role", role, "--tp-rank", &tp.to_string()])
            .args(["--prefill-tp", &a.prefill_tp.to_string(), "--decode-tp", "1"])
            .args(["--layers", &a.layers.to_string(), "--tokens", &a.tokens.to_string()])
            .args(["--inflight", &a.inflight.to_string(), "--backend", &a.backend])
            .args(["--abort-rate", &a.abort_rate.to_string(), "--lease-ttl-s", &a.lease_ttl_s.to_string()])
            .args(["--request-timeout-s", &a.request_timeout_s.to_string(), "--keep-going"])
            .args(["--duration-s", &secs(run), "--parent-pid", &std::process::id().to_string()])
            .args(&a.worker_arg);
        c.env_remove("KVXFER_SECRET");
        c
    };
    let mut decode = Kid::spawn("decode 0/0", worker("decode", 0, a.duration), &logs, "decode_0")?;
    let t0 = Instant::now();
    let mut prefills = Vec::new();
    for tp in 0..a.prefill_tp {
        let (name, stem) = (format!("prefill {tp}/0"), format!("prefill_{tp}"));
        prefills.push(Kid::spawn(&name, worker("prefill", tp, a.duration + PREFILL_EXTRA), &logs, &stem)?);
    }
    let long_lived: Vec<(String, u32)> =
        [("bootstrap".to_owned(), boot.pid()), ("decode 0/0".to_owned(), decode.pid())]
            .into_iter()
            .chain(
                prefills.iter().filter(|p| p.name != format!("prefill {victim}/0")).map(|p| (p.name.clone(), p.pid())),
            )
            .collect();
    let mut samples: Vec<Sample> = Vec::new();
    let mut kills: Vec<Kill> = Vec::new();
    let mut retired: Vec<Kid> = Vec::new();
    let mut failed_checks = Vec::new();
    let end = t0 + a.duration;
    let (mut next_sample, mut next_kill) = (t0, t0 + a.kill_every);
    while Instant::now() < end {
        let now = Instant::now();
        if now >= next_sample {
            let mut procs = BTreeMap::new();
            for (name, pid) in &long_lived {
                if let Some(v) = sample_pid(*pid) {
                    procs.insert(name.clone(), v);
                }
            }
            let t_s = (now - t0).as_secs_f64();
            let line: Vec<String> =
                procs.iter().map(|(n, (r, f))| format!("{n} {:.1} MiB {f} fds", *r as f64 / 1024.0)).collect();
            eprintln!("kvxfer soak: {t_s:7.1} s  {}  (decode done {})", line.join(", "), lock(&decode.seen).done);
            samples.push(Sample { t_s, procs });
            next_sample += a.sample_every;
        }
        if let Some(code) = decode.exited() {
            failed_checks.push(format!("the decode worker exited early ({code}); see {}", logs.display()));
            break;
        }
        if let Some(p) = prefills.iter_mut().find_map(|p| p.exited().map(|_| p)) {
            failed_checks.push(format!("{} exited early ({:?}); see {}", p.name, p.exit, logs.display()));
            break;
        }
        if now >= next_kill && next_kill + KILL_MARGIN <= end {
            next_kill += a.kill_every;
            record_service(&mut kills, &prefills, victim, &decode);
            let k = kill_and_restart(a, &mut prefills, victim, &decode, &worker, t0, end, &logs, kills.len() + 1)?;
            if let Some(old) = k.1 {
                retired.push(old);
            }
            kills.push(k.0);
            continue;
        }
        std::thread::sleep(Duration::from_millis(50).min(next_sample.saturating_duration_since(Instant::now())));
    }
    // The end of the run: the workers finish their requests, check and leave.
    let mut exits = BTreeMap::new();
    exits.insert(decode.name.clone(), decode.wait_exit(EXIT_BOUND));
    for p in &mut prefills {
        exits.insert(p.name.clone(), p.wait_exit(EXIT_BOUND));
    }
    // Served after each restart: until the next kill (recorded then) or the end.
    record_service(&mut kills, &prefills, victim, &decode);
    for k in &mut kills {
        k.ok = k.named_after_s.is_some() && k.restarted_sent > 0 && k.decode_done_after > 0;
        if k.named_after_s.is_none() {
            failed_checks.push(format!(
                "kill at {:.0} s: the decode never named prefill rank {} (epoch {}) lost",
                k.at_s, k.rank, k.epoch
            ));
        }
        if k.restarted_sent == 0 || k.decode_done_after == 0 {
            failed_checks.push(format!(
                "kill at {:.0} s: the restarted prefill rank {} was not back in service (it sent {}, the decode completed {} after its restart)",
                k.at_s, k.rank, k.restarted_sent, k.decode_done_after
            ));
        }
    }
    for (name, code) in &exits {
        if *code != Some(0) {
            failed_checks.push(format!("{name} exited {code:?} at the end (0 expected); see {}", logs.display()));
        }
    }
    let mut requests = Requests::default();
    match lock(&decode.seen).summary.clone() {
        Some(s) => {
            let n = |k: &str| s[k].as_u64().unwrap_or(0);
            requests.completed = n("completed");
            requests.verified = n("verified");
            requests.verified_bytes = n("verified_bytes");
            requests.aborted = n("aborted");
            requests.failed = n("failed");
            requests.quarantined = n("quarantined");
            let errors: Vec<String> =
                s["errors"].as_array().into_iter().flatten().filter_map(|e| e.as_str().map(str::to_owned)).collect();
            requests.wrong_byte_errors = errors
                .iter()
                .filter(|e| e.contains("verification failed") || e.contains("bytes changed") || e.contains("wrong"))
                .count() as u64;
            if requests.completed != requests.verified {
                failed_checks.push(format!(
                    "the decode completed {} requests but verified {}",
                    requests.completed, requests.verified
                ));
            }
            for e in errors.iter().take(10) {
                failed_checks.push(format!("decode: {e}"));
            }
        }
        None => failed_checks.push(format!("the decode printed no summary; see {}", logs.display())),
    }
    for p in prefills.iter().chain(&retired) {
        if let Some(s) = &lock(&p.seen).summary {
            requests.prefill_abandoned += s["abandoned"].as_u64().unwrap_or(0);
        }
    }
    // Growth after warm-up.
    let warm: Vec<&Sample> = samples.iter().filter(|s| s.t_s >= a.warmup.as_secs_f64()).collect();
    let mut processes = Vec::new();
    for (name, _) in &long_lived {
        let rss: Vec<u64> = warm.iter().filter_map(|s| s.procs.get(name).map(|v| v.0)).collect();
        let fds: Vec<u64> = warm.iter().filter_map(|s| s.procs.get(name).map(|v| v.1)).collect();
        let f =
            ProcFigures { name: name.clone(), samples: rss.len(), rss_kib: Growth::of(&rss), fds: Growth::of(&fds) };
        if f.samples < 2 {
            failed_checks.push(format!("{name}: {} samples after the warm-up (2 needed)", f.samples));
        }
        for (what, g) in [("RSS", &f.rss_kib), ("open fds", &f.fds)] {
            if g.last_pct > a.max_growth_pct || g.max_pct > a.max_growth_pct {
                failed_checks.push(format!(
                    "{name}: {what} grew after the warm-up: {} -> last {} ({:+.1}%), max {} ({:+.1}%), limit {}%",
                    g.first, g.last, g.last_pct, g.max, g.max_pct, a.max_growth_pct
                ));
            }
        }
        processes.push(f);
    }
    drop(boot);
    Ok(SoakReport {
        duration_s: a.duration.as_secs_f64(),
        kill_every_s: a.kill_every.as_secs_f64(),
        sample_every_s: a.sample_every.as_secs_f64(),
        warmup_s: a.warmup.as_secs_f64(),
        prefill_tp: a.prefill_tp,
        abort_rate: a.abort_rate,
        workload: format!(
            "{} tokens, {} in flight, {} layers, {}, lease TTL {} s, request timeout {} s",
            a.tokens, a.inflight, a.layers, a.backend, a.lease_ttl_s, a.request_timeout_s
        ),
        max_growth_pct: a.max_growth_pct,
        logs: logs.display().to_string(),
        processes,
        requests,
        kills,
        exits,
        failed_checks,
        samples,
    })
}

/// What the last restarted instance served so far: its `sent` lines, the decode's `done` lines since
/// its restart.
fn record_service(kills: &mut [Kill], prefills: &[Kid], victim: u32, decode: &Kid) {
    let done_now = lock(&decode.seen).done;
    if let (Some(k), Some(p)) = (kills.last_mut(), prefills.iter().find(|p| p.name == format!("prefill {victim}/0"))) {
        k.restarted_sent = lock(&p.seen).sent;
        k.decode_done_after = done_now - k.done_at_restart;
    }
}

/// Kills prefill rank `victim`, waits (bounded) for the decode to name it lost, restarts it.
/// Returns the kill and the killed process (kept for its logs).
#[allow(clippy::too_many_arguments)]
fn kill_and_restart(
    a: &SoakArgs,
    prefills: &mut [Kid],
    victim: u32,
    decode: &Kid,
    worker: &dyn Fn(&str, u32, Duration) -> Command,
    t0: Instant,
    end: Instant,
    logs: &Path,
    nth: usize,
) -> Result<(Kill, Option<Kid>), String> {
    let name = format!("prefill {victim}/0");
    let i = prefills.iter().position(|p| p.name == name).expect("the victim is a prefill rank");
    let rank = format!("{victim}/0");
    let epoch = lock(&prefills[i].seen).epoch.unwrap_or(0);
    let killed_at = Instant::now();
    prefills[i].kill9();
    let at_s = (killed_at - t0).as_secs_f64();
    eprintln!("kvxfer soak: {at_s:7.1} s  SIGKILL prefill {rank} (pid {}, epoch {epoch})", prefills[i].pid());
    let bound = Duration::from_secs_f64(a.lease_ttl_s) + Duration::from_secs(15);
    let named = decode.wait_seen(bound, |s| s.lost.iter().any(|l| l.0 == "prefill" && l.1 == rank && l.2 == epoch));
    let named_after_s = named.then(|| {
        let s = lock(&decode.seen);
        let at = s.lost.iter().find(|l| l.0 == "prefill" && l.1 == rank && l.2 == epoch).map(|l| l.3);
        at.map_or(0.0, |at| at.saturating_duration_since(killed_at).as_secs_f64())
    });
    let run = end.saturating_duration_since(Instant::now()) + PREFILL_EXTRA;
    let n = prefills[i].name.clone();
    let stem = format!("prefill_{victim}.restart{nth}");
    let restarted =
        Kid::spawn(&n, worker("prefill", victim, run), logs, &stem).map_err(|e| format!("restarting {n}: {e}"))?;
    let mut old = std::mem::replace(&mut prefills[i], restarted);
    old.name = format!("{n} (epoch {epoch})");
    let restarted_epoch =
        if prefills[i].wait_seen(START_BOUND, |s| s.epoch.is_some()) { lock(&prefills[i].seen).epoch } else { None };
    let done_at_restart = lock(&decode.seen).done;
    eprintln!(
        "kvxfer soak: {:7.1} s  prefill {rank} named lost after {} s, restarted (epoch {restarted_epoch:?})",
        (Instant::now() - t0).as_secs_f64(),
        named_after_s.map_or("never".to_owned(), |s| format!("{s:.2}")),
    );
    Ok((
        Kill {
            at_s,
            rank,
            epoch,
            named_after_s,
            restarted_epoch,
            restarted_sent: 0,
            decode_done_after: 0,
            ok: false,
            done_at_restart,
        },
        Some(old),
    ))
}

fn print_table(r: &SoakReport) {
    println!(
        "kvxfer soak: {:.0} s, prefill TP {} -> decode TP 1, abort rate {}, prefill rank {}/0 killed every {:.0} s, samples every {:.0} s, warm-up {:.0} s",
        r.duration_s,
        r.prefill_tp,
        r.abort_rate,
        r.prefill_tp - 1,
        r.kill_every_s,
        r.sample_every_s,
        r.warmup_s
    );
    println!("workload: {}", r.workload);
    println!();
    println!(
        "{:<12} {:>7} | {:>9} {:>9} {:>9} {:>7} {:>7} | {:>4} {:>4} {:>4} {:>7} {:>7}",
        "process", "samples", "RSS MiB", "last", "max", "last %", "max %", "fds", "last", "max", "last %", "max %"
    );
    let mib = |k: u64| k as f64 / 1024.0;
    for p in &r.processes {
        println!(
            "{:<12} {:>7} | {:>9.1} {:>9.1} {:>9.1} {:>+7.1} {:>+7.1} | {:>4} {:>4} {:>4} {:>+7.1} {:>+7.1}",
            p.name,
            p.samples,
            mib(p.rss_kib.first),
            mib(p.rss_kib.last),
            mib(p.rss_kib.max),
            p.rss_kib.last_pct,
            p.rss_kib.max_pct,
            p.fds.first,
            p.fds.last,
            p.fds.max,
            p.fds.last_pct,
            p.fds.max_pct
        );
    }
    println!("(RSS and fds: the first sample after the warm-up, the last, the largest; growth from the first)");
    println!();
    let q = &r.requests;
    println!(
        "requests (decode): completed {} (verified {}, {:.2} GB), aborted {}, failed {} (pages never reusable {}), wrong-byte errors {}; prefill abandoned {}",
        q.completed,
        q.verified,
        q.verified_bytes as f64 / 1e9,
        q.aborted,
        q.failed,
        q.quarantined,
        q.wrong_byte_errors,
        q.prefill_abandoned
    );
    println!();
    if r.kills.is_empty() {
        println!("kills: none (a kill needs --kill-every + 20 s within --duration)");
    }
    println!(
        "{:>3} {:>8} {:>5} {:>6} {:>12} {:>10} {:>10} {:>12} {:>4}",
        "#", "at s", "rank", "epoch", "named after", "new epoch", "it sent", "decode done", "ok"
    );
    for (i, k) in r.kills.iter().enumerate() {
        println!(
            "{:>3} {:>8.1} {:>5} {:>6} {:>12} {:>10} {:>10} {:>12} {:>4}",
            i + 1,
            k.at_s,
            k.rank,
            k.epoch,
            k.named_after_s.map_or("never".to_owned(), |s| format!("{s:.2} s")),
            k.restarted_epoch.map_or("-".to_owned(), |e| e.to_string()),
            k.restarted_sent,
            k.decode_done_after,
            if k.ok { "yes" } else { "NO" }
        );
    }
    println!();
    for (n, c) in &r.exits {
        println!("{n}: exit {}", c.map_or("none (still running)".to_owned(), |c| c.to_string()));
    }
    println!("logs: {}", r.logs);
    if r.failed_checks.is_empty() {
        println!("soak: every check passed");
    } else {
        for f in &r.failed_checks {
            println!("FAILED: {f}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans() {
        assert_eq!(parse_span("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_span("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_span("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_span("1.5m"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_span("12"), Ok(Duration::from_secs(12)));
        for bad in ["", "m", "-1s", "0", "25h", "x"] {
            assert!(parse_span(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn growth() {
        let g = Growth::of(&[100, 104, 103, 101]);
        assert_eq!((g.first, g.last, g.max), (100, 101, 104));
        assert!((g.last_pct - 1.0).abs() < 1e-9 && (g.max_pct - 4.0).abs() < 1e-9);
        assert_eq!(Growth::of(&[]).first, 0);
    }
}

//! `kvxfer worker`: one prefill or decode rank of a run, driven through the engine API as a serving
//! engine drives it: one [`Agent`] per process, `--inflight` request slots (slot `s` handles requests
//! `s, s + inflight, ...` on its own pages, reused as soon as the previous request is released).
//! `kvxfer demo` spawns these; on several hosts start them by hand with the same workload flags.
//!
//! Decode: `receiver`, `send_metadata(pages)`, wait for the final status; on success verify every
//! byte against the oracle (from head ownership, not the planner) and write the sentinel back;
//! `release`. `--abort-rate F` aborts a deterministic fraction F of requests right after the handoff
//! or after a short delay; once final with `pages_reusable` the pages get the sentinel and are reused
//! at once (the slot's next request first checks they kept it: nothing landed after the fence).
//! Prefill: `sender`, fill the source pages with the oracle pattern, `init`, wait for the handoffs,
//! `send` per chunk (`send_layers` per layer with `--layerwise`), wait, `release`; a request a decode
//! rank aborted counts as aborted, any other failure is an error.
//!
//! At the end each decode rank checks that its whole pool holds the sentinel (no stray write) and puts
//! `finished/<tp>.<pp>` (under a lease, deleted at the end); prefill ranks leave once their receivers
//! finished, decode ranks once their senders left, so no exit looks like a loss. A watch on the rank
//! records prints `peer_joined`/`peer_left`/`peer_lost`; after a failure with a lost peer the worker
//! waits at most the lease TTL + 1 s for the store's verdict, so the report names the rank.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::engine::{Agent, AgentConfig, EngineError, KvMemory, Phase, Receiver, RequestStatus, Sender};
use kvxfer::metadata::auth::Secret;
use kvxfer::metadata::members::rank_key as record_key;
use kvxfer::metadata::{self, wait_until, wait_value, MemberEvent, MemberWatch, MetadataAddr, MetadataStore};
use kvxfer_core::oracle::{BufferGeom, SENTINEL};
use kvxfer_core::plan::plan_sender;
use kvxfer_core::{RankId, RequestId, Side};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::model::{request_pages, token_base, SplitMix, Workload};

/// Salts of the two sides' page permutations (every decode rank makes the same choice for its own pool).
pub const SALT_PREFILL: u64 = 0x5052_4546;
/// See [`SALT_PREFILL`].
pub const SALT_DECODE: u64 = 0x4445_434f;
/// Salt of the abort choice.
const SALT_ABORT: u64 = 0x4142_4f52;

/// Which side a worker plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoleArg {
    /// A prefill rank (sends).
    Prefill,
    /// A decode rank (receives and verifies).
    Decode,
}

impl From<RoleArg> for Side {
    fn from(r: RoleArg) -> Self {
        match r {
            RoleArg::Prefill => Side::Prefill,
            RoleArg::Decode => Side::Decode,
        }
    }
}

/// Parses `--abort-rate`: a fraction in [0, 1].
pub fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a fraction in [0, 1]")),
    }
}

/// The run switches `demo` passes on to every worker.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Decode ranks abort this fraction of requests (deterministic, the same requests on every
    /// rank) right after the handoff or after a short delay, wait for the fence, and reuse the pages
    /// at once.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub abort_rate: f64,
    /// Prefill ranks send each chunk layer by layer (`Sender::send_layers`).
    #[arg(long)]
    pub layerwise: bool,
    /// Decode ranks verify an end-to-end digest of every request (`AgentConfig::digest`): each
    /// prefill rank hashes what it writes, each decode rank what landed, and a request succeeds
    /// only if they agree.
    #[arg(long)]
    pub digest: bool,
}

impl RunArgs {
    /// The flags that reproduce these switches.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec!["--abort-rate".to_owned(), self.abort_rate.to_string()];
        if self.layerwise {
            a.push("--layerwise".into());
        }
        if self.digest {
            a.push("--digest".into());
        }
        a
    }
}

/// Arguments of `kvxfer worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// Bootstrap service address (`host:port`), printed by `kvxfer bootstrap`.
    #[arg(long, required_unless_present = "metadata", conflicts_with = "metadata")]
    pub bootstrap: Option<String>,
    /// Metadata store instead of `--bootstrap`: `etcd://host:port[,host:port...][/prefix]` (cargo
    /// feature `etcd`) or `bootstrap://host:port[/prefix]`. The prefix namespaces the cluster.
    #[arg(long)]
    pub metadata: Option<String>,
    /// Lease time to live of this rank's record, seconds: a rank that dies is reported lost by its
    /// peers within about this long.
    #[arg(long, default_value_t = 5.0, value_parser = crate::model::parse_seconds)]
    pub lease_ttl_s: f64,
    /// Prefill or decode.
    #[arg(long, value_enum)]
    pub role: RoleArg,
    /// This rank's TP rank.
    #[arg(long, default_value_t = 0)]
    pub tp_rank: u32,
    /// This rank's PP stage.
    #[arg(long, default_value_t = 0)]
    pub pp_stage: u32,
    /// Deadline of every wait for peers (connecting, the end of the run), in seconds.
    #[arg(long, default_value_t = 120.0, value_parser = crate::model::parse_seconds)]
    pub timeout_s: f64,
    /// The cluster's shared secret, from this file (its bytes, trailing whitespace dropped); without
    /// it, from `KVXFER_SECRET` when that is set. Proved to the bootstrap service on every request and
    /// given to the backend (which then admits only ranks with the same secret).
    #[arg(long)]
    pub secret_file: Option<std::path::PathBuf>,
    /// Stop when the process with this id is no longer this worker's parent (it died and the worker
    /// was re-parented): in-flight requests are aborted (fenced), the agent shuts down, and the worker
    /// exits non-zero naming its parent; if that takes longer than 20 s it exits at once. `demo`
    /// passes its own id, so no worker outlives a demo that was killed.
    #[arg(long)]
    pub parent_pid: Option<u32>,
    /// Decode: seconds to wait, once the requests ended (finished or failed), before the final
    /// check of the whole pool. A fault test sets it so that a peer this rank gave up on, which may
    /// well resume (a stopped process, a healed partition), has time to write; the check then finds
    /// any byte that got past the fence.
    #[arg(long, default_value_t = 0.0, value_parser = crate::model::parse_seconds_or_zero)]
    pub linger_s: f64,
    /// Serve this rank's metrics (OpenMetrics text, see docs/operations.md) at `http://ADDR/metrics`
    /// while the worker runs; `127.0.0.1:0` picks a port. The address bound is printed as a
    /// progress line (`{"kind":"metrics","addr":...}`). After the requests ended the figures stay
    /// those of the end of the run.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// With `--metrics-listen`: after printing the summary, keep serving the final metrics until
    /// standard input is closed (at most 30 s). `demo` sets it to take each worker's final scrape.
    #[arg(long, hide = true, requires = "metrics_listen")]
    pub metrics_hold: bool,
    /// Pin the newest kvxfer protocol this rank speaks (`AgentConfig::protocol`): during a rolling
    /// upgrade, `--protocol 2` makes an upgraded rank speak as the previous release does. Unset: this
    /// build's newest. See docs/operations.md#versions-and-rolling-upgrades.
    #[arg(long)]
    pub protocol: Option<u16>,
    /// Long runs: stream requests for this many seconds (no new request starts after it; those in
    /// flight finish), then end the run as usual (decode: the whole-pool check). `--requests` is then
    /// ignored. A prefill rank restarted during a run is given the time left.
    #[arg(long, value_parser = crate::model::parse_seconds)]
    pub duration_s: Option<f64>,
    /// Long runs with faults (`kvxfer soak`): a request that fails (a lost peer, a deadline) is
    /// counted in the summary (`failed`, `failures`) and its slot goes on with the next request once
    /// the failed one's pages are reusable; a slot whose request's pages stay quarantined stops
    /// (counted in `quarantined`). Request numbers then follow the prefill ranks' membership epochs
    /// (a restarted prefill rank starts a new numbering on every rank), so every rank of the run
    /// needs the flag. A wrong byte, a stray write or a lost store still fails the run. Without it
    /// the first failure ends the run.
    #[arg(long)]
    pub keep_going: bool,
    /// Decode: how many released requests the completion tracker remembers to drop their late
    /// notifications (`TrackerConfig::released_memory`, 65,536 by default). For soak runs that
    /// check how much of the memory growth this bound explains.
    #[arg(long, hide = true)]
    pub released_memory: Option<usize>,
    /// Test-only fault: prefill rank 0/0 corrupts one source byte of request 0 after filling it,
    /// so verification must fail and the run must exit non-zero.
    #[arg(long, hide = true)]
    pub inject_wrong_byte: bool,
    /// Abort and layer-wise switches.
    #[command(flatten)]
    pub run: RunArgs,
    /// The workload (same on every worker).
    #[command(flatten)]
    pub workload: Workload,
}

/// What one worker reports at the end (one JSON line on stdout, `"kind":"summary"`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkerSummary {
    /// Prefill or decode.
    pub role: String,
    /// `tp/pp`.
    pub rank: String,
    /// Bytes sent (prefill: the planner's count for completed requests) or verified (decode).
    pub bytes: u64,
    /// Strided ops the planner made for this rank's completed requests (prefill).
    pub ops: u64,
    /// Requests handled (completed or aborted).
    pub requests: u32,
    /// Requests that succeeded on this rank.
    pub completed: u32,
    /// Requests aborted (decode: by this rank; prefill: by a decode rank).
    pub aborted: u32,
    /// Completed requests whose every byte matched the oracle (decode).
    pub verified: u32,
    /// The `--abort-rate` of the run.
    pub abort_rate: f64,
    /// Whether prefill sent layer by layer.
    pub layerwise: bool,
    /// Bytes this rank hashed for end-to-end digests (`--digest`; 0 without).
    pub digest_bytes: u64,
    /// Requests whose digest check failed here (decode).
    pub digest_mismatches: u64,
    /// Seconds from the first request's start to the last one's end (fill and verify included).
    pub seconds: f64,
    /// Seconds during which at least one transfer was in flight (prefill: from the first chunk to
    /// the final status; decode: from the handoff to the final status), the union of those intervals.
    pub transfer_seconds: f64,
    /// Transfer intervals, seconds since the stream started (merged into `transfer_seconds`).
    #[serde(skip)]
    pub intervals: Vec<(f64, f64)>,
    /// The union of the intervals already folded out of `intervals` (`--duration-s`).
    #[serde(skip)]
    pub folded_seconds: f64,
    /// The length of `intervals` at which they are folded next.
    #[serde(skip)]
    pub fold_at: usize,
    /// Per-request completion latency in microseconds (decode: from the handoff to success).
    pub latencies_us: Vec<u64>,
    /// Bytes compared against the oracle (decode).
    pub verified_bytes: u64,
    /// Every failure, with the request.
    pub errors: Vec<String>,
    /// `--keep-going`: requests that failed in the engine (a lost peer, a deadline) and were
    /// counted instead of ending the run.
    #[serde(default)]
    pub failed: u32,
    /// `--keep-going`: the first [`FAILURES_KEPT`] of those failures, with the request.
    #[serde(default)]
    pub failures: Vec<String>,
    /// `--keep-going`, prefill: requests given up before any decode rank handed them off (the
    /// numbering moved on after a restart, or the run's duration ended).
    #[serde(default)]
    pub abandoned: u32,
    /// `--keep-going`: requests whose pages never became reusable (still not final 10 s after the
    /// worker aborted them at their deadline: quarantined by the engine, or a fence that never came).
    /// Their pages are never reused (their slot stops) nor checked at the end.
    #[serde(default)]
    pub quarantined: u32,
    /// `--keep-going`: request numberings used (1 + the prefill membership changes seen).
    #[serde(default)]
    pub numberings: u32,
    /// `--keep-going`: every rank the store reported lost, as reported.
    #[serde(default)]
    pub lost: Vec<String>,
}

/// How many failures a `--keep-going` summary lists (all are counted).
pub const FAILURES_KEPT: usize = 50;

/// Runs a worker; the exit code is 0 only if every request moved and verified (or was aborted).
pub fn run(args: &WorkerArgs) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvxfer worker: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let role = Side::from(args.role);
    let rank = RankId::new(args.tp_rank, args.pp_stage);
    let served = Arc::new(Served::default());
    match rt.block_on(worker(args, &served)) {
        Ok(s) => {
            let ok = s.errors.is_empty();
            progress(json!({"kind": "summary", "summary": s}));
            if args.metrics_hold {
                crate::metrics_http::hold(METRICS_HOLD);
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                for e in &s.errors {
                    eprintln!("kvxfer worker {role} {rank}: {e}");
                }
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("kvxfer worker {role} {rank}: {e}");
            progress(json!({"kind": "error", "role": role.to_string(), "rank": rank.to_string(), "message": e}));
            ExitCode::FAILURE
        }
    }
}

/// One JSON line on stdout. A write error is ignored: stdout is the pipe of a parent that may have
/// died (`println!` would panic on EPIPE, and the worker must still stop cleanly).
fn progress(v: serde_json::Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}").and_then(|()| out.flush());
}

/// How long `--metrics-hold` keeps serving after the summary at most.
const METRICS_HOLD: Duration = Duration::from_secs(30);

/// What `--metrics-listen` serves: the live agent's metrics while the run goes on, then the final
/// figures taken before the agent shut down.
struct Served {
    state: Mutex<(std::sync::Weak<Ctx>, String)>,
}

impl Default for Served {
    fn default() -> Self {
        Self { state: Mutex::new((std::sync::Weak::new(), "# EOF\n".to_owned())) }
    }
}

impl Served {
    fn text(&self) -> String {
        // Held while encoding, so `detach` waits for a scrape in progress: afterwards no scrape
        // holds the context (the agent's shutdown needs it alone).
        let state = lock(&self.state);
        match state.0.upgrade() {
            Some(ctx) => ctx.agent.metrics(),
            None => state.1.clone(),
        }
    }

    fn attach(&self, ctx: &Arc<Ctx>) {
        lock(&self.state).0 = Arc::downgrade(ctx);
    }

    fn detach(&self, ctx: &Ctx) {
        let last = ctx.agent.metrics();
        *lock(&self.state) = (std::sync::Weak::new(), last);
    }
}

/// How often the worker checks that its parent (`--parent-pid`) is alive.
const PARENT_POLL: Duration = Duration::from_millis(100);
/// After the parent died, how long the worker may take to abort, fence and shut down before it
/// exits at once.
const ORPHAN_GRACE: Duration = Duration::from_secs(20);

/// Watches (on a thread of its own) that `parent` is still this process's parent. When it is not
/// (the parent died; the worker was re-parented), the report turns fatal, which stops the slots and
/// aborts every request in flight; after [`ORPHAN_GRACE`] the process exits regardless.
fn watch_parent(parent: u32, report: Arc<Report>, who: String) {
    let spawned = std::thread::Builder::new().name("kvxfer-parent".into()).spawn(move || {
        while std::os::unix::process::parent_id() == parent {
            std::thread::sleep(PARENT_POLL);
        }
        let why = format!(
            "parent process {parent} exited (this worker was re-parented to {}); stopping",
            std::os::unix::process::parent_id()
        );
        eprintln!("kvxfer worker {who}: {why}");
        lock(&report.fatal).get_or_insert(why);
        report.changed.notify_waiters();
        std::thread::sleep(ORPHAN_GRACE);
        eprintln!("kvxfer worker {who}: not stopped {ORPHAN_GRACE:?} after the parent exited; exiting now");
        std::process::exit(3);
    });
    if let Err(e) = spawned {
        eprintln!("kvxfer worker: cannot watch the parent process {parent}: {e}");
    }
}

/// What the worker's own store watch learned: the store's verdicts on lost ranks, and a store that
/// stayed unreachable longer than the lease TTL (peers then consider this rank lost: stop).
#[derive(Default)]
struct Report {
    verdicts: Mutex<Vec<String>>,
    /// The epoch of every prefill rank registered now (`--keep-going` numbers requests by them).
    prefill_epochs: Mutex<std::collections::BTreeMap<RankId, u64>>,
    fatal: Mutex<Option<String>>,
    changed: tokio::sync::Notify,
}

impl Report {
    fn fatal(&self) -> Option<String> {
        lock(&self.fatal).clone()
    }

    /// Resolves once the report is fatal (the store lost, the parent process gone).
    async fn fatal_set(&self) -> String {
        loop {
            let n = self.changed.notified();
            if let Some(f) = self.fatal() {
                return f;
            }
            // Also polled: a notification sent between the check and the wait is not lost for long.
            let _ = tokio::time::timeout(Duration::from_millis(200), n).await;
        }
    }

    /// Waits at most `within` for the store to report a lost rank.
    async fn wait_verdict(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let n = self.changed.notified();
            if !lock(&self.verdicts).is_empty() {
                return true;
            }
            if tokio::time::timeout_at(deadline, n).await.is_err() {
                return false;
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Prints joins, leaves and losses of every rank of the cluster (progress lines only: the agent
/// fails the requests a lost peer touches by itself). Runs until aborted.
async fn watch_members(store: Arc<dyn MetadataStore>, mut mw: MemberWatch, report: Arc<Report>, ttl: Duration) {
    let started = Instant::now();
    let mut failing: Option<Instant> = None;
    loop {
        // A failed call means the store was unreachable since (at the latest) that call started: a
        // call that timed out after 5 s counts 5 s, not 0, against the lease TTL.
        let call = Instant::now();
        match mw.next(Duration::from_millis(500)).await {
            Ok(evs) => {
                failing = None;
                for e in evs {
                    note_epoch(&report, &e);
                    let (kind, m) = match &e {
                        MemberEvent::Joined(m) => ("peer_joined", m),
                        MemberEvent::Left(m) => ("peer_left", m),
                        MemberEvent::Lost(m) => ("peer_lost", m),
                    };
                    let r = &m.registration;
                    let peer = json!({"role": r.role.to_string(), "rank": r.rank.to_string(), "label": r.label, "epoch": m.epoch});
                    if let MemberEvent::Lost(_) = e {
                        let reason = format!("{} lost: its lease in {} expired", m.describe(), store.name());
                        let secs = started.elapsed().as_secs_f64();
                        progress(
                            json!({"kind": kind, "peer": peer, "store": store.name(), "reason": reason, "watching_s": secs}),
                        );
                        lock(&report.verdicts).push(reason);
                        report.changed.notify_waiters();
                    } else {
                        progress(json!({"kind": kind, "peer": peer}));
                    }
                }
            }
            Err(e) => {
                progress(json!({"kind": "store_error", "error": e.to_string()}));
                let since = *failing.get_or_insert(call);
                if since.elapsed() >= ttl && lock(&report.fatal).is_none() {
                    *lock(&report.fatal) = Some(format!(
                        "{} unreachable for {:?} (lease TTL {ttl:?}), peers consider this rank lost: {e}",
                        store.name(),
                        since.elapsed()
                    ));
                    report.changed.notify_waiters();
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Keeps [`Report::prefill_epochs`] up to date.
fn note_epoch(report: &Report, e: &MemberEvent) {
    let mut epochs = lock(&report.prefill_epochs);
    match e {
        MemberEvent::Joined(m) if m.registration.role == Side::Prefill => {
            epochs.insert(m.registration.rank, m.epoch);
        }
        // Only if no newer instance replaced it meanwhile.
        MemberEvent::Left(m) | MemberEvent::Lost(m)
            if m.registration.role == Side::Prefill && epochs.get(&m.registration.rank) == Some(&m.epoch) =>
        {
            epochs.remove(&m.registration.rank);
        }
        _ => {}
    }
}

/// Requests of one `--keep-going` numbering at most (a range of the u32 request space each).
const NUMBERING_SPAN: u32 = 1 << 20;
/// Numberings the request space holds (`NUMBERING_SPAN` each); two runs of prefill epochs share
/// one with a chance of 1 in this.
const NUMBERINGS: u64 = 4_000;

/// The first request number of the numbering of these prefill epochs, a multiple of `inflight`
/// (so that request `base + i` lands on slot `i`'s pages). Every rank computes the same from the
/// same epochs; a stale write of another numbering carries other token numbers (the oracle sees it).
fn numbering_base(epochs: &std::collections::BTreeMap<RankId, u64>, inflight: u32) -> u32 {
    let mut h = 0x534f_414b_u64;
    for (r, e) in epochs {
        h = SplitMix(h ^ (u64::from(r.tp) << 48) ^ (u64::from(r.pp) << 32) ^ e).next_u64();
    }
    let base = (h % NUMBERINGS) as u32 * NUMBERING_SPAN;
    base - base % inflight.max(1)
}

/// One worker's state, shared by its request slots.
struct Ctx {
    agent: Agent,
    w: Workload,
    run: RunArgs,
    rank: RankId,
    pages: u32,
    inject: bool,
    /// `--linger-s`.
    linger: Duration,
    started: Instant,
    report: Arc<Report>,
    summary: Mutex<WorkerSummary>,
    /// Set after the first failure: no new request starts (requests in flight finish or fail).
    /// With `--keep-going` only by an error of the run itself (a wrong byte).
    stop: AtomicBool,
    /// `--keep-going`.
    keep_going: bool,
    /// `--duration-s`: when the last request may start.
    end: Option<Instant>,
    /// Prefill ranks of the run (`--keep-going`: a numbering needs every one's epoch).
    prefill_ranks: usize,
    /// `--keep-going`, decode: requests (and their pages) that never became reusable.
    held: Mutex<Vec<(u32, Vec<u32>)>>,
}

impl Ctx {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire) || self.report.fatal().is_some()
    }

    /// Whether `--duration-s` ran out.
    fn ended(&self) -> bool {
        self.end.is_some_and(|e| Instant::now() >= e)
    }

    /// `--keep-going`: the numbering of the prefill epochs now, once every prefill rank is
    /// registered.
    fn numbering(&self) -> Option<u32> {
        let epochs = lock(&self.report.prefill_epochs);
        (epochs.len() == self.prefill_ranks).then(|| numbering_base(&epochs, self.w.inflight))
    }

    /// `--keep-going`: waits until every peer is connected and every prefill rank registered;
    /// the numbering then, or `None` once the run ended or stopped.
    async fn ready(&self) -> Option<u32> {
        loop {
            if self.stopped() || self.ended() {
                return None;
            }
            if self.agent.is_connected() {
                if let Some(n) = self.numbering() {
                    return Some(n);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Records a transfer interval that started at `t0` and ends now. A `--duration-s` run folds
    /// the old ones into their union as it goes (its memory must stay flat): no later interval can
    /// overlap one that ended longer ago than a request may last.
    fn push_interval(&self, t0: Instant) {
        let (a, b) = ((t0 - self.started).as_secs_f64(), self.started.elapsed().as_secs_f64());
        let mut s = lock(&self.summary);
        s.intervals.push((a, b));
        // Folded when the list doubled since the last fold (amortized: no copy per request).
        if self.end.is_some() && s.intervals.len() >= s.fold_at.max(1024) {
            let cutoff = b - (self.w.request_timeout() + Duration::from_secs(30)).as_secs_f64();
            let (mut old, new): (Vec<_>, Vec<_>) = s.intervals.iter().partition(|iv| iv.1 < cutoff);
            s.folded_seconds += union(&mut old);
            s.fold_at = 2 * new.len();
            s.intervals = new;
        }
    }
}

async fn worker(args: &WorkerArgs, served: &Arc<Served>) -> Result<WorkerSummary, String> {
    let (w, side, rank) = (&args.workload, Side::from(args.role), RankId::new(args.tp_rank, args.pp_stage));
    let topo = w.topology()?;
    topo.check_rank(side, rank).map_err(|e| e.to_string())?;
    if let Some(listen) = &args.metrics_listen {
        let s = Arc::clone(served);
        let addr = crate::metrics_http::serve(listen, Arc::new(move || s.text())).await?;
        progress(json!({"kind": "metrics", "addr": addr.to_string()}));
    }
    let wait = Duration::from_secs_f64(args.timeout_s);
    let ttl = Duration::from_secs_f64(args.lease_ttl_s.max(0.1));
    let addr = match (&args.metadata, &args.bootstrap) {
        (Some(a), _) | (None, Some(a)) => MetadataAddr::parse(a).map_err(|e| e.to_string())?,
        (None, None) => return Err("give --bootstrap host:port or --metadata etcd://host:port/prefix".into()),
    };
    let secret = match &args.secret_file {
        Some(path) => Some(Secret::from_file(path).map_err(|e| format!("--secret-file {}: {e}", path.display()))?),
        None => Secret::from_env().map_err(|e| format!("{}: {e}", kvxfer::metadata::auth::SECRET_ENV))?,
    };
    // The worker's own store client: the membership watch behind the progress lines, `finished/`.
    let store =
        metadata::connect_with(&addr, metadata::DEFAULT_OP_TIMEOUT, secret.clone()).await.map_err(|e| e.to_string())?;
    let (members, now) = MemberWatch::start(Arc::clone(&store)).await.map_err(|e| e.to_string())?;
    let report = Arc::new(Report::default());
    for m in now {
        note_epoch(&report, &MemberEvent::Joined(m));
    }
    if let Some(parent) = args.parent_pid {
        watch_parent(parent, Arc::clone(&report), format!("{side} {rank}"));
    }
    let mut cfg = AgentConfig::new(side, rank, topo, addr);
    cfg.backend = w.backend.clone();
    cfg.backend_options = w.options();
    cfg.notify = w.notify.into();
    cfg.lease_ttl = ttl;
    cfg.connect_timeout = wait;
    cfg.request_timeout = w.request_timeout();
    cfg.secret = secret;
    cfg.digest = args.run.digest && side == Side::Decode;
    cfg.protocol = args.protocol;
    if let Some(n) = args.released_memory {
        cfg.tracker.released_memory = n;
    }
    let (pages, fill) = (w.pool_pages(), if side == Side::Decode { SENTINEL } else { 0 });
    let cut_off_wait = cfg.cut_off_timeout + Duration::from_secs(1);
    let agent = Agent::start(cfg, KvMemory::Host { pages, fill }).await.map_err(|e| e.to_string())?;
    progress(json!({"kind": "registered", "store": store.name(), "epoch": agent.epoch()}));
    let watcher = tokio::spawn(watch_members(Arc::clone(&store), members, Arc::clone(&report), ttl));
    let summary = WorkerSummary {
        role: side.to_string(),
        rank: rank.to_string(),
        abort_rate: args.run.abort_rate,
        layerwise: args.run.layerwise,
        ..Default::default()
    };
    let ctx = Arc::new(Ctx {
        agent,
        w: w.clone(),
        run: args.run.clone(),
        rank,
        pages,
        inject: args.inject_wrong_byte,
        linger: Duration::from_secs_f64(args.linger_s),
        started: Instant::now(),
        report: Arc::clone(&report),
        summary: Mutex::new(summary),
        stop: AtomicBool::new(false),
        keep_going: args.keep_going,
        end: args.duration_s.map(|d| Instant::now() + Duration::from_secs_f64(d)),
        prefill_ranks: (w.prefill_tp * w.prefill_pp) as usize,
        held: Mutex::new(Vec::new()),
    });
    served.attach(&ctx);
    let result = run_slots(&ctx, &*store, side, wait).await;
    // Served metrics: their final figures are taken once every peer given up on (a decode's senders
    // leave at the end) is settled, cut off or quarantined when the backend could not confirm it
    // (seen in CI: a scrape taken between a give-up and its cut-off). Bounded by the agent's cut-off
    // timeout, past which it is quarantined. Without metrics the worker does not wait for it.
    // A decode that finished waited for its senders' records to say `left`; its agent learns that
    // from its own watch, maybe a moment later: the figures wait for those give-ups too.
    let settle_by = Instant::now() + cut_off_wait;
    let clean = result.is_ok() && lock(&ctx.summary).errors.is_empty() && !ctx.stopped();
    let leaving = if side == Side::Decode && clean { topo.senders(rank).len() as u64 } else { 0 };
    while args.metrics_listen.is_some() {
        let st = ctx.agent.stats();
        let settled = st.peers_lost >= leaving && st.cut_offs + st.quarantined >= st.peers_lost;
        if settled || Instant::now() >= settle_by {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    served.detach(&ctx);
    let mut s = lock(&ctx.summary).clone();
    s.errors.extend(result.err().into_iter().chain(report.fatal()));
    // A peer was lost (the transport may see it first): wait, bounded, for the store to name it.
    let verdict_wait = ttl + Duration::from_secs(1);
    if !s.errors.is_empty() && ctx.agent.stats().peers_lost > 0 && !report.wait_verdict(verdict_wait).await {
        eprintln!("kvxfer worker {side} {rank}: {} reported no lost rank within {verdict_wait:?}", store.name());
    }
    watcher.abort();
    if !s.errors.is_empty() {
        s.errors.extend(lock(&report.verdicts).iter().cloned());
    }
    s.transfer_seconds = s.folded_seconds + union(&mut s.intervals);
    if ctx.keep_going {
        s.lost = lock(&report.verdicts).clone();
    }
    let st = ctx.agent.stats();
    (s.digest_bytes, s.digest_mismatches) = (st.digest_bytes, st.digest_mismatches);
    // Leave the cluster (peers see `left`) and close the registrations.
    if let Ok(c) = Arc::try_unwrap(ctx) {
        if let Err(e) = c.agent.shutdown(Instant::now() + Duration::from_secs(5)).await {
            eprintln!("kvxfer worker {side} {rank}: shutting down: {e}");
        }
    }
    Ok(s)
}

/// Connects, runs the request slots, then the end of the run: decode checks its whole pool and puts
/// `finished`, prefill waits for its receivers' `finished`, decode waits for its senders to leave.
async fn run_slots(ctx: &Arc<Ctx>, store: &dyn MetadataStore, side: Side, wait: Duration) -> Result<(), String> {
    tokio::select! {
        r = ctx.agent.wait_connected(Instant::now() + wait + Duration::from_secs(1)) => r.map_err(|e| e.to_string())?,
        f = ctx.report.fatal_set() => return Err(f),
    }
    let n = if ctx.end.is_some() { ctx.w.inflight } else { ctx.w.inflight.min(ctx.w.requests) };
    let slots: Vec<_> = (0..n).map(|i| tokio::spawn(slot(Arc::clone(ctx), i))).collect();
    for h in slots {
        h.await.map_err(|e| format!("a request slot panicked: {e}"))?;
    }
    lock(&ctx.summary).seconds = ctx.started.elapsed().as_secs_f64();
    if side == Side::Decode {
        if ctx.linger > Duration::ZERO {
            progress(json!({"kind": "linger", "seconds": ctx.linger.as_secs_f64()}));
            tokio::time::sleep(ctx.linger).await;
        }
        // `--keep-going`: the pages of a request that never became reusable are not checked (its
        // writes may still land); the request is named instead.
        let held = lock(&ctx.held).clone();
        let all: Vec<u32> = (0..ctx.pages).filter(|p| !held.iter().any(|(_, pages)| pages.contains(p))).collect();
        for (r, pages) in &held {
            lock(&ctx.summary).errors.push(format!(
                "request {r} never became final with its pages reusable: its {} pages were left unchecked and unused",
                pages.len()
            ));
        }
        let c = Arc::clone(ctx);
        let stray = tokio::task::spawn_blocking(move || sentinel_errors(&c, &all, "bytes changed outside any request"))
            .await
            .map_err(|e| format!("final check panicked: {e}"))?;
        lock(&ctx.summary).errors.extend(stray);
        progress(json!({"kind": "pool_checked", "pages": ctx.pages}));
        // Pages a peer given up on may still write (its cut-off was not confirmed) are named.
        for (r, why) in ctx.agent.quarantined() {
            lock(&ctx.summary).errors.push(format!("quarantined pages: prefill rank {r}: {why}"));
        }
    }
    if !lock(&ctx.summary).errors.is_empty() || ctx.stopped() {
        return Ok(());
    }
    let topo = ctx.agent.topology();
    let finished = |r: RankId| format!("finished/{}.{}", r.tp, r.pp);
    if side == Side::Prefill {
        // A sender that left early would look like a lost peer to a receiver still checking.
        let lost_before = ctx.agent.stats().peers_lost;
        for d in topo.receivers(ctx.rank) {
            let key = finished(d);
            let lost = async {
                while ctx.agent.stats().peers_lost == lost_before {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            };
            tokio::select! {
                r = wait_value(store, &key, wait) => {
                    r.map_err(|e| format!("waiting for decode rank {d} to finish: {e}"))?;
                }
                _ = lost => return Err(format!("decode rank {d} was lost before it finished its final check")),
                f = ctx.report.fatal_set() => return Err(f),
            }
        }
        return Ok(());
    }
    // The key lives under a lease of its own: deleted below, expired if this process dies.
    let lease = store.grant(wait + Duration::from_secs(10)).await.map_err(|e| e.to_string())?;
    let r = async {
        store.put(&finished(ctx.rank), &json!(true), Some(lease)).await.map_err(|e| e.to_string())?;
        for p in topo.senders(ctx.rank) {
            let what = format!("prefill rank {p} leaving");
            let left = |e: Option<&metadata::Entry>| {
                e.map_or(true, |e| e.parse::<metadata::RankRecord>().is_ok_and(|r| r.left))
            };
            wait_until(store, &record_key(Side::Prefill, p), wait, &what, left).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    let r = tokio::select! {
        r = r => r,
        f = ctx.report.fatal_set() => Err(f),
    };
    let _ = store.delete(&finished(ctx.rank)).await;
    let _ = store.revoke(lease).await;
    r
}

/// The abort reason of a `--keep-going` request whose numbering is no longer the prefill epochs'.
const MOVED_ON: &str = "the prefill ranks' epochs changed (a rank restarted): this request's numbering moved on";

/// A request [`Req::settle`] gave up on: why, and whether its pages are reusable anyway (the abort
/// was fenced) or not (never reuse them).
struct Unsettled {
    why: String,
    reusable: bool,
}

impl From<Unsettled> for String {
    fn from(u: Unsettled) -> String {
        u.why
    }
}

/// Either side's request, for the wait both sides share.
enum Req {
    Recv(Receiver),
    Send(Sender),
}

impl Req {
    fn abort(&self, why: &str) {
        match self {
            Req::Recv(r) => r.abort(why),
            Req::Send(s) => s.abort(why),
        }
    }

    /// Waits until the request is final with its pages reusable. Past `deadline` (or when the store
    /// is lost) aborts it and waits, bounded, for the fence; an error then means the request failed.
    /// `numbering` (`--keep-going`, decode): the request is aborted once the prefill epochs changed.
    async fn settle(&self, ctx: &Ctx, deadline: Instant, numbering: Option<u32>) -> Result<RequestStatus, Unsettled> {
        let mut late: Option<String> = None;
        let mut limit = deadline;
        let mut moved = false;
        loop {
            if let Some(f) = ctx.report.fatal() {
                self.abort(&f);
            }
            if numbering.is_some() && !moved && ctx.numbering().is_some_and(|n| Some(n) != numbering) {
                // Requests of the old numbering are never served by the restarted rank.
                self.abort(MOVED_ON);
                moved = true;
            }
            let until = limit.min(Instant::now() + Duration::from_millis(200));
            let s = match self {
                Req::Recv(r) => r.wait(until).await,
                Req::Send(s) => s.wait(until).await,
            };
            match s {
                Ok(s) if s.pages_reusable => return late.map_or(Ok(s), |why| Err(Unsettled { why, reusable: true })),
                Ok(_) => tokio::time::sleep(Duration::from_millis(2)).await,
                Err(EngineError::Timeout { .. }) if Instant::now() < limit => {}
                Err(e) if late.is_none() => {
                    let why = format!("not final in time ({e}); aborted");
                    self.abort(&why);
                    (late, limit) = (Some(why), Instant::now() + Duration::from_secs(10));
                }
                Err(e) => {
                    let why = format!("{}; its pages are still not reusable: {e}", late.unwrap_or_default());
                    return Err(Unsettled { why, reusable: false });
                }
            }
        }
    }

    fn release(self) -> Result<RequestStatus, String> {
        match self {
            Req::Recv(r) => r.release(),
            Req::Send(s) => s.release(),
        }
        .map_err(|e| e.to_string())
    }
}

/// Whether (and after how long) request `r` is aborted: a deterministic draw per request, the same
/// on every decode rank. Half of the aborts come right after the handoff, half after up to 3 ms.
fn abort_plan(seed: u64, rate: f64, r: u32) -> Option<Duration> {
    let h = SplitMix(seed ^ SALT_ABORT ^ (u64::from(r) << 20)).next_u64();
    if rate <= 0.0 || (h >> 11) as f64 / (1u64 << 53) as f64 >= rate {
        return None;
    }
    Some(if h & 1 == 0 { Duration::ZERO } else { Duration::from_micros((h >> 1) % 3000) })
}

enum Outcome {
    /// Bytes (and prefill: ops) of this rank's share; decode: the latency.
    Done {
        bytes: u64,
        ops: u64,
        latency: Duration,
    },
    Aborted(String),
    /// Failed in the engine (a lost peer, a deadline), its pages reusable; `--keep-going` counts it.
    Failed(String),
    /// Prefill, `--keep-going`: given up before the decode ranks handed it off.
    Abandoned(String),
    /// `--keep-going`: failed, and its pages stayed quarantined.
    Stuck(String),
}

/// Runs requests `i, i + inflight, ...` one after the other on the slot's pages.
async fn slot(ctx: Arc<Ctx>, i: u32) {
    if ctx.keep_going {
        return slot_keep_going(ctx, i).await;
    }
    let decode = ctx.agent.role() == Side::Decode;
    let mut after_abort = false;
    let last = if ctx.end.is_some() { u32::MAX } else { ctx.w.requests };
    for r in (i..last).step_by(ctx.w.inflight as usize) {
        if ctx.stopped() || ctx.ended() {
            break;
        }
        let res = if decode { receive(&ctx, r, after_abort, None).await } else { send(&ctx, r, None).await };
        after_abort = account(&ctx, r, res, after_abort);
    }
}

/// Counts one request's outcome in the summary and prints its progress line; whether the slot's
/// pages were reset after a fence (the next request checks they kept the sentinel).
fn account(ctx: &Ctx, r: u32, res: Result<Outcome, String>, after_abort: bool) -> bool {
    let decode = ctx.agent.role() == Side::Decode;
    let mut s = lock(&ctx.summary);
    match res {
        Ok(Outcome::Done { bytes, ops, latency }) => {
            s.requests += 1;
            s.completed += 1;
            s.bytes += bytes;
            s.ops += ops;
            if decode {
                let us = latency.as_micros() as u64;
                s.verified += 1;
                s.verified_bytes += bytes;
                // A long run keeps the first latencies only (its memory must stay flat).
                if ctx.end.is_none() || s.latencies_us.len() < LATENCIES_KEPT {
                    s.latencies_us.push(us);
                }
                progress(json!({"kind": "done", "request": r, "latency_us": us}));
            } else {
                progress(json!({"kind": "sent", "request": r}));
            }
            false
        }
        Ok(Outcome::Aborted(why)) => {
            s.requests += 1;
            s.aborted += 1;
            progress(json!({"kind": "aborted", "request": r, "reason": why}));
            true
        }
        Ok(Outcome::Failed(why)) if ctx.keep_going => {
            s.requests += 1;
            s.failed += 1;
            if s.failures.len() < FAILURES_KEPT {
                s.failures.push(format!("request {r}: {why}"));
            }
            progress(json!({"kind": "failed", "request": r, "error": why, "counted": true}));
            true
        }
        Ok(Outcome::Abandoned(why)) => {
            s.abandoned += 1;
            progress(json!({"kind": "abandoned", "request": r, "reason": why}));
            true
        }
        Ok(Outcome::Stuck(why)) => {
            s.requests += 1;
            s.failed += 1;
            s.quarantined += 1;
            if s.failures.len() < FAILURES_KEPT {
                s.failures.push(format!("request {r}: {why}"));
            }
            progress(json!({"kind": "quarantined", "request": r, "error": why}));
            after_abort
        }
        Ok(Outcome::Failed(e)) | Err(e) => {
            progress(json!({"kind": "failed", "request": r, "error": e}));
            s.errors.push(format!("request {r}: {e}"));
            ctx.stop.store(true, Ordering::Release);
            after_abort
        }
    }
}

/// Latencies a `--duration-s` run keeps (the first ones).
const LATENCIES_KEPT: usize = 10_000;

/// `--keep-going`: slot `i` runs requests `base + i, base + i + inflight, ...` of the numbering of
/// the prefill epochs now; a failed request is counted and the slot goes on; when the prefill
/// epochs change (a rank restarted) it starts over in the new numbering.
async fn slot_keep_going(ctx: Arc<Ctx>, i: u32) {
    let decode = ctx.agent.role() == Side::Decode;
    let k = ctx.w.inflight.max(1);
    let (mut base, mut next, mut after_abort) = (None, 0u32, false);
    while let Some(now) = ctx.ready().await {
        if base != Some(now) {
            if i == 0 {
                lock(&ctx.summary).numberings += 1;
                progress(json!({"kind": "numbering", "base": now}));
            }
            (base, next) = (Some(now), 0);
        }
        let off = next.saturating_mul(k).saturating_add(i);
        if off >= NUMBERING_SPAN {
            break;
        }
        next += 1;
        let r = now + off;
        let res = if decode { receive(&ctx, r, after_abort, Some(now)).await } else { send(&ctx, r, Some(now)).await };
        let stuck = matches!(res, Ok(Outcome::Stuck(_)));
        after_abort = account(&ctx, r, res, after_abort);
        if stuck {
            // Its pages may still be written: never reuse them.
            break;
        }
    }
}

async fn blocking<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f).await.map_err(|e| format!("{what} panicked: {e}"))
}

/// Decode: one request. `numbering`: `--keep-going` (see [`Req::settle`]); a failure is then an
/// outcome, not an error.
async fn receive(ctx: &Arc<Ctx>, r: u32, after_abort: bool, numbering: Option<u32>) -> Result<Outcome, String> {
    let dst = request_pages(&ctx.w, r, SALT_DECODE);
    if after_abort {
        // The slot's previous request was aborted and its pages reset once fenced: nothing may land since.
        let (c, d) = (Arc::clone(ctx), dst.clone());
        let what = "bytes changed after the fence of an aborted request";
        if let Some(e) = blocking("sentinel check", move || sentinel_errors(&c, &d, what)).await?.pop() {
            return Err(e);
        }
    }
    let rx = ctx.agent.receiver(RequestId(u64::from(r))).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    rx.send_metadata(&dst, None).map_err(|e| e.to_string())?;
    let abort = abort_plan(ctx.w.seed, ctx.run.abort_rate, r);
    if let Some(delay) = abort {
        tokio::time::sleep(delay).await;
        rx.abort(&format!("decode rank {} aborts request {r} (--abort-rate {})", ctx.rank, ctx.run.abort_rate));
    }
    let req = Req::Recv(rx);
    let settled = req.settle(ctx, t0 + ctx.w.request_timeout() + Duration::from_secs(5), numbering).await;
    let st = match settled {
        Ok(st) => st,
        Err(u) if ctx.keep_going && !u.reusable => {
            lock(&ctx.held).push((r, dst));
            return Ok(Outcome::Stuck(u.why));
        }
        Err(u) if ctx.keep_going => {
            // Fenced after a late abort: reset the pages (the next request checks them), release.
            let c = Arc::clone(ctx);
            blocking("resetting pages", move || verify_and_reset(&c, &dst, r, false)).await??;
            req.release()?;
            return Ok(Outcome::Failed(u.why));
        }
        Err(u) => return Err(u.why),
    };
    let (latency, ok) = (t0.elapsed(), st.phase == Phase::Success);
    if ok {
        ctx.push_interval(t0);
    }
    // Verify (a completed transfer) and restore the sentinel either way; then release.
    let c = Arc::clone(ctx);
    let verified = blocking("verification", move || verify_and_reset(&c, &dst, r, ok)).await?;
    req.release()?;
    let why = st.reason.unwrap_or_else(|| "failed without a reason".into());
    if ok {
        Ok(Outcome::Done { bytes: verified?, ops: 0, latency })
    } else if abort.is_some() && why.contains("--abort-rate") {
        // Failed by this rank's abort (or another decode rank's, through the prefill ranks).
        Ok(Outcome::Aborted(why))
    } else if ctx.keep_going {
        Ok(Outcome::Failed(why))
    } else {
        Err(why)
    }
}

/// The oracle's content of one page starting at byte `off` of a buffer: [`BufferGeom::coord`] once per
/// head row (`hb` bytes share layer, kind, head, page and slot), [`kvxfer_core::oracle::pattern`]
/// per byte. Equal to `BufferGeom::fill_range` (tested), many times faster.
fn page_pattern(geom: &BufferGeom, hb: u64, off: u64, out: &mut [u8], tok: &dyn Fn(u32) -> Option<u64>) {
    for (u, row) in out.chunks_mut(hb as usize).enumerate() {
        let c = geom.coord(off + u as u64 * hb);
        let Some(base) = tok(c.page) else {
            // Not a request page: the demo never fills or checks those byte-wise.
            row.fill(SENTINEL);
            continue;
        };
        let token = base + u64::from(c.slot);
        for (i, b) in row.iter_mut().enumerate() {
            *b = kvxfer_core::oracle::pattern(c.layer, c.kind, c.head, token, c.byte + i as u64);
        }
    }
}

fn verify_and_reset(ctx: &Ctx, dst: &[u32], r: u32, check: bool) -> Result<u64, String> {
    let topo = ctx.agent.topology();
    let map = kvxfer_core::oracle::token_map(dst, ctx.w.page_size);
    let base = token_base(r);
    let tok = |p: u32| map.get(&p).map(|t| base + t);
    let mut bytes = 0;
    let mut first_err = None;
    // One set of page buffers per call, resized per pool buffer (not three allocations of a page
    // per pool buffer and request).
    let (mut tmp, mut want, mut sentinel) = (Vec::new(), Vec::new(), Vec::new());
    for host in ctx.agent.host_memory() {
        let b = host.buffer;
        let geom = BufferGeom::new(topo, Side::Decode, ctx.rank, b.layer, b.kind, ctx.pages);
        let pb = geom.page_bytes();
        let hb = topo.kv().head_bytes(b.kind);
        tmp.resize(pb as usize, 0u8);
        want.resize(pb as usize, 0u8);
        sentinel.resize(pb as usize, SENTINEL);
        for &p in dst {
            let off = u64::from(p) * pb;
            if check {
                host.read(off, &mut tmp).map_err(|e| format!("reading decode page {p}: {e}"))?;
                page_pattern(&geom, hb, off, &mut want, &tok);
                if tmp == want {
                    bytes += pb;
                    host.write(off, &sentinel).map_err(|e| format!("resetting decode page {p}: {e}"))?;
                    continue;
                }
                // Slow path, for the message: the oracle's own byte-wise check names the coordinates.
                if let Err(e) = geom.verify(off, &tmp, &tok) {
                    first_err.get_or_insert_with(|| format!("decode layer {} {} page {p}: {e}", b.layer, b.kind));
                }
                bytes += pb;
            }
            host.write(off, &sentinel).map_err(|e| format!("resetting decode page {p}: {e}"))?;
        }
    }
    match first_err {
        Some(e) => Err(format!("verification failed: {e}")),
        None => Ok(bytes),
    }
}

/// One error per buffer in which some byte of `pages` does not hold the sentinel.
fn sentinel_errors(ctx: &Ctx, pages: &[u32], what: &str) -> Vec<String> {
    let mut wrong = Vec::new();
    for host in ctx.agent.host_memory() {
        let (b, pb) = (host.buffer, host.len() / u64::from(ctx.pages));
        let mut tmp = vec![0u8; pb as usize];
        let (mut n, mut first) = (0, None);
        for &p in pages {
            if let Err(e) = host.read(u64::from(p) * pb, &mut tmp) {
                wrong
                    .push(format!("decode rank {}: layer {} {}: cannot read page {p}: {e}", ctx.rank, b.layer, b.kind));
                break;
            }
            n += tmp.iter().filter(|x| **x != SENTINEL).count();
            first = first.or_else(|| tmp.iter().position(|x| *x != SENTINEL).map(|i| (p, i)));
        }
        if let Some((p, i)) = first {
            wrong.push(format!(
                "decode rank {}: layer {} {}: {n} {what}, first at page {p} byte {i}",
                ctx.rank, b.layer, b.kind
            ));
        }
    }
    wrong
}

fn fill_source(ctx: &Ctx, src: &[u32], r: u32) {
    let topo = ctx.agent.topology();
    let map = kvxfer_core::oracle::token_map(src, ctx.w.page_size);
    let base = token_base(r);
    let tok = |p: u32| map.get(&p).map(|t| base + t);
    let mut tmp = Vec::new();
    for host in ctx.agent.host_memory() {
        let b = host.buffer;
        let geom = BufferGeom::new(topo, Side::Prefill, ctx.rank, b.layer, b.kind, ctx.pages);
        let (pb, hb) = (geom.page_bytes(), topo.kv().head_bytes(b.kind));
        tmp.resize(pb as usize, 0u8);
        for &p in src {
            page_pattern(&geom, hb, u64::from(p) * pb, &mut tmp, &tok);
            host.write(u64::from(p) * pb, &tmp).expect("page inside the pool, not being sent");
        }
    }
    if ctx.inject && r == 0 && ctx.rank == RankId::new(0, 0) {
        if let (Some(host), Some(&p)) = (ctx.agent.host_memory().first(), src.first()) {
            let (off, mut b) = (u64::from(p) * (host.len() / u64::from(ctx.pages)), [0u8]);
            host.read(off, &mut b).expect("in pool");
            host.write(off, &[b[0] ^ 0x5a]).expect("in pool");
        }
    }
}

/// Pages per chunk (`--chunk-pages`, 0: the whole request).
fn chunk_len(w: &Workload, pages: usize) -> usize {
    if w.chunk_pages == 0 {
        pages.max(1)
    } else {
        w.chunk_pages as usize
    }
}

/// How long past `--duration-s` a `--keep-going` prefill rank waits for the handoff of a request it
/// already created before it abandons it.
const END_GRACE: Duration = Duration::from_secs(10);

/// Prefill: one request. `numbering`: `--keep-going`: a failure is then an outcome, and a request
/// not handed off when the numbering moves on (or the run ended) is abandoned.
async fn send(ctx: &Arc<Ctx>, r: u32, numbering: Option<u32>) -> Result<Outcome, String> {
    let (w, src) = (&ctx.w, request_pages(&ctx.w, r, SALT_PREFILL));
    let tx = ctx.agent.sender(RequestId(u64::from(r))).map_err(|e| e.to_string())?;
    // The slot's previous request is final: nothing reads these pages.
    let (c, s) = (Arc::clone(ctx), src.clone());
    blocking("filling source pages", move || fill_source(&c, &s, r)).await?;
    tx.init(src.len() as u32).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + w.request_timeout() + Duration::from_secs(5);
    // Every decode rank's handoff (the agent fails the request at its deadline or on a lost peer).
    let mut phase = tx.status().phase;
    let mut abandoned = None;
    let moved = || numbering.is_some() && ctx.numbering().is_some_and(|n| Some(n) != numbering);
    let past_end = || numbering.is_some() && ctx.end.is_some_and(|e| Instant::now() >= e + END_GRACE);
    while phase == Phase::Bootstrapping && Instant::now() < deadline && !ctx.stopped() {
        if moved() || past_end() {
            abandoned = Some(if moved() { MOVED_ON.to_owned() } else { "the run's --duration-s ended".to_owned() });
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        phase = tx.status().phase;
    }
    if let Some(why) = &abandoned {
        tx.abort(&format!("prefill rank {} abandons request {r}: {why}", ctx.rank));
    } else if phase == Phase::Bootstrapping {
        tx.abort(&format!("prefill rank {} stopped before every decode rank handed request {r} off", ctx.rank));
    }
    let t0 = Instant::now();
    let layers = ctx.agent.topology().stage_layers(Side::Prefill, ctx.rank.pp);
    // Layer-wise: one call per layer of each chunk; otherwise one per chunk.
    let calls = src.chunks(chunk_len(w, src.len())).flat_map(|c| (0..layers).map(move |l| (c, l)));
    for (chunk, l) in calls.filter(|_| phase == Phase::WaitingForInput) {
        let sent = match (ctx.run.layerwise, l) {
            (true, _) => tx.send_layers(chunk, l..l + 1),
            (false, 0) => tx.send(chunk),
            (false, _) => continue,
        };
        if let Err(e) = sent {
            // Failed meanwhile (a decode rank aborted it, a peer was lost): the status says why.
            if !matches!(tx.status().phase, Phase::Aborting | Phase::Failed) {
                tx.abort(&e.to_string());
                if !ctx.keep_going {
                    return Err(e.to_string());
                }
            }
            break;
        }
    }
    let req = Req::Send(tx);
    let st = match req.settle(ctx, deadline, None).await {
        Ok(st) => st,
        Err(u) if ctx.keep_going && !u.reusable => return Ok(Outcome::Stuck(u.why)),
        Err(u) if ctx.keep_going => {
            req.release()?;
            return Ok(Outcome::Failed(u.why));
        }
        Err(u) => return Err(u.why),
    };
    req.release()?;
    if let Some(why) = abandoned {
        return Ok(Outcome::Abandoned(why));
    }
    let why = match st.phase {
        Phase::Success => {
            ctx.push_interval(t0);
            // The planner's count of this rank's share (every decode rank hands off the same choice).
            let (dst, n) = (request_pages(w, r, SALT_DECODE), chunk_len(w, src.len()));
            let pairs =
                src.chunks(n).zip(dst.chunks(n)).flat_map(|(s, d)| plan_sender(ctx.agent.topology(), ctx.rank, s, d));
            let (bytes, ops) = pairs.flatten().fold((0, 0), |(b, o), p| (b + p.bytes(), o + p.op_count()));
            return Ok(Outcome::Done { bytes, ops, latency: t0.elapsed() });
        }
        _ => st.reason.unwrap_or_else(|| "failed without a reason".into()),
    };
    if ctx.run.abort_rate > 0.0 && why.contains("aborted the request") {
        Ok(Outcome::Aborted(why))
    } else if ctx.keep_going {
        Ok(Outcome::Failed(why))
    } else {
        Err(why)
    }
}

/// Total length of the union of intervals.
fn union(v: &mut [(f64, f64)]) -> f64 {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut cur: Option<(f64, f64)> = None;
    for &(a, b) in v.iter() {
        cur = match cur {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + cur.map(|(s, e)| e - s).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use kvxfer_core::Topology;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        w: Workload,
        #[command(flatten)]
        run: RunArgs,
    }

    #[test]
    fn fast_page_pattern_equals_the_oracle() {
        use kvxfer_core::{Attention, KvSpec, Layout, Parallel, SideSpec};
        for layout in [Layout::Nhd, Layout::Hnd] {
            let kv = KvSpec {
                attention: Attention::Gqa { kv_heads: 4, head_dim_k: 8, head_dim_v: 4 },
                layers: 2,
                dtype_bytes: 2,
                page_size: 4,
                layout,
            };
            let side = |tp| SideSpec { kv, parallel: Parallel::new(tp, 1) };
            let topo = Topology::new(&side(2), &side(4)).unwrap();
            for kind in [kvxfer_core::KvKind::K, kvxfer_core::KvKind::V] {
                let geom = BufferGeom::new(&topo, Side::Prefill, RankId::new(1, 0), 1, kind, 6);
                let hb = kv.head_bytes(kind);
                let pb = geom.page_bytes();
                let map = kvxfer_core::oracle::token_map(&[3, 1], 4);
                let tok = |p: u32| map.get(&p).map(|t| 1000 + t);
                for page in [3u64, 1] {
                    let (mut a, mut b) = (vec![0u8; pb as usize], vec![0u8; pb as usize]);
                    geom.fill_range(page * pb, &mut a, &tok);
                    page_pattern(&geom, hb, page * pb, &mut b, &tok);
                    assert_eq!(a, b, "{layout} {kind} page {page}");
                }
            }
        }
    }

    #[test]
    fn interval_union() {
        assert_eq!(union(&mut [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]), 3.0);
        assert_eq!(union(&mut []), 0.0);
    }

    #[test]
    fn abort_choice_is_deterministic_and_near_the_rate() {
        let n = 10_000;
        let picked = (0..n).filter(|r| abort_plan(7, 0.3, *r).is_some()).count();
        assert!((2_700..3_300).contains(&picked), "{picked} of {n}");
        assert!((0..n).all(|r| abort_plan(7, 0.0, r).is_none()));
        assert!((0..n).all(|r| abort_plan(7, 1.0, r).is_some()));
        assert!((0..100).all(|r| abort_plan(7, 0.3, r) == abort_plan(7, 0.3, r)));
        assert!((0..n).filter_map(|r| abort_plan(7, 0.5, r)).all(|d| d < Duration::from_millis(3)));
    }

    #[test]
    fn abort_rate_is_a_validated_fraction() {
        assert_eq!(parse_rate("0.3"), Ok(0.3));
        assert_eq!(parse_rate("1"), Ok(1.0));
        for bad in ["-0.1", "1.5", "nan", "x", ""] {
            assert!(parse_rate(bad).unwrap_err().contains("[0, 1]"), "{bad}");
        }
        let t = T::parse_from(["t", "--abort-rate", "0.25", "--layerwise"]);
        assert_eq!(T::parse_from(std::iter::once("t".to_owned()).chain(t.run.to_args())).run.abort_rate, 0.25);
        assert!(T::try_parse_from(["t", "--abort-rate", "2"]).is_err());
    }

    #[test]
    fn workload_flags_roundtrip() {
        let w = T::parse_from(["t", "--model", "deepseek-v3", "--layers", "4", "--backend-opt", "connections=3"]).w;
        let mut args = vec!["t".to_string()];
        args.extend(w.to_args());
        let w2 = T::parse_from(args).w;
        assert_eq!(w2.to_args(), w.to_args());
        assert_eq!(w2.prefill(), w.prefill());
    }
}

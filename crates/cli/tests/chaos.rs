//! The chaos suite (issue 14): real `kvxfer bootstrap` and `kvxfer worker` processes over loopback,
//! with faults injected while requests stream, and a table of measured times against stated bounds.
//!
//! | case | fault | every surviving side must |
//! |---|---|---|
//! | `kill9_decode` | SIGKILL of the decode worker mid-transfer | prefill names `decode rank 0/0` lost, exits non-zero |
//! | `kill9_prefill` | SIGKILL of the prefill worker mid-transfer | decode names `prefill rank 0/0` lost, exits non-zero, no wrong byte verified |
//! | `kill9_prefill_later_requests` | SIGKILL of the prefill worker under an in-process decode `Agent`, then a restart | a request registered after the loss fails at once (not at its 60 s deadline), naming the rank; the restarted rank (new epoch) rejoins and serves the next request |
//! | `sigstop_prefill`, `sigstop_decode` | SIGSTOP of one worker (sockets stay open; tcp `timeout_s=5`, ucx / fabric `timeout_ms=5000`) | the peer names it by its lease; exits once the stalled link fails; then SIGCONT and clean-up |
//! | `bootstrap_killed` | SIGKILL of the metadata service mid-run | both workers fail naming the store, exit non-zero |
//! | `forged_notification` | a client that read the decode's endpoint metadata sends chunk notifications on its data port (`KVXFER_SECRET` set) | refused at the handshake naming authentication, nothing applied, every request verified (skipped, saying why, on a tcp backend that does not authenticate) |
//! | `impersonated_identity` | a client claims prefill rank 0/0's identity on the decode's data port (`KVXFER_SECRET` set) | refused; the real prefill's requests unaffected |
//! | `slowloris` | one byte every 200 ms on the bootstrap port, the data port, and (no secret) a partial frame header after a handshake | each dropped within its deadline; the real ranks finish |
//! | `fd_exhaustion` | up to 2,000 idle connections from 127.0.0.2 to the bootstrap and to the data port of a decode under `ulimit -n 2048` | the bootstrap refuses beyond its per-source limit naming the source; the data port (no connection limit of its own) sheds them at the handshake deadline; then the real ranks finish |
//! | `demo_worker_killed` | SIGKILL of the decode worker under `kvxfer demo` | the demo exits non-zero naming the worker and the signal; nothing left running |
//! | `demo_killed` | SIGKILL of `kvxfer demo` (its store outside) | each orphaned worker names its parent and exits |
//! | `link_cut` | the veth between two network namespaces goes down mid-run (root only; ucx over its tcp transport on the veth, fabric's tcp provider bound to it) | decode names the prefill lost, prefill names the store, both exit |
//! | `presumed_dead_stop_prefill`, `_stop_decode`, `_store_killed`, `_link_healed` (issue 32) | a peer stalled (SIGSTOP) past its lease then resumed; the store killed; the veth down until the decode gave up, then up | the decode's whole pool checked: no byte outside a live request, nothing quarantined, every failure named; every give-up of the decode followed by a confirmed cut-off (with the store killed the decode may not give up at all: the prefill, losing its own membership first, fences its requests) |
//!
//! Every wait is bounded; every process is killed (after a SIGCONT) when its guard drops, also on a
//! panic. Each case runs under `catch_unwind`, so one failing case does not hide the others; the test
//! fails at the end if any case failed. Filters: `KVXFER_CHAOS_CASES=kill9_decode,slowloris` (or
//! `case:backend`) runs only those; `KVXFER_CHAOS_SLOW=1` adds the slow cases (every case on ucx /
//! fabric when built with those features); `KVXFER_CHAOS_BACKENDS=ucx,fabric` keeps only those
//! backends' cases (CI's ucx / fabric step). `link_cut` skips, saying why, where network namespaces
//! cannot be made (not root). Cases on tcp: about 44 s on 2 cores; ucx and fabric: about 150 s.
//!
//! On ucx and fabric, `forged_notification` and `impersonated_identity` attack with an endpoint of
//! the same backend made in this process without the secret (their data ports speak the C
//! library's protocol, not tcp's); `slowloris` and `fd_exhaustion` run on tcp only: the bootstrap
//! port is the same for every backend, and ucx and fabric listen inside the C library.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::panic::AssertUnwindSafe;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::engine::{identity, Agent, AgentConfig, KvMemory, Phase};
use kvxfer::metadata::{self, MetadataAddr};
use kvxfer_core::{Attention, KvSpec, Layout, Notification, Parallel, RankId, RequestId, SenderKey, Side, SideSpec};
use kvxfer_core::{BackendConfig, EndpointMetadata, Secret, Topology};
use serde_json::Value;

mod support;

const EXE: &str = env!("CARGO_BIN_EXE_kvxfer");

// ---- bounds ------------------------------------------------------------------------------------

/// Lease TTL every worker of the suite runs with (`--lease-ttl-s`): a rank that stops renewing is
/// expired by the service within the TTL (keep-alives every TTL/3).
const TTL: Duration = Duration::from_secs(2);
/// A dead or frozen peer is named (the survivor's `peer_lost` line, or an error naming the rank)
/// within the lease TTL + 1 s: the store's expiry and the watch's delivery (docs/operations.md, "Leases"; the
/// bound `metadata.rs` holds the workers to).
const NAMED_BOUND: Duration = Duration::from_secs(3);
/// A survivor that named its lost peer exits within: the verdict wait (TTL + 1 s), the agent's
/// shutdown deadline (5 s, `worker.rs`) and 2 s of scheduling on 2 shared cores.
const EXIT_BOUND: Duration = Duration::from_secs(10);
/// A survivor of a frozen (SIGSTOPped) peer exits within: the stalled link failed by the tcp
/// backend's `timeout_s` (5 s in these cases; nothing else releases a sender's pages while a frame
/// to a frozen reader is half-written), the agent's shutdown deadline (5 s) and 2 s of scheduling.
const SIGSTOP_EXIT_BOUND: Duration = Duration::from_secs(TCP_TIMEOUT_S + 5 + 2);
/// The same for ucx and fabric (`timeout_ms` = 5 s here): once the agent closes the connection to
/// the lost peer, its in-flight writes fail after `timeout_ms`; then the survivor's registration
/// close waits up to `timeout_ms` more for the frozen peer's revoke acknowledgement (with UCX's
/// put path a frozen peer could still write into the region when it wakes); + the lease TTL the
/// loss is named after, + 5 s for the worker's own shutdown, + the endpoint's teardown
/// ([`C_TEARDOWN`]).
const SIGSTOP_EXIT_BOUND_C: Duration = Duration::from_secs(2 * TCP_TIMEOUT_S + TTL.as_secs() + 5 + C_TEARDOWN);
/// Dropping a ucx endpoint whose peer is unreachable: its progress thread gives the last closes
/// and transfers 2 s, then the goodbyes and endpoint flushes 2 s more (`SHUTDOWN_WAIT` in
/// `backends/ucx/src/engine.rs`); it runs after the agent's shutdown returned. Seconds.
const C_TEARDOWN: u64 = 4;
/// A request registered after its sender was lost fails "at once" (issue 14): 1 s, against the
/// request deadline of 60 s it used to wait.
const LATE_REQUEST_BOUND: Duration = Duration::from_secs(1);
/// ... until the rank comes back under a new epoch: a restarted prefill process serves a request
/// registered once it runs within this (its start-up, registration and connect, a few seconds on 2
/// loaded cores; 15 s).
const REJOIN_BOUND: Duration = Duration::from_secs(15);
/// The metadata service killed: every store call fails within its bound (5 s,
/// `metadata::DEFAULT_OP_TIMEOUT`) with an error naming the store; + 1 s slack.
const STORE_NAMED_BOUND: Duration = Duration::from_secs(6);
/// ... and a worker whose store stays unreachable longer than the TTL aborts and exits: the store
/// bound (5 s) + TTL (2 s) + the request's abort fence and the shutdown deadline (5 s) + 3 s slack.
const STORE_EXIT_BOUND: Duration = Duration::from_secs(15);
/// The same for ucx and fabric cut off from their peer and store (`link_cut`): the store bound
/// (5 s) + TTL (2 s), then the aborted request's writes to the unreachable peer and the revoke
/// acknowledgement it never sends each time out (`timeout_ms`, 5 s), the endpoint's teardown
/// ([`C_TEARDOWN`]), + 3 s slack.
const STORE_EXIT_BOUND_C: Duration = Duration::from_secs(5 + TTL.as_secs() + 2 * TCP_TIMEOUT_S + C_TEARDOWN + 3);
/// The data port's handshake deadline for unauthenticated connections ("a few seconds", issue 14;
/// the tcp backend's default), + 1 s slack.
const TCP_HANDSHAKE_BOUND: Duration = Duration::from_secs(6);
/// ucx / fabric: a connect by an endpoint without the cluster secret is refused (the accepting side's
/// challenge-response over the backend's own messages) within the same bound.
const ENDPOINT_AUTH_BOUND: Duration = Duration::from_secs(6);
/// The bootstrap's `--idle-timeout-s` in the slowloris case (3 s) + 1 s slack.
const BOOT_IDLE_S: u64 = 3;
const BOOT_IDLE_BOUND: Duration = Duration::from_secs(BOOT_IDLE_S + 1);
/// The tcp backend's `timeout_s` the workers run with in the slowloris case: a partial frame header
/// after a valid handshake must be dropped by then (issue 14: "deadlines on every read"), + 1 s.
const TCP_TIMEOUT_S: u64 = 5;
const FRAME_BOUND: Duration = Duration::from_secs(TCP_TIMEOUT_S + 1);
/// A finite run of the hostile-client cases must end (all requests verified) within this: about
/// 3 s alone on 2 cores, 10x for the load of the attack and of other builds.
const RUN_BOUND: Duration = Duration::from_secs(45);
/// Connections a hostile client opens at most in `fd_exhaustion` (stops at the first refusal).
const FLOOD_MAX: usize = 2_000;
/// The decode worker's open-file limit in `fd_exhaustion` (the issue's run died at 2,048).
const DECODE_NOFILE: u32 = 2_048;

/// The shared secret of the authenticated cases (never printed by kvxfer).
const SECRET: &str = "chaos-suite-secret-0123456789abcdef";

// ---- processes ---------------------------------------------------------------------------------

/// One line a child printed, with when it was read.
#[derive(Clone)]
struct Line {
    at: Instant,
    err: bool,
    text: String,
}

/// A child process, killed (after a SIGCONT, in case it was stopped) when dropped; its stdout and
/// stderr lines collected with their arrival time.
struct Proc {
    name: String,
    child: Child,
    lines: Arc<Mutex<Vec<Line>>>,
    status: Option<ExitStatus>,
}

impl Proc {
    fn spawn(name: &str, mut cmd: Command) -> Proc {
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("start {name}: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        for (err, r) in [
            (false, Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>),
            (true, Box::new(child.stderr.take().unwrap())),
        ] {
            let l = Arc::clone(&lines);
            std::thread::spawn(move || {
                for text in BufReader::new(r).lines().map_while(Result::ok) {
                    l.lock().unwrap().push(Line { at: Instant::now(), err, text });
                }
            });
        }
        Proc { name: name.to_owned(), child, lines, status: None }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, sig: &str) {
        let st = Command::new("kill").args([&format!("-{sig}"), &self.pid().to_string()]).status().unwrap();
        assert!(st.success(), "kill -{sig} {}", self.name);
    }

    /// SIGKILL and reap; returns when it happened.
    fn kill9(&mut self) -> Instant {
        let _ = self.child.kill();
        let t = Instant::now();
        self.status = self.child.wait().ok();
        t
    }

    /// The first line after `since` for which `pred` holds, waiting at most until `until`.
    fn line_where(&self, since: Instant, until: Instant, pred: impl Fn(&Line) -> bool) -> Option<Line> {
        loop {
            if let Some(l) = self.lines.lock().unwrap().iter().find(|l| l.at >= since && pred(l)) {
                return Some(l.clone());
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for `n` stdout lines of `kind` (JSON `"kind":"<kind>"`).
    fn wait_kind(&mut self, kind: &str, n: usize, within: Duration) -> bool {
        let pat = format!("\"kind\":\"{kind}\"");
        let end = Instant::now() + within;
        loop {
            if self.lines.lock().unwrap().iter().filter(|l| !l.err && l.text.contains(&pat)).count() >= n {
                return true;
            }
            if Instant::now() >= end || self.exited().is_some() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// The exit status and when it was seen, waiting at most `within`.
    fn wait_exit(&mut self, within: Duration) -> Option<(ExitStatus, Instant)> {
        let end = Instant::now() + within;
        loop {
            if let Some(s) = self.exited() {
                return Some((s, Instant::now()));
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn output(&self) -> String {
        let l = self.lines.lock().unwrap();
        l.iter().map(|l| format!("{}{}\n", if l.err { "E| " } else { "O| " }, l.text)).collect()
    }

    /// The worker's summary (`{"kind":"summary"}`), waiting briefly for the reader thread.
    fn summary(&self) -> Option<Value> {
        let end = Instant::now() + Duration::from_secs(2);
        loop {
            let found = self.lines.lock().unwrap().iter().rev().find_map(|l| {
                let v: Value = serde_json::from_str(&l.text).ok()?;
                (v["kind"] == "summary").then(|| v["summary"].clone())
            });
            if found.is_some() || Instant::now() >= end {
                return found;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited().is_none() {
            let _ = Command::new("kill").args(["-CONT", &self.pid().to_string()]).status();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A process's lines after `t0`, each with its time since `t0` (progress of requests left out).
fn timeline(p: &Proc, t0: Instant) -> String {
    let l = p.lines.lock().unwrap();
    l.iter()
        .filter(|l| l.at >= t0 && !l.text.contains("\"kind\":\"sent\"") && !l.text.contains("\"kind\":\"done\""))
        .map(|l| format!("{:7.3} {}{}\n", (l.at - t0).as_secs_f64(), if l.err { "E| " } else { "O| " }, l.text))
        .collect()
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// The environment a case runs its processes with.
#[derive(Clone, Copy)]
struct Env {
    secret: bool,
}

impl Env {
    fn apply(self, c: &mut Command) {
        c.env_remove("KVXFER_SECRET");
        if self.secret {
            c.env("KVXFER_SECRET", SECRET);
        }
    }
}

/// A bootstrap service on a free loopback port; its address.
fn bootstrap(env: Env, extra: &[&str], netns: Option<&str>) -> (Proc, String) {
    let mut c = in_ns(netns);
    c.args(["bootstrap", "--listen", &format!("{}:0", netns.map_or("127.0.0.1", |_| NS_ADDR_A)), "--for-s", "300"]);
    c.args(extra);
    env.apply(&mut c);
    let p = Proc::spawn("bootstrap", c);
    let l = p
        .line_where(Instant::now() - Duration::from_secs(60), Instant::now() + Duration::from_secs(20), |l| {
            !l.err && l.text.rsplit(' ').next().is_some_and(|a| a.parse::<SocketAddr>().is_ok())
        })
        .unwrap_or_else(|| panic!("bootstrap printed no address: {}", p.output()));
    let addr = l.text.rsplit(' ').next().unwrap().to_owned();
    (p, addr)
}

const NS_ADDR_A: &str = "10.231.11.1";

fn in_ns(netns: Option<&str>) -> Command {
    match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, EXE]);
            c
        }
        None => Command::new(EXE),
    }
}

/// An endless stream (killed by the case) or `n` requests.
fn stream(n: Option<u32>) -> Vec<String> {
    let n = n.map_or("100000".to_owned(), |n| n.to_string());
    ["--requests", &n, "--tokens", "256", "--inflight", "2", "--request-timeout-s", "60"].map(String::from).to_vec()
}

struct WorkerOpts<'a> {
    backend: &'a str,
    env: Env,
    extra: Vec<String>,
    netns: Option<&'a str>,
    nofile: Option<u32>,
}

fn worker(addr: &str, role: &str, o: &WorkerOpts<'_>) -> Proc {
    let mut c = match (o.nofile, o.netns) {
        (Some(n), None) => {
            let mut c = Command::new("bash");
            c.args(["-c", &format!("ulimit -n {n} && exec \"$0\" \"$@\""), EXE]);
            c
        }
        (_, ns) => in_ns(ns),
    };
    c.args(["worker", "--bootstrap", addr, "--role", role, "--layers", "4", "--timeout-s", "30"])
        .args(["--lease-ttl-s", &TTL.as_secs().to_string(), "--prefill-tp", "1", "--decode-tp", "1"])
        .args(["--backend", o.backend])
        // Inside a namespace the case names the device itself (`netns_opts`).
        .args(if o.netns.is_none() { backend_opts(o.backend) } else { Vec::new() })
        .args(&o.extra);
    o.env.apply(&mut c);
    Proc::spawn(&format!("{role} worker"), c)
}

/// The options every process of `backend` runs with over loopback (ucx: its devices on `lo`).
fn backend_options(backend: &str) -> std::collections::BTreeMap<String, String> {
    match backend {
        "ucx" => [("net_devices".to_owned(), "lo".to_owned())].into(),
        _ => Default::default(),
    }
}

/// [`backend_options`] as `kvxfer` flags.
fn backend_opts(backend: &str) -> Vec<String> {
    backend_options(backend).into_iter().flat_map(|(k, v)| ["--backend-opt".to_owned(), format!("{k}={v}")]).collect()
}

/// Whether a line names `who` (`"decode rank 0/0"`) as lost: a `peer_lost` progress line for that
/// role and rank, or an error line naming it with "lost".
fn names_lost(l: &Line, role: &str) -> bool {
    if let Ok(v) = serde_json::from_str::<Value>(&l.text) {
        if v["kind"] == "peer_lost" && v["peer"]["role"] == role && v["peer"]["rank"] == "0/0" {
            return true;
        }
    }
    l.text.contains(&format!("{role} rank 0/0")) && l.text.contains("lost")
}

/// The decode summary's accounting: every completed request verified, no wrong byte counted.
fn check_verified(d: &Proc, want_completed: Option<u64>) -> String {
    let s = d.summary().unwrap_or_else(|| panic!("decode printed no summary:\n{}", d.output()));
    let (completed, verified) = (s["completed"].as_u64().unwrap_or(0), s["verified"].as_u64().unwrap_or(0));
    assert_eq!(completed, verified, "decode counted a request completed but not verified: {s}");
    let errs = s["errors"].to_string();
    assert!(!errs.contains("verification failed") && !errs.contains("wrong bytes"), "wrong bytes: {errs}");
    if let Some(n) = want_completed {
        assert_eq!(verified, n, "decode verified {verified} of {n} requests: {s}\n{}", d.output());
    }
    format!("verified {verified}")
}

// ---- the suite ---------------------------------------------------------------------------------

/// One row of the table.
struct Row {
    case: String,
    backend: String,
    bound: String,
    measured: String,
    result: String,
}

/// What a case returns: (bound, measured, note) for the table.
type CaseOut = (String, String, String);

fn measure(what: &str, took: Duration, bound: Duration) -> String {
    assert!(took <= bound, "{what}: took {took:?}, bound {bound:?}");
    format!("{what} {}", secs(took))
}

/// Starts bootstrap, decode, prefill (endless stream); returns once 3 requests completed.
fn running(backend: &str, env: Env) -> (Proc, String, Proc, Proc) {
    running_with(backend, env, &[], &[])
}

/// [`running`] with extra flags for the bootstrap and for both workers.
fn running_with(backend: &str, env: Env, boot_extra: &[&str], extra: &[String]) -> (Proc, String, Proc, Proc) {
    let (boot, addr) = bootstrap(env, boot_extra, None);
    let mut o = WorkerOpts { backend, env, extra: stream(None), netns: None, nofile: None };
    o.extra.extend(extra.iter().cloned());
    let mut d = worker(&addr, "decode", &o);
    let p = worker(&addr, "prefill", &o);
    assert!(d.wait_kind("done", 3, Duration::from_secs(60)), "no request completed:\n{}\n{}", d.output(), p.output());
    (boot, addr, d, p)
}

fn count_kind(p: &Proc, kind: &str) -> usize {
    let pat = format!("\"kind\":\"{kind}\"");
    p.lines.lock().unwrap().iter().filter(|l| !l.err && l.text.contains(&pat)).count()
}

/// The real ranks of an endless stream were not disturbed: `more` further requests verified by the
/// decode (a `done` line comes only after every byte matched the oracle), no request failed and no
/// error on either side, both still running. Returns a note.
fn still_serving(d: &mut Proc, p: &mut Proc, more: usize) -> String {
    let before = count_kind(d, "done");
    let t0 = Instant::now();
    assert!(
        d.wait_kind("done", before + more, RUN_BOUND),
        "the decode verified no {more} further requests within {RUN_BOUND:?}:\n{}\n{}",
        d.output(),
        p.output()
    );
    for w in [&mut *d, &mut *p] {
        for kind in ["failed", "error", "peer_lost"] {
            assert_eq!(count_kind(w, kind), 0, "the {} printed a {kind} line:\n{}", w.name, w.output());
        }
        assert!(w.exited().is_none(), "the {} exited:\n{}", w.name, w.output());
    }
    format!(
        "{} requests verified, none failed ({more} more {} after the attack)",
        count_kind(d, "done"),
        secs(t0.elapsed())
    )
}

fn kill9(backend: &str, victim: &str) -> CaseOut {
    let (_boot, _addr, mut d, mut p) = running(backend, Env { secret: false });
    let (victim_p, survivor) = if victim == "decode" { (&mut d, &mut p) } else { (&mut p, &mut d) };
    let t0 = victim_p.kill9();
    let named = survivor
        .line_where(t0, t0 + NAMED_BOUND + Duration::from_secs(10), |l| names_lost(l, victim))
        .unwrap_or_else(|| panic!("the {} never named {victim} rank 0/0 lost:\n{}", survivor.name, survivor.output()));
    let m1 = measure("named", named.at - t0, NAMED_BOUND);
    let (st, at) = survivor
        .wait_exit(EXIT_BOUND + Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the {} did not exit:\n{}", survivor.name, survivor.output()));
    let m2 = measure("exit", at - t0, EXIT_BOUND);
    assert!(!st.success(), "the {} exited 0 after losing its peer", survivor.name);
    let out = survivor.output();
    assert!(out.contains(&format!("{victim} rank 0/0")), "exit message does not name the rank:\n{out}");
    let mut note = vec![format!("survivor {st}")];
    if victim == "prefill" {
        note.push(check_verified(survivor, None));
    }
    (format!("named {}, exit {}", secs(NAMED_BOUND), secs(EXIT_BOUND)), format!("{m1}, {m2}"), note.join("; "))
}

fn sigstop(backend: &str, victim: &str) -> CaseOut {
    // A write in flight to a frozen peer holds the sender's source pages (its fence) until the
    // backend gives up on the stalled connection, which the agent closes once the peer's lease
    // expired: tcp's `timeout_s` (120 s by default), ucx's and fabric's `timeout_ms` (30 s by
    // default); 5 s here.
    let extra: Vec<String> = match backend {
        "tcp" => vec!["--backend-opt".into(), format!("timeout_s={TCP_TIMEOUT_S}")],
        _ => vec!["--backend-opt".into(), format!("timeout_ms={}", TCP_TIMEOUT_S * 1000)],
    };
    let bound = if backend == "tcp" { SIGSTOP_EXIT_BOUND } else { SIGSTOP_EXIT_BOUND_C };
    let (_boot, _addr, mut d, mut p) = running_with(backend, Env { secret: false }, &[], &extra);
    let (victim_p, survivor) = if victim == "decode" { (&mut d, &mut p) } else { (&mut p, &mut d) };
    victim_p.signal("STOP");
    let t0 = Instant::now();
    let named = survivor
        .line_where(t0, t0 + NAMED_BOUND + Duration::from_secs(10), |l| names_lost(l, victim))
        .unwrap_or_else(|| panic!("the {} never named {victim} rank 0/0 lost:\n{}", survivor.name, survivor.output()));
    let m1 = measure("named", named.at - t0, NAMED_BOUND);
    let (st, at) = survivor
        .wait_exit(bound + Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the {} did not exit:\n{}", survivor.name, survivor.output()));
    if at - t0 > bound {
        eprintln!(
            "sigstop_{victim}: the {}'s lines, seconds after the stop:\n{}",
            survivor.name,
            timeline(survivor, t0)
        );
    }
    let m2 = measure("exit", at - t0, bound);
    assert!(!st.success(), "the {} exited 0 after its peer froze", survivor.name);
    let mut note = vec![format!("survivor {st}")];
    if victim == "prefill" {
        note.push(check_verified(survivor, None));
    }
    // Thaw: the frozen rank finds its lease gone; give it a few seconds to leave by itself.
    victim_p.signal("CONT");
    let own = victim_p.wait_exit(Duration::from_secs(8));
    let after = match own {
        Some((s, _)) => format!("thawed {victim} exited by itself ({s})"),
        None => {
            victim_p.kill9();
            format!("thawed {victim} still running after 8 s: killed")
        }
    };
    (
        format!("named {}, exit {}", secs(NAMED_BOUND), secs(bound)),
        format!("{m1}, {m2}"),
        format!("{}; {after}", note.join("; ")),
    )
}

fn bootstrap_killed(backend: &str) -> CaseOut {
    let (mut boot, addr, mut d, mut p) = running(backend, Env { secret: false });
    let t0 = boot.kill9();
    let mut ms = Vec::new();
    let mut notes = Vec::new();
    for w in [&mut d, &mut p] {
        let names_store = |l: &Line| l.text.contains(&format!("bootstrap at {addr}"));
        let named = w
            .line_where(t0, t0 + STORE_EXIT_BOUND + Duration::from_secs(10), names_store)
            .unwrap_or_else(|| panic!("the {} never named the store:\n{}", w.name, w.output()));
        ms.push(measure(&format!("{} named", &w.name[..w.name.find(' ').unwrap()]), named.at - t0, STORE_NAMED_BOUND));
        let (st, at) = w
            .wait_exit(STORE_EXIT_BOUND + Duration::from_secs(10))
            .unwrap_or_else(|| panic!("the {} did not exit after its store died:\n{}", w.name, w.output()));
        ms.push(measure("exit", at - t0, STORE_EXIT_BOUND));
        assert!(!st.success(), "an endless stream cannot end well without its store: {} exited 0", w.name);
        notes.push(format!("{} {st}", w.name));
    }
    notes.push(check_verified(&d, None));
    (format!("named {}, exit {}", secs(STORE_NAMED_BOUND), secs(STORE_EXIT_BOUND)), ms.join(", "), notes.join("; "))
}

/// The decode side in this process (an engine `Agent`), a prefill worker process killed under it;
/// a request registered after the loss must fail at once, naming the rank; once the rank is
/// restarted (a new epoch), its requests complete again.
fn later_requests(backend: &str) -> CaseOut {
    let (_boot, addr) = bootstrap(Env { secret: false }, &[], None);
    let o = WorkerOpts { backend, env: Env { secret: false }, extra: stream(None), netns: None, nofile: None };
    let mut p = worker(&addr, "prefill", &o);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads: 8, head_dim_k: 128, head_dim_v: 128 },
        layers: 4,
        dtype_bytes: 2,
        page_size: 16,
        layout: Layout::Nhd,
    };
    let side = SideSpec { kv, parallel: Parallel::new(1, 1) };
    let topo = Topology::new(&side, &side).unwrap();
    let mut cfg = AgentConfig::new(
        Side::Decode,
        RankId::new(0, 0),
        topo,
        MetadataAddr::parse(&format!("bootstrap://{addr}")).unwrap(),
    );
    cfg.backend = backend.to_owned();
    cfg.backend_options = backend_options(backend);
    cfg.lease_ttl = TTL;
    cfg.connect_timeout = Duration::from_secs(30);
    cfg.request_timeout = Duration::from_secs(60);
    // 16 pages per request (256 tokens), the prefill's two request slots.
    let pages: Vec<u32> = (0..16).collect();
    rt.block_on(async {
        let agent = Agent::start(cfg, KvMemory::Host { pages: 40, fill: 0 }).await.expect("decode agent");
        agent.wait_connected(Instant::now() + Duration::from_secs(30)).await.expect("prefill connected");
        // The worker's requests 0, 1, 2 (its slots take 0 and 1 first).
        for r in 0..3u64 {
            let rx = agent.receiver(RequestId(r)).unwrap();
            rx.send_metadata(&pages.iter().map(|x| x + 16 * (r as u32 % 2)).collect::<Vec<_>>(), None).unwrap();
            let st = rx.wait(Instant::now() + Duration::from_secs(30)).await.expect("request completes");
            assert_eq!(st.phase, Phase::Success, "{st:?}");
            let _ = rx.release();
        }
        let t0 = p.kill9();
        // Wait (bounded) until the agent counts the loss.
        let end = t0 + NAMED_BOUND + Duration::from_secs(10);
        while agent.stats().peers_lost == 0 && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let seen = t0.elapsed();
        assert!(agent.stats().peers_lost > 0, "the agent never counted prefill rank 0/0 lost");
        // A request registered after the loss.
        let t1 = Instant::now();
        let rx = agent.receiver(RequestId(1000)).unwrap();
        let _ = rx.send_metadata(&pages, None);
        let mut st = rx.status();
        while !st.phase.is_final() && t1.elapsed() < Duration::from_secs(70) {
            st = match rx.wait(Instant::now() + Duration::from_millis(100)).await {
                Ok(s) => s,
                Err(_) => rx.status(),
            };
        }
        let took = t1.elapsed();
        assert_eq!(st.phase, Phase::Failed, "{st:?}");
        let why = st.reason.clone().unwrap_or_default();
        assert!(
            why.contains("prefill rank 0/0") || why.contains("tp0.pp0"),
            "the failure does not name the rank: {why}"
        );
        let m = measure("later request failed", took, LATE_REQUEST_BOUND);
        let _ = rx.release();
        // The rank comes back (a new process: a new epoch). Its first request, 0 again, completes:
        // the loss holds only until the peer rejoins.
        drop(p);
        let t2 = Instant::now();
        let _p2 = worker(&addr, "prefill", &o);
        // An engine learns of the rejoin from `is_connected` / `wait_connected` (a request registered
        // before it fails at once, as above).
        agent.wait_connected(t2 + REJOIN_BOUND + Duration::from_secs(10)).await.expect("the restarted prefill rejoins");
        let m_join = measure("rejoined", t2.elapsed(), REJOIN_BOUND);
        let rx = agent.receiver(RequestId(0)).unwrap();
        rx.send_metadata(&pages, None).unwrap();
        let st = rx.wait(t2 + REJOIN_BOUND + Duration::from_secs(10)).await.expect("request after the rejoin");
        assert_eq!(st.phase, Phase::Success, "the restarted prefill's request did not complete: {st:?}");
        let m2 = measure("restarted rank served", t2.elapsed(), REJOIN_BOUND);
        let _ = rx.release();
        let _ = agent.shutdown(Instant::now() + Duration::from_secs(5)).await;
        (
            format!("{}; rejoin {}", secs(LATE_REQUEST_BOUND), secs(REJOIN_BOUND)),
            format!("loss counted {}, {m}, {m_join}, {m2}", secs(seen)),
            format!("reason: {}", why.chars().take(90).collect::<String>()),
        )
    })
}

// ---- hostile clients ---------------------------------------------------------------------------

/// What an attacker learns from the store: the decode's data address, its token (if the metadata
/// still carries one) and the decode's epoch. `secret`: the attacker read it with the secret,
/// standing for one who saw the values on the wire (the service does not encrypt).
struct Target {
    addr: SocketAddr,
    token: [u8; 16],
    epoch: u64,
}

/// The decode rank 0/0's record in the store (its value and its epoch), read with `secret`.
fn decode_record(boot: &str, secret: Option<&str>) -> Result<(Value, u64), String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let a = MetadataAddr::parse(&format!("bootstrap://{boot}")).unwrap();
        let s = secret.map(|s| Secret::new(s.as_bytes().to_vec()).unwrap());
        let store = metadata::connect_with(&a, Duration::from_secs(5), s).await.map_err(|e| e.to_string())?;
        let (e, _) = store.get("ranks/decode/0.0").await.map_err(|e| e.to_string())?;
        let e = e.ok_or("no decode record")?;
        Ok((e.json(), e.create_revision))
    })
}

fn read_target(boot: &str, secret: Option<&str>) -> Result<Target, String> {
    let (value, epoch) = decode_record(boot, secret)?;
    let payload: Vec<u8> = match &value["registration"]["endpoint"]["payload"] {
        Value::Array(a) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u8)).collect(),
        Value::String(s) => s.as_bytes().to_vec(),
        v => return Err(format!("endpoint payload {v}")),
    };
    let m: Value = serde_json::from_slice(&payload).map_err(|e| format!("payload: {e}"))?;
    let addr = m["addr"].as_str().ok_or(format!("no addr in {m}"))?.parse().map_err(|e| format!("addr: {e}"))?;
    let mut token = [0u8; 16];
    if let Some(t) = m["token"].as_str().filter(|t| t.len() == 32) {
        for (i, o) in token.iter_mut().enumerate() {
            *o = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).unwrap_or(0);
        }
    }
    Ok(Target { addr, token, epoch })
}

/// A few pseudo-random bytes (nonces, forged proofs, link ids): not secret, only distinct.
fn noise(n: usize) -> Vec<u8> {
    let mut x = (Instant::now().elapsed().as_nanos() as u64)
        ^ (u64::from(std::process::id()) << 32)
        ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A raw client of the tcp data port, speaking whichever handshake the listener speaks: protocol 2
/// (the client's HELLO first, 48 bytes; no authentication) or protocol 4 (the listener's CHALLENGE
/// first, then a 120-byte HELLO with the client's instance and, when there is a secret, an HMAC
/// proof of it; protocol 3 was the same without the instance).
/// The attacker has the endpoint's metadata (address, token) but not the secret.
struct Raw {
    s: TcpStream,
    /// 2 or 4.
    version: u16,
    /// Protocol 4: whether the listener's CHALLENGE says it has a cluster secret.
    secret_required: bool,
}

/// The listener's first words: a protocol-4 CHALLENGE within 500 ms, or nothing (protocol 2).
fn raw_connect(addr: SocketAddr) -> Raw {
    let mut s = TcpStream::connect(addr).expect("connect to the data port");
    let mut c = Vec::new();
    let end = Instant::now() + Duration::from_millis(500);
    let mut b = [0u8; 48];
    while c.len() < 48 && Instant::now() < end {
        s.set_read_timeout(Some((end - Instant::now()).max(Duration::from_millis(1)))).unwrap();
        match s.read(&mut b[..48 - c.len()]) {
            Ok(0) => break,
            Ok(n) => c.extend_from_slice(&b[..n]),
            Err(_) => break,
        }
    }
    let v4 = c.len() == 48 && &c[..4] == b"KVXT" && c[4..6] == 4u16.to_le_bytes();
    assert!(c.is_empty() || v4, "the data port opened with {} bytes that are no protocol-4 challenge", c.len());
    Raw { s, version: if v4 { 4 } else { 2 }, secret_required: v4 && c[6] & 1 != 0 }
}

impl Raw {
    /// The HELLO a client that read the metadata sends. `proof`: protocol 4 only, a proof it made up
    /// (flag set, 32 bytes of noise): it has no secret.
    fn hello(&self, token: &[u8; 16], kind: u8, identity: u64, proof: bool) -> Vec<u8> {
        let mut h = Vec::with_capacity(120);
        h.extend_from_slice(b"KVXT");
        h.extend_from_slice(&self.version.to_le_bytes());
        h.push(kind);
        h.push(0);
        h.extend_from_slice(token);
        h.extend_from_slice(&(0x6368_616f_7300_0000u64 | u64::from(std::process::id())).to_le_bytes());
        h.extend_from_slice(&identity.to_le_bytes());
        h.extend_from_slice(&1u32.to_le_bytes());
        if self.version == 2 {
            h.extend_from_slice(&0u32.to_le_bytes());
            return h;
        }
        h.push(u8::from(proof));
        h.extend_from_slice(&[0, 0, 0]);
        h.extend(noise(32));
        h.extend_from_slice(&0x0bad_1d00_u64.to_le_bytes());
        h.extend(if proof { noise(32) } else { vec![0; 32] });
        h
    }

    /// Bytes of the listener's reply before its reason.
    fn reply_len(&self) -> usize {
        if self.version == 4 {
            52
        } else {
            20
        }
    }
}

/// A BYE frame (a client that leaves on good terms: no loss report).
fn bye_frame() -> Vec<u8> {
    let mut f = vec![3, 0];
    f.extend_from_slice(&0x584bu16.to_le_bytes());
    f.extend_from_slice(&[0; 28]);
    f
}

/// Whether the decode's data port authenticates: a HELLO without any proof, under a cluster secret,
/// must be refused. Ok(()) if it is; Err(why the authenticated cases cannot run on this build) if the
/// port accepts it (the probe then leaves with a BYE, under an identity no rank has, so nothing is
/// disturbed). Runs before any forged byte is sent.
fn probe_auth(t: &Target) -> Result<(), String> {
    let mut r = raw_connect(t.addr);
    let h = r.hello(&t.token, 1, 0x00c4_a05e_0000_0001, false);
    r.s.write_all(&h).expect("send a probe HELLO");
    let (a, _) = read_answer(&mut r, Duration::from_secs(3));
    match a {
        Answer::Accepted => {
            let _ = r.s.write_all(&bye_frame());
            Err(format!(
                "the tcp data port (protocol {}) accepted a handshake without any proof of the cluster secret \
                 although KVXFER_SECRET is set: this build's tcp backend does not authenticate its data port yet",
                r.version
            ))
        }
        _ => Ok(()),
    }
}

/// A NOTE frame (parts 0: deliver now) carrying `n`.
fn note_frame(n: &Notification, batch: u64) -> Vec<u8> {
    let body = n.encode().unwrap();
    let mut f = Vec::with_capacity(32 + body.len());
    f.push(2);
    f.push(0);
    f.extend_from_slice(&0x584bu16.to_le_bytes());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(&batch.to_le_bytes());
    f.extend_from_slice(&0u64.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(&body);
    f
}

/// How the data port answered a raw client.
#[derive(Debug)]
enum Answer {
    /// A v2 reply accepting the stream.
    Accepted,
    /// A v2 reply refusing it, with the reason.
    Rejected(String),
    /// Other bytes (e.g. a challenge), then the connection closed.
    Other { bytes: usize, text: String },
    /// Closed without a byte.
    Closed,
    /// Still open with nothing said at the end of the wait.
    Open,
}

/// Reads what the listener says for up to `within`, until it closes. Returns the answer and when
/// the connection was closed (None: still open).
fn read_answer(r: &mut Raw, within: Duration) -> (Answer, Option<Instant>) {
    let hl = r.reply_len();
    let end = Instant::now() + within;
    let mut buf = Vec::new();
    let mut closed = None;
    let mut chunk = [0u8; 4096];
    while Instant::now() < end {
        r.s.set_read_timeout(Some((end - Instant::now()).max(Duration::from_millis(1)))).unwrap();
        match r.s.read(&mut chunk) {
            Ok(0) => {
                closed = Some(Instant::now());
                break;
            }
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                // An accepting reply keeps the stream open: no need to wait for more.
                if buf.len() >= hl && &buf[..4] == b"KVXT" && buf[6] == 0 {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => break,
            Err(_) => {
                closed = Some(Instant::now());
                break;
            }
        }
    }
    let a = if buf.is_empty() {
        if closed.is_some() {
            Answer::Closed
        } else {
            Answer::Open
        }
    } else if buf.len() >= hl && &buf[..4] == b"KVXT" && buf[4..6] == r.version.to_le_bytes() {
        if buf[6] == 0 {
            Answer::Accepted
        } else {
            Answer::Rejected(String::from_utf8_lossy(&buf[hl..]).into_owned())
        }
    } else {
        Answer::Other {
            bytes: buf.len(),
            text: String::from_utf8_lossy(&buf).chars().filter(|c| !c.is_control()).collect(),
        }
    };
    (a, closed)
}

/// The refusal an authenticated data port must give a client without the secret: a rejecting
/// reply naming authentication, then the connection closed within the handshake bound.
fn assert_refused_for_auth(what: &str, a: &Answer, closed: Option<Instant>) -> Instant {
    match a {
        Answer::Rejected(why) => {
            assert!(
                why.to_lowercase().contains("authentication"),
                "{what}: refused without naming authentication: {why}"
            )
        }
        other => panic!("{what}: the data port answered {other:?}, not a refusal naming authentication"),
    }
    closed.unwrap_or_else(|| panic!("{what}: refused but the connection was not closed ({a:?})"))
}

/// An endless run with an attacker; the real ranks must go on verifying requests, undisturbed.
/// Returns what the attacker saw (Err: skipped, why).
fn hostile_run(
    env: Env,
    boot_extra: &[&str],
    extra: &[String],
    attack: impl FnOnce(&str) -> Result<CaseOut, String>,
) -> Result<CaseOut, String> {
    hostile_run_on("tcp", env, boot_extra, extra, attack)
}

/// [`hostile_run`] on `backend`.
fn hostile_run_on(
    backend: &str,
    env: Env,
    boot_extra: &[&str],
    extra: &[String],
    attack: impl FnOnce(&str) -> Result<CaseOut, String>,
) -> Result<CaseOut, String> {
    let (_boot, addr, mut d, mut p) = running_with(backend, env, boot_extra, extra);
    let out = attack(&addr)?;
    let v = still_serving(&mut d, &mut p, 3);
    Ok((out.0, out.1, format!("{}; {v}", out.2)))
}

fn forged_notification() -> Result<CaseOut, String> {
    hostile_run(Env { secret: true }, &[], &[], |boot| {
        // Without the secret the store gives nothing away.
        let unauth = read_target(boot, None);
        assert!(unauth.is_err(), "the bootstrap handed the decode's metadata to a client without the secret");
        // With it (one who saw the metadata on the wire): forge chunk notifications as prefill rank 0/0.
        let t = read_target(boot, Some(SECRET)).expect("metadata");
        probe_auth(&t)?;
        let key = SenderKey::of(RankId::new(0, 0));
        let mut r = raw_connect(t.addr);
        assert!(r.secret_required, "the decode's challenge does not say it has a cluster secret");
        let t0 = Instant::now();
        // The HELLO and the forged notifications in one write: nothing after a refused HELLO may count.
        let mut bytes = r.hello(&t.token, 1, identity(Side::Prefill, RankId::new(0, 0)), false);
        for req in 0..24u64 {
            for c in 1..4u64 {
                let n =
                    Notification::chunk(RequestId(req), key, 0, true).with_generation((t.epoch << 32) | (req + c - 1));
                bytes.extend(note_frame(&n, req * 8 + c));
            }
        }
        let _ = r.s.write_all(&bytes);
        let (a, closed) = read_answer(&mut r, TCP_HANDSHAKE_BOUND + Duration::from_secs(4));
        let closed = assert_refused_for_auth("forged notifications", &a, closed);
        let m = measure("refused", closed - t0, TCP_HANDSHAKE_BOUND);
        Ok((
            secs(TCP_HANDSHAKE_BOUND),
            m,
            format!(
                "unauthenticated store read refused ({}); data port: {}",
                short(&unauth.err().unwrap()),
                answer_note(&a)
            ),
        ))
    })
}

/// The decode rank 0/0's endpoint metadata and epoch as the store holds them, read with the secret
/// (standing for one who saw them on the wire).
fn read_endpoint(boot: &str) -> Result<(EndpointMetadata, u64), String> {
    let (value, epoch) = decode_record(boot, Some(SECRET))?;
    let md: EndpointMetadata = serde_json::from_value(value["registration"]["endpoint"].clone())
        .map_err(|err| format!("endpoint metadata: {err}"))?;
    Ok((md, epoch))
}

/// An endpoint of `backend` in this process that claims `identity`, with `secret` (None: none),
/// connects to the decode's endpoint `md` and, if that is not refused, sends it `notes`. Returns how
/// long until the refusal and what it said; panics if the connection was not refused naming
/// authentication.
fn endpoint_attack(
    backend: &str,
    md: &EndpointMetadata,
    identity: u64,
    secret: Option<&str>,
    notes: &[Notification],
) -> (Duration, String) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let mut cfg =
            BackendConfig::new(identity).with_secret(secret.map(|s| Secret::new(s.as_bytes().to_vec()).unwrap()));
        cfg.options = backend_options(backend);
        let ep = kvxfer::backends::create(backend, &cfg).expect("attacker endpoint");
        let t0 = Instant::now();
        let r = tokio::time::timeout(ENDPOINT_AUTH_BOUND + Duration::from_secs(10), ep.connect(md)).await;
        let took = t0.elapsed();
        let out = match r {
            Err(_) => panic!("connect without the secret neither failed nor succeeded within {:?}", took),
            Ok(Ok(peer)) => {
                // A transport that learns of the refusal only on first use: the forged notes must fail
                // (and the real ranks' accounting below shows none was applied); the case fails anyway.
                let mut sent = Vec::new();
                for n in notes {
                    sent.push(format!("{:?}", ep.notify(peer, n).await.err()));
                }
                panic!("an endpoint without the cluster secret connected to the decode (notes: {sent:?})")
            }
            Ok(Err(e)) => {
                let why = e.to_string();
                let l = why.to_lowercase();
                assert!(
                    l.contains("authenticat") || l.contains("secret"),
                    "connect failed, but not naming authentication: {why}"
                );
                (took, why)
            }
        };
        drop(ep);
        out
    })
}

/// ucx / fabric: an endpoint without the secret, claiming prefill rank 0/0, tries to send chunk
/// notifications (last chunk of the next requests, their generations guessed from the epoch) to the
/// decode. The connect is refused naming authentication; the real ranks go on verifying.
fn endpoint_forged_notification(backend: &'static str) -> Result<CaseOut, String> {
    hostile_run_on(backend, Env { secret: true }, &[], &[], |boot| {
        let (md, epoch) = read_endpoint(boot)?;
        let key = SenderKey::of(RankId::new(0, 0));
        let notes: Vec<Notification> = (0..24u64)
            .map(|r| Notification::chunk(RequestId(r), key, 0, true).with_generation((epoch << 32) | r))
            .collect();
        let (took, why) = endpoint_attack(backend, &md, identity(Side::Prefill, RankId::new(0, 0)), None, &notes);
        Ok((
            secs(ENDPOINT_AUTH_BOUND),
            measure("refused", took, ENDPOINT_AUTH_BOUND),
            format!("refused: {}", short(&why)),
        ))
    })
}

/// ucx / fabric: endpoints claiming prefill rank 0/0 (no secret, a wrong one) connect to the decode,
/// six times; each is refused naming authentication, the real prefill's requests go on.
fn endpoint_impersonation(backend: &'static str) -> Result<CaseOut, String> {
    hostile_run_on(backend, Env { secret: true }, &[], &[], |boot| {
        let (md, _) = read_endpoint(boot)?;
        let mut worst = Duration::ZERO;
        let mut said = Vec::new();
        for i in 0..6 {
            let secret = (i % 2 == 1).then_some("a made-up cluster secret");
            let (took, why) = endpoint_attack(backend, &md, identity(Side::Prefill, RankId::new(0, 0)), secret, &[]);
            worst = worst.max(took);
            said.push(short(&why));
        }
        said.sort();
        said.dedup();
        Ok((secs(ENDPOINT_AUTH_BOUND), measure("refused (worst of 6)", worst, ENDPOINT_AUTH_BOUND), said.join(" / ")))
    })
}

fn short(s: &str) -> String {
    s.chars().take(80).collect()
}

fn answer_note(a: &Answer) -> String {
    match a {
        Answer::Rejected(why) => format!("refused: {}", short(why)),
        Answer::Other { bytes, text } => format!("{bytes} bytes that are no reply: {}", short(text)),
        other => format!("{other:?}"),
    }
}

fn impersonated_identity() -> Result<CaseOut, String> {
    hostile_run(Env { secret: true }, &[], &[], |boot| {
        let t = read_target(boot, Some(SECRET)).expect("metadata");
        probe_auth(&t)?;
        let mut worst = Duration::ZERO;
        let mut answers = Vec::new();
        // Claim prefill rank 0/0 on data and control streams, with no proof and with a made-up one,
        // a few times, leaving without a BYE.
        for i in 0..6u8 {
            let mut r = raw_connect(t.addr);
            let t0 = Instant::now();
            let h = r.hello(&t.token, i % 2, identity(Side::Prefill, RankId::new(0, 0)), i % 4 >= 2);
            let _ = r.s.write_all(&h);
            let (a, closed) = read_answer(&mut r, TCP_HANDSHAKE_BOUND + Duration::from_secs(4));
            let closed = assert_refused_for_auth("impersonation", &a, closed);
            worst = worst.max(closed - t0);
            answers.push(answer_note(&a));
            drop(r);
            std::thread::sleep(Duration::from_millis(200));
        }
        answers.sort();
        answers.dedup();
        Ok((
            secs(TCP_HANDSHAKE_BOUND),
            measure("refused (worst of 6)", worst, TCP_HANDSHAKE_BOUND),
            answers.join(" / "),
        ))
    })
}

/// Sends `bytes` one every 200 ms until the server closes; when it closed (None: never, within `max`).
fn trickle(s: &mut TcpStream, bytes: &[u8], max: Duration) -> (Option<Duration>, String) {
    let t0 = Instant::now();
    let mut said = Vec::new();
    s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    for b in bytes.iter().cycle() {
        if t0.elapsed() > max {
            return (None, String::from_utf8_lossy(&said).into_owned());
        }
        let mut buf = [0u8; 4096];
        match s.read(&mut buf) {
            Ok(0) => return (Some(t0.elapsed()), String::from_utf8_lossy(&said).into_owned()),
            Ok(n) => said.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return (Some(t0.elapsed()), String::from_utf8_lossy(&said).into_owned()),
        }
        if s.write_all(&[*b]).is_err() {
            return (Some(t0.elapsed()), String::from_utf8_lossy(&said).into_owned());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    unreachable!()
}

fn slowloris() -> Result<CaseOut, String> {
    let env = Env { secret: false };
    let extra = ["--backend-opt".to_owned(), format!("timeout_s={TCP_TIMEOUT_S}")];
    hostile_run(env, &["--idle-timeout-s", &BOOT_IDLE_S.to_string()], &extra, |addr| {
        let t = read_target(addr, None).expect("metadata");
        let boot_addr: SocketAddr = addr.parse().unwrap();
        let cap = Duration::from_secs(20);
        // Three slow clients at once, while the stream runs.
        let a = std::thread::spawn(move || {
            let mut s = TcpStream::connect(boot_addr).unwrap();
            trickle(&mut s, br#"{"op":"get","key":"slow","wait_ms":1}"#, cap)
        });
        let (token, daddr) = (t.token, t.addr);
        let b = std::thread::spawn(move || {
            // The deadline runs from the accept: count from the connect (the challenge is read first).
            let t0 = Instant::now();
            let mut r = raw_connect(daddr);
            let h = r.hello(&token, 0, 0xdead_beef, false);
            let (took, said) = trickle(&mut r.s, &h, cap);
            (took.map(|_| t0.elapsed()), said)
        });
        // A valid handshake (no secret: the token from the metadata), then 10 bytes of a frame header.
        let c = std::thread::spawn(move || -> Result<(Duration, String), String> {
            let mut r = raw_connect(daddr);
            let h = r.hello(&token, 0, 0xdead_bef0, false);
            r.s.write_all(&h).unwrap();
            match read_answer(&mut r, Duration::from_secs(3)).0 {
                Answer::Accepted => {}
                other => return Err(format!("handshake without a secret not accepted ({other:?}): sub-case skipped")),
            }
            let hdr = note_frame(&Notification::chunk(RequestId(0), SenderKey::of(RankId::new(0, 9)), 0, false), 1);
            r.s.write_all(&hdr[..10]).unwrap();
            let t0 = Instant::now();
            let (ans, closed) = read_answer(&mut r, cap);
            Ok((closed.map_or(cap, |c| c - t0), answer_note(&ans)))
        });
        let (ra, rb, rc) = (a.join().unwrap(), b.join().unwrap(), c.join().unwrap());
        let ta = ra.0.unwrap_or_else(|| panic!("bootstrap kept a slowloris client for {cap:?}"));
        let tb = rb.0.unwrap_or_else(|| panic!("data port kept a slowloris handshake for {cap:?}"));
        let mut ms =
            vec![measure("bootstrap", ta, BOOT_IDLE_BOUND), measure("data-port handshake", tb, TCP_HANDSHAKE_BOUND)];
        let mut notes = vec![format!("bootstrap said {:?}", short(ra.1.trim()))];
        if !rb.1.is_empty() {
            notes.push(format!("data port said {:?}", short(&rb.1)));
        }
        match rc {
            Ok((tc, ans)) => {
                ms.push(measure("partial header", tc, FRAME_BOUND));
                notes.push(format!("partial header: {ans}"));
            }
            Err(e) => notes.push(e),
        }
        Ok((
            format!(
                "bootstrap {}, handshake {}, frame {}",
                secs(BOOT_IDLE_BOUND),
                secs(TCP_HANDSHAKE_BOUND),
                secs(FRAME_BOUND)
            ),
            ms.join(", "),
            notes.join("; "),
        ))
    })
}

/// Connects from `src` (another loopback address: another source for per-source limits).
fn connect_from(rt: &tokio::runtime::Runtime, src: &str, dst: SocketAddr) -> std::io::Result<TcpStream> {
    rt.block_on(async {
        let s = tokio::net::TcpSocket::new_v4()?;
        s.bind(format!("{src}:0").parse().unwrap())?;
        let st = tokio::time::timeout(Duration::from_secs(2), s.connect(dst))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect"))??;
        let st = st.into_std()?;
        st.set_nonblocking(false)?;
        Ok(st)
    })
}

/// Opens idle connections to `dst` until one is refused (a reason, or closed at once); returns the
/// held ones and the refusal (index, what it said). A protocol-4 CHALLENGE (what the tcp data port
/// says first on every stream) is no refusal.
fn flood(rt: &tokio::runtime::Runtime, dst: SocketAddr) -> (Vec<TcpStream>, Option<(usize, String)>) {
    let mut held: Vec<TcpStream> = Vec::new();
    let mut heard = Vec::new();
    for i in 0..FLOOD_MAX {
        let s = match connect_from(rt, "127.0.0.2", dst) {
            Ok(s) => s,
            Err(e) => return (held, Some((i, format!("connect refused: {e}")))),
        };
        held.push(s);
        heard.push(0usize);
        // Every 50th, and the last, look for a refusal on the connections opened since.
        if i % 50 == 49 || i + 1 == FLOOD_MAX {
            std::thread::sleep(Duration::from_millis(50));
            for j in i.saturating_sub(49)..=i {
                let h = &mut held[j];
                h.set_nonblocking(true).unwrap();
                let mut b = [0u8; 4096];
                let r = h.read(&mut b);
                h.set_nonblocking(false).unwrap();
                match r {
                    Ok(0) => return (held, Some((j, "closed".into()))),
                    Ok(n) if heard[j] + n <= 48 && (heard[j] > 0 || b.starts_with(b"KVXT")) => heard[j] += n,
                    Ok(n) => {
                        let text = String::from_utf8_lossy(&b[..n]).chars().filter(|c| !c.is_control()).collect();
                        return (held, Some((j, text)));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return (held, Some((j, e.to_string()))),
                }
            }
        }
    }
    (held, None)
}

/// Waits until the listener closed every one of `held` (read 0 or an error; a CHALLENGE is read and
/// skipped); returns when the last was closed, or how many were still open at `until`.
fn wait_all_closed(held: &mut [TcpStream], until: Instant) -> Result<Instant, usize> {
    let mut open: Vec<usize> = (0..held.len()).collect();
    let mut b = [0u8; 4096];
    loop {
        open.retain(|&j| {
            let h = &mut held[j];
            h.set_nonblocking(true).unwrap();
            let r = loop {
                match h.read(&mut b) {
                    Ok(0) => break false,
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break true,
                    Err(_) => break false,
                }
            };
            h.set_nonblocking(false).unwrap();
            r
        });
        if open.is_empty() {
            return Ok(Instant::now());
        }
        if Instant::now() >= until {
            return Err(open.len());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn fd_exhaustion() -> CaseOut {
    let env = Env { secret: false };
    let (_boot, addr) = bootstrap(env, &[], None);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let n = 24;
    // timeout_s: the handshake deadline of protocol 2 (protocol 4 has handshake_timeout_s, 5 s).
    let mut extra = stream(Some(n));
    extra.extend(["--backend-opt".into(), format!("timeout_s={TCP_TIMEOUT_S}")]);
    let o = WorkerOpts { backend: "tcp", env, extra, netns: None, nofile: Some(DECODE_NOFILE) };
    let mut d = worker(&addr, "decode", &o);
    assert!(d.wait_kind("registered", 1, Duration::from_secs(30)), "decode did not register:\n{}", d.output());
    let t = read_target(&addr, None).expect("metadata");
    // Flood both ports from 127.0.0.2 and hold the connections.
    let t0 = Instant::now();
    let (held_b, refused_b) = flood(&rt, addr.parse().unwrap());
    let (mut held_d, refused_d) = flood(&rt, t.addr);
    let flood_took = t0.elapsed();
    let flooded = Instant::now();
    // The bootstrap refuses one source beyond its share, naming it (and still serves 127.0.0.1).
    let rb = refused_b
        .unwrap_or_else(|| panic!("the bootstrap held {FLOOD_MAX} idle connections from one source, none refused"));
    assert!(rb.1.contains("127.0.0.2"), "the bootstrap's refusal does not name the source: {}", rb.1);
    // The data port has no connection limit of its own: idle connections that never complete a
    // handshake are closed at the handshake deadline, so the decode (2,048 descriptors) gets them back.
    let closed = wait_all_closed(&mut held_d, flooded + TCP_HANDSHAKE_BOUND + Duration::from_secs(5));
    let closed = closed.unwrap_or_else(|left| {
        panic!(
            "{left} of {} idle data-port connections still open {:?} after the flood",
            held_d.len(),
            flooded.elapsed()
        )
    });
    assert!(d.exited().is_none(), "the decode died under the flood:\n{}", d.output());
    let m_closed = measure("data port shed idle", closed - flooded, TCP_HANDSHAKE_BOUND);
    // The real ranks run while the bootstrap flood is still held.
    let o = WorkerOpts { nofile: None, ..o };
    let t1 = Instant::now();
    let mut p = worker(&addr, "prefill", &o);
    let sd = d.wait_exit(RUN_BOUND).unwrap_or_else(|| panic!("decode did not finish:\n{}", d.output()));
    let sp = p.wait_exit(Duration::from_secs(15)).unwrap_or_else(|| panic!("prefill did not finish:\n{}", p.output()));
    let run = t1.elapsed();
    drop((held_b, held_d));
    assert!(sd.0.success() && sp.0.success(), "real ranks failed under the flood:\n{}\n{}", d.output(), p.output());
    let v = check_verified(&d, Some(u64::from(n)));
    let data = match refused_d {
        Some((i, why)) => format!("data port refused #{i}: {:?}", short(&why)),
        None => format!("data port held {FLOOD_MAX}"),
    };
    (
        format!("shed {}, run {}", secs(TCP_HANDSHAKE_BOUND), secs(RUN_BOUND)),
        format!("flood {}, {m_closed}, {}", secs(flood_took), measure("run", run, RUN_BOUND)),
        format!("bootstrap refused #{}: {:?}; {data}; {v}", rb.0, short(&rb.1)),
    )
}

// ---- the demo and its workers -------------------------------------------------------------------

/// Processes whose parent is `ppid` (from /proc), with their command lines.
fn children_of(ppid: u32) -> Vec<(u32, String)> {
    let mut v = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else { return v };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let Some((_, rest)) = stat.rsplit_once(')') else { continue };
        if rest.split_whitespace().nth(1).and_then(|x| x.parse::<u32>().ok()) == Some(ppid) {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            v.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ")));
        }
    }
    v
}

/// Whether `pid` ended (gone, or a zombie not reaped yet).
fn ended(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |st| {
        st.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()).map_or(true, |s| s == "Z" || s == "X")
    })
}

/// Processes that are not this test's children (a killed demo's workers): SIGKILLed on drop unless
/// they ended.
struct Strays(Vec<u32>);

impl Drop for Strays {
    fn drop(&mut self) {
        for &p in &self.0 {
            if !ended(p) {
                let _ = Command::new("kill").args(["-KILL", &p.to_string()]).status();
            }
        }
    }
}

/// `kvxfer demo` with an endless stream; returns it and its two workers (decode, prefill pids) once
/// both run.
fn demo(backend: &str, extra: &[&str]) -> (Proc, u32, u32) {
    let mut c = Command::new(EXE);
    c.args(["demo", "--format", "json", "--layers", "4", "--prefill-tp", "1", "--decode-tp", "1"])
        .args(["--lease-ttl-s", &TTL.as_secs().to_string(), "--timeout-s", "120"])
        .args(["--backend", backend])
        .args(backend_opts(backend))
        .args(stream(None))
        .args(extra)
        .env_remove("KVXFER_SECRET");
    let d = Proc::spawn("demo", c);
    let end = Instant::now() + Duration::from_secs(30);
    let (mut dec, mut pre) = (None, None);
    while (dec.is_none() || pre.is_none()) && Instant::now() < end {
        for (pid, cmd) in children_of(d.pid()) {
            if cmd.contains(" worker ") && cmd.contains("--role decode") {
                dec = Some(pid);
            } else if cmd.contains(" worker ") && cmd.contains("--role prefill") {
                pre = Some(pid);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (Some(dec), Some(pre)) = (dec, pre) else { panic!("the demo started no two workers:\n{}", d.output()) };
    // Let requests stream (the workers connect within a second or two, also on loaded cores).
    std::thread::sleep(Duration::from_secs(3));
    (d, dec, pre)
}

/// SIGKILL of the decode worker under `kvxfer demo`: the demo exits non-zero and names the worker
/// and how it died (the signal); the prefill worker is stopped, nothing is left running.
fn demo_worker_killed(backend: &str) -> CaseOut {
    let (mut d, dec, pre) = demo(backend, &[]);
    let _strays = Strays(vec![dec, pre]);
    let st = Command::new("kill").args(["-KILL", &dec.to_string()]).status().unwrap();
    assert!(st.success());
    let t0 = Instant::now();
    let (st, at) = d
        .wait_exit(EXIT_BOUND + Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the demo did not exit after its decode worker was killed:\n{}", d.output()));
    let m = measure("demo exit", at - t0, EXIT_BOUND);
    assert!(!st.success(), "the demo exited 0 although its decode worker was killed");
    // Its JSON report (stdout) names the worker and the signal.
    let end = Instant::now() + Duration::from_secs(2);
    let report = loop {
        let out: String = d.lines.lock().unwrap().iter().filter(|l| !l.err).map(|l| l.text.clone() + "\n").collect();
        if let Ok(v) = serde_json::from_str::<Value>(&out) {
            break v;
        }
        assert!(Instant::now() < end, "the demo printed no JSON report:\n{}", d.output());
        std::thread::sleep(Duration::from_millis(20));
    };
    let errors: Vec<String> =
        report["errors"].as_array().into_iter().flatten().filter_map(|e| e.as_str().map(String::from)).collect();
    let named = errors
        .iter()
        .find(|e| e.contains("worker decode") && e.contains("killed by signal 9 (SIGKILL)"))
        .unwrap_or_else(|| panic!("the demo's report does not name the killed decode worker: {errors:?}"));
    let end = Instant::now() + Duration::from_secs(2);
    while !ended(pre) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(ended(pre), "the prefill worker outlived the demo");
    (secs(EXIT_BOUND), m, format!("demo {st}, report: {named:?}"))
}

/// SIGKILL of `kvxfer demo` itself (its store outside, so only the parent is gone): both workers
/// notice they were orphaned, name their parent, abort and exit within the bound.
fn demo_killed(backend: &str) -> CaseOut {
    let (_boot, addr) = bootstrap(Env { secret: false }, &[], None);
    let (mut d, dec, pre) = demo(backend, &["--metadata", &format!("bootstrap://{addr}")]);
    let strays = Strays(vec![dec, pre]);
    let demo_pid = d.pid();
    let t0 = d.kill9();
    let mut ms = Vec::new();
    for (pid, role) in [(dec, "decode"), (pre, "prefill")] {
        let end = t0 + EXIT_BOUND + Duration::from_secs(10);
        while !ended(pid) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(ended(pid), "the {role} worker (pid {pid}) still runs {:?} after its demo was killed", t0.elapsed());
        ms.push(measure(&format!("{role} exit"), t0.elapsed(), EXIT_BOUND));
    }
    drop(strays);
    // Their stderr is the demo's, still read here: each named its dead parent.
    let pat = format!("parent process {demo_pid} exited");
    for role in ["decode", "prefill"] {
        let said = d.line_where(t0, Instant::now() + Duration::from_secs(2), |l| {
            l.err && l.text.contains(&pat) && l.text.contains(&format!("worker {role}"))
        });
        assert!(said.is_some(), "the {role} worker did not say its parent died:\n{}", d.output());
    }
    (secs(EXIT_BOUND), ms.join(", "), "each worker named its parent and exited".into())
}

/// The options that put `backend` on the veth of a namespace (`addr`, its device `veth`): tcp listens
/// on the address, ucx takes the device and only its tcp transport (shared memory would cross the
/// namespaces and survive the cut), fabric binds its tcp provider to the address. ucx and fabric
/// get 5 s transfer timeouts, as in the SIGSTOP cases.
fn netns_opts(backend: &str, addr: &str, veth: &str) -> Vec<String> {
    let opts = match backend {
        "tcp" => vec![format!("listen={addr}:0")],
        "ucx" => vec![format!("net_devices={veth}"), "tls=tcp".into(), format!("timeout_ms={}", TCP_TIMEOUT_S * 1000)],
        _ => vec![format!("addr={addr}"), format!("timeout_ms={}", TCP_TIMEOUT_S * 1000)],
    };
    opts.into_iter().flat_map(|o| ["--backend-opt".to_owned(), o]).collect()
}

/// Bootstrap and decode in one namespace, prefill in another; the veth goes down mid-run.
fn link_cut(backend: &str) -> Result<CaseOut, String> {
    let ns =
        support::NetnsPair::create("kvc", 11).map_err(|e| format!("cannot create network namespaces here ({e})"))?;
    assert_eq!(ns.addr_a, NS_ADDR_A);
    let env = Env { secret: false };
    let (_boot, addr) = bootstrap(env, &[], Some(&ns.a));
    let mut od = WorkerOpts { backend, env, extra: stream(None), netns: Some(&ns.a), nofile: None };
    od.extra.extend(netns_opts(backend, &ns.addr_a, &ns.veth_a));
    let mut d = worker(&addr, "decode", &od);
    let mut op = WorkerOpts { backend, env, extra: stream(None), netns: Some(&ns.b), nofile: None };
    op.extra.extend(netns_opts(backend, &ns.addr_b, &ns.veth_b));
    let mut p = worker(&addr, "prefill", &op);
    assert!(d.wait_kind("done", 3, Duration::from_secs(60)), "no request completed:\n{}\n{}", d.output(), p.output());
    let st = Command::new("ip").args(["-n", &ns.a, "link", "set", &ns.veth_a, "down"]).status().unwrap();
    assert!(st.success());
    let t0 = Instant::now();
    // tcp: the agent's close of the lost peer's connection; ucx / fabric: their transfers to (and
    // the revoke acknowledgement from) the unreachable peer time out first (`timeout_ms`), as
    // after a SIGSTOP.
    let (exit_bound, store_exit_bound) =
        if backend == "tcp" { (EXIT_BOUND, STORE_EXIT_BOUND) } else { (SIGSTOP_EXIT_BOUND_C, STORE_EXIT_BOUND_C) };
    let named = d
        .line_where(t0, t0 + NAMED_BOUND + Duration::from_secs(10), |l| names_lost(l, "prefill"))
        .unwrap_or_else(|| panic!("decode never named prefill rank 0/0 lost:\n{}", d.output()));
    let m1 = measure("decode named prefill", named.at - t0, NAMED_BOUND);
    let (sd, at) = d
        .wait_exit(exit_bound + Duration::from_secs(10))
        .unwrap_or_else(|| panic!("decode did not exit:\n{}", d.output()));
    if at - t0 > exit_bound {
        eprintln!("link_cut: the decode's lines, seconds after the cut:\n{}", timeline(&d, t0));
    }
    let m2 = measure("decode exit", at - t0, exit_bound);
    // The prefill lost its store (in the other namespace): it names it and exits.
    let named_p = p
        .line_where(t0, t0 + store_exit_bound + Duration::from_secs(10), |l| {
            l.text.contains(&format!("bootstrap at {addr}"))
        })
        .unwrap_or_else(|| panic!("prefill never named its store:\n{}", p.output()));
    let m3 = measure("prefill named store", named_p.at - t0, STORE_NAMED_BOUND);
    let (spr, at) = p
        .wait_exit(store_exit_bound + Duration::from_secs(10))
        .unwrap_or_else(|| panic!("prefill did not exit:\n{}", p.output()));
    if at - t0 > store_exit_bound || std::env::var("KVXFER_CHAOS_TIMELINE").is_ok() {
        eprintln!("link_cut: the prefill's lines, seconds after the cut:\n{}", timeline(&p, t0));
    }
    let m4 = measure("prefill exit", at - t0, store_exit_bound);
    assert!(!sd.success() && !spr.success());
    let v = check_verified(&d, None);
    drop((d, p));
    Ok((
        format!(
            "named {}, exit {}; store {} / {}",
            secs(NAMED_BOUND),
            secs(exit_bound),
            secs(STORE_NAMED_BOUND),
            secs(store_exit_bound)
        ),
        format!("{m1}, {m2}, {m3}, {m4}"),
        v,
    ))
}

// ---- presumed dead (issue 32) -----------------------------------------------------------------

/// What resumes after the survivor gave up on it (SEMANTICS §6: giving up is no proof of death).
#[derive(Clone, Copy, Debug)]
enum Presumed {
    /// SIGSTOP of the prefill worker until the decode gave up on it, then SIGCONT.
    StopPrefill,
    /// The same for the decode worker (the prefill gives up; the decode resumes, finds its own
    /// lease gone and gives up on its peers).
    StopDecode,
    /// SIGKILL of the metadata service: both ranks lose their own membership while their peer is
    /// alive and connected.
    StoreKilled,
    /// The veth between the decode's and the prefill's namespaces down until the decode gave up,
    /// then up again.
    LinkHealed,
}

/// How long the decode waits, once its requests ended, before checking its whole pool: the
/// resumed peer's queued writes reach it well within this.
const LINGER_S: u64 = 6;
/// From the fault to the decode's exit: its give-up (store bound 5 s + TTL), the cut-off, its
/// requests' ends, the linger, the shutdown (5 s) and scheduling on 2 shared cores.
const PRESUMED_EXIT_BOUND: Duration = Duration::from_secs(5 + 2 + 10 + LINGER_S + 5 + 7);

/// The cut-off time the decode logged ("cut off prefill rank 0/0 X ms after giving up"), in ms.
fn cut_off_ms(p: &Proc) -> Option<f64> {
    p.lines.lock().unwrap().iter().find_map(|l| {
        let i = l.text.find("cut off prefill rank 0/0 ")?;
        let rest = &l.text[i + "cut off prefill rank 0/0 ".len()..];
        rest.split(' ').next()?.parse().ok()
    })
}

/// One run of a presumed-dead fault: returns the decode's cut-off time (ms) and a note.
fn presumed_dead_once(backend: &str, fault: Presumed) -> Result<(f64, String), String> {
    let env = Env { secret: false };
    let mut extra = stream(None);
    extra.extend(["--linger-s".to_owned(), LINGER_S.to_string()]);
    if backend != "tcp" {
        extra.extend(["--backend-opt".to_owned(), format!("timeout_ms={}", TCP_TIMEOUT_S * 1000)]);
    }
    let ns = match fault {
        Presumed::LinkHealed => Some(
            support::NetnsPair::create("kvp", 12)
                .map_err(|e| format!("cannot create network namespaces here ({e})"))?,
        ),
        _ => None,
    };
    let (mut boot, _addr, mut d, mut p) = match &ns {
        None => {
            let (boot, addr) = bootstrap(env, &[], None);
            let o = WorkerOpts { backend, env, extra: extra.clone(), netns: None, nofile: None };
            let d = worker(&addr, "decode", &o);
            let p = worker(&addr, "prefill", &o);
            (boot, addr, d, p)
        }
        Some(ns) => {
            let (boot, addr) = bootstrap_at(env, &ns.a, &ns.addr_a);
            let mut od = WorkerOpts { backend, env, extra: extra.clone(), netns: Some(&ns.a), nofile: None };
            od.extra.extend(netns_opts(backend, &ns.addr_a, &ns.veth_a));
            let d = worker(&addr, "decode", &od);
            let mut op = WorkerOpts { backend, env, extra: extra.clone(), netns: Some(&ns.b), nofile: None };
            op.extra.extend(netns_opts(backend, &ns.addr_b, &ns.veth_b));
            let p = worker(&addr, "prefill", &op);
            (boot, addr, d, p)
        }
    };
    if !d.wait_kind("done", 3, Duration::from_secs(60)) {
        return Err(format!("no request completed:\n{}\n{}", d.output(), p.output()));
    }
    let t0 = Instant::now();
    let give_up_bound = t0 + STORE_EXIT_BOUND + Duration::from_secs(10);
    match fault {
        Presumed::StopPrefill => {
            p.signal("STOP");
            d.line_where(t0, give_up_bound, |l| names_lost(l, "prefill"))
                .ok_or_else(|| format!("the decode never gave up on the stopped prefill:\n{}", d.output()))?;
            p.signal("CONT");
        }
        Presumed::StopDecode => {
            d.signal("STOP");
            p.line_where(t0, give_up_bound, |l| names_lost(l, "decode"))
                .ok_or_else(|| format!("the prefill never gave up on the stopped decode:\n{}", p.output()))?;
            d.signal("CONT");
        }
        Presumed::StoreKilled => {
            boot.kill9();
        }
        Presumed::LinkHealed => {
            let ns = ns.as_ref().unwrap();
            let link = |state: &str| {
                Command::new("ip").args(["-n", &ns.a, "link", "set", &ns.veth_a, state]).status().map(|s| s.success())
            };
            if !link("down").unwrap_or(false) {
                return Err("could not take the veth down".into());
            }
            let named = d.line_where(t0, give_up_bound, |l| names_lost(l, "prefill"));
            let up = link("up").unwrap_or(false);
            named.ok_or_else(|| format!("the decode never gave up on the cut-off prefill:\n{}", d.output()))?;
            if !up {
                return Err("could not bring the veth up again".into());
            }
        }
    }
    let (st, _) = d
        .wait_exit(PRESUMED_EXIT_BOUND)
        .ok_or_else(|| format!("the decode did not exit within {PRESUMED_EXIT_BOUND:?}:\n{}", timeline(&d, t0)))?;
    let took = t0.elapsed();
    let out = d.output();
    if !out.contains("\"kind\":\"pool_checked\"") {
        return Err(format!("the decode never checked its pool ({st}):\n{out}"));
    }
    let s = d.summary().ok_or_else(|| format!("the decode printed no summary:\n{out}"))?;
    let errors: Vec<String> =
        s["errors"].as_array().into_iter().flatten().filter_map(|e| e.as_str().map(String::from)).collect();
    for bad in
        ["changed outside any request", "cannot read page", "after the fence", "verification failed", "quarantined"]
    {
        if let Some(e) = errors.iter().find(|e| e.contains(bad)) {
            return Err(format!("STRAY: {e}\n{}", timeline(&d, t0)));
        }
    }
    if st.success() || errors.is_empty() {
        return Err(format!("an endless stream cannot end well after its peer was given up on ({st}): {s}"));
    }
    for e in &errors {
        if !(e.contains("rank 0/0") || e.contains("bootstrap at") || e.contains("lost")) {
            return Err(format!("a failure that names no peer and no store: {e}"));
        }
    }
    // Every give-up is followed by a confirmed cut-off. With the store killed the decode may never
    // give up on the prefill: the prefill, losing its own membership first, fails and fences its
    // requests, and the decode's pages come back by that fence (SEMANTICS §6), not by a cut-off.
    // Then there is no cut-off to time (NaN), and the pool check above is the whole verdict.
    let gave_up = d.line_where(t0, Instant::now(), |l| l.text.contains("lost prefill rank 0/0:"));
    let ms = match cut_off_ms(&d) {
        Some(ms) => ms,
        None if matches!(fault, Presumed::StoreKilled) && gave_up.is_none() => f64::NAN,
        None => return Err(format!("the decode logged no confirmed cut-off of prefill rank 0/0:\n{out}")),
    };
    // The other side: a resumed or surviving prefill leaves by itself, or is killed.
    let prefill = match p.wait_exit(Duration::from_secs(15)) {
        Some((s, _)) => format!("prefill {s}"),
        None => {
            p.kill9();
            "prefill still running after 15 s: killed".into()
        }
    };
    drop(boot);
    Ok((ms, format!("decode {st} after {}, {} errors named, pool clean; {prefill}", secs(took), errors.len())))
}

/// `KVXFER_CHAOS_RUNS` runs (default 1) of one presumed-dead fault; every run must end with a
/// clean decode pool. Reports the runs and the cut-off times.
fn presumed_dead(backend: &str, fault: Presumed) -> Result<CaseOut, String> {
    let runs: usize = std::env::var("KVXFER_CHAOS_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    let mut ms = Vec::new();
    let mut last = String::new();
    for i in 0..runs {
        match presumed_dead_once(backend, fault) {
            Ok((m, note)) => {
                let cut = if m.is_nan() {
                    "no give-up (the senders fenced)".to_owned()
                } else {
                    format!("cut-off {m:.1} ms")
                };
                eprintln!("chaos: presumed_dead {fault:?} on {backend}, run {}/{runs}: {cut}; {note}", i + 1);
                ms.push(m);
                last = note;
            }
            Err(e) if e.starts_with("cannot create network namespaces") => return Err(e),
            Err(e) => panic!("{fault:?} on {backend}, run {} of {runs}: {e}", i + 1),
        }
    }
    let fenced = ms.iter().filter(|m| m.is_nan()).count();
    ms.retain(|m| !m.is_nan());
    ms.sort_by(f64::total_cmp);
    let timing = if ms.is_empty() {
        "no cut-off needed".to_owned()
    } else {
        format!("give-up to cut-off {:.1} ms median, {:.1} ms max", ms[ms.len() / 2], ms[ms.len() - 1])
    };
    let fenced =
        if fenced > 0 { format!(" ({fenced} released by the senders' fence, no give-up)") } else { String::new() };
    Ok((
        format!("stray bytes 0 in {runs} run(s); exit {}", secs(PRESUMED_EXIT_BOUND)),
        format!("{runs} run(s), 0 stray; {timing}{fenced}"),
        last,
    ))
}

/// A bootstrap service inside namespace `ns`, listening on `addr`.
fn bootstrap_at(env: Env, ns: &str, addr: &str) -> (Proc, String) {
    let mut c = in_ns(Some(ns));
    c.args(["bootstrap", "--listen", &format!("{addr}:0"), "--for-s", "300"]);
    env.apply(&mut c);
    let p = Proc::spawn("bootstrap", c);
    let l = p
        .line_where(Instant::now() - Duration::from_secs(60), Instant::now() + Duration::from_secs(20), |l| {
            !l.err && l.text.rsplit(' ').next().is_some_and(|a| a.parse::<SocketAddr>().is_ok())
        })
        .unwrap_or_else(|| panic!("bootstrap printed no address: {}", p.output()));
    let addr = l.text.rsplit(' ').next().unwrap().to_owned();
    (p, addr)
}

/// A case of the matrix: name, backend, whether it is slow, and its body (Err: skipped, why).
type Body = Box<dyn FnOnce() -> Result<CaseOut, String>>;

/// The backends built in, narrowed by `KVXFER_CHAOS_BACKENDS=ucx,fabric` when set.
fn backends() -> Vec<&'static str> {
    let mut b = vec!["tcp"];
    if cfg!(feature = "ucx") {
        b.push("ucx");
    }
    if cfg!(feature = "fabric") {
        b.push("fabric");
    }
    if let Ok(only) = std::env::var("KVXFER_CHAOS_BACKENDS") {
        let only: Vec<&str> = only.split(',').map(str::trim).collect();
        for o in &only {
            assert!(b.contains(o), "KVXFER_CHAOS_BACKENDS names {o}, which this build lacks (built: {b:?})");
        }
        b.retain(|x| only.contains(x));
    }
    b
}

fn matrix() -> Vec<(String, &'static str, bool, Body)> {
    let mut m: Vec<(String, &'static str, bool, Body)> = Vec::new();
    for b in backends() {
        let slow = b != "tcp";
        m.push(("kill9_decode".into(), b, slow, Box::new(move || Ok(kill9(b, "decode")))));
        m.push(("kill9_prefill".into(), b, slow, Box::new(move || Ok(kill9(b, "prefill")))));
        m.push(("kill9_prefill_later_requests".into(), b, slow, Box::new(move || Ok(later_requests(b)))));
        m.push(("sigstop_prefill".into(), b, slow, Box::new(move || Ok(sigstop(b, "prefill")))));
        m.push(("sigstop_decode".into(), b, slow, Box::new(move || Ok(sigstop(b, "decode")))));
        m.push(("bootstrap_killed".into(), b, slow, Box::new(move || Ok(bootstrap_killed(b)))));
        if b == "tcp" {
            // Raw clients of the tcp data port's own protocol.
            m.push(("forged_notification".into(), b, false, Box::new(forged_notification)));
            m.push(("impersonated_identity".into(), b, false, Box::new(impersonated_identity)));
        } else {
            // An endpoint of the same backend without the secret, from this process.
            m.push(("forged_notification".into(), b, slow, Box::new(move || endpoint_forged_notification(b))));
            m.push(("impersonated_identity".into(), b, slow, Box::new(move || endpoint_impersonation(b))));
        }
        m.push(("demo_worker_killed".into(), b, slow, Box::new(move || Ok(demo_worker_killed(b)))));
        m.push(("demo_killed".into(), b, slow, Box::new(move || Ok(demo_killed(b)))));
        m.push(("link_cut".into(), b, slow, Box::new(move || link_cut(b))));
        for (name, fault) in [
            ("presumed_dead_stop_prefill", Presumed::StopPrefill),
            ("presumed_dead_stop_decode", Presumed::StopDecode),
            ("presumed_dead_store_killed", Presumed::StoreKilled),
            ("presumed_dead_link_healed", Presumed::LinkHealed),
        ] {
            m.push((name.into(), b, slow, Box::new(move || presumed_dead(b, fault))));
        }
    }
    // The bootstrap port is the same for every backend, the data port's protocol is tcp's own (ucx
    // and fabric listen inside the C library).
    if backends().contains(&"tcp") {
        m.push(("slowloris".into(), "tcp", false, Box::new(slowloris)));
        m.push(("fd_exhaustion".into(), "tcp", false, Box::new(|| Ok(fd_exhaustion()))));
    }
    m
}

#[test]
fn chaos_matrix() {
    let only: Option<Vec<String>> =
        std::env::var("KVXFER_CHAOS_CASES").ok().map(|s| s.split(',').map(|x| x.trim().to_owned()).collect());
    let slow = std::env::var("KVXFER_CHAOS_SLOW").is_ok_and(|v| v == "1");
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    let started = Instant::now();
    for (case, backend, is_slow, body) in matrix() {
        if let Some(o) = &only {
            if !o.iter().any(|x| *x == case || *x == format!("{case}:{backend}")) {
                continue;
            }
        } else if is_slow && !slow {
            rows.push(Row {
                case,
                backend: backend.into(),
                bound: "-".into(),
                measured: "-".into(),
                result: "skipped (slow: KVXFER_CHAOS_SLOW=1)".into(),
            });
            continue;
        }
        eprintln!("chaos: {case} on {backend} ...");
        let t0 = Instant::now();
        let r = std::panic::catch_unwind(AssertUnwindSafe(body));
        let took = t0.elapsed();
        let row = match r {
            Ok(Ok((bound, measured, note))) => Row {
                case,
                backend: backend.into(),
                bound,
                measured,
                result: format!("pass ({}; case {})", note, secs(took)),
            },
            Ok(Err(skip)) => {
                eprintln!("SKIPPED {case}: {skip}");
                Row {
                    case,
                    backend: backend.into(),
                    bound: "-".into(),
                    measured: "-".into(),
                    result: format!("skipped: {skip}"),
                }
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "panic".into());
                failed.push(format!("{case} on {backend}"));
                let first = msg.lines().next().unwrap_or("").chars().take(160).collect::<String>();
                Row {
                    case,
                    backend: backend.into(),
                    bound: "-".into(),
                    measured: "-".into(),
                    result: format!("FAIL after {}: {first}", secs(took)),
                }
            }
        };
        eprintln!("chaos: {} on {}: {}", row.case, row.backend, row.result);
        rows.push(row);
    }
    eprintln!("\nchaos suite, {} in all\n", secs(started.elapsed()));
    eprintln!("| case | backend | bound | measured | result |\n|---|---|---|---|---|");
    for r in &rows {
        eprintln!("| {} | {} | {} | {} | {} |", r.case, r.backend, r.bound, r.measured, r.result);
    }
    assert!(failed.is_empty(), "chaos cases failed: {}", failed.join(", "));
}

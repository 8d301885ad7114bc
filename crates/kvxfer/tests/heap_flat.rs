//! An agent's live heap stays flat under sustained load: the soak (scripts/soak.sh) saw a decode
//! rank's RSS grow slowly after warm-up; this measures the heap itself, in one process, with a
//! counting allocator, so growth of kvxfer's own state is told apart from the allocator's.
//!
//! P2 -> D1, four requests in flight, 30 % aborted by the decode rank at a pseudo-random moment (as
//! the soak's `--abort-rate 0.3`); the tracker's bounds are set small so that its memory of
//! released requests fills during the warm-up. Live bytes are sampled between waves (nothing in
//! flight) after every `STEP` requests, on `local` and then on `tcp`. Then prefill restarts: rank
//! 0 leaves and a new agent of it joins, again and again, with requests between. The bootstrap
//! service runs in a child process (this binary), so its store's history is not counted.
//!
//! `KVXFER_HEAP_REQUESTS=200000 KVXFER_HEAP_RESTARTS=100 cargo test --release -p kvxfer --test
//! heap_flat -- --nocapture` prints every sample of a longer run.

mod support;

use std::alloc::System;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::bootstrap::BootstrapServer;
use kvxfer::engine::{Agent, AgentConfig};
use kvxfer_core::tracker::TrackerConfig;
use stats_alloc::{StatsAlloc, INSTRUMENTED_SYSTEM};

use kvxfer_core::{Side, Topology};
use support::{cluster, config, connected, prefill, wave};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const STEP: u64 = 2_000;

/// The agents' configuration with the tracker's bounds small, reached during the warm-up (the
/// defaults, 65,536 each, take a long run).
fn bounded(role: Side, tp: u32, t: &Topology, addr: &str, backend: &str) -> AgentConfig {
    let mut c = config(role, tp, t, addr, backend);
    c.tracker = TrackerConfig { early_max: 256, early_ttl: Duration::from_secs(60), released_memory: 1_024 };
    c.early_max = 256;
    c
}

/// 30 % aborted, within 0..3000 us of the handoff.
fn moment(r: u64) -> Option<u64> {
    (r % 10 < 3).then_some((r >> 8) % 3000)
}

/// A wave of requests, each of which must become final on every rank.
async fn serve(pre: &[Arc<Agent>], dec: &Arc<Agent>, room: &mut u64, seed: &mut u64) {
    let stuck = wave(pre, dec, room, seed, moment).await;
    assert!(stuck.is_empty(), "requests that never became final:\n{}", stuck.join("\n"));
}

/// Bytes allocated and not freed, process-wide.
fn live() -> i64 {
    let s = GLOBAL.stats();
    // (A realloc's growth or shrink is already in these two; `bytes_reallocated` repeats it.)
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}

/// Allocations made so far, process-wide (reallocations not counted).
fn allocations() -> usize {
    GLOBAL.stats().allocations
}

/// Runs `requests` (or `KVXFER_HEAP_REQUESTS`) requests on `backend` and checks the live heap
/// after the first half.
async fn flat(backend: &str, default_requests: u64) {
    let requests: u64 =
        std::env::var("KVXFER_HEAP_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(default_requests);
    // Bounded state fills during the first half (measured: about 12,000 requests on local and
    // 20,000 on tcp reach their plateau within a few per cent).
    let warm_up = requests / 2;
    let service = Service::start();
    let (pre, dec) = cluster(&service.addr, backend, bounded).await;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut room = 1u64;
    let mut samples: Vec<(u64, i64)> = Vec::new();
    let mut counted_from = None;
    while room <= requests {
        serve(&pre, &dec, &mut room, &mut seed).await;
        if (room - 1) % STEP == 0 {
            // Let the progress tasks settle what the last wave left (fence asks, counted outcomes).
            tokio::time::sleep(Duration::from_millis(50)).await;
            samples.push((room - 1, live()));
            eprintln!("{backend}: {:>8} requests: live heap {:>10} bytes", room - 1, live());
            if room > warm_up && counted_from.is_none() {
                counted_from = Some((room - 1, allocations()));
            }
        }
    }
    // Reported, not checked: the allocator's churn per request (the whole cluster's: two prefill
    // agents and one decode agent), which a long run's RSS reflects beside the live heap.
    if let Some((from, n)) = counted_from {
        let per = (allocations() - n) as f64 / (room - 1 - from).max(1) as f64;
        eprintln!("{backend}: {per:.1} allocations a request after the warm-up ({} requests)", room - 1 - from);
    }
    let d = dec.stats();
    eprintln!("decode: {} succeeded, {} failed; tracker: {:?}", d.succeeded, d.failed, d.tracker);
    let after: Vec<i64> = samples.iter().filter(|(n, _)| *n >= warm_up).map(|(_, b)| *b).collect();
    let (lo, hi) = (*after.iter().min().unwrap(), *after.iter().max().unwrap());
    let first = after[0];
    let last = *after.last().unwrap();
    eprintln!("{backend}: after warm-up ({warm_up} requests): first {first}, last {last}, min {lo}, max {hi} bytes");
    // Measured flat within about 45 KB of noise (a sample taken while a task still held a
    // wave's buffers) on both backends; a leak of 10 bytes a request shows as 160 KB over the
    // default run's 16,000 requests after the warm-up on local.
    let allowed = first / 5;
    assert!(
        last - first <= allowed,
        "{backend}: the live heap grew by {} bytes over {} requests after the warm-up (first {first}, last {last}, \
         allowed {allowed}): something keeps per-request state; samples: {samples:?}",
        last - first,
        requests - warm_up
    );
    for a in pre.into_iter().chain([dec]) {
        Arc::try_unwrap(a).unwrap().shutdown(Instant::now() + Duration::from_secs(10)).await.unwrap();
    }
}

/// One test, the runs one after the other: the allocator's count is process-wide, so two runs
/// side by side would count each other's requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_heap_is_flat_after_warm_up_on_local_and_tcp() {
    flat("local", 32_000).await;
    flat("tcp", 16_000).await;
    let cycles = std::env::var("KVXFER_HEAP_RESTARTS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    restarts("local", cycles, Exit::Leaves).await;
    restarts("tcp", cycles, Exit::Leaves).await;
}

/// How prefill rank 0 goes before its successor joins.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Exit {
    /// `Agent::shutdown`: it leaves the cluster.
    Leaves,
    /// Dropped without leaving (a killed process, as the soak's SIGKILL): the surviving agents
    /// learn of the loss from the transport or the lease (1 s here).
    Killed,
}

/// Prefill rank 0 goes (`exit`) and a new agent of it joins, `cycles` times, 200 requests after
/// each: what the surviving agents (the decode rank, prefill rank 1) keep per peer instance.
/// Checked after `WARM_CYCLES`: at most `PER_CYCLE` bytes a restart on average.
async fn restarts(backend: &str, cycles: u32, exit: Exit) {
    assert!(cycles > WARM_CYCLES, "at least {} restarts", WARM_CYCLES + 1);
    let configure: support::Configure = if exit == Exit::Killed { short_lease } else { bounded };
    let service = Service::start();
    let (mut pre, dec) = cluster(&service.addr, backend, configure).await;
    let mut room = 1u64;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut samples = Vec::new();
    for cycle in 0..=cycles {
        connected(&pre, &dec).await;
        for _ in 0..50 {
            serve(&pre, &dec, &mut room, &mut seed).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        samples.push(live());
        eprintln!("{backend}: restart {cycle:>3}: live heap {:>10} bytes", live());
        if cycle == cycles {
            break;
        }
        let old = Arc::try_unwrap(pre.remove(0)).unwrap();
        match exit {
            Exit::Leaves => old.shutdown(Instant::now() + Duration::from_secs(10)).await.unwrap(),
            Exit::Killed => drop(old),
        }
        pre.insert(0, prefill(&service.addr, backend, configure, 0).await);
    }
    assert_eq!(dec.stats().peers_lost, u64::from(cycles), "{backend}: the decode rank saw every restart");
    for a in pre.into_iter().chain([dec]) {
        Arc::try_unwrap(a).unwrap().shutdown(Instant::now() + Duration::from_secs(10)).await.unwrap();
    }
    let (at, last) = (samples[WARM_CYCLES as usize], *samples.last().unwrap());
    let per = (last - at) / i64::from(cycles - WARM_CYCLES);
    eprintln!("{backend}: {per} bytes a restart after {WARM_CYCLES} (from {at} to {last})");
    assert!(
        per <= PER_CYCLE,
        "{backend}: the live heap grew by {per} bytes per prefill restart after {WARM_CYCLES} restarts (allowed \
         {PER_CYCLE}): the surviving agents keep state of every peer instance; samples: {samples:?}"
    );
}

/// [`bounded`], with 1 s leases: a prefill agent dropped without leaving is lost within about a
/// second (its lease expires, or the transport sees it go), and its successor joins as soon.
fn short_lease(role: Side, tp: u32, t: &Topology, addr: &str, backend: &str) -> AgentConfig {
    let mut c = bounded(role, tp, t, addr, backend);
    c.lease_ttl = Duration::from_secs(1);
    c
}

/// [`restarts`] with prefill ranks killed instead of leaving. Slower (a lease to expire per
/// restart), so not in `cargo test`:
/// `cargo test --release -p kvxfer --test heap_flat killed -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn live_heap_after_killed_prefill_ranks() {
    let cycles = std::env::var("KVXFER_HEAP_RESTARTS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    restarts("local", cycles, Exit::Killed).await;
    restarts("tcp", cycles, Exit::Killed).await;
}

/// Restarts before the per-restart growth is measured.
const WARM_CYCLES: u32 = 6;
/// Bytes a restart may leave in the surviving agents (measured: 300-830; a leaked agent's state is
/// about 45,000).
const PER_CYCLE: i64 = 4096;

/// The bootstrap service in a child process (this test binary, running
/// [`bootstrap_service_for_the_parent`] alone), so that the store's bounded history of joins and
/// leaves does not count in the agents' heap.
struct Service {
    child: std::process::Child,
    addr: String,
}

impl Service {
    fn start() -> Service {
        use std::io::BufRead;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "bootstrap_service_for_the_parent", "--nocapture", "--test-threads=1"])
            .env("KVXFER_HEAP_SERVICE", "1")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(out).lines();
        let addr = loop {
            let line = lines.next().expect("the service process ended before it said its address").unwrap();
            // libtest writes "test <name> ... " before it on the same line.
            if let Some((_, a)) = line.split_once("SERVICE ") {
                break a.trim().to_owned();
            }
        };
        Service { child, addr }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Not a test: the child process of [`Service`]. Serves until its standard input closes (its
/// parent ended) or 10 minutes passed.
#[test]
#[ignore]
fn bootstrap_service_for_the_parent() {
    if std::env::var("KVXFER_HEAP_SERVICE").is_err() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
        println!("SERVICE {}", server.addr());
        let stdin = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        });
        let _ = tokio::time::timeout(Duration::from_secs(600), stdin).await;
        drop(server);
    });
}

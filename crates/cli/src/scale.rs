//! `kvxfer scale`: the control plane at scale. `--ranks` simulated ranks, tasks of this one process,
//! start at once and do on the metadata store what an `Agent` does when it starts
//! (`kvxfer::engine::Agent::start`): join under a lease ([`Membership::join`], which checks the new
//! rank against every registered one), start the membership watch ([`MemberWatch::start`]) and wait
//! for the ranks it exchanges with ([`kvxfer::metadata::handshake_among`]). A rank is done when its
//! membership watch knows every rank of the cluster. The store is a `kvxfer bootstrap` service
//! started in its own process on loopback (so its memory is its own), or an etcd given by address.
//!
//! The registrations are real ones: each role's pool is registered with a real tcp endpoint once,
//! and every simulated rank of that role publishes that pool and endpoint metadata under its own
//! rank (same bytes, so the records have a deployment's size). Only the data plane is left out: no
//! rank connects to its peers' endpoints.

use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::bootstrap::RankRegistration;
use kvxfer::metadata::{self, MemberEvent, MemberWatch, Membership, MetadataAddr, MetadataStore};
use kvxfer::session::KvPool;
use kvxfer_core::{BackendConfig, KvSpec, Layout, Parallel, ProtocolRange, RankId, Side, SideSpec, Topology};
use serde::Serialize;

use crate::model::{parse_seconds, Preset};
use crate::plan::Format;

/// Arguments of `kvxfer scale`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Ranks in all: half prefill, half decode.
    #[arg(long, default_value_t = 1024)]
    pub ranks: u32,
    /// Tensor-parallel size of each side; each side has ranks / 2 / tp pipeline stages.
    #[arg(long, default_value_t = 64)]
    pub tp: u32,
    /// Model shape (its layers are split over the pipeline stages).
    #[arg(long, value_enum, default_value = "llama3-70b")]
    pub model: Preset,
    /// The metadata store: `bootstrap` starts `kvxfer bootstrap` in its own process on a free
    /// loopback port; else an address as `worker --metadata` takes it (`etcd://HOST:PORT/PREFIX`,
    /// `bootstrap://HOST:PORT/PREFIX`), whose prefix must hold no ranks.
    #[arg(long, default_value = "bootstrap")]
    pub store: String,
    /// Lease TTL of each rank, in seconds (keep-alives every third of it).
    #[arg(long, default_value_t = 10.0, value_parser = parse_seconds)]
    pub lease_ttl_s: f64,
    /// Give up after this many seconds (a rank that has not seen every rank by then fails the run).
    #[arg(long, default_value_t = 120.0, value_parser = parse_seconds)]
    pub timeout_s: f64,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    pub format: Format,
}

/// Seconds at the 50th, 99th percentile and the maximum.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    /// Median.
    pub p50_s: f64,
    /// 99th percentile.
    pub p99_s: f64,
    /// Slowest rank.
    pub max_s: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Self { p50_s: at(0.5), p99_s: at(0.99), max_s: at(1.0) }
    }
}

/// What `kvxfer scale` measured (its `--format json`).
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    /// Ranks in all.
    pub ranks: u32,
    /// The store (`bootstrap` service in its own process, or the address given).
    pub store: String,
    /// Prefill and decode parallel config, as `tp x pp`.
    pub parallel: String,
    /// Bytes of one rank record as stored (JSON).
    pub record_bytes: usize,
    /// From the common start until every rank's membership watch knew every rank: the figure the
    /// goal ("1,024 ranks see full membership within 2 s") is about.
    pub full_membership_s: f64,
    /// Per rank: joined (lease granted, record created after checking every registered rank).
    pub join: Spread,
    /// Per rank: the ranks it exchanges with found and checked (the handshake).
    pub handshake: Spread,
    /// Per rank: its membership watch knew every rank.
    pub full: Spread,
    /// Growth of the bootstrap service's resident memory from empty to every rank registered and
    /// watching, per rank, in KiB (`None` for a store this command did not start).
    pub store_kib_per_rank: Option<f64>,
    /// Growth of this process's resident memory over the same span, per simulated rank, in KiB:
    /// what one rank's membership state (every record, its watch) costs a rank process.
    pub client_kib_per_rank: f64,
    /// CPU seconds the bootstrap service spent from the start to full membership (`None` for a
    /// store this command did not start). With every simulated rank on the same cores, this and
    /// the ranks' share below tell which side the time went to.
    pub store_cpu_s: Option<f64>,
    /// CPU milliseconds this process spent over the same span, per simulated rank: what a rank
    /// process spends reading the membership (each rank on its own host spends this once).
    pub client_cpu_ms_per_rank: f64,
}

/// Runs `kvxfer scale`.
pub fn run(args: &ScaleArgs) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvxfer scale: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(measure(args)) {
        Ok(report) => {
            match args.format {
                Format::Json => println!("{}", serde_json::to_string_pretty(&report).expect("report serializes")),
                Format::Table => print_table(&report),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvxfer scale: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_table(r: &ScaleReport) {
    println!(
        "{} ranks on {} (prefill and decode {} each), records of {} B",
        r.ranks, r.store, r.parallel, r.record_bytes
    );
    println!("every rank sees the full membership after {:.3} s", r.full_membership_s);
    println!("{:<26} {:>9} {:>9} {:>9}", "per rank, from the start", "p50 s", "p99 s", "max s");
    for (what, s) in [("joined", r.join), ("handshake done", r.handshake), ("full membership", r.full)] {
        println!("{what:<26} {:>9.3} {:>9.3} {:>9.3}", s.p50_s, s.p99_s, s.max_s);
    }
    match r.store_kib_per_rank {
        Some(k) => println!("memory per rank: store {k:.1} KiB, rank process {:.1} KiB", r.client_kib_per_rank),
        None => println!("memory per rank: rank process {:.1} KiB (store not measured)", r.client_kib_per_rank),
    }
    match r.store_cpu_s {
        Some(c) => println!("cpu: store {c:.2} s, ranks {:.1} ms each", r.client_cpu_ms_per_rank),
        None => println!("cpu: ranks {:.1} ms each (store not measured)", r.client_cpu_ms_per_rank),
    }
}

/// Resident memory of process `pid` (`self` for this one), KiB, from /proc.
fn rss_kib(pid: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU seconds (user and system) process `pid` (`self` for this one) has used, from /proc.
fn cpu_s(pid: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces), which ends at the last ')'.
    let rest: Vec<&str> = s.get(s.rfind(')')? + 2..)?.split_whitespace().collect();
    let ticks: u64 = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
    // /proc counts in USER_HZ, which Linux fixes at 100 for every user-space ABI.
    Some(ticks as f64 / 100.0)
}

/// A `kvxfer bootstrap` child, killed on drop.
struct Service(Child);

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn start_service(ranks: u32) -> Result<(Service, String), String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free loopback port: {e}"))?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    // Every rank holds a few connections at once (its watch, its handshake's watch, a call):
    // one source address (loopback) for all of them, so the per-source limit goes up too.
    let conns = (ranks as u64 * 4 + 256).to_string();
    let child = Command::new(exe)
        .args(["bootstrap", "--listen", &addr, "--max-connections", &conns, "--max-connections-per-source", &conns])
        .args(["--max-waits", &conns])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start the bootstrap service: {e}"))?;
    let service = Service(child);
    let until = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(&addr).await.is_err() {
        if Instant::now() > until {
            return Err(format!("the bootstrap service did not listen on {addr} within 10 s"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((service, addr))
}

/// One rank's times from the common start: joined, handshake done, full membership.
type Times = (f64, f64, f64);

async fn measure(args: &ScaleArgs) -> Result<ScaleReport, String> {
    if args.ranks < 2 || args.ranks % 2 != 0 || args.tp == 0 || (args.ranks / 2) % args.tp != 0 {
        return Err(format!(
            "--ranks {} with --tp {}: give an even number of ranks whose half is a multiple of --tp",
            args.ranks, args.tp
        ));
    }
    let want = (args.ranks as u64 * 4 + 256).max(4096);
    if let Err(e) = kvxfer::bootstrap::raise_open_file_limit(want) {
        eprintln!("kvxfer scale: could not raise the open-file limit ({e}); many ranks may run out of descriptors");
    }
    let pp = args.ranks / 2 / args.tp;
    let (attention, layers) = args.model.shape();
    let side = SideSpec {
        kv: KvSpec { attention, layers, dtype_bytes: 2, page_size: 16, layout: Layout::Nhd },
        parallel: Parallel::new(args.tp, pp),
    };
    let topo =
        Topology::new(&side, &side).map_err(|e| format!("{} with tp {} x pp {pp}: {e}", args.model.name(), args.tp))?;

    let (service, addr) = if args.store == "bootstrap" {
        let (s, a) = start_service(args.ranks).await?;
        (Some(s), MetadataAddr::parse(&format!("bootstrap://{a}/scale")).map_err(|e| e.to_string())?)
    } else {
        (None, MetadataAddr::parse(&args.store).map_err(|e| e.to_string())?)
    };
    let store_name = if service.is_some() { "bootstrap (own process)".to_owned() } else { addr.to_string() };

    // One real tcp endpoint per role with a real pool of stage 0 (every stage has as many layers).
    let mut templates = Vec::new();
    let mut endpoints = Vec::new();
    for role in [Side::Prefill, Side::Decode] {
        let backend = kvxfer::backends::create("tcp", &BackendConfig::default()).map_err(|e| e.to_string())?;
        let (pool, memory): (KvPool, _) = KvPool::allocate(&topo, role, RankId::new(0, 0), 1, &*backend, &|_, _| {})
            .await
            .map_err(|e| e.to_string())?;
        let endpoint = backend.metadata().map_err(|e| e.to_string())?;
        templates.push((role, pool, endpoint));
        endpoints.push((backend, memory));
    }
    let regs: Vec<RankRegistration> = templates
        .iter()
        .flat_map(|(role, pool, endpoint)| {
            (0..pp).flat_map(move |p| (0..args.tp).map(move |t| (*role, RankId::new(t, p), pool, endpoint)))
        })
        .enumerate()
        .map(|(i, (role, rank, pool, endpoint))| {
            let mut endpoint = endpoint.clone();
            endpoint.identity = i as u64 + 1;
            RankRegistration {
                role,
                rank,
                backend: "tcp".into(),
                endpoint,
                pool: pool.clone(),
                spec: side,
                label: format!("scale rank {i}"),
                model: None,
                protocol: ProtocolRange::THIS_BUILD,
                warmup: None,
            }
        })
        .collect();
    let record_bytes = serde_json::to_vec(&metadata::RankRecord { registration: regs[0].clone(), left: false })
        .map_err(|e| e.to_string())?
        .len();

    // Every rank its own store client (as every rank process has), connected before the start.
    let op_timeout = Duration::from_secs_f64(args.timeout_s);
    let mut stores = Vec::with_capacity(regs.len());
    for _ in &regs {
        stores.push(metadata::connect(&addr, op_timeout).await.map_err(|e| e.to_string())?);
    }
    let service_pid = service.as_ref().map(|s| s.0.id().to_string());
    let store_before = service_pid.as_deref().and_then(rss_kib);
    let client_before = rss_kib("self").unwrap_or(0);
    let store_cpu_before = service_pid.as_deref().and_then(cpu_s);
    let client_cpu_before = cpu_s("self").unwrap_or(0.0);

    let n = regs.len();
    let start = Arc::new(tokio::sync::Barrier::new(n + 1));
    // One start time for every rank and the whole run, set before the barrier releases anyone.
    let common_t0 = Arc::new(std::sync::OnceLock::<Instant>::new());
    let done = Arc::new(tokio::sync::Barrier::new(n + 1));
    let (report_tx, mut report_rx) = tokio::sync::mpsc::channel::<Result<Times, String>>(n);
    let ttl = Duration::from_secs_f64(args.lease_ttl_s);
    let deadline = Duration::from_secs_f64(args.timeout_s);
    let mut tasks = Vec::with_capacity(n);
    for (me, store) in regs.into_iter().zip(stores) {
        let (start, done, tx, topo) = (Arc::clone(&start), Arc::clone(&done), report_tx.clone(), topo);
        let t0_cell = Arc::clone(&common_t0);
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let t0 = *t0_cell.get().expect("set before the start");
            let r = tokio::time::timeout(deadline, one_rank(store, me, &topo, ttl, deadline, t0)).await;
            let (r, membership) = match r {
                Ok(Ok((times, m))) => (Ok(times), Some(m)),
                Ok(Err(e)) => (Err(e), None),
                Err(_) => (Err(format!("not done within {deadline:?}")), None),
            };
            let _ = tx.send(r).await;
            // Stay registered until every rank is done (a leaving rank is a membership change).
            done.wait().await;
            if let Some(m) = membership {
                let _ = m.leave().await;
            }
        }));
    }
    drop(report_tx);
    let t0 = *common_t0.get_or_init(Instant::now);
    start.wait().await;
    let mut times = Vec::with_capacity(n);
    let mut failures = Vec::new();
    while let Some(r) = report_rx.recv().await {
        match r {
            Ok(t) => times.push(t),
            Err(e) => failures.push(e),
        }
        if times.len() + failures.len() == n {
            break;
        }
    }
    let full_membership_s = t0.elapsed().as_secs_f64();
    let store_after = service_pid.as_deref().and_then(rss_kib);
    let client_after = rss_kib("self").unwrap_or(0);
    let store_cpu_after = service_pid.as_deref().and_then(cpu_s);
    let client_cpu_after = cpu_s("self").unwrap_or(0.0);
    done.wait().await;
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
    }
    drop(endpoints);
    drop(service);
    if !failures.is_empty() {
        failures.sort();
        failures.dedup();
        return Err(format!(
            "{} of {n} ranks failed; first: {}",
            n - times.len(),
            failures.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
        ));
    }
    Ok(ScaleReport {
        ranks: args.ranks,
        store: store_name,
        parallel: format!("tp {} x pp {pp}", args.tp),
        record_bytes,
        full_membership_s,
        join: Spread::of(times.iter().map(|t| t.0).collect()),
        handshake: Spread::of(times.iter().map(|t| t.1).collect()),
        full: Spread::of(times.iter().map(|t| t.2).collect()),
        store_kib_per_rank: store_before
            .zip(store_after)
            .map(|(b, a)| a.saturating_sub(b) as f64 / f64::from(args.ranks)),
        client_kib_per_rank: client_after.saturating_sub(client_before) as f64 / f64::from(args.ranks),
        store_cpu_s: store_cpu_before.zip(store_cpu_after).map(|(b, a)| a - b),
        client_cpu_ms_per_rank: (client_cpu_after - client_cpu_before) * 1000.0 / f64::from(args.ranks),
    })
}

/// One simulated rank, as `Agent::start` and its connect task drive the store: join, start the
/// membership watch, and (beside it) wait for and check the ranks it exchanges with; then follow the
/// watch until it knows every rank.
async fn one_rank(
    store: Arc<dyn MetadataStore>,
    me: RankRegistration,
    topo: &Topology,
    ttl: Duration,
    deadline: Duration,
    t0: Instant,
) -> Result<(Times, Membership), String> {
    let who = format!("{} rank {}", me.role, me.rank);
    let membership =
        Membership::join(Arc::clone(&store), me.clone(), ttl).await.map_err(|e| format!("{who}: join: {e}"))?;
    let joined = t0.elapsed().as_secs_f64();
    let total = topo.ranks(Side::Prefill).len() + topo.ranks(Side::Decode).len();
    let (other, need) = match me.role {
        Side::Prefill => (Side::Decode, topo.receivers(me.rank)),
        Side::Decode => (Side::Prefill, topo.senders(me.rank)),
    };
    let handshake = async {
        metadata::handshake_among(&*store, &me, other, &need, deadline)
            .await
            .map_err(|e| format!("{who}: handshake: {e}"))?;
        Ok::<f64, String>(t0.elapsed().as_secs_f64())
    };
    let follow = async {
        let (mut watch, now) =
            MemberWatch::start(Arc::clone(&store)).await.map_err(|e| format!("{who}: watch: {e}"))?;
        let mut known = now.iter().filter(|m| !m.left).count();
        while known < total {
            for ev in watch.next(deadline).await.map_err(|e| format!("{who}: watch: {e}"))? {
                match ev {
                    MemberEvent::Joined(_) => known += 1,
                    MemberEvent::Left(_) | MemberEvent::Lost(_) => known = known.saturating_sub(1),
                }
            }
        }
        Ok::<f64, String>(t0.elapsed().as_secs_f64())
    };
    let (handshake, full) = tokio::try_join!(handshake, follow)?;
    Ok(((joined, handshake, full), membership))
}

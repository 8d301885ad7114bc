//! `kvxfer worker`: one prefill or decode rank of a run, meeting its peers through a metadata store
//! (the bootstrap service, `--bootstrap host:port`, or any store, `--metadata etcd://host:port/prefix`).
//! `kvxfer demo` spawns these; on separate hosts, start them by hand with the same workload flags
//! and one store address.
//!
//! Everything a worker publishes and looks up goes through [`kvxfer::metadata::MetadataStore`]: its
//! rank record lives under a lease it keeps alive ([`Membership`]), and a watch on every rank record
//! ([`MemberWatch`]) reports ranks that join, leave and are lost (`peer_joined`, `peer_left`,
//! `peer_lost` progress lines). A lost peer this rank depends on ends its waits and fails its
//! requests naming the rank; when the transport saw a peer go first, the worker waits (at most the
//! lease TTL plus one second) for the store's verdict before it exits, so the report names the rank.
//!
//! Per request (decode-initiated, as in a serving engine): decode rank 0/0 picks the destination
//! pages and publishes them under `req/<r>`; every decode rank calls `expect`, then puts
//! `ready/<r>/<tp>.<pp>`; each prefill rank fills its source pages with the oracle pattern, waits
//! until its receivers are ready and sends; each decode rank waits for completion, verifies every
//! byte of the request's pages against the oracle (written from head ownership, not the planner),
//! writes the sentinel back, and puts `done/<r>/<tp>.<pp>`. A page slot is reused only after every
//! decode rank is done with it. At the end each decode rank checks that its whole pool holds the
//! sentinel again (no stray write anywhere) and puts `finished/<tp>.<pp>`; each prefill rank waits
//! for its receivers' `finished` and leaves (marks its rank record `left`, revokes its lease), and each
//! decode rank exits only after its senders left (so no exit looks like a lost peer). Each rank prints
//! a JSON summary line on stdout. Every key a rank puts lives under its lease: a finished or dead run
//! leaves nothing behind once the leases are gone.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::bootstrap::Registration;
use kvxfer::metadata::members::{rank_key as record_key, record_of};
use kvxfer::metadata::{
    wait_until, wait_value, LeaseId, Member, MemberEvent, MemberWatch, Membership, MetadataAddr, MetadataStore,
};
use kvxfer::session::SessionError;
use kvxfer::session::{Chunk, ExpectOptions, KvPool, PoolMemory, ReceiverSession, SenderSession};
use kvxfer_core::oracle::{BufferGeom, SENTINEL};
use kvxfer_core::{BackendConfig, BufferRef, Failure, KvTransferBackend, RankId, RequestId, SenderKey, Side, Topology};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::model::{request_pages, token_base, Workload};

/// Salts of the two sides' page permutations.
const SALT_PREFILL: u64 = 0x5052_4546;
const SALT_DECODE: u64 = 0x4445_434f;

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
    /// Deadline of every bootstrap wait (peers, page lists, readiness), in seconds.
    #[arg(long, default_value_t = 120.0, value_parser = crate::model::parse_seconds)]
    pub timeout_s: f64,
    /// Test-only fault: prefill rank 0/0 corrupts one source byte of request 0 after filling it,
    /// so verification must fail and the run must exit non-zero.
    #[arg(long, hide = true)]
    pub inject_wrong_byte: bool,
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
    /// Bytes sent (prefill) or received and verified (decode).
    pub bytes: u64,
    /// Strided ops posted (prefill).
    pub ops: u64,
    /// Requests handled.
    pub requests: u32,
    /// Seconds from the first request's start to the last one's end (fill and verify included).
    pub seconds: f64,
    /// Seconds during which at least one transfer was in flight (prefill: inside `send_chunk`;
    /// decode: from `expect` to completion), the union of those intervals.
    pub transfer_seconds: f64,
    /// Transfer intervals, seconds since the stream started (merged into `transfer_seconds`).
    #[serde(skip)]
    pub intervals: Vec<(f64, f64)>,
    /// Per-request completion latency in microseconds (decode: from `expect` to done).
    pub latencies_us: Vec<u64>,
    /// Bytes compared against the oracle (decode).
    pub verified_bytes: u64,
    /// Every failure, with the request.
    pub errors: Vec<String>,
}

/// Runs a worker; the exit code is 0 only if every request moved and verified.
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
    match rt.block_on(worker(args)) {
        Ok(s) => {
            let ok = s.errors.is_empty();
            println!("{}", json!({"kind": "summary", "summary": s}));
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
            println!("{}", json!({"kind": "error", "role": role.to_string(), "rank": rank.to_string(), "message": e}));
            ExitCode::FAILURE
        }
    }
}

fn rank_key(r: RankId) -> String {
    format!("{}.{}", r.tp, r.pp)
}

/// The identity a rank's endpoint carries: prefill ranks use their sender key (the receiver maps a
/// lost peer to the key); decode ranks a value with the top bit set.
pub fn identity(side: Side, rank: RankId) -> u64 {
    match side {
        Side::Prefill => SenderKey::of(rank).to_u64(),
        Side::Decode => (1 << 63) | (u64::from(rank.pp) << 16) | u64::from(rank.tp),
    }
}

/// Builds a backend endpoint by registry name.
pub fn make_backend(name: &str, identity: u64, w: &Workload) -> Result<Arc<dyn KvTransferBackend>, String> {
    let config = BackendConfig { identity, options: w.options() };
    kvxfer::backends::create(name, &config).map_err(|e| e.to_string())
}

/// The store a worker's flags name.
pub fn metadata_addr(bootstrap: Option<&str>, metadata: Option<&str>) -> Result<MetadataAddr, String> {
    match (metadata, bootstrap) {
        (Some(m), _) => MetadataAddr::parse(m).map_err(|e| e.to_string()),
        (None, Some(b)) => MetadataAddr::parse(b).map_err(|e| e.to_string()),
        (None, None) => Err("give --bootstrap host:port or --metadata etcd://host:port/prefix".into()),
    }
}

fn describe_member(m: &Member) -> serde_json::Value {
    let r = &m.registration;
    json!({"role": r.role.to_string(), "rank": r.rank.to_string(), "label": r.label, "epoch": m.epoch})
}

async fn worker(args: &WorkerArgs) -> Result<WorkerSummary, String> {
    let w = &args.workload;
    let side = Side::from(args.role);
    let rank = RankId::new(args.tp_rank, args.pp_stage);
    let local_topo = w.topology()?;
    local_topo.check_rank(side, rank).map_err(|e| e.to_string())?;
    let wait = Duration::from_secs_f64(args.timeout_s);
    let ttl = Duration::from_secs_f64(args.lease_ttl_s.max(0.1));
    let addr = metadata_addr(args.bootstrap.as_deref(), args.metadata.as_deref())?;
    let store =
        kvxfer::metadata::connect(&addr, kvxfer::metadata::DEFAULT_OP_TIMEOUT).await.map_err(|e| e.to_string())?;

    let backend = make_backend(&w.backend, identity(side, rank), w)?;
    let pages = w.pool_pages();
    let init = |_: BufferRef, bytes: &mut [u8]| {
        if side == Side::Decode {
            bytes.fill(SENTINEL);
        }
    };
    let (pool, bufs) =
        KvPool::allocate(&local_topo, side, rank, pages, &*backend, &init).await.map_err(|e| e.to_string())?;
    let me = Registration {
        role: side,
        rank,
        backend: w.backend.clone(),
        endpoint: backend.metadata().map_err(|e| e.to_string())?,
        pool: pool.clone(),
        spec: local_topo.side(side),
        label: format!("pid {}", std::process::id()),
    };
    let membership = Membership::join(Arc::clone(&store), me.clone(), ttl).await.map_err(|e| e.to_string())?;
    // Watch from now on, so no peer that dies after registering goes unreported.
    let (members, _) = MemberWatch::start(Arc::clone(&store)).await.map_err(|e| e.to_string())?;
    progress(
        json!({"kind": "registered", "store": store.name(), "epoch": membership.epoch(), "lease": membership.lease().to_string()}),
    );
    let other = match side {
        Side::Prefill => Side::Decode,
        Side::Decode => Side::Prefill,
    };
    let want = local_topo.ranks(other).len() as u32;
    let (peers, topo) =
        kvxfer::metadata::handshake(&*store, &me, other, want, wait).await.map_err(|e| e.to_string())?;
    let peers: Vec<Registration> = peers.into_iter().map(|m| m.registration).collect();
    // The peers whose loss ends this rank's requests.
    let deps: Vec<(Side, RankId)> = match side {
        Side::Prefill => topo.receivers(rank).into_iter().map(|r| (Side::Decode, r)).collect(),
        Side::Decode => topo.senders(rank).into_iter().map(|r| (Side::Prefill, r)).collect(),
    };
    let loss = Arc::new(Loss::default());
    let watcher =
        tokio::spawn(watch_members(Arc::clone(&store), members, deps, Arc::clone(&loss), membership.health()));
    let ctx = Ctx {
        loss: Arc::clone(&loss),
        w: w.clone(),
        topo,
        rank,
        store: Arc::clone(&store),
        lease: membership.lease(),
        wait,
        bufs: Arc::new(bufs),
        pages,
    };
    let result = match side {
        Side::Prefill => prefill(ctx, backend, pool, peers, args.inject_wrong_byte).await,
        Side::Decode => decode(ctx, backend, pool).await,
    };
    let failed = result.as_ref().map(|s| !s.errors.is_empty()).unwrap_or(true);
    // The transport saw a peer go: wait (bounded) for the store to say which rank is gone.
    if failed && loss.transport_lost() {
        let verdict = loss.wait_verdict(ttl + Duration::from_secs(1)).await;
        if verdict.is_none() {
            eprintln!(
                "kvxfer worker {side} {rank}: {} reported no lost rank within {:?}",
                store.name(),
                ttl + Duration::from_secs(1)
            );
        }
    }
    watcher.abort();
    let verdicts = loss.verdicts();
    if let Err(e) = membership.leave().await {
        eprintln!("kvxfer worker {side} {rank}: leaving: {e}");
    }
    result.map(|mut s| {
        if !s.errors.is_empty() {
            s.errors.extend(verdicts);
        }
        s
    })
}

/// Follows every rank record: prints joins, leaves and losses, and reports lost peers this rank
/// depends on (and a store that can no longer keep this rank's lease). Runs until aborted.
async fn watch_members(
    store: Arc<dyn MetadataStore>,
    mut mw: MemberWatch,
    deps: Vec<(Side, RankId)>,
    loss: Arc<Loss>,
    mut health: tokio::sync::watch::Receiver<Option<String>>,
) {
    let started = Instant::now();
    let mut health_open = true;
    loop {
        tokio::select! {
            r = mw.next(Duration::from_millis(500)) => match r {
                Ok(evs) => for e in evs {
                    match e {
                        MemberEvent::Joined(m) => progress(json!({"kind": "peer_joined", "peer": describe_member(&m)})),
                        MemberEvent::Left(m) => progress(json!({"kind": "peer_left", "peer": describe_member(&m)})),
                        MemberEvent::Lost(m) => {
                            let r = &m.registration;
                            let reason = format!("{} lost: its lease in {} expired", m.describe(), store.name());
                            progress(json!({
                                "kind": "peer_lost", "peer": describe_member(&m), "store": store.name(),
                                "reason": reason, "watching_s": started.elapsed().as_secs_f64(),
                            }));
                            loss.verdict(reason.clone());
                            if deps.contains(&(r.role, r.rank)) {
                                loss.set(reason);
                            }
                        }
                    }
                },
                Err(e) => {
                    progress(json!({"kind": "store_error", "error": e.to_string()}));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            },
            ch = health.changed(), if health_open => {
                if ch.is_err() {
                    // The keep-alive ended (leaving, or the lease is gone): nothing more to hear there.
                    health_open = false;
                    continue;
                }
                let h = health.borrow().clone();
                if let Some(h) = h {
                    progress(json!({"kind": "store_error", "error": h}));
                }
            }
        }
    }
}

/// The first lost peer of this worker, and a wake-up for waits that should end with it.
#[derive(Default)]
struct Loss {
    reason: Mutex<Option<String>>,
    notify: tokio::sync::Notify,
    /// The transport (or the session) reported a lost peer.
    transport: std::sync::atomic::AtomicBool,
    /// What the store said about lost ranks.
    verdicts: Mutex<Vec<String>>,
    verdict_notify: tokio::sync::Notify,
}

impl Loss {
    fn set(&self, reason: String) {
        self.reason.lock().expect("loss lock").get_or_insert(reason);
        self.notify.notify_waiters();
    }

    fn set_transport(&self) {
        self.transport.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn transport_lost(&self) -> bool {
        self.transport.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn verdict(&self, v: String) {
        self.verdicts.lock().expect("loss lock").push(v);
        self.verdict_notify.notify_waiters();
    }

    fn verdicts(&self) -> Vec<String> {
        self.verdicts.lock().expect("loss lock").clone()
    }

    /// Waits at most `within` for the store to report a lost rank.
    async fn wait_verdict(&self, within: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let n = self.verdict_notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if let Some(v) = self.verdicts.lock().expect("loss lock").first().cloned() {
                return Some(v);
            }
            if tokio::time::timeout_at(deadline, n).await.is_err() {
                return None;
            }
        }
    }

    fn get(&self) -> Option<String> {
        self.reason.lock().expect("loss lock").clone()
    }

    /// Runs a bootstrap wait, ending it early with the loss reason if a peer is lost meanwhile.
    async fn guard<T, E: std::fmt::Display>(
        &self,
        fut: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, String> {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(r) = self.get() {
            return Err(r);
        }
        tokio::select! {
            r = fut => r.map_err(|e| e.to_string()),
            _ = notified => Err(self.get().unwrap_or_else(|| "a peer was lost".into())),
        }
    }
}

impl Ctx {
    /// Waits until `key` is put (at most the worker's timeout) and returns its value.
    async fn get(&self, key: &str) -> Result<serde_json::Value, String> {
        wait_value(&*self.store, key, self.wait).await.map_err(|e| e.to_string())
    }

    /// Puts `key` under this rank's lease.
    async fn put(&self, key: &str, v: serde_json::Value) -> Result<(), String> {
        self.store.put(key, &v, Some(self.lease)).await.map(|_| ()).map_err(|e| e.to_string())
    }
}

struct Ctx {
    loss: Arc<Loss>,
    w: Workload,
    topo: Topology,
    rank: RankId,
    store: Arc<dyn MetadataStore>,
    /// This rank's lease: every key it puts lives under it.
    lease: LeaseId,
    wait: Duration,
    bufs: Arc<Vec<PoolMemory>>,
    pages: u32,
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

/// Fail fast: after one failed request no new request starts (requests in flight still finish or
/// fail; the session fails those of a lost peer at once).
fn stopped(s: &Mutex<WorkerSummary>) -> bool {
    !s.lock().expect("summary lock").errors.is_empty()
}

fn progress(v: serde_json::Value) {
    println!("{v}");
}

/// The pages of a request in chunks of `chunk_pages` (0: one chunk).
fn chunks(w: &Workload, src: &[u32], dst: &[u32]) -> Vec<Chunk> {
    let n = if w.chunk_pages == 0 { src.len().max(1) } else { w.chunk_pages as usize };
    let k = src.len().div_ceil(n).max(1);
    (0..k)
        .map(|i| {
            let r = i * n..((i + 1) * n).min(src.len());
            Chunk { index: i as u32, last: i + 1 == k, src_pages: src[r.clone()].to_vec(), dst_pages: dst[r].to_vec() }
        })
        .collect()
}

async fn prefill(
    ctx: Ctx,
    backend: Arc<dyn KvTransferBackend>,
    pool: KvPool,
    peers: Vec<Registration>,
    inject: bool,
) -> Result<WorkerSummary, String> {
    let w = ctx.w.clone();
    let sender = Arc::new(
        SenderSession::new(Arc::clone(&backend), ctx.topo, ctx.rank, pool, w.notify.into())
            .map_err(|e| e.to_string())?,
    );
    let receivers = sender.receivers();
    for d in &receivers {
        let reg = peers.iter().find(|p| p.rank == *d).ok_or_else(|| format!("decode rank {d} did not register"))?;
        sender.connect(*d, &reg.endpoint, reg.pool.clone()).await.map_err(|e| e.to_string())?;
    }
    // Watch the endpoint for lost receivers, so requests waiting on the bootstrap (for page lists
    // or readiness) fail at once instead of at the bootstrap deadline.
    let names: HashMap<u64, RankId> = peers.iter().map(|p| (p.endpoint.identity, p.rank)).collect();
    let watch = {
        let (backend, loss) = (Arc::clone(&backend), Arc::clone(&ctx.loss));
        tokio::spawn(async move {
            loop {
                match backend.recv(Duration::from_millis(200)).await {
                    Ok(evs) => {
                        for e in evs {
                            if let kvxfer_core::BackendEvent::PeerLost { identity, reason } = e {
                                let who = names.get(&identity).map(|r| format!("decode rank {r}")).unwrap_or_default();
                                loss.set_transport();
                                loss.set(format!("lost {who}: {reason}"));
                            }
                        }
                    }
                    Err(e) => {
                        loss.set(format!("endpoint failed: {e}"));
                        return;
                    }
                }
            }
        })
    };
    let ctx = Arc::new(ctx);
    let summary = Arc::new(Mutex::new(WorkerSummary {
        role: "prefill".into(),
        rank: ctx.rank.to_string(),
        ..Default::default()
    }));
    let started = Instant::now();
    let mut window = std::collections::VecDeque::new();
    for r in 0..w.requests {
        if window.len() == w.inflight as usize {
            let h: tokio::task::JoinHandle<()> = window.pop_front().expect("non-empty");
            h.await.map_err(|e| format!("request task panicked: {e}"))?;
        }
        if stopped(&summary) {
            break;
        }
        let (ctx, sender, summary, receivers) =
            (Arc::clone(&ctx), Arc::clone(&sender), Arc::clone(&summary), receivers.clone());
        window.push_back(tokio::spawn(async move {
            let res = send_request(&ctx, &sender, &receivers, r, inject).await;
            let mut s = summary.lock().expect("summary lock");
            match res {
                Ok((bytes, ops, t0, t1)) => {
                    s.intervals.push(((t0 - started).as_secs_f64(), (t1 - started).as_secs_f64()));
                    s.bytes += bytes;
                    s.ops += ops;
                    s.requests += 1;
                    progress(json!({"kind": "sent", "request": r}));
                }
                Err(e) => s.errors.push(format!("request {r}: {e}")),
            }
        }));
    }
    for h in window {
        h.await.map_err(|e| format!("request task panicked: {e}"))?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    // Stay connected until every receiver has verified everything (a sender that leaves early
    // would look like a lost peer), then leave gracefully. After a failure, leave at once.
    for d in receivers.iter().filter(|_| !stopped(&summary)) {
        ctx.loss.guard(ctx.get(&format!("finished/{}", rank_key(*d)))).await?;
    }
    watch.abort();
    // The caller then leaves (rank record marked `left`, lease revoked): the receivers stay up until
    // then, so their exit is never mistaken for a loss here.
    let mut s = summary.lock().expect("summary lock").clone();
    s.seconds = elapsed;
    s.transfer_seconds = union(&mut s.intervals);
    Ok(s)
}

fn fill_source(ctx: &Ctx, src: &[u32], r: u32, inject: bool) {
    let map: HashMap<u32, u64> = kvxfer_core::oracle::token_map(src, ctx.w.page_size);
    let base = token_base(r);
    let tok = |p: u32| map.get(&p).map(|t| base + t);
    for host in ctx.bufs.iter() {
        let b = host.buffer;
        let geom = BufferGeom::new(&ctx.topo, Side::Prefill, ctx.rank, b.layer, b.kind, ctx.pages);
        let pb = geom.page_bytes();
        let hb = ctx.topo.kv().head_bytes(b.kind);
        let mut tmp = vec![0u8; pb as usize];
        for &p in src {
            page_pattern(&geom, hb, u64::from(p) * pb, &mut tmp, &tok);
            host.write(u64::from(p) * pb, &tmp).expect("page inside the pool, not being sent");
        }
    }
    if inject && r == 0 && ctx.rank == RankId::new(0, 0) {
        if let (Some(host), Some(&p)) = (ctx.bufs.first(), src.first()) {
            let geom = BufferGeom::new(&ctx.topo, Side::Prefill, ctx.rank, 0, host.buffer.kind, ctx.pages);
            let off = u64::from(p) * geom.page_bytes();
            let mut b = [0u8];
            host.read(off, &mut b).expect("in pool");
            host.write(off, &[b[0] ^ 0x5a]).expect("in pool");
        }
    }
}

async fn send_request(
    ctx: &Arc<Ctx>,
    sender: &SenderSession,
    receivers: &[RankId],
    r: u32,
    inject: bool,
) -> Result<(u64, u64, Instant, Instant), String> {
    let src = request_pages(&ctx.w, r, SALT_PREFILL);
    {
        let (ctx, src) = (Arc::clone(ctx), src.clone());
        tokio::task::spawn_blocking(move || fill_source(&ctx, &src, r, inject))
            .await
            .map_err(|e| format!("filling source pages panicked: {e}"))?;
    }
    let dst: Vec<u32> = serde_json::from_value(ctx.loss.guard(ctx.get(&format!("req/{r}"))).await?)
        .map_err(|e| format!("bad page list for request {r}: {e}"))?;
    for d in receivers {
        ctx.loss.guard(ctx.get(&format!("ready/{r}/{}", rank_key(*d)))).await?;
    }
    let t0 = Instant::now();
    let deadline = t0 + ctx.w.request_timeout();
    let (mut bytes, mut ops) = (0, 0);
    for c in chunks(&ctx.w, &src, &dst) {
        let s = sender.send_chunk(RequestId(u64::from(r)), &c, deadline).await.map_err(|e| e.to_string())?;
        bytes += s.bytes;
        ops += s.ops;
    }
    Ok((bytes, ops, t0, Instant::now()))
}

async fn decode(ctx: Ctx, backend: Arc<dyn KvTransferBackend>, pool: KvPool) -> Result<WorkerSummary, String> {
    let w = ctx.w.clone();
    let recv = Arc::new(ReceiverSession::new(backend, ctx.topo, ctx.rank, pool).map_err(|e| e.to_string())?);
    let all_decode = ctx.topo.ranks(Side::Decode);
    let ctx = Arc::new(ctx);
    let summary =
        Arc::new(Mutex::new(WorkerSummary { role: "decode".into(), rank: ctx.rank.to_string(), ..Default::default() }));
    let started = Instant::now();
    let mut window = std::collections::VecDeque::new();
    for r in 0..w.requests {
        if window.len() == w.inflight as usize {
            let h: tokio::task::JoinHandle<()> = window.pop_front().expect("non-empty");
            h.await.map_err(|e| format!("request task panicked: {e}"))?;
        }
        if stopped(&summary) {
            break;
        }
        let (ctx, recv, summary, all) = (Arc::clone(&ctx), Arc::clone(&recv), Arc::clone(&summary), all_decode.clone());
        window.push_back(tokio::spawn(async move {
            let res = receive_request(&ctx, &recv, &all, r).await;
            {
                let mut s = summary.lock().expect("summary lock");
                match &res {
                    Ok((lat, bytes, t0)) => {
                        let a = (*t0 - started).as_secs_f64();
                        s.intervals.push((a, a + lat.as_secs_f64()));
                        s.requests += 1;
                        s.bytes += bytes;
                        s.verified_bytes += bytes;
                        s.latencies_us.push(lat.as_micros() as u64);
                        progress(json!({"kind": "done", "request": r, "latency_us": lat.as_micros() as u64}));
                    }
                    Err(e) => {
                        s.errors.push(format!("request {r}: {e}"));
                        progress(json!({"kind": "failed", "request": r, "error": e}));
                    }
                }
            }
            // Free the page slot whatever happened, so the stream goes on.
            let _ = ctx.put(&format!("done/{r}/{}", rank_key(ctx.rank)), json!(res.is_ok())).await;
        }));
    }
    for h in window {
        h.await.map_err(|e| format!("request task panicked: {e}"))?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    // No byte outside a request's pages may ever change, and every request's pages were restored:
    // the whole pool must hold the sentinel again.
    let ctx2 = Arc::clone(&ctx);
    let stray = tokio::task::spawn_blocking(move || {
        let mut wrong = Vec::new();
        for host in ctx2.bufs.iter() {
            let b = host.buffer;
            let mut v = vec![0u8; host.len() as usize];
            if let Err(e) = host.read(0, &mut v) {
                wrong.push(format!("layer {} {}: cannot read the pool: {e}", b.layer, b.kind));
                continue;
            }
            if let Some(i) = v.iter().position(|x| *x != SENTINEL) {
                let n = v.iter().filter(|x| **x != SENTINEL).count();
                wrong.push(format!(
                    "layer {} {}: {n} bytes changed outside any request, first at offset {i}",
                    b.layer, b.kind
                ));
            }
        }
        wrong
    })
    .await
    .map_err(|e| format!("final check panicked: {e}"))?;
    let mut s = summary.lock().expect("summary lock").clone();
    s.errors.extend(stray);
    s.seconds = elapsed;
    s.transfer_seconds = union(&mut s.intervals);
    ctx.put(&format!("finished/{}", rank_key(ctx.rank)), json!(true)).await?;
    if s.errors.is_empty() {
        // Each sender leaves once it saw `finished` (or is gone): only then may this rank exit.
        for p in ctx.topo.senders(ctx.rank) {
            let what = format!("prefill rank {p} leaving");
            wait_until(&*ctx.store, &record_key(Side::Prefill, p), ctx.wait, &what, |e| match e {
                None => true,
                Some(e) => record_of(&e.value).is_some_and(|r| r.left),
            })
            .await
            .map_err(|e| e.to_string())?;
        }
    }
    Ok(s)
}

async fn receive_request(
    ctx: &Arc<Ctx>,
    recv: &ReceiverSession,
    all: &[RankId],
    r: u32,
) -> Result<(Duration, u64, Instant), String> {
    let w = &ctx.w;
    let key = format!("req/{r}");
    let dst: Vec<u32> = if ctx.rank == RankId::new(0, 0) {
        if r >= w.inflight {
            for d in all {
                ctx.get(&format!("done/{}/{}", r - w.inflight, rank_key(*d))).await?;
            }
        }
        let dst = request_pages(w, r, SALT_DECODE);
        ctx.put(&key, json!(dst)).await?;
        dst
    } else {
        serde_json::from_value(ctx.get(&key).await?).map_err(|e| format!("bad page list: {e}"))?
    };
    let req = RequestId(u64::from(r));
    let t0 = Instant::now();
    recv.expect(req, &dst, ExpectOptions::default(), t0 + w.request_timeout()).map_err(|e| e.to_string())?;
    ctx.put(&format!("ready/{r}/{}", rank_key(ctx.rank)), json!(true)).await?;
    // A sender the store reports lost (its lease expired: dead, frozen or cut off, even while its
    // connection looks open) fails the request at once, naming the rank.
    let waited = {
        let lost = ctx.loss.notify.notified();
        tokio::pin!(lost);
        lost.as_mut().enable();
        if let Some(reason) = ctx.loss.get() {
            recv.abort(req, &reason);
        }
        tokio::select! {
            r = recv.wait(req) => r,
            _ = lost => {
                if let Some(reason) = ctx.loss.get() {
                    recv.abort(req, &reason);
                }
                recv.wait(req).await
            }
        }
    };
    if let Err(SessionError::Failed { failure: Failure::PeerLost { .. }, .. }) = &waited {
        ctx.loss.set_transport();
    }
    let latency = t0.elapsed();
    recv.release(req);
    let (ctx2, dst2) = (Arc::clone(ctx), dst.clone());
    let ok = waited.is_ok();
    // Verify (only when the transfer completed) and restore the sentinel either way.
    let verified = tokio::task::spawn_blocking(move || verify_and_reset(&ctx2, &dst2, r, ok))
        .await
        .map_err(|e| format!("verification panicked: {e}"))?;
    waited.map_err(|e| e.to_string())?;
    Ok((latency, verified?, t0))
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
    let map = kvxfer_core::oracle::token_map(dst, ctx.w.page_size);
    let base = token_base(r);
    let tok = |p: u32| map.get(&p).map(|t| base + t);
    let mut bytes = 0;
    let mut first_err = None;
    for host in ctx.bufs.iter() {
        let b = host.buffer;
        let geom = BufferGeom::new(&ctx.topo, Side::Decode, ctx.rank, b.layer, b.kind, ctx.pages);
        let pb = geom.page_bytes();
        let hb = ctx.topo.kv().head_bytes(b.kind);
        let mut tmp = vec![0u8; pb as usize];
        let mut want = vec![0u8; pb as usize];
        let sentinel = vec![SENTINEL; pb as usize];
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        w: Workload,
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
            let side = |tp| SideSpec { kv, parallel: Parallel { tp, pp: 1 } };
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
    fn chunks_split_pages_in_order() {
        let mut w = T::parse_from(["t"]).w;
        w.chunk_pages = 2;
        let c = chunks(&w, &[1, 2, 3, 4, 5], &[9, 8, 7, 6, 5]);
        assert_eq!(c.len(), 3);
        assert_eq!(c[2], Chunk { index: 2, last: true, src_pages: vec![5], dst_pages: vec![5] });
        assert!(!c[0].last);
        w.chunk_pages = 0;
        assert_eq!(chunks(&w, &[1, 2], &[3, 4]).len(), 1);
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

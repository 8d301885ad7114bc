//! What `abort_race.rs` and `heap_flat.rs` share: a P2 -> D1 cluster's topology and agent
//! configuration, and waves of its requests with decode aborts at pseudo-random moments.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::engine::{Agent, AgentConfig, KvMemory, Phase};
use kvxfer::metadata::MetadataAddr;
use kvxfer_core::{Attention, KvSpec, Layout, Parallel, RankId, RequestId, Side, SideSpec, Topology};

/// Pages of every rank's pool.
pub const PAGES: u32 = 64;
/// Requests in flight at once (each on its own pages).
pub const SLOTS: u32 = 4;
/// Pages of one request.
pub const PAGES_PER_REQUEST: u32 = 4;

/// Two prefill ranks feed one decode rank: two KV heads, two layers, pages of four tokens.
pub fn topo() -> Topology {
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads: 2, head_dim_k: 16, head_dim_v: 16 },
        layers: 2,
        dtype_bytes: 2,
        page_size: 4,
        layout: Layout::Nhd,
    };
    Topology::new(&SideSpec { kv, parallel: Parallel::new(2, 1) }, &SideSpec { kv, parallel: Parallel::new(1, 1) })
        .unwrap()
}

/// An agent of `backend` (tcp listens on a free loopback port), 5 s leases, 20 s requests.
pub fn config(role: Side, tp: u32, t: &Topology, addr: &str, backend: &str) -> AgentConfig {
    let mut c = AgentConfig::new(role, RankId::new(tp, 0), *t, MetadataAddr::parse(addr).unwrap());
    c.backend = backend.into();
    if backend == "tcp" {
        c.backend_options.insert("listen".into(), "127.0.0.1:0".into());
    }
    c.lease_ttl = Duration::from_secs(5);
    c.request_timeout = Duration::from_secs(20);
    c
}

/// How the agents of a cluster are configured: [`config`] or a variant of it.
pub type Configure = fn(Side, u32, &Topology, &str, &str) -> AgentConfig;

/// Starts the cluster's agents on the store at `addr`: prefill ranks 0 and 1 (pools filled with
/// 1), then the decode rank (pool 0), and waits until every one is connected.
pub async fn cluster(addr: &str, backend: &str, configure: Configure) -> (Vec<Arc<Agent>>, Arc<Agent>) {
    let t = topo();
    let mut pre = Vec::new();
    for tp in 0..2 {
        pre.push(prefill(addr, backend, configure, tp).await);
    }
    let dec = Agent::start(configure(Side::Decode, 0, &t, addr, backend), KvMemory::Host { pages: PAGES, fill: 0 });
    let dec = Arc::new(dec.await.unwrap());
    connected(&pre, &dec).await;
    (pre, dec)
}

/// Starts prefill rank `tp` of the cluster (it connects in the background).
pub async fn prefill(addr: &str, backend: &str, configure: Configure, tp: u32) -> Arc<Agent> {
    let a =
        Agent::start(configure(Side::Prefill, tp, &topo(), addr, backend), KvMemory::Host { pages: PAGES, fill: 1 });
    Arc::new(a.await.unwrap())
}

/// Waits (at most 20 s) until every agent is connected.
pub async fn connected(pre: &[Arc<Agent>], dec: &Arc<Agent>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    for a in pre.iter().chain([dec]) {
        a.wait_connected(deadline).await.unwrap();
    }
}

/// xorshift: the abort moments, reproducible.
pub fn next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// One request in slot `slot`: both prefill ranks send, the decode rank maybe aborts after
/// `abort_us`; every handle that became final is released. Returns a description of every rank
/// that did not become final in time.
pub async fn request(pre: &[Arc<Agent>], dec: &Arc<Agent>, room: u64, slot: u32, abort_us: Option<u64>) -> Vec<String> {
    let pages: Vec<u32> = (0..PAGES_PER_REQUEST).map(|i| slot * PAGES_PER_REQUEST + i).collect();
    let deadline = Instant::now() + Duration::from_secs(15);
    let senders: Vec<_> = pre
        .iter()
        .map(|p| {
            let tx = p.sender(RequestId(room)).unwrap();
            tx.init(PAGES_PER_REQUEST).unwrap();
            tx
        })
        .collect();
    let rx = dec.receiver(RequestId(room)).unwrap();
    rx.send_metadata(&pages, None).unwrap();
    let sends = senders.into_iter().map(|tx| {
        let pages = pages.clone();
        tokio::spawn(async move {
            let s = tx.wait_ready(deadline).await.unwrap();
            if s.phase == Phase::WaitingForInput {
                // May fail when the abort got there first: the status says so.
                let _ = tx.send(&pages);
            }
            let s = tx.wait(deadline).await.unwrap();
            let ok = s.phase.is_final();
            if ok {
                tx.release().unwrap();
            }
            (ok, format!("{:?} {:?}", s.phase, s.reason))
        })
    });
    let sends: Vec<_> = sends.collect();
    if let Some(us) = abort_us {
        tokio::time::sleep(Duration::from_micros(us)).await;
        rx.abort("the test aborts");
    }
    let s = rx.wait(deadline).await.unwrap();
    let mut stuck = Vec::new();
    if s.phase.is_final() {
        rx.release().unwrap();
    } else {
        stuck.push(format!("room {room}: decode {:?} {:?} (abort after {abort_us:?} us)", s.phase, s.reason));
    }
    for (i, h) in sends.into_iter().enumerate() {
        let (ok, what) = h.await.unwrap();
        if !ok {
            stuck.push(format!("room {room}: prefill {i} {what} (abort after {abort_us:?} us)"));
        }
    }
    stuck
}

/// One wave: [`SLOTS`] requests side by side from room `*room` on (advanced past them), each
/// aborted after `abort(draw)` microseconds (or not), `draw` the next number of `seed`. Returns
/// what did not become final.
pub async fn wave(
    pre: &[Arc<Agent>],
    dec: &Arc<Agent>,
    room: &mut u64,
    seed: &mut u64,
    abort: fn(u64) -> Option<u64>,
) -> Vec<String> {
    let mut wave = Vec::new();
    for slot in 0..SLOTS {
        let at = abort(next(seed));
        let (pre, dec) = (pre.to_vec(), Arc::clone(dec));
        let this = *room;
        wave.push(tokio::spawn(async move { request(&pre, &dec, this, slot, at).await }));
        *room += 1;
    }
    let mut stuck = Vec::new();
    for w in wave {
        stuck.extend(w.await.unwrap());
    }
    stuck
}

//! What the end-to-end digest (`AgentConfig::digest`, issue 30) costs on the engine path, in one
//! run: two clusters per backend in this process (prefill TP 2 -> decode TP 1, Llama-3-8B's KV
//! shape), one with the option and one without, requests alternated between them; and, as a
//! baseline of the same run, XXH3-64 over the same bytes in memory.
//!
//! ```sh
//! cargo run --release -p kvxfer --features ucx --example digest_cost -- [ROUNDS] [REQUESTS_PER_ROUND]
//! ```
//!
//! Per backend (tcp; ucx over shared memory when compiled in) it prints GB/s = bytes of a request /
//! seconds from its handoff to the decode's `Success` (which includes the decode's hashing; the
//! prefill hashes beside its sends), min/median/max over the rounds, and the ratio of medians.

use std::time::{Duration, Instant};

use kvxfer::bootstrap::BootstrapServer;
use kvxfer::engine::{Agent, AgentConfig, KvMemory, Phase};
use kvxfer::metadata::MetadataAddr;
use kvxfer_core::{Attention, KvSpec, Layout, Parallel, RankId, RequestId, Side, SideSpec, Topology};

/// Pages per request (32 pages of 16 tokens: 512 tokens, 64 MiB with Llama-3-8B's KV).
const PAGES: u32 = 32;

fn topology() -> Topology {
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads: 8, head_dim_k: 128, head_dim_v: 128 },
        layers: 32,
        dtype_bytes: 2,
        page_size: 16,
        layout: Layout::Nhd,
    };
    Topology::new(&SideSpec { kv, parallel: Parallel::new(2, 1) }, &SideSpec { kv, parallel: Parallel::new(1, 1) })
        .expect("a valid topology")
}

struct Cluster {
    _server: BootstrapServer,
    prefill: Vec<Agent>,
    decode: Agent,
}

async fn cluster(backend: &str, options: &[(&str, &str)], digest: bool) -> Cluster {
    let t = topology();
    let server = BootstrapServer::start("127.0.0.1:0").await.expect("bootstrap");
    let addr = MetadataAddr::parse(&server.addr().to_string()).expect("address");
    let config = |role: Side, tp: u32| {
        let mut c = AgentConfig::new(role, RankId::new(tp, 0), t, addr.clone());
        c.backend = backend.into();
        for (k, v) in options {
            c.backend_options.insert((*k).into(), (*v).into());
        }
        c.digest = digest && role == Side::Decode;
        c
    };
    let mut prefill = Vec::new();
    for tp in 0..2 {
        let a = Agent::start(config(Side::Prefill, tp), KvMemory::Host { pages: PAGES, fill: 0 }).await;
        prefill.push(a.expect("prefill agent"));
    }
    let decode = Agent::start(config(Side::Decode, 0), KvMemory::Host { pages: PAGES, fill: 0 }).await;
    let decode = decode.expect("decode agent");
    let deadline = Instant::now() + Duration::from_secs(30);
    for a in prefill.iter().chain([&decode]) {
        a.wait_connected(deadline).await.expect("connected");
    }
    for (r, a) in prefill.iter().enumerate() {
        for m in a.host_memory() {
            let data: Vec<u8> = (0..m.len()).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ r as u8).collect();
            m.write(0, &data).expect("fill");
        }
    }
    Cluster { _server: server, prefill, decode }
}

/// One request of every page; returns seconds from handoff to the decode's success.
async fn request(c: &Cluster, room: u64) -> f64 {
    let room = RequestId(room);
    let pages: Vec<u32> = (0..PAGES).collect();
    let rx = c.decode.receiver(room).expect("receiver");
    let txs: Vec<_> = c.prefill.iter().map(|a| a.sender(room).expect("sender")).collect();
    for tx in &txs {
        tx.init(PAGES).expect("init");
    }
    let start = Instant::now();
    rx.send_metadata(&pages, None).expect("handoff");
    for tx in &txs {
        while tx.status().phase != Phase::WaitingForInput {
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
        tx.send(&pages).expect("send");
    }
    let s = rx.wait(Instant::now() + Duration::from_secs(60)).await.expect("wait");
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(s.phase, Phase::Success, "{s:?}");
    rx.release().expect("release");
    for tx in txs {
        tx.wait(Instant::now() + Duration::from_secs(60)).await.expect("prefill wait");
        tx.release().expect("release");
    }
    secs
}

fn mmm(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<u64> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let rounds = args.first().copied().unwrap_or(5).max(1);
    let per_round = args.get(1).copied().unwrap_or(8).max(1);
    let t = topology();
    let bytes: u64 = t.kv().kinds().iter().map(|k| t.buffer_bytes(Side::Decode, *k, PAGES)).sum::<u64>() * 32;
    // The baseline: XXH3-64 over the same number of bytes in 2 KiB pieces (one token's K of 8 heads
    // here is 2 KiB), in memory.
    let buf: Vec<u8> = (0..bytes as usize).map(|i| (i >> 7) as u8).collect();
    let t0 = Instant::now();
    let mut x = 0u64;
    for c in buf.chunks(2048) {
        x = x.wrapping_add(xxhash_rust::xxh3::xxh3_64_with_seed(c, x));
    }
    let hash_gbps = bytes as f64 / t0.elapsed().as_secs_f64() / 1e9;
    println!(
        "request: {} MiB (Llama-3-8B KV shape, 512 tokens, prefill TP 2 -> decode TP 1), {rounds} rounds x {per_round} requests per mode; XXH3-64 in memory: {hash_gbps:.2} GB/s ({x:x})",
        bytes >> 20
    );
    let mut backends: Vec<(&str, Vec<(&str, &str)>)> = vec![("tcp", vec![("listen", "127.0.0.1:0")])];
    if kvxfer::backends::linked().iter().any(|(n, _)| *n == "ucx") {
        backends.push(("ucx", vec![("tls", "posix,sysv,cma,self")]));
    } else {
        println!("ucx: not compiled in (--features ucx)");
    }
    for (backend, options) in backends {
        let off = cluster(backend, &options, false).await;
        let on = cluster(backend, &options, true).await;
        // Warm-up: one request each.
        request(&off, 1).await;
        request(&on, 1).await;
        let (mut g_off, mut g_on) = (Vec::new(), Vec::new());
        let mut room = 2;
        for _ in 0..rounds {
            let (mut s_off, mut s_on) = (0.0, 0.0);
            for _ in 0..per_round {
                s_off += request(&off, room).await;
                s_on += request(&on, room).await;
                room += 1;
            }
            g_off.push(bytes as f64 * per_round as f64 / s_off / 1e9);
            g_on.push(bytes as f64 * per_round as f64 / s_on / 1e9);
        }
        let hashed = (on.decode.stats().digest_bytes, off.decode.stats().digest_bytes);
        let (a, b) = (mmm(&mut g_off), mmm(&mut g_on));
        println!(
            "{backend}: GB/s min/median/max without {:.2}/{:.2}/{:.2}, with digest {:.2}/{:.2}/{:.2}; with/without {:.2} (decode hashed {} MiB with, {} without)",
            a.0,
            a.1,
            a.2,
            b.0,
            b.1,
            b.2,
            b.1 / a.1,
            hashed.0 >> 20,
            hashed.1 >> 20
        );
        for c in [off, on] {
            let d = Instant::now() + Duration::from_secs(10);
            for a in c.prefill {
                let _ = a.shutdown(d).await;
            }
            let _ = c.decode.shutdown(d).await;
        }
    }
}

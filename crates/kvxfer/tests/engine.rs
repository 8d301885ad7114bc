//! The engine API end to end in one process: prefill and decode agents over the `local` backend,
//! meeting through an in-process bootstrap service. Each test is one of the lifecycle rules of
//! SEMANTICS §5-§6 (handoff, early handoff, generations and room reuse, abort from either side with
//! its fence, lost peers, layer-wise sending) and checks the bytes that landed.

use std::time::{Duration, Instant};

use kvxfer::bootstrap::BootstrapServer;
use kvxfer::engine::{Agent, AgentConfig, KvMemory, Phase, Receiver, Sender};
use kvxfer::metadata::MetadataAddr;
use kvxfer_core::{Attention, KvSpec, Layout, NotifyStyle, Parallel, RankId, RequestId, Side, SideSpec, Topology};

const PAGES: u32 = 64;
const SENTINEL: u8 = 0xee;

fn topo(prefill_tp: u32, decode_tp: u32, layers: u32) -> Topology {
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads: 2, head_dim_k: 8, head_dim_v: 8 },
        layers,
        dtype_bytes: 2,
        page_size: 4,
        layout: Layout::Nhd,
    };
    let p = SideSpec { kv, parallel: Parallel::new(prefill_tp, 1) };
    let d = SideSpec { kv, parallel: Parallel::new(decode_tp, 1) };
    Topology::new(&p, &d).unwrap()
}

struct Cluster {
    _server: BootstrapServer,
    prefill: Vec<Agent>,
    decode: Vec<Agent>,
}

fn config(role: Side, tp: u32, t: &Topology, addr: &str, style: NotifyStyle, backend: &str) -> AgentConfig {
    let mut c = AgentConfig::new(role, RankId::new(tp, 0), *t, MetadataAddr::parse(addr).unwrap());
    c.backend = backend.into();
    if backend == "tcp" {
        c.backend_options.insert("listen".into(), "127.0.0.1:0".into());
    }
    c.notify = style;
    c.lease_ttl = Duration::from_secs(2);
    c.connect_timeout = Duration::from_secs(20);
    c.request_timeout = Duration::from_secs(20);
    c
}

async fn cluster(t: Topology, style: NotifyStyle) -> Cluster {
    cluster_on(t, style, "local").await
}

async fn cluster_on(t: Topology, style: NotifyStyle, backend: &str) -> Cluster {
    cluster_warmed(t, style, backend, true).await
}

async fn cluster_warmed(t: Topology, style: NotifyStyle, backend: &str, warm_up: bool) -> Cluster {
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let addr = server.addr().to_string();
    let mut prefill = Vec::new();
    for tp in 0..t.parallel(Side::Prefill).tp {
        let mut c = config(Side::Prefill, tp, &t, &addr, style, backend);
        c.warm_up = warm_up;
        // Every source byte carries its prefill rank and position, so misplaced bytes show.
        prefill.push(Agent::start(c, KvMemory::Host { pages: PAGES, fill: 0 }).await.unwrap());
    }
    let mut decode = Vec::new();
    for tp in 0..t.parallel(Side::Decode).tp {
        let c = config(Side::Decode, tp, &t, &addr, style, backend);
        decode.push(Agent::start(c, KvMemory::Host { pages: PAGES, fill: SENTINEL }).await.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for a in prefill.iter().chain(&decode) {
        a.wait_connected(deadline).await.unwrap();
    }
    // Source pattern: byte i of prefill buffer b holds a value derived from (rank, buffer, i).
    for (r, a) in prefill.iter().enumerate() {
        for (bi, m) in a.host_memory().iter().enumerate() {
            let data: Vec<u8> = (0..m.len()).map(|i| pattern(r, bi, i)).collect();
            m.write(0, &data).unwrap();
        }
    }
    Cluster { _server: server, prefill, decode }
}

fn pattern(rank: usize, buffer: usize, i: u64) -> u8 {
    ((i as usize).wrapping_mul(31) ^ (rank * 7 + buffer * 13) ^ (i as usize >> 8)) as u8 | 1
}

fn page_bytes(t: &Topology, side: Side) -> u64 {
    t.buffer_bytes(side, kvxfer_core::KvKind::K, 1)
}

/// P == D: decode page `dst[i]` of every buffer must equal prefill page `src[i]`.
fn check_same_tp(c: &Cluster, t: &Topology, src: &[u32], dst: &[u32]) {
    let pb = page_bytes(t, Side::Decode);
    for (r, (p, d)) in c.prefill.iter().zip(&c.decode).enumerate() {
        for (bi, (pm, dm)) in p.host_memory().iter().zip(d.host_memory()).enumerate() {
            for (s, dd) in src.iter().zip(dst) {
                let mut got = vec![0u8; pb as usize];
                dm.read(u64::from(*dd) * pb, &mut got).unwrap();
                let want: Vec<u8> = (0..pb).map(|i| pattern(r, bi, u64::from(*s) * pb + i)).collect();
                assert_eq!(got, want, "rank {r} buffer {bi} page {s} -> {dd}");
                let _ = pm;
            }
        }
    }
}

fn reset_pages(c: &Cluster, t: &Topology, dst: &[u32]) {
    let pb = page_bytes(t, Side::Decode);
    for d in &c.decode {
        for m in d.host_memory() {
            for p in dst {
                m.write(u64::from(*p) * pb, &vec![SENTINEL; pb as usize]).unwrap();
            }
        }
    }
}

fn all_sentinel(c: &Cluster, t: &Topology, pages: &[u32]) -> bool {
    let pb = page_bytes(t, Side::Decode);
    c.decode.iter().all(|d| {
        d.host_memory().iter().all(|m| {
            pages.iter().all(|p| {
                let mut got = vec![0u8; pb as usize];
                m.read(u64::from(*p) * pb, &mut got).unwrap();
                got.iter().all(|b| *b == SENTINEL)
            })
        })
    })
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

async fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn shutdown(c: Cluster) {
    for a in c.prefill.into_iter().chain(c.decode) {
        a.shutdown(soon()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_ranks_warm_every_connection_before_they_count_as_connected_and_no_pool_byte_changes() {
    let t = topo(2, 1, 2);
    let every_page: Vec<u32> = (0..PAGES).collect();
    for backend in ["local", "tcp"] {
        for warm_up in [true, false] {
            let c = cluster_warmed(t, NotifyStyle::Attached, backend, warm_up).await;
            for p in &c.prefill {
                let s = p.stats();
                let want = if warm_up { t.receivers(p.rank()).len() as u64 } else { 0 };
                assert_eq!((s.warm_ups, s.warm_up_failures), (want, 0), "{backend}, warm_up {warm_up}, {}", p.rank());
            }
            assert_eq!(c.decode[0].stats().warm_ups, 0, "{backend}: decode ranks warm nothing");
            assert!(all_sentinel(&c, &t, &every_page), "{backend}: a warm-up changed the decode pool");
            // And the warmed connections carry requests as before.
            let room = RequestId(1);
            let senders: Vec<_> = c.prefill.iter().map(|p| p.sender(room).unwrap()).collect();
            let rx = c.decode[0].receiver(room).unwrap();
            rx.send_metadata(&[2], None).unwrap();
            for s in &senders {
                s.init(1).unwrap();
                s.wait_ready(soon()).await.unwrap();
                s.send(&[0]).unwrap();
            }
            assert_eq!(rx.wait(soon()).await.unwrap().phase, Phase::Success, "{backend}");
            for s in senders {
                s.wait(soon()).await.unwrap();
                s.release().unwrap();
            }
            rx.release().unwrap();
            shutdown(c).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_two_chunks_lands_and_both_sides_succeed() {
    for style in [NotifyStyle::Attached, NotifyStyle::OutOfBand] {
        let t = topo(1, 1, 3);
        let c = cluster(t, style).await;
        let room = RequestId(7);
        let rx = c.decode[0].receiver(room).unwrap();
        assert_eq!(rx.status().phase, Phase::WaitingForInput);
        let dst = [9, 3, 17, 4, 40];
        rx.send_metadata(&dst, None).unwrap();
        assert_eq!(rx.status().phase, Phase::Transferring);
        let tx = c.prefill[0].sender(room).unwrap();
        tx.init(5).unwrap();
        until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
        let src = [1, 2, 30, 31, 32];
        tx.send(&src[..2]).unwrap();
        assert_eq!(tx.status().phase, Phase::WaitingForInput);
        tx.send(&src[2..]).unwrap();
        let s = rx.wait(soon()).await.unwrap();
        assert_eq!(s.phase, Phase::Success, "{s:?}");
        assert!(s.pages_reusable);
        assert_eq!(tx.wait(soon()).await.unwrap().phase, Phase::Success);
        check_same_tp(&c, &t, &src, &dst);
        // A chunk past the total is refused and changes nothing.
        assert!(tx.send(&[5]).is_err());
        tx.release().unwrap();
        rx.release().unwrap();
        assert_eq!(c.decode[0].active_requests(), 0);
        shutdown(c).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_that_arrives_before_the_sender_exists_is_kept() {
    let t = topo(2, 1, 2);
    let c = cluster(t, NotifyStyle::Attached).await;
    let room = RequestId(1);
    let rx = c.decode[0].receiver(room).unwrap();
    rx.send_metadata(&[0, 1, 2], None).unwrap();
    until("both prefill ranks to keep the handoff", || c.prefill.iter().all(|p| p.stats().early_handoffs_kept == 1))
        .await;
    let senders: Vec<Sender> = c.prefill.iter().map(|p| p.sender(room).unwrap()).collect();
    for s in &senders {
        assert_eq!(s.status().phase, Phase::WaitingForInput, "the kept handoff applies at once");
        s.init(3).unwrap();
        s.send(&[5, 6, 7]).unwrap();
    }
    assert_eq!(rx.wait(soon()).await.unwrap().phase, Phase::Success);
    for s in senders {
        s.wait(soon()).await.unwrap();
        s.release().unwrap();
    }
    rx.release().unwrap();
    shutdown(c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_abort_fences_then_the_room_and_its_pages_are_reused() {
    let t = topo(1, 1, 4);
    let c = cluster(t, NotifyStyle::Attached).await;
    let room = RequestId(42);
    let dst: Vec<u32> = (0..32).collect();
    let rx = c.decode[0].receiver(room).unwrap();
    rx.send_metadata(&dst, None).unwrap();
    let tx = c.prefill[0].sender(room).unwrap();
    tx.init(32).unwrap();
    until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
    tx.send(&(0..16).collect::<Vec<_>>()).unwrap();
    rx.abort("the scheduler preempted it");
    let first = rx.status();
    assert!(matches!(first.phase, Phase::Aborting | Phase::Failed), "{first:?}");
    let s = rx.wait(soon()).await.unwrap();
    assert_eq!(s.phase, Phase::Failed);
    assert!(s.pages_reusable, "failed means fenced: {s:?}");
    assert!(s.reason.unwrap().contains("preempted"));
    // The sender heard of it at once, not at its deadline.
    let ts = tx.wait(soon()).await.unwrap();
    assert_eq!(ts.phase, Phase::Failed);
    assert!(ts.reason.unwrap().contains("decode rank 0/0 aborted"), "names the decode rank");
    assert!(tx.send(&[16]).is_err(), "no more chunks after an abort");
    assert!(c.decode[0].stats().fences >= 1, "the fence came from the sender");
    // Reuse the pages at once for the same room, under a new generation.
    let gen1 = rx.generation().unwrap();
    rx.release().unwrap();
    tx.release().unwrap();
    reset_pages(&c, &t, &dst);
    let rx2 = c.decode[0].receiver(room).unwrap();
    rx2.send_metadata(&dst, None).unwrap();
    assert_ne!(rx2.generation().unwrap(), gen1);
    let tx2 = c.prefill[0].sender(room).unwrap();
    tx2.init(32).unwrap();
    until("the second handoff", || tx2.status().phase == Phase::WaitingForInput).await;
    let src: Vec<u32> = (32..64).collect();
    tx2.send(&src).unwrap();
    assert_eq!(rx2.wait(soon()).await.unwrap().phase, Phase::Success);
    check_same_tp(&c, &t, &src, &dst);
    shutdown(c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_abort_fails_every_decode_rank_at_once() {
    let t = topo(1, 2, 2);
    let c = cluster(t, NotifyStyle::OutOfBand).await;
    let room = RequestId(3);
    let rxs: Vec<Receiver> = c.decode.iter().map(|d| d.receiver(room).unwrap()).collect();
    for r in &rxs {
        r.send_metadata(&[4, 5], None).unwrap();
    }
    let tx = c.prefill[0].sender(room).unwrap();
    tx.init(2).unwrap();
    until("both handoffs", || tx.status().phase == Phase::WaitingForInput).await;
    let t0 = Instant::now();
    tx.abort("out of memory on the prefill side");
    for r in &rxs {
        let s = r.wait(soon()).await.unwrap();
        assert_eq!(s.phase, Phase::Failed);
        assert!(s.pages_reusable);
        let why = s.reason.unwrap();
        assert!(why.contains("out of memory") && why.contains("tp0.pp0"), "{why}");
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "told at once, not at the 20 s deadline");
    assert!(all_sentinel(&c, &t, &[4, 5]), "nothing was written");
    shutdown(c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborting_before_the_handoff_needs_no_fence() {
    let t = topo(1, 1, 1);
    let c = cluster(t, NotifyStyle::Attached).await;
    let rx = c.decode[0].receiver(RequestId(5)).unwrap();
    rx.abort("client went away");
    let s = rx.status();
    assert_eq!((s.phase, s.pages_reusable), (Phase::Failed, true));
    assert!(rx.send_metadata(&[1], None).is_err());
    rx.release().unwrap();
    shutdown(c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layerwise_chunks_land_and_complete_per_chunk() {
    let t = topo(1, 1, 4);
    let c = cluster(t, NotifyStyle::Attached).await;
    let room = RequestId(11);
    let dst = [10, 11, 12, 13];
    let rx = c.decode[0].receiver(room).unwrap();
    rx.send_metadata(&dst, None).unwrap();
    let tx = c.prefill[0].sender(room).unwrap();
    tx.init(4).unwrap();
    until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
    let src = [20, 21, 22, 23];
    for chunk in src.chunks(2) {
        for l in 0..4 {
            tx.send_layers(chunk, l..l + 1).unwrap();
            if l < 3 {
                assert_ne!(rx.status().phase, Phase::Success);
            }
        }
    }
    assert!(tx.send_layers(&src[..2], 0..1).is_err(), "everything was sent");
    assert_eq!(rx.wait(soon()).await.unwrap().phase, Phase::Success);
    assert_eq!(tx.wait(soon()).await.unwrap().phase, Phase::Success);
    check_same_tp(&c, &t, &src, &dst);
    shutdown(c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aux_data_reaches_the_decode_rank_that_asked() {
    let t = topo(1, 1, 1);
    let c = cluster(t, NotifyStyle::Attached).await;
    let rx = c.decode[0].receiver(RequestId(2)).unwrap();
    rx.send_metadata(&[0], Some(3)).unwrap();
    let tx = c.prefill[0].sender(RequestId(2)).unwrap();
    tx.init(1).unwrap();
    until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
    tx.send(&[0]).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(rx.status().phase, Phase::Transferring, "aux was required");
    tx.send_aux(b"first token".to_vec()).unwrap();
    assert_eq!(rx.wait(soon()).await.unwrap().phase, Phase::Success);
    assert_eq!(rx.aux().unwrap(), b"first token");
    assert_eq!(tx.wait(soon()).await.unwrap().phase, Phase::Success);
    shutdown(c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_prefill_rank_fails_current_and_later_requests_at_once() {
    let t = topo(1, 1, 1);
    let mut c = cluster(t, NotifyStyle::Attached).await;
    let rx = c.decode[0].receiver(RequestId(1)).unwrap();
    rx.send_metadata(&[0, 1], None).unwrap();
    // The prefill rank dies (dropped without leaving: its lease expires).
    let p = c.prefill.pop().unwrap();
    drop(p);
    let t0 = Instant::now();
    let s = rx.wait(soon()).await.unwrap();
    assert_eq!(s.phase, Phase::Failed, "{s:?}");
    assert!(s.pages_reusable, "a lost sender counts as fenced");
    assert!(s.reason.unwrap().contains("tp0.pp0"));
    assert!(t0.elapsed() < Duration::from_secs(10));
    // A request registered after the loss fails at once.
    let rx2 = c.decode[0].receiver(RequestId(2)).unwrap();
    rx2.send_metadata(&[2], None).unwrap();
    let s2 = rx2.status();
    assert_eq!(s2.phase, Phase::Failed, "{s2:?}");
    assert!(s2.reason.unwrap().contains("lost"));
    for a in c.decode.drain(..) {
        a.shutdown(soon()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misuse_is_refused_with_a_clear_error() {
    let t = topo(1, 1, 1);
    let c = cluster(t, NotifyStyle::Attached).await;
    assert!(c.decode[0].sender(RequestId(1)).unwrap_err().to_string().contains("prefill call"));
    let rx = c.decode[0].receiver(RequestId(1)).unwrap();
    assert!(c.decode[0].receiver(RequestId(1)).unwrap_err().to_string().contains("already active"));
    let e = rx.send_metadata(&[PAGES], None).unwrap_err().to_string();
    assert!(e.contains("outside the pool"), "{e}");
    rx.send_metadata(&[1], None).unwrap();
    let e = rx.clone().release().unwrap_err().to_string();
    assert!(e.contains("cannot release while transferring"), "{e}");
    let tx = c.prefill[0].sender(RequestId(1)).unwrap();
    until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
    assert!(tx.send(&[0]).unwrap_err().to_string().contains("init"));
    tx.init(1).unwrap();
    assert!(tx.send(&[0, 1]).unwrap_err().to_string().contains("exceed"));
    tx.send(&[0]).unwrap();
    rx.wait(soon()).await.unwrap();
    shutdown(c).await;
}

/// A start that cannot reach its store says so by its variant (the one start failure a retry fixes),
/// and the same agent starts once the store is up; a start failure a retry does not fix is `Setup`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_without_its_store_is_store_unreachable_and_a_later_start_succeeds() {
    use kvxfer::engine::EngineError;
    let t = topo(1, 1, 1);
    // A port that was free a moment ago: nothing listens there.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let c = config(Side::Prefill, 0, &t, &addr, NotifyStyle::Attached, "local");
    let started = Instant::now();
    let e = Agent::start(c.clone(), KvMemory::Host { pages: PAGES, fill: 0 }).await.unwrap_err();
    assert!(matches!(e, EngineError::StoreUnreachable { .. }), "{e:?}");
    assert!(e.to_string().starts_with("prefill rank 0/0: ") && e.to_string().contains(&addr), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    let server = BootstrapServer::start(&addr).await.unwrap();
    let a = Agent::start(c, KvMemory::Host { pages: PAGES, fill: 0 }).await.unwrap();
    let mut bad = config(Side::Decode, 0, &t, &addr, NotifyStyle::Attached, "local");
    bad.backend = "no-such-backend".into();
    let e = Agent::start(bad, KvMemory::Host { pages: PAGES, fill: 0 }).await.unwrap_err();
    assert!(matches!(e, EngineError::Setup { .. }), "{e:?}");
    a.shutdown(soon()).await.unwrap();
    drop(server);
}

/// Defect 5 of the engine API issue: an abort neither told the senders nor waited for their writes,
/// so pages reused after it could be overwritten. Over tcp (writes really are in flight): once the
/// aborted request is `Failed` with `pages_reusable`, pages reset to the sentinel stay so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_write_lands_after_the_fence() {
    for style in [NotifyStyle::Attached, NotifyStyle::OutOfBand] {
        let t = topo(1, 1, 8);
        let c = cluster_on(t, style, "tcp").await;
        let dst: Vec<u32> = (0..PAGES).collect();
        for round in 0..4u64 {
            let room = RequestId(100 + round);
            let rx = c.decode[0].receiver(room).unwrap();
            rx.send_metadata(&dst, None).unwrap();
            let tx = c.prefill[0].sender(room).unwrap();
            tx.init(PAGES).unwrap();
            until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
            for chunk in (0..PAGES).collect::<Vec<_>>().chunks(4) {
                tx.send(chunk).unwrap();
            }
            // Abort while chunks are in flight (after a growing delay, so some rounds abort later).
            tokio::time::sleep(Duration::from_micros(200 * round)).await;
            rx.abort("preempted");
            let s = rx.wait(soon()).await.unwrap();
            assert!(s.pages_reusable, "{s:?}");
            if s.phase == Phase::Success {
                // The abort came too late to matter: fine, the bytes are complete.
                check_same_tp(&c, &t, &(0..PAGES).collect::<Vec<_>>(), &dst);
            }
            reset_pages(&c, &t, &dst);
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(all_sentinel(&c, &t, &dst), "{style:?} round {round}: a write landed after the fence");
            tx.wait(soon()).await.unwrap();
            tx.release().unwrap();
            rx.release().unwrap();
        }
        shutdown(c).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_decode_rank_fails_prefill_requests_now_and_later() {
    let t = topo(1, 1, 1);
    let mut c = cluster(t, NotifyStyle::Attached).await;
    let rx = c.decode[0].receiver(RequestId(1)).unwrap();
    rx.send_metadata(&[0], None).unwrap();
    let tx = c.prefill[0].sender(RequestId(1)).unwrap();
    until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
    drop(rx);
    drop(c.decode.pop().unwrap());
    let s = tx.wait(soon()).await.unwrap();
    assert_eq!(s.phase, Phase::Failed, "{s:?}");
    assert!(s.reason.unwrap().contains("decode rank 0/0"));
    let tx2 = c.prefill[0].sender(RequestId(2)).unwrap();
    let s2 = tx2.wait(Instant::now() + Duration::from_secs(2)).await.unwrap();
    assert_eq!(s2.phase, Phase::Failed, "a request created after the loss fails at once: {s2:?}");
    for a in c.prefill.drain(..) {
        a.shutdown(soon()).await.unwrap();
    }
}

/// MLA with prefill TP 2 and decode TP 1: decode rank 0 reads the latent from prefill rank 0 only,
/// so prefill rank 1 feeds nobody and may finish and leave before the decode rank starts. The
/// decode rank waits for the ranks it exchanges with, not for every prefill rank: before, it
/// waited for both, its handoffs went nowhere and prefill rank 0's requests failed at their
/// deadline ("not finished within 60s", seen in CI on `kvxfer demo --model deepseek-v3`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_rank_that_feeds_nobody_may_leave_before_decode_starts() {
    let kv = KvSpec {
        attention: Attention::Mla { latent_dim: 16 },
        layers: 2,
        dtype_bytes: 2,
        page_size: 4,
        layout: Layout::Nhd,
    };
    let t =
        Topology::new(&SideSpec { kv, parallel: Parallel::new(2, 1) }, &SideSpec { kv, parallel: Parallel::new(1, 1) })
            .unwrap();
    assert!(t.receivers(RankId::new(1, 0)).is_empty(), "prefill rank 1 feeds nobody");
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let addr = server.addr().to_string();
    let cfg = |role, tp| {
        let mut c = config(role, tp, &t, &addr, NotifyStyle::Attached, "local");
        c.connect_timeout = Duration::from_secs(3);
        c
    };
    let p0 = Agent::start(cfg(Side::Prefill, 0), KvMemory::Host { pages: PAGES, fill: 0 }).await.unwrap();
    let p1 = Agent::start(cfg(Side::Prefill, 1), KvMemory::Host { pages: PAGES, fill: 0 }).await.unwrap();
    p1.shutdown(soon()).await.unwrap();
    let d = Agent::start(cfg(Side::Decode, 0), KvMemory::Host { pages: PAGES, fill: SENTINEL }).await.unwrap();
    d.wait_connected(soon()).await.expect("the decode rank connects without the prefill rank that left");
    p0.wait_connected(soon()).await.unwrap();
    for (bi, m) in p0.host_memory().iter().enumerate() {
        let data: Vec<u8> = (0..m.len()).map(|i| pattern(0, bi, i)).collect();
        m.write(0, &data).unwrap();
    }
    let room = RequestId(3);
    let rx = d.receiver(room).unwrap();
    let (src, dst) = ([4u32, 9, 1], [0u32, 7, 2]);
    rx.send_metadata(&dst, None).unwrap();
    let tx = p0.sender(room).unwrap();
    tx.init(3).unwrap();
    until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
    tx.send(&src).unwrap();
    let s = rx.wait(soon()).await.unwrap();
    assert_eq!(s.phase, Phase::Success, "{s:?}");
    assert_eq!(tx.wait(soon()).await.unwrap().phase, Phase::Success);
    let pb = t.buffer_bytes(Side::Decode, kvxfer_core::KvKind::Latent, 1);
    for (bi, m) in d.host_memory().iter().enumerate() {
        for (sp, dp) in src.iter().zip(&dst) {
            let mut got = vec![0u8; pb as usize];
            m.read(u64::from(*dp) * pb, &mut got).unwrap();
            let want: Vec<u8> = (0..pb).map(|i| pattern(0, bi, u64::from(*sp) * pb + i)).collect();
            assert_eq!(got, want, "buffer {bi} page {sp} -> {dp}");
        }
    }
    tx.release().unwrap();
    rx.release().unwrap();
    p0.shutdown(soon()).await.unwrap();
    d.shutdown(soon()).await.unwrap();
}

/// `c` with a 1 s connect deadline and a long request deadline: a failed connect must fail the
/// requests long before their own deadline.
fn quick_connect(mut c: AgentConfig) -> AgentConfig {
    c.connect_timeout = Duration::from_secs(1);
    c.request_timeout = Duration::from_secs(30);
    c
}

/// A rank whose initial connect fails (a needed peer never registered) fails its requests with
/// that error as soon as the connect deadline passes, on both sides, instead of at each request's
/// own deadline; the decode pages are reusable (no handoff went out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connect_fails_requests_at_once_on_either_side() {
    let t = topo(2, 1, 1);
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let addr = server.addr().to_string();
    let cfg = |role, tp| quick_connect(config(role, tp, &t, &addr, NotifyStyle::Attached, "local"));
    // Prefill rank 1 never starts; prefill rank 0 waits for the decode rank, which waits for both.
    let p0 = Agent::start(cfg(Side::Prefill, 0), KvMemory::Host { pages: PAGES, fill: 0 }).await.unwrap();
    let d = Agent::start(cfg(Side::Decode, 0), KvMemory::Host { pages: PAGES, fill: SENTINEL }).await.unwrap();
    let t0 = Instant::now();
    let rx = d.receiver(RequestId(1)).unwrap();
    rx.send_metadata(&[0, 1], None).unwrap();
    let s = rx.wait(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(s.phase, Phase::Failed, "{s:?}");
    assert!(s.pages_reusable, "{s:?}");
    let why = s.reason.unwrap();
    assert!(why.contains("connecting") && why.contains("1/0"), "{why}");
    assert!(t0.elapsed() < Duration::from_secs(10), "failed after {:?}", t0.elapsed());
    rx.release().unwrap();
    d.shutdown(soon()).await.unwrap();
    p0.shutdown(soon()).await.unwrap();

    // Prefill side: P1 -> D2, decode rank 1 never starts.
    let t = topo(1, 2, 1);
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let addr = server.addr().to_string();
    let cfg = |role, tp| quick_connect(config(role, tp, &t, &addr, NotifyStyle::Attached, "local"));
    let p0 = Agent::start(cfg(Side::Prefill, 0), KvMemory::Host { pages: PAGES, fill: 0 }).await.unwrap();
    let t0 = Instant::now();
    let tx = p0.sender(RequestId(1)).unwrap();
    tx.init(2).unwrap();
    let s = tx.wait(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(s.phase, Phase::Failed, "{s:?}");
    let why = s.reason.unwrap();
    assert!(why.contains("connecting") && why.contains("decode"), "{why}");
    assert!(t0.elapsed() < Duration::from_secs(10), "failed after {:?}", t0.elapsed());
    tx.release().unwrap();
    p0.shutdown(soon()).await.unwrap();
    drop(server);
}

/// A rank that cannot renew its own lease for a whole TTL is considered lost by its peers; it
/// considers them lost too: its requests fail naming its own membership, on both sides, instead
/// of waiting on links the peers have dropped (chaos `link_cut`: the prefill's exit went from up to
/// 21.5 s to 6.6 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_loses_its_own_membership_fails_its_requests() {
    let t = topo(1, 1, 1);
    let c = cluster(t, NotifyStyle::Attached).await;
    let room = RequestId(9);
    let rx = c.decode[0].receiver(room).unwrap();
    rx.send_metadata(&[0, 1], None).unwrap();
    let tx = c.prefill[0].sender(room).unwrap();
    tx.init(2).unwrap();
    until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
    // The store goes away (nothing is sent for the request): keep-alives fail from now on.
    let t0 = Instant::now();
    drop(c._server);
    let deadline = Instant::now() + Duration::from_secs(10);
    let s = rx.wait(deadline).await.unwrap();
    assert_eq!(s.phase, Phase::Failed, "{s:?}");
    assert!(s.reason.as_deref().unwrap_or("").contains("own membership is lost"), "{s:?}");
    assert!(s.pages_reusable, "{s:?}");
    let s = tx.wait(deadline).await.unwrap();
    assert_eq!(s.phase, Phase::Failed, "{s:?}");
    assert!(s.reason.as_deref().unwrap_or("").contains("own membership is lost"), "{s:?}");
    // The lease TTL is 2 s: named within it and one keep-alive round more.
    assert!(t0.elapsed() < Duration::from_secs(5), "failed after {:?}", t0.elapsed());
    // The first rank to notice may fail the other's request by telling it; each notices by itself
    // too, within the same bound.
    until("both ranks to count their peer lost", || {
        c.decode[0].stats().peers_lost >= 1 && c.prefill[0].stats().peers_lost >= 1
    })
    .await;
    assert!(t0.elapsed() < Duration::from_secs(6), "counted after {:?}", t0.elapsed());
    tx.release().unwrap();
    rx.release().unwrap();
    for a in c.prefill.into_iter().chain(c.decode) {
        // Leaving the unreachable store is bounded (1 s); the error says so.
        let t1 = Instant::now();
        let _ = a.shutdown(Instant::now() + Duration::from_secs(5)).await;
        assert!(t1.elapsed() < Duration::from_secs(5), "shutdown took {:?}", t1.elapsed());
    }
}

/// Issue 32: the decode rank gives up on a prefill rank that is still alive (its record in the
/// store vanished, as when its lease expired while it was stopped); the prefill rank resumes and
/// sends the request's pages. The decode rank cut it off before it reported the pages reusable, so
/// after the engine reused them (wrote them back) not one byte of the late sender lands. Run on the
/// tcp backend (across sockets) and the local one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_given_up_on_while_alive_lands_nothing_after_the_fence() {
    for backend in ["tcp", "local"] {
        let t = topo(1, 1, 2);
        let c = cluster_on(t, NotifyStyle::Attached, backend).await;
        let room = RequestId(32);
        let dst: Vec<u32> = (0..32).collect();
        let rx = c.decode[0].receiver(room).unwrap();
        rx.send_metadata(&dst, None).unwrap();
        let tx = c.prefill[0].sender(room).unwrap();
        tx.init(32).unwrap();
        until("the handoff", || tx.status().phase == Phase::WaitingForInput).await;
        // The prefill rank's record vanishes from the store; the process itself goes on.
        let addr = MetadataAddr::parse(&c._server.addr().to_string()).unwrap();
        let store = kvxfer::metadata::connect(&addr, Duration::from_secs(5)).await.unwrap();
        let key = kvxfer::metadata::members::rank_key(Side::Prefill, RankId::new(0, 0));
        assert!(store.delete(&key).await.unwrap(), "{backend}: the record existed");
        let s = rx.wait(soon()).await.unwrap();
        assert_eq!(s.phase, Phase::Failed, "{backend}: {s:?}");
        assert!(s.pages_reusable, "{backend}: cut off, so fenced: {s:?}");
        let st = c.decode[0].stats();
        assert_eq!((st.cut_offs, st.quarantined), (1, 0), "{backend}: {st:?}");
        assert!(c.decode[0].quarantined().is_empty());
        // The engine reuses the pages at once; the prefill rank, unaware, sends them all.
        reset_pages(&c, &t, &dst);
        let src: Vec<u32> = (32..64).collect();
        let _ = tx.send(&src);
        let ts = tx.wait(soon()).await.unwrap();
        assert_eq!(ts.phase, Phase::Failed, "{backend}: the cut-off sender cannot succeed: {ts:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(all_sentinel(&c, &t, &dst), "{backend}: a byte of the cut-off sender landed in reused pages");
        tx.release().unwrap();
        rx.release().unwrap();
        for a in c.prefill.into_iter().chain(c.decode) {
            let _ = a.shutdown(soon()).await;
        }
    }
}

/// A backend whose cut-off is never confirmed: the local backend without `cut_off` (the trait's
/// default refuses).
struct NoCut(std::sync::Arc<dyn kvxfer_core::KvTransferBackend>);

#[async_trait::async_trait]
impl kvxfer_core::KvTransferBackend for NoCut {
    fn name(&self) -> &'static str {
        "nocut"
    }
    fn capabilities(&self) -> kvxfer_core::Capabilities {
        self.0.capabilities()
    }
    async fn register(
        &self,
        id: kvxfer_core::RegionId,
        mem: kvxfer_core::MemDesc,
    ) -> Result<kvxfer_core::Registration, kvxfer_core::BackendError> {
        self.0.register(id, mem).await
    }
    fn metadata(&self) -> Result<kvxfer_core::EndpointMetadata, kvxfer_core::BackendError> {
        self.0.metadata()
    }
    async fn connect(
        &self,
        peer: &kvxfer_core::EndpointMetadata,
    ) -> Result<kvxfer_core::PeerId, kvxfer_core::BackendError> {
        self.0.connect(peer).await
    }
    fn post(
        &self,
        peer: kvxfer_core::PeerId,
        ops: &[kvxfer_core::WriteOp],
        notify: Option<&kvxfer_core::Notification>,
    ) -> Result<kvxfer_core::Transfer, kvxfer_core::BackendError> {
        self.0.post(peer, ops, notify)
    }
    async fn notify(
        &self,
        peer: kvxfer_core::PeerId,
        n: &kvxfer_core::Notification,
    ) -> Result<(), kvxfer_core::BackendError> {
        self.0.notify(peer, n).await
    }
    async fn recv(&self, max_wait: Duration) -> Result<Vec<kvxfer_core::BackendEvent>, kvxfer_core::BackendError> {
        self.0.recv(max_wait).await
    }
    async fn disconnect(&self, peer: kvxfer_core::PeerId) -> Result<(), kvxfer_core::BackendError> {
        self.0.disconnect(peer).await
    }
}

fn nocut(
    cfg: &kvxfer_core::BackendConfig,
) -> Result<std::sync::Arc<dyn kvxfer_core::KvTransferBackend>, kvxfer_core::BackendError> {
    Ok(std::sync::Arc::new(NoCut(kvxfer_local::create(cfg)?)))
}

kvxfer_core::register_backend!("nocut", "test: local without cut_off", kvxfer_local::CAPABILITIES, nocut);

/// Issue 32: when the backend cannot confirm the cut-off, the pages the given-up peer could write
/// stay quarantined: the request stays `Aborting`, never `pages_reusable`, its reason and
/// `Agent::quarantined` name the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_that_cannot_be_confirmed_quarantines_the_pages() {
    let t = topo(1, 1, 1);
    let c = cluster_on(t, NotifyStyle::Attached, "nocut").await;
    let rx = c.decode[0].receiver(RequestId(5)).unwrap();
    rx.send_metadata(&[0, 1], None).unwrap();
    let addr = MetadataAddr::parse(&c._server.addr().to_string()).unwrap();
    let store = kvxfer::metadata::connect(&addr, Duration::from_secs(5)).await.unwrap();
    store.delete(&kvxfer::metadata::members::rank_key(Side::Prefill, RankId::new(0, 0))).await.unwrap();
    until("the quarantine", || !c.decode[0].quarantined().is_empty()).await;
    let s = rx.status();
    assert_eq!(s.phase, Phase::Aborting, "{s:?}");
    assert!(!s.pages_reusable, "{s:?}");
    let why = s.reason.unwrap();
    assert!(why.contains("QUARANTINED") && why.contains("prefill rank 0/0"), "{why}");
    let q = c.decode[0].quarantined();
    assert_eq!(q[0].0, RankId::new(0, 0));
    assert!(q[0].1.contains("not supported"), "{q:?}");
    assert_eq!(c.decode[0].stats().quarantined, 1);
    // Still quarantined later: nothing but a confirmed cut-off releases the pages.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!rx.status().pages_reusable);
    for a in c.prefill.into_iter().chain(c.decode) {
        let _ = a.shutdown(soon()).await;
    }
}

/// Issue 32, the prefill side: a prefill rank gives up on a decode rank that is still alive (its
/// record vanished from the store) and cuts it off; the decode rank, unaware, hands a new request
/// off under its old instance. The handoff never reaches the prefill rank (nothing kept, no sender
/// ready), and the decode rank's request fails naming the prefill rank instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_given_up_on_while_alive_cannot_hand_off_afterwards() {
    for backend in ["tcp", "local"] {
        let t = topo(1, 1, 1);
        let c = cluster_on(t, NotifyStyle::Attached, backend).await;
        let addr = MetadataAddr::parse(&c._server.addr().to_string()).unwrap();
        let store = kvxfer::metadata::connect(&addr, Duration::from_secs(5)).await.unwrap();
        store.delete(&kvxfer::metadata::members::rank_key(Side::Decode, RankId::new(0, 0))).await.unwrap();
        until("the prefill rank to cut the decode rank off", || c.prefill[0].stats().cut_offs == 1).await;
        // The prefill rank's sender exists (and failed: its decode rank is lost) before the handoff,
        // so a handoff that got through would be answered with that failure.
        let tx = c.prefill[0].sender(RequestId(77)).unwrap();
        let rx = c.decode[0].receiver(RequestId(77)).unwrap();
        let _ = rx.send_metadata(&[0, 1], None);
        let s = rx.wait(soon()).await.unwrap();
        assert_eq!(s.phase, Phase::Failed, "{backend}: {s:?}");
        let why = s.reason.as_deref().unwrap_or("");
        assert!(why.contains("prefill rank 0/0") && why.contains("lost"), "{backend}: {s:?}");
        assert!(!why.contains("reported failure"), "{backend}: the handoff reached the prefill rank: {s:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let st = c.prefill[0].stats();
        assert_eq!(st.early_handoffs_kept, 0, "{backend}: the cut-off instance's handoff arrived: {st:?}");
        assert_ne!(tx.status().phase, Phase::WaitingForInput, "{backend}: {:?}", tx.status());
        for a in c.prefill.into_iter().chain(c.decode) {
            let _ = a.shutdown(soon()).await;
        }
    }
}

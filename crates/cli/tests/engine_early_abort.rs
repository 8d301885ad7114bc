//! The engine rule `kvxfer worker --abort-rate` depends on: a decode rank that aborts a request
//! before the prefill rank created its sender is fenced at once, and the sender created afterwards
//! fails at once and tells the other decode ranks. (The prefill rank used to drop the kept handoff,
//! so that sender waited in `Bootstrapping` until its deadline, and the other decode ranks with it;
//! had the handoff arrived after its abort, it would have been kept and sent into pages the decode
//! rank had already reused.) In one process over the `local` backend.

use std::time::{Duration, Instant};

use kvxfer::bootstrap::BootstrapServer;
use kvxfer::engine::{Agent, AgentConfig, KvMemory, Phase};
use kvxfer::metadata::MetadataAddr;
use kvxfer_core::{Attention, KvSpec, Layout, NotifyStyle, Parallel, RankId, RequestId, Side, SideSpec, Topology};

const SENTINEL: u8 = 0xee;

fn topo(prefill_tp: u32, decode_tp: u32) -> Topology {
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads: 2, head_dim_k: 8, head_dim_v: 8 },
        layers: 2,
        dtype_bytes: 2,
        page_size: 4,
        layout: Layout::Nhd,
    };
    let side = |tp| SideSpec { kv, parallel: Parallel::new(tp, 1) };
    Topology::new(&side(prefill_tp), &side(decode_tp)).unwrap()
}

async fn agents(t: Topology) -> (BootstrapServer, Agent, Vec<Agent>) {
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let addr = MetadataAddr::parse(&server.addr().to_string()).unwrap();
    let config = |role, tp| {
        let mut c = AgentConfig::new(role, RankId::new(tp, 0), t, addr.clone());
        c.backend = "local".into();
        c.notify = NotifyStyle::Attached;
        c.lease_ttl = Duration::from_secs(2);
        c.connect_timeout = Duration::from_secs(20);
        c.request_timeout = Duration::from_secs(20);
        c
    };
    let prefill = Agent::start(config(Side::Prefill, 0), KvMemory::Host { pages: 16, fill: 1 }).await.unwrap();
    let mut decode = Vec::new();
    for tp in 0..t.parallel(Side::Decode).tp {
        decode
            .push(Agent::start(config(Side::Decode, tp), KvMemory::Host { pages: 16, fill: SENTINEL }).await.unwrap());
    }
    let deadline = soon();
    for a in std::iter::once(&prefill).chain(&decode) {
        a.wait_connected(deadline).await.unwrap();
    }
    (server, prefill, decode)
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

async fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = soon();
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn all_sentinel(a: &Agent) -> bool {
    a.host_memory().iter().all(|m| {
        let mut v = vec![0u8; m.len() as usize];
        m.read(0, &mut v).unwrap();
        v.iter().all(|b| *b == SENTINEL)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_created_after_the_decode_abort_fails_at_once_and_writes_nothing() {
    let (_server, prefill, decode) = agents(topo(1, 1)).await;
    let room = RequestId(9);
    let rx = decode[0].receiver(room).unwrap();
    rx.send_metadata(&[3, 4, 5], None).unwrap();
    until("the prefill rank to keep the handoff", || prefill.stats().early_handoffs_kept == 1).await;
    rx.abort("preempted before prefill started");
    let s = rx.wait(soon()).await.unwrap();
    assert_eq!((s.phase, s.pages_reusable), (Phase::Failed, true), "fenced by the prefill rank at once: {s:?}");
    rx.release().unwrap();
    // The engine creates the sender only now.
    let tx = prefill.sender(room).unwrap();
    let t0 = Instant::now();
    let st = tx.wait(soon()).await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2), "failed at once, not at the 20 s deadline");
    assert_eq!((st.phase, st.pages_reusable), (Phase::Failed, true), "{st:?}");
    let why = st.reason.unwrap();
    assert!(why.contains("decode rank 0/0 aborted the request") && why.contains("preempted"), "{why}");
    tx.init(3).unwrap();
    assert!(tx.send(&[0, 1, 2]).is_err(), "nothing may be sent for an aborted handoff");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(all_sentinel(&decode[0]), "no byte landed");
    tx.release().unwrap();
    for a in std::iter::once(prefill).chain(decode) {
        a.shutdown(soon()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_decode_rank_is_told_at_once_when_one_aborted_before_the_sender_existed() {
    let (_server, prefill, decode) = agents(topo(1, 2)).await;
    let room = RequestId(4);
    let rx0 = decode[0].receiver(room).unwrap();
    let rx1 = decode[1].receiver(room).unwrap();
    rx0.send_metadata(&[1, 2], None).unwrap();
    rx1.send_metadata(&[7, 8], None).unwrap();
    until("both handoffs to be kept", || prefill.stats().early_handoffs_kept == 2).await;
    rx0.abort("client went away");
    assert_eq!(rx0.wait(soon()).await.unwrap().phase, Phase::Failed);
    let tx = prefill.sender(room).unwrap();
    let t0 = Instant::now();
    let s1 = rx1.wait(soon()).await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2), "told at once, not at the 20 s deadline");
    assert_eq!((s1.phase, s1.pages_reusable), (Phase::Failed, true), "{s1:?}");
    assert!(s1.reason.unwrap().contains("aborted the request"));
    assert_eq!(tx.wait(soon()).await.unwrap().phase, Phase::Failed);
    assert!(decode.iter().all(all_sentinel), "no byte landed");
    for a in std::iter::once(prefill).chain(decode) {
        a.shutdown(soon()).await.unwrap();
    }
}

//! Defect 4 of the engine API issue: `send_chunk` returned plan errors, out-of-range pages and
//! `NotConnected` before telling any receiver (its doc says every receiver is told), and
//! `notify_receivers` stopped at the first failing receiver. Decode then learned of the failure only
//! at its deadline. Now every error path tells every connected receiver first, so the decode side
//! fails at once, naming the sender and the cause.

use std::time::{Duration, Instant};

use kvxfer::engine::identity;
use kvxfer::session::{Chunk, ExpectOptions, KvPool, ReceiverSession, SenderSession};
use kvxfer_core::{
    Attention, BackendConfig, Failure, KvSpec, Layout, Notification, NotifyStyle, Parallel, RankId, RequestId, Side,
    SideSpec, Status, Topology,
};

const PAGES: u32 = 8;

fn topo() -> Topology {
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads: 2, head_dim_k: 4, head_dim_v: 4 },
        layers: 2,
        dtype_bytes: 2,
        page_size: 2,
        layout: Layout::Nhd,
    };
    // One prefill rank feeding two decode ranks.
    Topology::new(&SideSpec { kv, parallel: Parallel::new(1, 1) }, &SideSpec { kv, parallel: Parallel::new(2, 1) })
        .unwrap()
}

struct Rig {
    sender: SenderSession,
    receivers: Vec<ReceiverSession>,
    _memory: Vec<Vec<kvxfer::session::PoolMemory>>,
}

/// A prefill rank connected to the decode ranks in `connect` only.
async fn rig(connect: &[u32]) -> Rig {
    let t = topo();
    let p = RankId::new(0, 0);
    let pb = kvxfer::backends::create("local", &BackendConfig::new(identity(Side::Prefill, p))).unwrap();
    let (ppool, pmem) = KvPool::allocate(&t, Side::Prefill, p, PAGES, &*pb, &|_, _| {}).await.unwrap();
    let sender = SenderSession::new(pb, t, p, ppool, NotifyStyle::Attached).unwrap();
    let mut receivers = Vec::new();
    let mut memory = vec![pmem];
    for tp in 0..2 {
        let d = RankId::new(tp, 0);
        let db = kvxfer::backends::create("local", &BackendConfig::new(identity(Side::Decode, d))).unwrap();
        let (dpool, dmem) = KvPool::allocate(&t, Side::Decode, d, PAGES, &*db, &|_, _| {}).await.unwrap();
        if connect.contains(&tp) {
            sender.connect(d, &db.metadata().unwrap(), dpool.clone()).await.unwrap();
        }
        receivers.push(ReceiverSession::new(db, t, d, dpool).unwrap());
        memory.push(dmem);
    }
    Rig { sender, receivers, _memory: memory }
}

fn expect_all(rig: &Rig, request: RequestId, pages: &[u32]) {
    for r in &rig.receivers {
        r.expect(request, pages, ExpectOptions::default(), Instant::now() + Duration::from_secs(30)).unwrap();
    }
}

/// Pumps a receiver until the request has an outcome, at most 5 s (the request's deadline is 30 s).
async fn outcome(r: &ReceiverSession, request: RequestId) -> Status {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let s = r.status(request).unwrap();
        if s != Status::Pending || Instant::now() >= until {
            return s;
        }
        r.pump(Duration::from_millis(10)).await.unwrap();
    }
}

fn notified(s: &Status, what: &str) {
    match s {
        Status::Failed(Failure::Notified { key, reason }) => {
            assert_eq!(key.to_string(), "tp0.pp0");
            assert!(reason.contains(what), "reason {reason:?} should contain {what:?}");
        }
        other => panic!("expected a failure notification naming {what:?}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_connection_is_told_to_the_connected_receiver_at_once() {
    let rig = rig(&[0]).await;
    let req = RequestId(1);
    expect_all(&rig, req, &[0, 1]);
    let chunk = Chunk { index: 0, last: true, src_pages: vec![2, 3], dst_pages: vec![0, 1] };
    let e = rig.sender.send_chunk(req, &chunk, Instant::now() + Duration::from_secs(30)).await.unwrap_err();
    assert!(e.to_string().contains("not connected to decode rank 1/0"), "{e}");
    notified(&outcome(&rig.receivers[0], req).await, "not connected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_range_page_is_told_to_every_receiver() {
    let rig = rig(&[0, 1]).await;
    let req = RequestId(2);
    expect_all(&rig, req, &[0, 1]);
    let chunk = Chunk { index: 0, last: true, src_pages: vec![2, PAGES], dst_pages: vec![0, 1] };
    let e = rig.sender.send_chunk(req, &chunk, Instant::now() + Duration::from_secs(30)).await.unwrap_err();
    assert!(e.to_string().contains("outside the pool"), "{e}");
    for r in &rig.receivers {
        notified(&outcome(r, req).await, "outside the pool");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_error_is_told_to_every_receiver() {
    let rig = rig(&[0, 1]).await;
    let req = RequestId(3);
    expect_all(&rig, req, &[0, 1]);
    // Two source pages for one destination page: the planner refuses.
    let chunk = Chunk { index: 0, last: true, src_pages: vec![2, 3], dst_pages: vec![0] };
    let e = rig.sender.send_chunk(req, &chunk, Instant::now() + Duration::from_secs(30)).await.unwrap_err();
    assert!(e.to_string().contains("every source page needs one destination page"), "{e}");
    for r in &rig.receivers {
        notified(&outcome(r, req).await, "destination");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_receivers_tries_every_receiver() {
    // Decode rank 0 is not connected: rank 1 still gets the notification, and the error names rank 0.
    let rig = rig(&[1]).await;
    let req = RequestId(4);
    expect_all(&rig, req, &[0]);
    let n = Notification::failure(req, rig.sender.key(), "the engine gave up");
    let e = rig.sender.notify_receivers(&n).await.unwrap_err();
    assert!(e.to_string().contains("decode rank 0/0"), "{e}");
    notified(&outcome(&rig.receivers[1], req).await, "gave up");
}

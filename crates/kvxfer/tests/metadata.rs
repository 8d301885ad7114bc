//! The metadata-store scenarios, run against every store: the in-process store, the embedded
//! bootstrap service over TCP, and (cargo feature `etcd`) a real etcd server that this test starts on
//! a free loopback port with a temporary data directory and stops afterwards. Without the `etcd`
//! binary the etcd cases print why they are skipped.
//!
//! Each scenario is a plain async function over `Arc<dyn MetadataStore>`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::bootstrap::{BootstrapServer, RankRegistration};
use kvxfer::metadata::bootstrap::BootstrapStore;
use kvxfer::metadata::memory::MemShared;
use kvxfer::metadata::{
    wait_value, Created, MemberEvent, MemberWatch, Membership, MetadataError, MetadataStore, StoreError,
};
use kvxfer::session::KvPool;
use kvxfer::{Attention, EndpointMetadata, KvSpec, Layout, Parallel, RankId, Side, SideSpec};
use serde_json::json;

const TTL: Duration = Duration::from_secs(2);

fn spec(tp: u32, page: u32) -> SideSpec {
    SideSpec {
        kv: KvSpec {
            attention: Attention::Gqa { kv_heads: 8, head_dim_k: 128, head_dim_v: 128 },
            layers: 4,
            dtype_bytes: 2,
            page_size: page,
            layout: Layout::Nhd,
        },
        parallel: Parallel::new(tp, 1),
    }
}

fn reg(role: Side, tp: u32, s: SideSpec, label: &str) -> RankRegistration {
    RankRegistration {
        role,
        rank: RankId::new(tp, 0),
        backend: "tcp".into(),
        endpoint: EndpointMetadata { version: 1, backend: "tcp".into(), identity: u64::from(tp), payload: vec![] },
        pool: KvPool { pages: 1, buffers: vec![] },
        spec: s,
        label: label.into(),
        model: None,
        protocol: kvxfer_core::ProtocolRange::THIS_BUILD,
        warmup: None,
    }
}

async fn basics(s: Arc<dyn MetadataStore>, other_prefix: Arc<dyn MetadataStore>) {
    let r1 = s.put("req/1", &json!([3, 1, 2]), None).await.unwrap();
    let (e, rev) = s.get("req/1").await.unwrap();
    let e = e.unwrap();
    assert_eq!((e.key.as_str(), &e.json()), ("req/1", &json!([3, 1, 2])));
    assert!(rev >= r1 && e.mod_revision == r1);
    // Create is exclusive.
    assert!(
        matches!(s.create("req/1", &json!(0), None).await.unwrap(), Created::Exists(x) if x.json() == json!([3, 1, 2]))
    );
    assert!(matches!(s.create("req/2", &json!(7), None).await.unwrap(), Created::Yes { .. }));
    let (l, _) = s.list("req/").await.unwrap();
    assert_eq!(l.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), ["req/1", "req/2"]);
    // Another cluster prefix on the same store sees none of it.
    assert!(other_prefix.list("").await.unwrap().0.is_empty());
    assert!(other_prefix.get("req/1").await.unwrap().0.is_none());
    // A waiting get sees a later put; a key never put ends at the deadline, naming the store.
    let s2 = Arc::clone(&s);
    let waiter = tokio::spawn(async move { wait_value(&*s2, "ready/1", Duration::from_secs(10)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.put("ready/1", &json!(true), None).await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), json!(true));
    let e = wait_value(&*s, "never", Duration::from_millis(200)).await.unwrap_err().to_string();
    assert!(e.contains("never") && e.contains(s.name()), "{e}");
    assert!(s.delete("req/1").await.unwrap());
    assert!(!s.delete("req/1").await.unwrap());
    // Keys under a revoked lease vanish.
    let l = s.grant(TTL).await.unwrap();
    s.put("tmp/x", &json!(1), Some(l)).await.unwrap();
    s.revoke(l).await.unwrap();
    assert!(s.get("tmp/x").await.unwrap().0.is_none());
    assert!(matches!(s.keep_alive(l).await, Err(StoreError::LeaseGone { .. })));
    s.revoke(l).await.unwrap();
}

/// Returns the measured time from a rank's death (keep-alive stopped) to the watcher's report.
async fn membership(s: Arc<dyn MetadataStore>) -> Duration {
    let (mut watch, now) = MemberWatch::start(Arc::clone(&s)).await.unwrap();
    assert!(now.is_empty());
    let d = Membership::join(Arc::clone(&s), reg(Side::Decode, 0, spec(1, 16), "decode-a"), TTL).await.unwrap();
    let p = Membership::join(Arc::clone(&s), reg(Side::Prefill, 0, spec(2, 16), "prefill-a"), TTL).await.unwrap();
    // The same rank again, while alive: refused, naming the rank and the registered one.
    let e = Membership::join(Arc::clone(&s), reg(Side::Prefill, 0, spec(2, 16), "prefill-b"), TTL).await.unwrap_err();
    assert!(matches!(e, MetadataError::Duplicate { .. }), "{e}");
    assert!(e.to_string().contains("prefill-a") && e.to_string().contains(s.name()), "{e}");
    // An incompatible rank: every mismatch listed, before anything is published.
    let mut bad = spec(2, 32);
    bad.kv.dtype_bytes = 1;
    let e = Membership::join(Arc::clone(&s), reg(Side::Prefill, 1, bad, "bad"), TTL).await.unwrap_err().to_string();
    assert!(e.contains("page_size") && e.contains("dtype_bytes"), "{e}");
    // A rank outside its own side's parallel config (TP rank 2 of TP 2), and one whose side spec
    // differs from the registered ranks of its role: refused, naming both values.
    let e = Membership::join(Arc::clone(&s), reg(Side::Prefill, 2, spec(2, 16), "p2"), TTL).await.unwrap_err();
    assert!(
        e.to_string().contains("outside its own parallel config") && e.to_string().contains("TP rank 2 with TP 2"),
        "{e}"
    );
    let e =
        Membership::join(Arc::clone(&s), reg(Side::Prefill, 1, spec(4, 16), "p4"), TTL).await.unwrap_err().to_string();
    assert!(e.contains("different configurations") && e.contains("TP 4") && e.contains("has 2"), "{e}");
    assert!(
        s.get("ranks/prefill/1.0").await.unwrap().0.is_none() && s.get("ranks/prefill/2.0").await.unwrap().0.is_none()
    );
    // Peers and handshake.
    let me = reg(Side::Decode, 0, spec(1, 16), "decode-a");
    let e = kvxfer::metadata::peers(&*s, Side::Prefill, 2, Duration::from_millis(300)).await.unwrap_err().to_string();
    assert!(e.contains("only 1 of 2 prefill ranks"), "{e}");
    let p1 = Membership::join(Arc::clone(&s), reg(Side::Prefill, 1, spec(2, 16), "prefill-1"), TTL).await.unwrap();
    let (peers, topo) = kvxfer::metadata::handshake(&*s, &me, Side::Prefill, 2, Duration::from_secs(5)).await.unwrap();
    assert_eq!(peers.len(), 2);
    assert_eq!(topo.expected_senders(RankId::new(0, 0)).len(), 2);
    // Joins are reported.
    let mut joined = 0;
    let end = Instant::now() + Duration::from_secs(5);
    while joined < 3 && Instant::now() < end {
        joined += watch
            .next(Duration::from_millis(500))
            .await
            .unwrap()
            .iter()
            .filter(|e| matches!(e, MemberEvent::Joined(_)))
            .count();
    }
    assert_eq!(joined, 3);
    // Leases are kept alive past their TTL.
    tokio::time::sleep(TTL + Duration::from_millis(500)).await;
    assert!(s.get("ranks/prefill/0.0").await.unwrap().0.is_some(), "the keep-alive did not keep the lease");
    // A graceful leave is Left, not Lost.
    p1.leave().await.unwrap();
    // Death: prefill 0/0 stops its keep-alive (dropped without leaving).
    let old_epoch = p.epoch();
    let old_lease = p.lease();
    drop(p);
    let died = Instant::now();
    let (mut left, mut lost) = (None, None);
    let end = died + TTL + Duration::from_secs(5);
    while lost.is_none() && Instant::now() < end {
        for e in watch.next(Duration::from_millis(200)).await.unwrap() {
            match e {
                MemberEvent::Left(m) => left = Some(m),
                MemberEvent::Lost(m) => lost = Some((m, died.elapsed())),
                MemberEvent::Joined(m) => panic!("unexpected join {m:?}"),
            }
        }
    }
    let left = left.expect("no Left for a graceful leave");
    assert_eq!(left.registration.label, "prefill-1");
    let (lost, took) = lost.expect("the dead rank was never reported lost");
    assert_eq!(
        (lost.registration.role, lost.registration.rank, lost.epoch),
        (Side::Prefill, RankId::new(0, 0), old_epoch)
    );
    assert!(
        lost.describe().contains("prefill rank 0/0") && lost.describe().contains("prefill-a"),
        "{}",
        lost.describe()
    );
    assert!(took <= TTL + Duration::from_secs(1), "reported after {took:?} (TTL {TTL:?})");
    // It comes back: a new lease and a higher epoch, and watchers see it join.
    let p = Membership::join(Arc::clone(&s), reg(Side::Prefill, 0, spec(2, 16), "prefill-a2"), TTL).await.unwrap();
    assert!(p.epoch() > old_epoch && p.lease() != old_lease);
    let end = Instant::now() + Duration::from_secs(5);
    let mut rejoined = None;
    while rejoined.is_none() && Instant::now() < end {
        for e in watch.next(Duration::from_millis(200)).await.unwrap() {
            if let MemberEvent::Joined(m) = e {
                rejoined = Some(m);
            }
        }
    }
    assert_eq!(rejoined.expect("no join").epoch, p.epoch());
    p.leave().await.unwrap();
    d.leave().await.unwrap();
    assert!(s.list("ranks/").await.unwrap().0.is_empty(), "leave removes the records");
    took
}

fn in_process(prefix: &str, m: &Arc<MemShared>) -> Arc<dyn MetadataStore> {
    Arc::new(BootstrapStore::in_process(Arc::clone(m), prefix))
}

#[tokio::test]
async fn in_process_store() {
    let m = Arc::new(MemShared::new());
    basics(in_process("/a", &m), in_process("/b", &m)).await;
    let took = membership(in_process("/m", &m)).await;
    eprintln!("in-process store: loss reported {took:?} after death (TTL {TTL:?})");
}

/// Issue 30: the model identity in the layout handshake. A rank naming another model than a
/// registered rank is refused naming both (across sides and within one); the same model, or a rank
/// that names none (an engine that gave none, an older kvxfer), joins. Nothing of a refused rank is
/// published.
#[tokio::test]
async fn ranks_of_different_models_never_pair() {
    use kvxfer::bootstrap::ModelIdentity;
    let m = Arc::new(MemShared::new());
    let s = in_process("/models", &m);
    let model = |name: &str, revision: &str, dtype: &str| {
        Some(ModelIdentity { name: name.into(), revision: revision.into(), dtype: dtype.into() })
    };
    let with = |mut r: RankRegistration, m: Option<ModelIdentity>| {
        r.model = m;
        r
    };
    let llama = model("meta-llama/Llama-3.1-8B", "0e9e39f", "bfloat16");
    let _p0 = Membership::join(Arc::clone(&s), with(reg(Side::Prefill, 0, spec(2, 16), "p0"), llama.clone()), TTL)
        .await
        .unwrap();
    for (other, what) in [
        (model("meta-llama/Llama-3.1-8B-Instruct", "0e9e39f", "bfloat16"), "another fine-tune"),
        (model("meta-llama/Llama-3.1-8B", "5206a32", "bfloat16"), "another revision"),
        (model("meta-llama/Llama-3.1-8B", "0e9e39f", "float16"), "another dtype of the same width"),
    ] {
        let d = with(reg(Side::Decode, 0, spec(1, 16), "d0"), other.clone());
        let e = Membership::join(Arc::clone(&s), d, TTL).await.unwrap_err().to_string();
        assert!(
            e.contains("model differs")
                && e.contains("prefill meta-llama/Llama-3.1-8B@0e9e39f (bfloat16)")
                && e.contains(&format!("decode {}", other.unwrap())),
            "{what}: {e}"
        );
        assert!(s.get("ranks/decode/0.0").await.unwrap().0.is_none(), "{what}: nothing published");
    }
    let p1 = with(reg(Side::Prefill, 1, spec(2, 16), "p1"), model("other", "", ""));
    let e = Membership::join(Arc::clone(&s), p1, TTL).await.unwrap_err().to_string();
    assert!(e.contains("two prefill ranks") && e.contains("p0") && e.contains("other"), "{e}");
    // No model named: pairs with anything of the same layout; the same model: pairs.
    let _p1 = Membership::join(Arc::clone(&s), reg(Side::Prefill, 1, spec(2, 16), "p1"), TTL).await.unwrap();
    let _d0 =
        Membership::join(Arc::clone(&s), with(reg(Side::Decode, 0, spec(1, 16), "d0"), llama), TTL).await.unwrap();
}

#[tokio::test]
async fn bootstrap_service_over_tcp() {
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let addr = server.addr().to_string();
    let st = |p: &str| -> Arc<dyn MetadataStore> { Arc::new(BootstrapStore::new(&addr, p)) };
    basics(st("/a"), st("/b")).await;
    let took = membership(st("/m")).await;
    eprintln!("bootstrap: loss reported {took:?} after death (TTL {TTL:?})");
    // The service goes away: calls fail promptly with an error naming it.
    let s = st("/a");
    drop(server);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    let e = s.get("x").await.unwrap_err().to_string();
    assert!(e.contains(&format!("bootstrap at {addr}")), "{e}");
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
}

#[tokio::test]
async fn bootstrap_service_with_a_shared_secret() {
    use kvxfer::bootstrap::{Limits, Secret, ServerConfig};
    let secret = Secret::new(b"a shared secret".to_vec()).unwrap();
    let config = ServerConfig { secret: Some(secret.clone()), limits: Limits::default(), tls: None };
    let server = BootstrapServer::start_with("127.0.0.1:0", config).await.unwrap();
    let addr = server.addr().to_string();
    let st =
        |p: &str| -> Arc<dyn MetadataStore> { Arc::new(BootstrapStore::new(&addr, p).with_secret(secret.clone())) };
    basics(st("/a"), st("/b")).await;
    let took = membership(st("/m")).await;
    eprintln!("bootstrap with a secret: loss reported {took:?} after death (TTL {TTL:?})");
    // Without the secret, or with another: every call is refused, naming the store; nothing is read.
    st("/a").put("k", &json!("v"), None).await.unwrap();
    let none: Arc<dyn MetadataStore> = Arc::new(BootstrapStore::new(&addr, "/a"));
    let e = none.get("k").await.unwrap_err().to_string();
    assert!(e.contains(&format!("bootstrap at {addr}")) && e.contains("authentication required"), "{e}");
    let wrong: Arc<dyn MetadataStore> =
        Arc::new(BootstrapStore::new(&addr, "/a").with_secret(Secret::new(b"guess".to_vec()).unwrap()));
    let e = wrong.put("k", &json!("evil"), None).await.unwrap_err().to_string();
    assert!(e.contains("authentication failed"), "{e}");
    assert_eq!(st("/a").get("k").await.unwrap().0.unwrap().json(), json!("v"));
    assert_eq!(server.stats().auth_failures, 2);
    // The secret never shows in a store's Debug output.
    assert!(!format!("{:?}", st("/a")).contains("shared secret"));
}

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use kvxfer::metadata::testing::EtcdServer;
    use kvxfer::metadata::{connect, MetadataAddr};

    fn server() -> Option<EtcdServer> {
        match EtcdServer::start() {
            Ok(s) => Some(s),
            Err(e) if kvxfer::metadata::testing::etcd_binary().is_none() => {
                eprintln!("SKIPPED etcd scenarios: {e}");
                None
            }
            Err(e) => panic!("etcd did not start: {e}"),
        }
    }

    async fn store(addr: &str) -> Arc<dyn MetadataStore> {
        connect(&MetadataAddr::parse(addr).unwrap(), Duration::from_secs(3)).await.unwrap()
    }

    #[tokio::test]
    async fn etcd_server() {
        let Some(mut etcd) = server() else { return };
        basics(store(&etcd.address("a")).await, store(&etcd.address("b")).await).await;
        let took = membership(store(&etcd.address("m")).await).await;
        eprintln!("etcd: loss reported {took:?} after death (TTL {TTL:?})");
        // etcd stops: calls and watches fail within the call timeout, naming the store; a
        // membership's health says the lease can no longer be kept.
        let s = store(&etcd.address("z")).await;
        let m = Membership::join(Arc::clone(&s), reg(Side::Decode, 0, spec(1, 16), "d"), TTL).await.unwrap();
        let (mut w, _) = MemberWatch::start(Arc::clone(&s)).await.unwrap();
        let mut health = m.health();
        etcd.stop();
        let t = Instant::now();
        let e = s.get("x").await.unwrap_err().to_string();
        assert!(e.contains(&format!("etcd at {}", etcd.endpoint())), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        let e = w.next(Duration::from_secs(5)).await;
        assert!(e.is_err() || e.as_ref().is_ok_and(|v| v.is_empty()), "{e:?}");
        let end = Instant::now() + TTL + Duration::from_secs(5);
        while health.borrow().is_none() && Instant::now() < end {
            let _ = tokio::time::timeout(Duration::from_millis(200), health.changed()).await;
        }
        let h = health.borrow().clone().expect("membership health did not report the lost store");
        assert!(h.contains("etcd at"), "{h}");
        // Leaving with the store gone fails (bounded), naming it.
        let e = tokio::time::timeout(Duration::from_secs(15), m.leave()).await.expect("leave hung").unwrap_err();
        assert!(e.to_string().contains("etcd at"), "{e}");
        // And a store that is not there at all is an error at connect, naming it.
        let e = connect(&MetadataAddr::parse(&etcd.address("q")).unwrap(), Duration::from_secs(2)).await.unwrap_err();
        assert!(e.to_string().contains(&etcd.endpoint()), "{e}");
    }
}

/// A rank restarted right after a crash (its old lease still running) registers once that lease
/// expired, under a higher epoch; a second live process of the rank is still refused, after the wait.
#[tokio::test]
async fn a_restarted_rank_waits_out_its_old_lease() {
    let m = Arc::new(MemShared::new());
    let s = in_process("/rejoin", &m);
    let first = Membership::join(Arc::clone(&s), reg(Side::Prefill, 0, spec(1, 16), "first"), TTL).await.unwrap();
    // Alive: the wait ends in the duplicate error, naming the live one.
    let t0 = Instant::now();
    let wait = Duration::from_millis(600);
    let e = Membership::join_waiting(Arc::clone(&s), reg(Side::Prefill, 0, spec(1, 16), "second"), TTL, wait)
        .await
        .unwrap_err();
    assert!(matches!(e, MetadataError::Duplicate { .. }) && e.to_string().contains("first"), "{e}");
    assert!(t0.elapsed() >= wait, "gave up after {:?}, before its wait of {wait:?}", t0.elapsed());
    // Crashed (keep-alive gone, lease still running): the restart registers once it expired.
    let old = first.epoch();
    drop(first);
    let t0 = Instant::now();
    let again = Membership::join_waiting(
        Arc::clone(&s),
        reg(Side::Prefill, 0, spec(1, 16), "restarted"),
        TTL,
        TTL + Duration::from_secs(1),
    )
    .await
    .unwrap();
    let took = t0.elapsed();
    assert!(again.epoch() > old, "epoch {} after {old}", again.epoch());
    assert!(took <= TTL + Duration::from_secs(1), "registered after {took:?}");
    eprintln!("restart registered {took:?} after the crash (TTL {TTL:?})");
    again.leave().await.unwrap();
}

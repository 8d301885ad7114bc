//! The cluster secret through the engine API: agents with the service's secret register, connect and
//! move a request (over `local` and `tcp`); an agent with another secret, or none, is refused at
//! start with an error that names authentication (not a timeout).

use std::time::{Duration, Instant};

use kvxfer::bootstrap::{BootstrapServer, Limits, ServerConfig};
use kvxfer::engine::{Agent, AgentConfig, KvMemory, Phase};
use kvxfer::metadata::MetadataAddr;
use kvxfer_core::{
    Attention, KvSpec, Layout, NotifyStyle, Parallel, RankId, RequestId, Secret, Side, SideSpec, Topology,
};

fn topo() -> Topology {
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads: 2, head_dim_k: 8, head_dim_v: 8 },
        layers: 2,
        dtype_bytes: 2,
        page_size: 4,
        layout: Layout::Nhd,
    };
    let s = SideSpec { kv, parallel: Parallel::new(1, 1) };
    Topology::new(&s, &s).unwrap()
}

fn config(role: Side, addr: &str, backend: &str, secret: Option<Secret>) -> AgentConfig {
    let mut c = AgentConfig::new(role, RankId::new(0, 0), topo(), MetadataAddr::parse(addr).unwrap());
    c.backend = backend.into();
    if backend == "tcp" {
        c.backend_options.insert("listen".into(), "127.0.0.1:0".into());
    }
    c.notify = NotifyStyle::Attached;
    c.lease_ttl = Duration::from_secs(2);
    c.connect_timeout = Duration::from_secs(20);
    c.request_timeout = Duration::from_secs(20);
    c.secret = secret;
    c
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

async fn server(secret: &Secret) -> BootstrapServer {
    let cfg = ServerConfig { secret: Some(secret.clone()), limits: Limits::default(), tls: None };
    BootstrapServer::start_with("127.0.0.1:0", cfg).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_with_the_cluster_secret_move_a_request() {
    for backend in ["local", "tcp"] {
        let s = Secret::new(b"engine test secret".to_vec()).unwrap();
        let srv = server(&s).await;
        let addr = srv.addr().to_string();
        let p =
            Agent::start(config(Side::Prefill, &addr, backend, Some(s.clone())), KvMemory::Host { pages: 16, fill: 7 })
                .await
                .unwrap();
        let d = Agent::start(config(Side::Decode, &addr, backend, Some(s)), KvMemory::Host { pages: 16, fill: 0 })
            .await
            .unwrap();
        p.wait_connected(soon()).await.unwrap();
        d.wait_connected(soon()).await.unwrap();
        let room = RequestId(3);
        let rx = d.receiver(room).unwrap();
        rx.send_metadata(&[5, 6], None).unwrap();
        let tx = p.sender(room).unwrap();
        tx.init(2).unwrap();
        let until = soon();
        while tx.status().phase != Phase::WaitingForInput {
            assert!(Instant::now() < until, "{backend}: no handoff: {:?}", tx.status());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tx.send(&[1, 2]).unwrap();
        assert_eq!(rx.wait(soon()).await.unwrap().phase, Phase::Success, "{backend}");
        assert_eq!(tx.wait(soon()).await.unwrap().phase, Phase::Success, "{backend}");
        let pb = topo().buffer_bytes(Side::Decode, kvxfer_core::KvKind::K, 1);
        let mut page = vec![0u8; pb as usize];
        d.host_memory()[0].read(5 * pb, &mut page).unwrap();
        assert_eq!(page, vec![7u8; pb as usize], "{backend}: the page landed");
        p.shutdown(soon()).await.unwrap();
        d.shutdown(soon()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_another_secret_or_none_is_refused_naming_authentication() {
    let s = Secret::new(b"engine test secret".to_vec()).unwrap();
    let srv = server(&s).await;
    let addr = srv.addr().to_string();
    for (what, secret) in [("another secret", Some(Secret::new(b"wrong".to_vec()).unwrap())), ("no secret", None)] {
        let started = Instant::now();
        let r = Agent::start(config(Side::Decode, &addr, "local", secret), KvMemory::Host { pages: 4, fill: 0 }).await;
        let e = match r {
            Ok(_) => panic!("{what}: an agent started against a service with a secret"),
            Err(e) => e.to_string(),
        };
        assert!(e.to_lowercase().contains("authenticat"), "{what}: {e}");
        assert!(started.elapsed() < Duration::from_secs(10), "{what}: refused only after {:?}", started.elapsed());
    }
}

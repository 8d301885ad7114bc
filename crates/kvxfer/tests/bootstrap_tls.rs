//! The bootstrap service over TLS (cluster CA, mutual): a client of the cluster with the secret
//! works; a plaintext client, a client of another cluster and a TLS client of a plaintext service are
//! refused with errors, in time, and the service counts the failed handshakes.

use std::time::{Duration, Instant};

use kvxfer::bootstrap::{BootstrapClient, BootstrapServer, Limits, ServerConfig};
use kvxfer::metadata::bootstrap::BootstrapStore;
use kvxfer::metadata::MetadataStore;
use kvxfer_core::Secret;
use kvxfer_tls::Tls;
use serde_json::Value;

async fn tls_server(tls: &Tls, secret: Option<Secret>) -> BootstrapServer {
    let limits = Limits { idle_timeout: Duration::from_secs(2), ..Limits::default() };
    BootstrapServer::start_with("127.0.0.1:0", ServerConfig { secret, limits, tls: Some(tls.clone()) }).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_the_cluster_with_the_secret_is_served_over_tls() {
    let (tls, _) = Tls::generate().unwrap();
    let secret = Secret::new(b"tls test".to_vec()).unwrap();
    let server = tls_server(&tls, Some(secret.clone())).await;
    let addr = server.addr().to_string();
    let store = BootstrapStore::new(&addr, "/tls").with_secret(secret.clone()).with_tls(Some(tls.clone()));
    store.put("k", &Value::from(42), None).await.unwrap();
    assert_eq!(store.get("k").await.unwrap().0.unwrap().json(), Value::from(42));
    let c = BootstrapClient::new(addr).with_secret(secret).with_tls(Some(tls));
    let s = c.stats().await.unwrap();
    assert_eq!((s.tls_failures, s.auth_failures, s.store_keys), (0, 0, 1), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_and_foreign_clients_are_refused_and_counted() {
    let (tls, _) = Tls::generate().unwrap();
    let (foreign, _) = Tls::generate().unwrap();
    let server = tls_server(&tls, None).await;
    let addr = server.addr().to_string();
    let t0 = Instant::now();
    let plain = BootstrapClient::new(addr.clone()).with_timeout(Duration::from_secs(3));
    let e = plain.stats().await.unwrap_err().to_string();
    assert!(t0.elapsed() < Duration::from_secs(6), "plaintext refused only after {:?}", t0.elapsed());
    assert!(e.contains(&addr), "{e}");
    let other = BootstrapClient::new(addr.clone()).with_tls(Some(foreign)).with_timeout(Duration::from_secs(3));
    let e = other.stats().await.unwrap_err().to_string();
    assert!(e.contains("TLS handshake") && e.contains("same cluster CA"), "{e}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.stats().tls_failures < 2 {
        assert!(Instant::now() < deadline, "tls failures not counted: {:?}", server.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.stats().store_keys, 0, "nothing was stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_of_a_plaintext_service_fails_in_time() {
    let (tls, _) = Tls::generate().unwrap();
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let c = BootstrapClient::new(server.addr().to_string()).with_tls(Some(tls)).with_timeout(Duration::from_secs(3));
    let t0 = Instant::now();
    let e = c.stats().await.unwrap_err().to_string();
    assert!(e.contains("TLS handshake"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
}

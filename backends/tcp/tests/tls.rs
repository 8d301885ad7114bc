//! TLS (`tls=on`) over real loopback sockets: bytes move verified with attached and out-of-band
//! notifications; a peer with a certificate of another cluster CA is refused at `connect` on both
//! sides, naming TLS and the certificate; a plaintext endpoint and a TLS endpoint refuse each other
//! at once from the metadata, and within `handshake_timeout_s` when the metadata lies; the cluster
//! secret is still required inside TLS; missing or partial material is refused at create.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendEvent, EndpointMetadata, HostBuffer, KvTransferBackend, MemDesc, Notification, RankId,
    RegionId, RequestId, Secret, SenderKey, WriteOp,
};
use kvxfer_tcp::{TcpBackend, TcpMetadata, TcpOptions};

/// A generated cluster pair written under the temporary directory, one per `name` and process.
fn cluster(name: &str) -> PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    let root = ROOT.get_or_init(|| std::env::temp_dir().join(format!("kvxfer-tcp-tls-{}", std::process::id())));
    let dir = root.join(name);
    if !dir.join("ca.pem").exists() {
        let (_, g) = kvxfer_tls::Tls::generate().expect("generate");
        let tmp = root.join(format!("{name}.tmp{:?}", std::thread::current().id()));
        g.write_to(&tmp).expect("write the pair");
        // Another test may have written the same cluster meanwhile: the first rename wins.
        let _ = std::fs::rename(&tmp, &dir);
        let _ = std::fs::remove_dir_all(&tmp);
    }
    dir
}

fn files(cert_dir: &Path, ca_dir: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("tls", "on".into()),
        ("tls_cert", cert_dir.join("cert.pem").display().to_string()),
        ("tls_key", cert_dir.join("key.pem").display().to_string()),
        ("tls_ca", ca_dir.join("ca.pem").display().to_string()),
    ]
}

fn tls_of(name: &str) -> Vec<(&'static str, String)> {
    let d = cluster(name);
    files(&d, &d)
}

fn ep(identity: u64, secret: Option<Secret>, options: &[(&'static str, String)]) -> Arc<TcpBackend> {
    let mut c = BackendConfig::new(identity).with("connections", "2").with("timeout_s", "10").with_secret(secret);
    for (k, v) in options {
        c = c.with(k, v.clone());
    }
    Arc::new(TcpBackend::new(&c).expect("endpoint"))
}

fn secret(s: &str) -> Secret {
    Secret::new(format!("tls test {s}").into_bytes()).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| ((i as u8).wrapping_mul(31) ^ (i >> 9) as u8).wrapping_add(seed)).collect()
}

fn view(d: &MemDesc) -> Vec<u8> {
    d.read_guard(0, d.len() as u64).expect("no write under way").as_slice().to_vec()
}

async fn next_note(b: &TcpBackend) -> Notification {
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        for e in b.recv(Duration::from_millis(100)).await.unwrap() {
            if let BackendEvent::Notification(n) = e {
                return n;
            }
        }
    }
    panic!("no notification within 10 s");
}

/// The same metadata with its TLS flag flipped (a stale or lying store).
fn with_tls_flag(meta: &EndpointMetadata, tls: bool) -> EndpointMetadata {
    let mut m = TcpMetadata::from_envelope(meta).unwrap();
    m.tls = tls;
    EndpointMetadata::new(kvxfer_tcp::NAME, meta.identity, serde_json::to_vec(&m).unwrap())
}

/// Waits up to 5 s for `b` to have refused a handshake.
async fn refused(b: &TcpBackend) -> u64 {
    let end = Instant::now() + Duration::from_secs(5);
    while b.refused_handshakes() == 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    b.refused_handshakes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_move_verified_over_tls_with_both_notification_styles() {
    let s = secret("shared");
    let key = SenderKey::of(RankId::new(1, 0));
    let (a, b) = (ep(key.to_u64(), Some(s.clone()), &tls_of("one")), ep(2, Some(s), &tls_of("one")));
    assert!(a.encrypts() && b.encrypts() && a.authenticates());
    assert!(TcpMetadata::from_envelope(&b.metadata().unwrap()).unwrap().tls, "the metadata says tls");
    let len = 6 << 20;
    let mut src = HostBuffer::from_slice(&pattern(len, 9));
    let mut dst = HostBuffer::filled(len, 0xEE);
    let d = dst.desc();
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let _rd = b.register(RegionId(1), d.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // Attached: a contiguous op across both streams and a strided one.
    let ops = [
        WriteOp::contiguous(RegionId(0), 0, RegionId(1), 0, 4 << 20),
        WriteOp {
            src: RegionId(0),
            src_offset: 4 << 20,
            dst: RegionId(1),
            dst_offset: 5 << 20,
            len: 1000,
            count: 300,
            src_stride: 3000,
            dst_stride: 2000,
        },
    ];
    let attached = Notification::chunk(RequestId(1), key, 0, true);
    let deadline = Instant::now() + Duration::from_secs(20);
    a.post(peer, &ops, Some(&attached)).unwrap().wait(deadline).await.unwrap();
    assert_eq!(next_note(&b).await, attached);
    let (got, want) = (view(&d), pattern(len, 9));
    assert!(got[..4 << 20] == want[..4 << 20], "contiguous bytes differ");
    for i in 0..300 {
        let (g, w) = ((5 << 20) + i * 2000, (4 << 20) + i * 3000);
        assert_eq!(got[g..g + 1000], want[w..w + 1000], "strided range {i}");
    }
    // Out of band: a write, then a notification on the control stream.
    let op = WriteOp::contiguous(RegionId(0), 1 << 20, RegionId(1), 0, 3 << 20);
    a.post(peer, &[op], None).unwrap().wait(deadline).await.unwrap();
    let oob = Notification::chunk(RequestId(2), key, 1, true);
    a.notify(peer, &oob).await.unwrap();
    assert_eq!(next_note(&b).await, oob);
    assert!(view(&d)[..3 << 20] == want[1 << 20..4 << 20], "bytes of the second write differ");
    a.disconnect(peer).await.unwrap();
    assert_eq!((a.refused_handshakes(), b.refused_handshakes()), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_another_cluster_ca_is_refused_at_connect_on_both_sides() {
    let (a, b) = (ep(1, None, &tls_of("one")), ep(2, None, &tls_of("two")));
    for (client, server) in [(&a, &b), (&b, &a)] {
        let before = server.refused_handshakes();
        let start = Instant::now();
        let e = client.connect(&server.metadata().unwrap()).await.expect_err("another CA was accepted").to_string();
        assert!(e.contains("TLS") && e.contains("certificate"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(3), "took {:?}", start.elapsed());
        let end = Instant::now() + Duration::from_secs(5);
        while server.refused_handshakes() == before && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(server.refused_handshakes() > before, "the server did not count the refused handshake");
    }
    // A client that trusts the server's CA but whose own certificate another CA signed: the server
    // refuses it (TLS 1.3 tells the client only once it reads), still at connect and naming TLS.
    let (one, two) = (cluster("one"), cluster("two"));
    let c = ep(3, None, &files(&two, &one));
    let before = a.refused_handshakes();
    let e = c.connect(&a.metadata().unwrap()).await.expect_err("a foreign client certificate was accepted");
    let e = e.to_string();
    assert!(e.contains("TLS") && e.contains("certificate"), "{e}");
    let end = Instant::now() + Duration::from_secs(5);
    while a.refused_handshakes() == before && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(a.refused_handshakes() > before, "the listener did not count the foreign client certificate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_and_tls_endpoints_refuse_each_other_within_the_bound() {
    let hs = [("handshake_timeout_s", "1".to_owned())];
    let mut t_opts = tls_of("one");
    t_opts.extend(hs.iter().cloned());
    let (p, t) = (ep(1, None, &hs), ep(2, None, &t_opts));
    // Honest metadata: refused before a byte is sent, both ways.
    for (client, server) in [(&p, &t), (&t, &p)] {
        let start = Instant::now();
        let e = client.connect(&server.metadata().unwrap()).await.expect_err("connected across TLS settings");
        let e = e.to_string();
        assert!(e.contains("TLS") && e.contains("tls=on") && e.contains("tls=off"), "{e}");
        assert!(start.elapsed() < Duration::from_millis(500), "took {:?}", start.elapsed());
    }
    // Metadata that lies about TLS: a TLS client meets a plaintext listener (which speaks first).
    let start = Instant::now();
    let e = t.connect(&with_tls_flag(&p.metadata().unwrap(), true)).await.expect_err("TLS to plaintext");
    let e = e.to_string();
    assert!(e.contains("TLS handshake"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3), "took {:?}", start.elapsed());
    assert!(refused(&p).await > 0, "the plaintext listener did not refuse the ClientHello");
    // A plaintext client meets a TLS listener: both wait for the other, the listener closes the
    // stream at its handshake deadline, the client names TLS.
    let start = Instant::now();
    let e = p.connect(&with_tls_flag(&t.metadata().unwrap(), false)).await.expect_err("plaintext to TLS");
    let e = e.to_string();
    assert!(e.contains("tls=on"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3), "took {:?}", start.elapsed());
    assert!(refused(&t).await > 0, "the TLS listener did not refuse the plaintext client");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_secret_is_still_required_inside_tls() {
    let tls = tls_of("one");
    let key = SenderKey::of(RankId::new(1, 0)).to_u64();
    let with = ep(2, Some(secret("right")), &tls);
    for (client, want) in [
        (ep(key, Some(secret("wrong")), &tls), "authentication failed"),
        (ep(key, None, &tls), "authentication required"),
    ] {
        let e = client.connect(&with.metadata().unwrap()).await.expect_err("no or another secret was accepted");
        let e = e.to_string();
        assert!(e.contains(want), "{e}");
    }
    assert!(refused(&with).await >= 2);
    // A TLS endpoint with the secret does not trust a TLS peer without one either.
    let e = ep(key, Some(secret("right")), &tls).connect(&ep(3, None, &tls).metadata().unwrap()).await;
    assert!(e.expect_err("a peer without the secret").to_string().contains("no cluster secret"));
    // The same secret: connected, and a notification keyed with the proved identity arrives.
    let good = ep(key, Some(secret("right")), &tls);
    let peer = good.connect(&with.metadata().unwrap()).await.unwrap();
    let n = Notification::chunk(RequestId(5), SenderKey::from_u64(key), 0, true);
    good.notify(peer, &n).await.unwrap();
    assert_eq!(next_note(&with).await, n);
}

#[test]
fn missing_or_partial_material_is_refused_at_create_saying_what_to_do() {
    let cfg = |opts: &[(&str, &str)]| {
        let mut c = BackendConfig::new(1);
        for (k, v) in opts {
            c = c.with(k, *v);
        }
        c
    };
    let env_set =
        [kvxfer_tls::CERT_ENV, kvxfer_tls::KEY_ENV, kvxfer_tls::CA_ENV].iter().any(|v| std::env::var_os(v).is_some());
    if !env_set && std::env::var_os("KVXFER_TCP_TLS_CERT").is_none() {
        let e = TcpBackend::new(&cfg(&[("tls", "on")])).expect_err("tls=on without material").to_string();
        for want in ["tls_cert", "tls_key", "tls_ca", kvxfer_tls::CERT_ENV, "--example generate"] {
            assert!(e.contains(want), "{want} missing from: {e}");
        }
    }
    let e = TcpOptions::from_config(&cfg(&[("tls", "on"), ("tls_cert", "/x/cert.pem")])).unwrap_err().to_string();
    assert!(e.contains("tls_key, tls_ca") && e.contains("tls_cert"), "{e}");
    let e = TcpOptions::from_config(&cfg(&[("tls", "off"), ("tls_ca", "/x/ca.pem")])).unwrap_err().to_string();
    assert!(e.contains("tls=on"), "{e}");
    let e = TcpOptions::from_config(&cfg(&[("tls", "tcp")])).unwrap_err().to_string();
    assert!(e.contains("tls=tcp"), "{e}");
    let dir = cluster("one");
    let bad = [
        ("tls", "on"),
        ("tls_cert", "/nonexistent/cert.pem"),
        ("tls_key", &*dir.join("key.pem").display().to_string()),
        ("tls_ca", &*dir.join("ca.pem").display().to_string()),
    ]
    .map(|(k, v)| (k, v.to_owned()));
    let c = bad.iter().fold(BackendConfig::new(1), |c, (k, v)| c.with(k, v.clone()));
    let e = TcpBackend::new(&c).expect_err("a missing certificate file").to_string();
    assert!(e.contains("/nonexistent/cert.pem") && e.contains("TLS"), "{e}");
}

/// With TLS a connection beyond `max_handshakes` is closed at once, before any TLS: the
/// connecting endpoint's `connect` fails at once, its error saying a limit may be the cause, and
/// the listener counts the refusal by its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_handshakes_a_tls_listener_closes_at_once() {
    let mut opts = tls_of("limits");
    opts.extend([("max_handshakes", "2".into()), ("handshake_timeout_s", "3".into())]);
    let b = ep(2, None, &opts);
    let addr = TcpMetadata::from_envelope(&b.metadata().unwrap()).unwrap().addr;
    // Two connections that never start TLS hold both slots.
    let _held =
        [tokio::net::TcpStream::connect(&addr).await.unwrap(), tokio::net::TcpStream::connect(&addr).await.unwrap()];
    tokio::time::sleep(Duration::from_millis(200)).await;
    let a = ep(1, None, &tls_of("limits"));
    let t0 = Instant::now();
    let e = a.connect(&b.metadata().unwrap()).await.unwrap_err().to_string();
    let t = t0.elapsed();
    eprintln!("tls, max_handshakes=2: connect refused after {t:?}: {e}");
    assert!(t < Duration::from_secs(1), "refused after {t:?}");
    assert!(e.contains("max_handshakes"), "{e}");
    assert_eq!(b.handshake_refusals().max_handshakes, 1);
}

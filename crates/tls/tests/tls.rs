//! TLS between two ends of this process over loopback: a generated cluster pair moves bytes both
//! ways; a peer of another cluster, a plaintext client and a silent client are refused within the
//! handshake timeout; PEM files round-trip (the key written 0600) and unusable ones are named.

use std::time::{Duration, Instant};

use kvxfer_tls::{Tls, TlsError, TlsFiles};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const T: Duration = Duration::from_secs(5);

async fn pair() -> (TcpListener, std::net::SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_cluster_pair_moves_bytes_both_ways() {
    let (tls, _) = Tls::generate().unwrap();
    let (l, addr) = pair().await;
    let server_tls = tls.clone();
    let server = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let mut s = server_tls.accept(tcp, T).await.unwrap();
        let mut buf = vec![0u8; 1 << 20];
        s.read_exact(&mut buf).await.unwrap();
        for b in &mut buf {
            *b = b.wrapping_add(1);
        }
        s.write_all(&buf).await.unwrap();
        s.flush().await.unwrap();
        s.shutdown().await.unwrap();
    });
    let mut c = tls.connect(TcpStream::connect(addr).await.unwrap(), T).await.unwrap();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 13) as u8).collect();
    c.write_all(&data).await.unwrap();
    let mut back = vec![0u8; data.len()];
    c.read_exact(&mut back).await.unwrap();
    assert!(back.iter().zip(&data).all(|(b, d)| *b == d.wrapping_add(1)));
    server.await.unwrap();
    assert_eq!(tls.server_name(), "kvxfer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_of_another_cluster_is_refused_on_both_sides() {
    let (ours, _) = Tls::generate().unwrap();
    let (theirs, _) = Tls::generate().unwrap();
    let (l, addr) = pair().await;
    let server = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        ours.accept(tcp, T).await.map(|_| ())
    });
    let c = theirs.connect(TcpStream::connect(addr).await.unwrap(), T).await;
    let Err(e) = c else { panic!("a client of another CA must not connect") };
    assert!(matches!(e, TlsError::Handshake { .. }), "{e}");
    assert!(e.to_string().contains("same cluster CA"), "{e}");
    // The server refused the client's certificate too (or saw the client abort).
    let s = server.await.unwrap();
    assert!(matches!(s, Err(TlsError::Handshake { .. })), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_and_silent_clients_are_dropped_within_the_handshake_timeout() {
    let (tls, _) = Tls::generate().unwrap();
    let (l, addr) = pair().await;
    let short = Duration::from_millis(500);
    let server = tokio::spawn(async move {
        let mut out = Vec::new();
        for _ in 0..2 {
            let (tcp, _) = l.accept().await.unwrap();
            let t0 = Instant::now();
            out.push((tls.accept(tcp, short).await.map(|_| ()), t0.elapsed()));
        }
        out
    });
    // A plaintext client: a bootstrap request line where a ClientHello is expected.
    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain.write_all(b"{\"op\":\"stats\"}\n").await.unwrap();
    // A silent client (slowloris): connects and sends nothing.
    let _silent = TcpStream::connect(addr).await.unwrap();
    let out = server.await.unwrap();
    let (r, took) = &out[0];
    assert!(matches!(r, Err(TlsError::Handshake { .. })), "plaintext: {r:?}");
    assert!(*took < short + Duration::from_millis(500), "plaintext refused after {took:?}");
    let (r, took) = &out[1];
    assert!(r.as_ref().err().is_some_and(|e| e.to_string().contains("not finished within")), "silent: {r:?}");
    assert!(*took >= short && *took < short * 3, "silent dropped after {took:?}");
}

#[test]
fn pem_files_round_trip_and_bad_ones_are_named() {
    let dir = std::env::temp_dir().join(format!("kvxfer-tls-test-{}", std::process::id()));
    let (_, g) = Tls::generate().unwrap();
    let files = g.write_to(&dir).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&files.key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the key file is private");
    }
    let t = Tls::from_files(&files, Some("kvxfer")).unwrap();
    assert_eq!(t.server_name(), "kvxfer");
    assert_eq!(format!("{g:?}"), "Generated(..)", "no key material in Debug");
    // A key that is not PEM, a missing CA, a certificate file with no certificate.
    std::fs::write(dir.join("bad.pem"), "not pem").unwrap();
    let bad = TlsFiles { key: dir.join("bad.pem"), ..files.clone() };
    let e = Tls::from_files(&bad, None).unwrap_err().to_string();
    assert!(e.contains("private key") && e.contains("bad.pem"), "{e}");
    let missing = TlsFiles { ca: dir.join("missing.pem"), ..files.clone() };
    let e = Tls::from_files(&missing, None).unwrap_err().to_string();
    assert!(e.contains("cannot read the CA file") && e.contains("missing.pem"), "{e}");
    let nocert = TlsFiles { cert: dir.join("bad.pem"), ..files.clone() };
    let e = Tls::from_files(&nocert, None).unwrap_err().to_string();
    assert!(e.contains("no certificate") && e.contains("bad.pem"), "{e}");
    // A key of another pair: rustls refuses the configuration.
    let (_, other) = Tls::generate().unwrap();
    let e = Tls::from_pem(g.cert_pem.as_bytes(), other.key_pem.as_bytes(), g.ca_pem.as_bytes(), None);
    assert!(matches!(e, Err(TlsError::Config { .. })), "{e:?}");
    let e = Tls::from_pem(g.cert_pem.as_bytes(), g.key_pem.as_bytes(), g.ca_pem.as_bytes(), Some("not a name!"));
    assert!(matches!(e, Err(TlsError::Config { .. })), "{e:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

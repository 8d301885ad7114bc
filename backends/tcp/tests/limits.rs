//! Limits on connections in their handshake, over real loopback sockets: beyond `max_handshakes`
//! (in total) or `max_handshakes_per_source` (per source IP address) a connection is answered at
//! once with a refusal naming the limit, while those within it are dropped at the handshake
//! deadline; accepted links do not count, and a real endpoint from another source still connects
//! and moves verified bytes. Loopback only: the "other source" is 127.0.0.2.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{BackendConfig, BackendError, HostBuffer, KvTransferBackend, RegionId, WriteOp};
use kvxfer_tcp::wire;
use kvxfer_tcp::{HandshakeRefusals, TcpBackend, TcpMetadata};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};

fn ep(identity: u64, options: &[(&str, &str)]) -> Arc<TcpBackend> {
    let mut c = BackendConfig::new(identity).with("connections", "2").with("timeout_s", "10");
    for (k, v) in options {
        c = c.with(k, *v);
    }
    Arc::new(TcpBackend::new(&c).expect("endpoint"))
}

fn addr_of(b: &TcpBackend) -> SocketAddr {
    TcpMetadata::from_envelope(&b.metadata().unwrap()).unwrap().addr.parse().unwrap()
}

/// A connection from `source` (a loopback address) to `addr`.
async fn connect_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::from((source, 0))).unwrap();
    tokio::time::timeout(Duration::from_secs(5), s.connect(addr)).await.expect("connect within 5 s").unwrap()
}

/// A connection in its handshake that stays silent: it reads the challenge (so the listener has
/// accepted it and counts it), then sends nothing.
async fn silent_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let mut s = connect_from(source, addr).await;
    let mut cb = [0u8; wire::CHALLENGE_LEN];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut cb)).await.expect("a challenge within 5 s").unwrap();
    s
}

/// What the listener answers a connection beyond a limit, without sending a HELLO: a challenge,
/// then a rejected reply; returns the reason and how long it took.
async fn refusal_from(source: [u8; 4], addr: SocketAddr) -> (String, Duration) {
    let start = Instant::now();
    let mut s = connect_from(source, addr).await;
    let read = async {
        let mut cb = [0u8; wire::CHALLENGE_LEN];
        s.read_exact(&mut cb).await?;
        wire::Challenge::decode(&cb).expect("a challenge");
        let mut rep = [0u8; wire::HELLO_REPLY_LEN];
        s.read_exact(&mut rep).await?;
        let head = wire::decode_hello_reply(&rep).expect("a reply");
        assert!(head.rejected, "the reply accepts");
        let mut reason = vec![0u8; head.reason_len as usize];
        s.read_exact(&mut reason).await?;
        // Then the listener closes.
        let n = s.read(&mut [0u8; 16]).await?;
        assert_eq!(n, 0, "more bytes after the refusal");
        Ok::<_, std::io::Error>(String::from_utf8(reason).unwrap())
    };
    let reason = tokio::time::timeout(Duration::from_secs(5), read).await.expect("a refusal within 5 s").unwrap();
    (reason, start.elapsed())
}

/// How long until the listener closes `s`, at most `max`.
async fn closed_after(s: &mut TcpStream, start: Instant, max: Duration) -> Duration {
    let mut buf = [0u8; 64];
    loop {
        match tokio::time::timeout(max.saturating_sub(start.elapsed()), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return start.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("the listener kept the stream open for {max:?}"),
        }
    }
}

async fn refusals_until(b: &TcpBackend, want: impl Fn(&HandshakeRefusals) -> bool) -> HandshakeRefusals {
    let end = Instant::now() + Duration::from_secs(5);
    while !want(&b.handshake_refusals()) && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    b.handshake_refusals()
}

/// Writes a pattern from `a` into `b` over `peer` and checks every byte landed.
async fn moves_verified_bytes(a: &TcpBackend, b: &TcpBackend, seed: u8) {
    let len = 256 << 10;
    let bytes: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    let mut src = HostBuffer::from_slice(&bytes);
    let mut dst = HostBuffer::filled(len, 0xEE);
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let d = dst.desc();
    // A region id of its own per call: a dropped registration may still be closing.
    let dst_region = RegionId(100 + u32::from(seed));
    let _rd = b.register(dst_region, d.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.expect("connect");
    let ops = [WriteOp::contiguous(RegionId(0), 0, dst_region, 0, len as u64)];
    a.post(peer, &ops, None).unwrap().wait(Instant::now() + Duration::from_secs(10)).await.unwrap();
    let got = d.read_guard(0, len as u64).unwrap().as_slice().to_vec();
    assert!(got == bytes, "destination differs from the source");
    a.disconnect(peer).await.unwrap();
}

/// N silent connections with `max_handshakes=N`: the (N+1)th is refused at once naming the limit
/// (a raw client reads the refusal, a kvxfer endpoint's `connect` fails with it), the first N are
/// dropped at the handshake deadline, and then the listener takes connections again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_handshakes_a_connection_is_refused_at_once() {
    const N: usize = 8;
    let b = ep(2, &[("max_handshakes", "8"), ("max_handshakes_per_source", "64"), ("handshake_timeout_s", "1")]);
    let addr = addr_of(&b);
    let start = Instant::now();
    let mut held = Vec::new();
    for _ in 0..N {
        held.push(silent_from([127, 0, 0, 1], addr).await);
    }
    let (reason, t) = refusal_from([127, 0, 0, 1], addr).await;
    eprintln!("max_handshakes=8: the 9th connection was refused after {t:?}: {reason}");
    assert!(t < Duration::from_secs(1), "refused after {t:?}");
    assert!(reason.contains("max_handshakes=8") && reason.contains("option"), "{reason}");
    // A kvxfer endpoint's connect fails naming the limit, its value and the option.
    let a = ep(1, &[]);
    let t0 = Instant::now();
    let e = a.connect(&b.metadata().unwrap()).await.unwrap_err();
    let t_connect = t0.elapsed();
    eprintln!("max_handshakes=8: a kvxfer connect was refused after {t_connect:?}: {e}");
    assert!(matches!(e, BackendError::Connect { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("max_handshakes=8") && msg.contains("raise the listener's max_handshakes option"), "{msg}");
    assert!(t_connect < Duration::from_secs(1), "connect refused after {t_connect:?}");
    // The first N are dropped at the handshake deadline (1 s), not refused at once.
    let mut times = Vec::new();
    for s in &mut held {
        times.push(closed_after(s, start, Duration::from_secs(4)).await);
    }
    let (first, last) = (times.iter().min().unwrap(), times.iter().max().unwrap());
    eprintln!("max_handshakes=8: the 8 silent connections were dropped after {first:?} to {last:?}");
    assert!(*first >= Duration::from_millis(900) && *last < Duration::from_secs(3), "{times:?}");
    let r = refusals_until(&b, |r| r.timed_out == N as u64).await;
    assert_eq!(
        r,
        HandshakeRefusals { rejected: 0, timed_out: N as u64, max_handshakes: 2, max_handshakes_per_source: 0 }
    );
    assert_eq!(b.refused_handshakes(), N as u64 + 2);
    // The slots were given back: a real endpoint connects and moves bytes.
    moves_verified_bytes(&a, &b, 3).await;
}

/// Connections from 127.0.0.2 beyond `max_handshakes_per_source` are refused naming the limit and
/// the source, while a real endpoint connecting from 127.0.0.1 still connects and moves verified
/// bytes; accepted links do not count against either limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_handshakes_per_source_only_that_source_is_refused() {
    let b = ep(2, &[("max_handshakes", "6"), ("max_handshakes_per_source", "3"), ("handshake_timeout_s", "5")]);
    let addr = addr_of(&b);
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(silent_from([127, 0, 0, 2], addr).await);
    }
    let mut times = Vec::new();
    for _ in 0..3 {
        let (reason, t) = refusal_from([127, 0, 0, 2], addr).await;
        assert!(reason.contains("max_handshakes_per_source=3") && reason.contains("127.0.0.2"), "{reason}");
        assert!(reason.contains("option"), "{reason}");
        times.push(t);
    }
    eprintln!("max_handshakes_per_source=3: connections 4-6 from 127.0.0.2 refused after {times:?}");
    assert!(times.iter().all(|t| *t < Duration::from_secs(1)), "{times:?}");
    // Three real endpoints from 127.0.0.1, each with 3 streams (2 data, 1 control): 9 accepted
    // streams, more than max_handshakes=6, while the 3 silent ones still hold their slots.
    let senders: Vec<_> = (0..3).map(|i| ep(10 + i, &[])).collect();
    for (i, a) in senders.iter().enumerate() {
        moves_verified_bytes(a, &b, i as u8).await;
    }
    let mut peers = Vec::new();
    for a in &senders {
        peers.push(a.connect(&b.metadata().unwrap()).await.expect("an accepted link does not count"));
    }
    // Still held: the silent ones are dropped only at their deadline.
    for s in &mut held {
        let mut one = [0u8; 1];
        assert!(tokio::time::timeout(Duration::from_millis(10), s.read(&mut one)).await.is_err(), "dropped early");
    }
    let r = b.handshake_refusals();
    assert_eq!((r.max_handshakes_per_source, r.max_handshakes, r.rejected), (3, 0, 0), "{r:?}");
    for (a, p) in senders.iter().zip(peers) {
        a.disconnect(p).await.unwrap();
    }
}

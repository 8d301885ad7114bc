//! Limits on the handshake listener over the in-process verbs model (`--features emulator`; the
//! handshake is real loopback TCP): beyond `max_handshakes` (in total) or
//! `max_handshakes_per_source` (per source IP address) a connection is answered at once with a
//! `Frame::Reject` naming the limit; connections that do not authenticate are closed at
//! `handshake_timeout_ms` however they trickle; established peers do not count, and a real endpoint
//! from another source still connects and moves verified bytes. Loopback only: the "other source"
//! is 127.0.0.2.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::secret::NONCE_BYTES;
use kvxfer_core::{BackendConfig, BackendError, HostBuffer, KvTransferBackend, RegionId, WriteOp};
use kvxfer_verbs::wire::{Address, Frame, Open, PROTO_VERSION};
use kvxfer_verbs::{HandshakeRefusals, VerbsBackend};

fn endpoint(identity: u64, opts: &[(&str, &str)]) -> Arc<VerbsBackend> {
    let mut c = BackendConfig::new(identity).with("device", kvxfer_verbs::EMULATED_DEVICE).with("timeout_ms", "10000");
    for (k, v) in opts {
        c = c.with(k, *v);
    }
    Arc::new(VerbsBackend::new(&c).expect("creating a model endpoint"))
}

fn addr_of(b: &VerbsBackend) -> SocketAddr {
    Address::from_payload(&b.metadata().unwrap().payload).unwrap().handshake.parse().unwrap()
}

/// A blocking connection from `source` (a loopback address) to `addr`, reads bounded by 5 s.
async fn connect_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::from((source, 0))).unwrap();
    let s = tokio::time::timeout(Duration::from_secs(5), s.connect(addr)).await.expect("connect within 5 s").unwrap();
    let s = s.into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn open(identity: u64) -> Frame {
    Frame::Open(Open { version: PROTO_VERSION, identity, instance: 1, nonce: [7; NONCE_BYTES] })
}

/// A connection that opens, reads the challenge (so the listener counts it), then stalls before
/// its auth.
async fn stalled_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let mut s = connect_from(source, addr).await;
    tokio::task::spawn_blocking(move || {
        open(5).write_to(&mut s).unwrap();
        match Frame::read_from(&mut s).unwrap() {
            Frame::Challenge(_) => s,
            f => panic!("expected a challenge, got {f:?}"),
        }
    })
    .await
    .unwrap()
}

/// What the listener answers a connection beyond a limit (it sends its open, then reads), and how
/// long it took from the connect.
async fn refusal_from(source: [u8; 4], addr: SocketAddr) -> (String, Duration) {
    let start = Instant::now();
    let mut s = connect_from(source, addr).await;
    tokio::task::spawn_blocking(move || {
        open(6).write_to(&mut s).unwrap();
        let reason = match Frame::read_from(&mut s).unwrap() {
            Frame::Reject(r) => r,
            f => panic!("expected a refusal, got {f:?}"),
        };
        assert_eq!(s.read(&mut [0u8; 16]).unwrap(), 0, "more bytes after the refusal");
        (reason, start.elapsed())
    })
    .await
    .unwrap()
}

/// How long after `start` the listener closes `s` (a read ends or fails), at most `max`.
async fn closed_after(mut s: TcpStream, start: Instant, max: Duration) -> Duration {
    tokio::task::spawn_blocking(move || {
        s.set_read_timeout(Some(max.saturating_sub(start.elapsed()).max(Duration::from_millis(1)))).unwrap();
        let mut buf = [0u8; 64];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return start.elapsed(),
                Ok(_) => {}
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    panic!("the listener kept the connection open for {max:?}")
                }
                Err(_) => return start.elapsed(),
            }
        }
    })
    .await
    .unwrap()
}

/// Writes a pattern from `a` into `b` and checks every byte landed.
async fn moves_verified_bytes(a: &VerbsBackend, b: &VerbsBackend, seed: u8) {
    let len = 64 << 10;
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    let mut src = HostBuffer::from_slice(&data);
    let mut dst = HostBuffer::filled(len, 0xee);
    let _s = a.register(RegionId(1), src.desc()).await.unwrap();
    let view = dst.desc();
    // A region id of its own per call: a dropped registration closes in the background.
    let dst_region = RegionId(100 + u32::from(seed));
    let _d = b.register(dst_region, view.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.expect("connect");
    let op = WriteOp::contiguous(RegionId(1), 0, dst_region, 0, len as u64);
    a.post(peer, &[op], None).unwrap().wait(Instant::now() + Duration::from_secs(10)).await.unwrap();
    let got = view.read_guard(0, len as u64).expect("readable").as_slice().to_vec();
    assert!(got == data, "destination differs from the source");
    a.disconnect(peer).await.unwrap();
}

/// Four connections that do not authenticate (two stalled after the challenge, one mute, one
/// dripping its open a byte at a time) with `max_handshakes=4`: a fifth is refused at once naming
/// the limit (a raw client reads the `Reject`, a kvxfer endpoint's `connect` fails with it), the
/// four are closed at `handshake_timeout_ms=1000` (the dripping one too: the deadline is for the
/// whole exchange, not each read), and then the listener takes connections again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_handshakes_a_connection_is_refused_at_once() {
    let b =
        endpoint(2, &[("max_handshakes", "4"), ("max_handshakes_per_source", "64"), ("handshake_timeout_ms", "1000")]);
    let addr = addr_of(&b);
    let start = Instant::now();
    let mut held = vec![stalled_from([127, 0, 0, 1], addr).await, stalled_from([127, 0, 0, 1], addr).await];
    held.push(connect_from([127, 0, 0, 1], addr).await);
    let drip = connect_from([127, 0, 0, 1], addr).await;
    let stop = Arc::new(AtomicBool::new(false));
    let dripper = {
        let (mut w, stop) = (drip.try_clone().unwrap(), Arc::clone(&stop));
        std::thread::spawn(move || {
            for byte in open(7).encode() {
                if stop.load(Ordering::SeqCst) || w.write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    drip.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    held.push(drip);
    // The listener accepts every 50 ms at most: give it time to take the mute and dripping ones.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let (reason, t) = refusal_from([127, 0, 0, 1], addr).await;
    eprintln!("verbs max_handshakes=4: the 5th connection was refused after {t:?}: {reason}");
    assert!(t < Duration::from_secs(1), "refused after {t:?}");
    assert!(reason.contains("max_handshakes=4") && reason.contains("option"), "{reason}");
    let a = endpoint(1, &[]);
    let t0 = Instant::now();
    let e = a.connect(&b.metadata().unwrap()).await.unwrap_err();
    let t_connect = t0.elapsed();
    eprintln!("verbs max_handshakes=4: a kvxfer connect was refused after {t_connect:?}: {e}");
    assert!(matches!(e, BackendError::Connect { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("max_handshakes=4") && msg.contains("raise the listener's max_handshakes option"), "{msg}");
    assert!(t_connect < Duration::from_secs(1), "connect refused after {t_connect:?}");
    let mut times = Vec::new();
    for s in held {
        times.push(closed_after(s, start, Duration::from_secs(4)).await);
    }
    stop.store(true, Ordering::SeqCst);
    dripper.join().unwrap();
    eprintln!("verbs handshake_timeout_ms=1000: stalled, stalled, mute, dripping closed after {times:?}");
    assert!(times.iter().all(|t| *t >= Duration::from_millis(900) && *t < Duration::from_secs(3)), "{times:?}");
    let r = b.handshake_refusals();
    assert_eq!(r, HandshakeRefusals { rejected: 0, timed_out: 4, max_handshakes: 2, max_handshakes_per_source: 0 });
    moves_verified_bytes(&a, &b, 3).await;
}

/// Connections from 127.0.0.2 beyond `max_handshakes_per_source` are refused naming the limit and
/// the source, while real endpoints from 127.0.0.1 connect and move verified bytes (established
/// peers do not count); with the default `handshake_timeout_ms` the stalled ones go after 5 s
/// (before, an unauthenticated connection held its thread for `timeout_ms`, 30 s by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_handshakes_per_source_only_that_source_is_refused() {
    let b = endpoint(2, &[("max_handshakes", "5"), ("max_handshakes_per_source", "3"), ("timeout_ms", "30000")]);
    let addr = addr_of(&b);
    let start = Instant::now();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(stalled_from([127, 0, 0, 2], addr).await);
    }
    let mut times = Vec::new();
    for _ in 0..3 {
        let (reason, t) = refusal_from([127, 0, 0, 2], addr).await;
        assert!(reason.contains("max_handshakes_per_source=3") && reason.contains("127.0.0.2"), "{reason}");
        assert!(reason.contains("option"), "{reason}");
        times.push(t);
    }
    eprintln!("verbs max_handshakes_per_source=3: connections 4-6 from 127.0.0.2 refused after {times:?}");
    assert!(times.iter().all(|t| *t < Duration::from_secs(1)), "{times:?}");
    // Three peers from 127.0.0.1, all established at once: more than the 2 slots left.
    let senders: Vec<_> = (0..3).map(|i| endpoint(10 + i, &[])).collect();
    for (i, a) in senders.iter().enumerate() {
        moves_verified_bytes(a, &b, i as u8).await;
    }
    let mut peers = Vec::new();
    for a in &senders {
        peers.push(a.connect(&b.metadata().unwrap()).await.expect("an established peer does not count"));
    }
    let r = b.handshake_refusals();
    assert_eq!((r.max_handshakes_per_source, r.max_handshakes, r.rejected), (3, 0, 0), "{r:?}");
    let mut dropped = Vec::new();
    for s in held {
        dropped.push(closed_after(s, start, Duration::from_secs(9)).await);
    }
    eprintln!("verbs default handshake_timeout_ms: the 3 stalled connections closed after {dropped:?}");
    assert!(dropped.iter().all(|t| *t >= Duration::from_millis(4500) && *t < Duration::from_secs(8)), "{dropped:?}");
    for (a, p) in senders.iter().zip(peers) {
        a.disconnect(p).await.unwrap();
    }
}

//! Peers in other processes, killed mid-transfer: the survivor gets an error or a PeerLost event
//! with a reason, promptly, and never hangs. Run over tcp and over shared memory.
//!
//! The peer process is this test binary re-executed with `--ignored --exact peer_process`, which
//! runs the `peer_process` helper below (ignored in normal runs; it does nothing without its
//! environment variables).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, EndpointMetadata, HostBuffer, KvTransferBackend, Notification, PeerId,
    RegionId, RequestId, SenderKey, WriteOp,
};

const TRANSPORTS: [(&str, &str); 2] = [("tcp", "tcp"), ("shm", "posix,sysv,cma,self")];
const LEN: usize = 8 << 20;

fn endpoint(tls: &str, identity: u64) -> Arc<dyn KvTransferBackend> {
    let mut c = BackendConfig::new(identity).with("tls", tls).with("timeout_ms", "10000").with("keepalive_ms", "200");
    if tls.contains("tcp") {
        c = c.with("net_devices", "lo");
    }
    kvxfer_ucx::create(&c).expect("creating a UCX endpoint")
}

/// Posts one op and waits for it (bounded).
async fn write(
    tx: &dyn KvTransferBackend,
    peer: PeerId,
    op: WriteOp,
    n: Option<&Notification>,
) -> Result<(), BackendError> {
    tx.post(peer, &[op], n)?.wait(Instant::now() + Duration::from_secs(10)).await
}

/// Kills and reaps the peer when dropped (also on a failed assertion).
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_peer(role: &str, tls: &str) -> (Peer, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "peer_process", "--nocapture", "--test-threads", "1"])
        .env("KVXFER_UCX_TEST_ROLE", role)
        .env("KVXFER_UCX_TEST_TLS", tls)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawning the peer process");
    let out = BufReader::new(child.stdout.take().unwrap());
    (Peer(child), out)
}

/// Reads lines until one contains `META ` (the test harness prints its own lines too).
fn read_meta(out: &mut BufReader<std::process::ChildStdout>) -> EndpointMetadata {
    let mut line = String::new();
    for _ in 0..100 {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the peer process exited before publishing its metadata");
        // libtest may print "test peer_process ... " on the same line first.
        if let Some(at) = line.find("META ") {
            return serde_json::from_str(&line[at + 5..]).unwrap();
        }
    }
    panic!("no metadata from the peer process");
}

/// The peer side. As "receiver": registers LEN bytes, publishes its metadata, serves until killed.
/// As "sender": reads the receiver's metadata from stdin, then writes with notifications until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: runs as the peer process of the other tests"]
async fn peer_process() {
    let (Ok(role), Ok(tls)) = (std::env::var("KVXFER_UCX_TEST_ROLE"), std::env::var("KVXFER_UCX_TEST_TLS")) else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    if role == "receiver" {
        let rx = endpoint(&tls, 2);
        let mut dst = HostBuffer::zeroed(LEN);
        let _reg = rx.register(RegionId(2), dst.desc()).await.unwrap();
        println!("META {}", serde_json::to_string(&rx.metadata().unwrap()).unwrap());
        std::io::stdout().flush().unwrap();
        while Instant::now() < deadline {
            let _ = rx.recv(Duration::from_millis(100)).await;
        }
    } else {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        let meta: EndpointMetadata = serde_json::from_str(&line).unwrap();
        let tx = endpoint(&tls, 1);
        let mut src = HostBuffer::filled(LEN, 5);
        let _reg = tx.register(RegionId(1), src.desc()).await.unwrap();
        let peer = tx.connect(&meta).await.unwrap();
        let mut chunk = 0;
        while Instant::now() < deadline {
            let n = Notification::chunk(RequestId(1), SenderKey::from_u64(1), chunk, false);
            let op = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, LEN as u64);
            if write(&*tx, peer, op, Some(&n)).await.is_err() {
                break;
            }
            chunk += 1;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_killed_mid_transfer_fails_the_sender_promptly() {
    for (name, tls) in TRANSPORTS {
        let (mut peer, mut out) = spawn_peer("receiver", tls);
        let meta = read_meta(&mut out);
        let tx = endpoint(tls, 1);
        let mut src = HostBuffer::filled(LEN, 9);
        let _reg = tx.register(RegionId(1), src.desc()).await.unwrap();
        let pid = tx.connect(&meta).await.unwrap();
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, LEN as u64);
        for _ in 0..3 {
            write(&*tx, pid, op, None).await.unwrap();
        }
        // Keep writing from another task while the receiver is killed.
        let writer = {
            let tx = tx.clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                loop {
                    if let Err(e) = write(&*tx, pid, op, None).await {
                        return Ok::<_, String>(e);
                    }
                    if t0.elapsed() > Duration::from_secs(30) {
                        return Err("writes kept succeeding 30 s after the receiver was killed".into());
                    }
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        peer.0.kill().unwrap();
        let killed = Instant::now();
        let err = writer.await.unwrap().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            matches!(err, BackendError::PeerLost { .. } | BackendError::Ffi { .. } | BackendError::Timeout { .. }),
            "{name}: {err}"
        );
        assert!(killed.elapsed() < Duration::from_secs(12), "{name}: failing took {:?}", killed.elapsed());
        // Later writes fail at once, with the reason.
        let t0 = Instant::now();
        let again = write(&*tx, pid, op, None).await.unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(11), "{name}: {again}");
        eprintln!("{name}: in-flight write: {err}; next write: {again}");
        drop(out);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_killed_mid_transfer_is_reported_to_the_receiver() {
    for (name, tls) in TRANSPORTS {
        let rx = endpoint(tls, 2);
        let mut dst = HostBuffer::zeroed(LEN);
        let reg = rx.register(RegionId(2), dst.desc()).await.unwrap();
        let (mut peer, out) = spawn_peer("sender", tls);
        let stdin = peer.0.stdin.as_mut().unwrap();
        writeln!(stdin, "{}", serde_json::to_string(&rx.metadata().unwrap()).unwrap()).unwrap();
        stdin.flush().unwrap();
        // Wait until data flows (a few notifications), then kill the sender.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seen = 0;
        while seen < 3 && Instant::now() < deadline {
            for e in rx.recv(Duration::from_millis(100)).await.unwrap() {
                if matches!(e, BackendEvent::Notification(_)) {
                    seen += 1;
                }
            }
        }
        assert!(seen >= 3, "{name}: the sender process never delivered");
        peer.0.kill().unwrap();
        let killed = Instant::now();
        let mut lost = None;
        while lost.is_none() && killed.elapsed() < Duration::from_secs(15) {
            for e in rx.recv(Duration::from_millis(100)).await.unwrap() {
                if let BackendEvent::PeerLost { identity, reason } = e {
                    lost = Some((identity, reason));
                }
            }
        }
        let (identity, reason) = lost.unwrap_or_else(|| panic!("{name}: no PeerLost within 15 s of the kill"));
        assert_eq!(identity, 1, "{name}: {reason}");
        eprintln!("{name}: PeerLost after {:?}: {reason}", killed.elapsed());
        // The bytes that did land are the sender's (the lost peer does not block the close).
        reg.close(Instant::now() + Duration::from_secs(10)).await.unwrap();
        assert!(dst.to_vec().unwrap()[..4096].iter().all(|&b| b == 5), "{name}");
        drop(out);
    }
}

//! Every stream runs on a thread of its own: those threads end with their streams (a disconnect, a
//! lost peer, a dropped endpoint), so a long-running process does not collect them. Its own test
//! binary: it counts the threads of the whole process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{BackendConfig, BackendEvent, HostBuffer, KvTransferBackend, RegionId, TransferStatus, WriteOp};

fn ep(identity: u64) -> Arc<dyn KvTransferBackend> {
    kvxfer_tcp::create(&BackendConfig::new(identity).with("connections", "3").with("timeout_s", "10")).unwrap()
}

/// Threads of this process named like the backend's stream threads.
fn stream_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                .filter(|c| c.starts_with("kvxfer-tcp-"))
                .count()
        })
        .unwrap_or(0)
}

async fn settle_at(n: usize) {
    let end = Instant::now() + Duration::from_secs(10);
    while stream_threads() != n {
        assert!(Instant::now() < end, "{} stream threads, expected {n}", stream_threads());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_threads_end_with_their_streams() {
    if !std::path::Path::new("/proc/self/task").exists() {
        return; // not Linux: nothing to count
    }
    settle_at(0).await;
    let (a, b) = (ep(1), ep(2));
    let mut src = HostBuffer::from_slice(&[7u8; 1 << 16]);
    let mut dst = HostBuffer::zeroed(1 << 16);
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let _rd = b.register(RegionId(0), dst.desc()).await.unwrap();

    // A link: 3 data streams and a control stream, a thread per stream on each side.
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let op = [WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 1 << 16)];
    let t = a.post(peer, &op, None).unwrap();
    t.wait(Instant::now() + Duration::from_secs(10)).await.unwrap();
    assert_eq!(t.status(), TransferStatus::Done);
    settle_at(8).await;
    // A disconnect ends the sender's threads and, after BYE, the receiver's.
    a.disconnect(peer).await.unwrap();
    settle_at(0).await;

    // A lost peer: dropping the receiving endpoint ends its threads, the sender's follow.
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    settle_at(8).await;
    drop((_rd, b));
    let end = Instant::now() + Duration::from_secs(10);
    'lost: while Instant::now() < end {
        for e in a.recv(Duration::from_millis(100)).await.unwrap() {
            if matches!(e, BackendEvent::PeerLost { .. }) {
                break 'lost;
            }
        }
    }
    settle_at(0).await;
    assert!(a.post(peer, &op, None).is_err());
    drop((_rs, a));
    settle_at(0).await;
}

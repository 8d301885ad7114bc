//! Issue 10, defect 7 (first part): the bootstrap's line limit applies while reading. A client that
//! sends 100 MB without a newline gets an error and is disconnected once it passes the limit; the
//! server's memory (this process's RSS, server in-process) grows by less than 64 MiB meanwhile; a
//! well-formed client publishes a rank record and lists it at the same time (the store calls a
//! joining rank makes) and succeeds.
//!
//! The only test of this binary, so no other test's allocations disturb the measurement.

use std::time::{Duration, Instant};

use kvxfer::bootstrap::{BootstrapServer, RankRegistration, MAX_REQUEST_LINE};
use kvxfer::metadata::bootstrap::BootstrapStore;
use kvxfer::metadata::{MetadataStore, RankRecord};
use kvxfer::session::KvPool;
use kvxfer_core::{Attention, EndpointMetadata, KvSpec, Layout, Parallel, RankId, Side, SideSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: u64 = 1 << 20;

/// A field of /proc/self/status, in bytes.
fn status_bytes(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = s.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kb: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("a number of kB");
    kb * 1024
}

fn registration() -> RankRegistration {
    RankRegistration {
        role: Side::Prefill,
        rank: RankId::new(0, 0),
        backend: "tcp".into(),
        endpoint: EndpointMetadata { version: 1, backend: "tcp".into(), identity: 0, payload: vec![1, 2, 3] },
        pool: KvPool { pages: 1, buffers: vec![] },
        spec: SideSpec {
            kv: KvSpec {
                attention: Attention::Gqa { kv_heads: 8, head_dim_k: 128, head_dim_v: 128 },
                layers: 4,
                dtype_bytes: 2,
                page_size: 16,
                layout: Layout::Nhd,
            },
            parallel: Parallel::new(1, 1),
        },
        label: "well-formed".into(),
        model: None,
        protocol: kvxfer_core::ProtocolRange::THIS_BUILD,
        warmup: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_newline_is_cut_off_at_the_limit_while_others_are_served() {
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let addr = server.addr().to_string();
    let client = BootstrapStore::new(&addr, "/hostile").with_timeout(Duration::from_secs(20));
    // Warm up: the runtime, the service and the client have made their first allocations.
    client.put("warm", &serde_json::json!(1), None).await.unwrap();
    assert_eq!(client.get("warm").await.unwrap().0.unwrap().json(), serde_json::json!(1));
    // Start the peak count here (Linux >= 4.0: "5" resets VmHWM to VmRSS); without it the peak only
    // overestimates the growth.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let idle = status_bytes("VmRSS:");

    // The hostile client: 100 MB of 'x', no newline, from one reused 1 MiB buffer, while reading
    // whatever the server answers (at most 64 KiB kept).
    let stream = TcpStream::connect(&addr).await.unwrap();
    let (mut r, mut w) = stream.into_split();
    let (sent_tx, sent_rx) = tokio::sync::oneshot::channel::<()>();
    let writer = tokio::spawn(async move {
        let chunk = vec![b'x'; MIB as usize];
        let mut sent = 0u64;
        let mut sent_tx = Some(sent_tx);
        let mut error = None;
        while sent < 100 * MIB {
            if let Err(e) = w.write_all(&chunk).await {
                error = Some(e.kind());
                break;
            }
            sent += MIB;
            if sent >= 4 * MIB {
                if let Some(tx) = sent_tx.take() {
                    let _ = tx.send(());
                }
            }
        }
        let _ = w.shutdown().await;
        (sent, error)
    });
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match r.read(&mut buf).await {
                Ok(0) => return (got, None),
                Ok(n) => {
                    if got.len() < 64 << 10 {
                        got.extend_from_slice(&buf[..n]);
                    }
                }
                Err(e) => return (got, Some(e.kind())),
            }
        }
    });

    // Meanwhile a well-formed client publishes a rank record and lists the ranks.
    let _ = sent_rx.await;
    let t = Instant::now();
    let record = RankRecord { registration: registration(), left: false };
    let lease = client.grant(Duration::from_secs(30)).await.unwrap();
    client.put("ranks/prefill/0.0", &serde_json::to_value(&record).unwrap(), Some(lease)).await.unwrap();
    let (ranks, _) = client.list("ranks/").await.unwrap();
    let listed: Vec<RankRecord> = ranks.into_iter().map(|e| e.parse().unwrap()).collect();
    assert_eq!(listed, vec![record]);
    let served_in = t.elapsed();

    let (sent, write_error) =
        tokio::time::timeout(Duration::from_secs(60), writer).await.expect("writer hangs").unwrap();
    let (answer, read_error) =
        tokio::time::timeout(Duration::from_secs(60), reader).await.expect("reader hangs").unwrap();
    let peak = status_bytes("VmHWM:").max(status_bytes("VmRSS:"));
    let growth = peak.saturating_sub(idle);
    let answer = String::from_utf8_lossy(&answer);
    eprintln!(
        "idle RSS {} MiB, peak {} MiB, growth {:.1} MiB; hostile client sent {} MiB ({write_error:?}), \
         got {answer:?} ({read_error:?}); well-formed client served in {served_in:?}",
        idle / MIB,
        peak / MIB,
        growth as f64 / MIB as f64,
        sent / MIB,
    );
    assert!(
        growth < 64 * MIB,
        "the server's memory grew by {} MiB (over 64 MiB) for a line without newline",
        growth / MIB
    );
    // The limit itself, plus this client's 1 MiB send buffer and a little slack for the runtime.
    let bound = MAX_REQUEST_LINE as u64 + 4 * MIB;
    assert!(growth <= bound, "the server's memory grew by {growth} bytes, more than the line limit allows ({bound})");
    assert!(answer.contains("\"ok\":false") && answer.contains("longer than"), "no error answer: {answer:?}");
    // The service still answers afterwards.
    client.put("after", &serde_json::json!(2), None).await.unwrap();
    assert_eq!(client.get("after").await.unwrap().0.unwrap().json(), serde_json::json!(2));
}

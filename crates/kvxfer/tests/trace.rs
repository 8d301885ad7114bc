//! Issue 30, traces: one request's steps, logged by the decode rank and by both prefill ranks that
//! feed it, carry one trace id (`TraceId`: the room and the decode rank's generation, both already
//! in the handoff and in every notification), so the log of several processes can be joined on it.
//! Also for an aborted request: the abort, its receipt and both final statuses.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::bootstrap::BootstrapServer;
use kvxfer::engine::{Agent, AgentConfig, KvMemory, Phase, TraceId};
use kvxfer::metadata::MetadataAddr;
use kvxfer_core::{Attention, KvSpec, Layout, Parallel, RankId, RequestId, Side, SideSpec, Topology};

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    /// The lines that carry `t`.
    fn lines_of(&self, t: TraceId) -> Vec<String> {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        let key = format!("trace_id={t}");
        text.lines().filter(|l| l.contains(&key)).map(str::to_owned).collect()
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// Whether some line of `lines` has every one of `parts`.
fn has(lines: &[String], parts: &[&str]) -> bool {
    lines.iter().any(|l| parts.iter().all(|p| l.contains(p)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_one_trace_id_on_every_rank() {
    let log = Log::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_env_filter("kvxfer::request=debug")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads: 2, head_dim_k: 8, head_dim_v: 8 },
        layers: 2,
        dtype_bytes: 2,
        page_size: 4,
        layout: Layout::Nhd,
    };
    let t =
        Topology::new(&SideSpec { kv, parallel: Parallel::new(2, 1) }, &SideSpec { kv, parallel: Parallel::new(1, 1) })
            .unwrap();
    let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
    let addr = MetadataAddr::parse(&server.addr().to_string()).unwrap();
    let config = |role, tp| {
        let mut c = AgentConfig::new(role, RankId::new(tp, 0), t, addr.clone());
        c.backend = "local".into();
        c.lease_ttl = Duration::from_secs(2);
        c
    };
    let mut prefill = Vec::new();
    for tp in 0..2 {
        prefill.push(Agent::start(config(Side::Prefill, tp), KvMemory::Host { pages: 16, fill: 1 }).await.unwrap());
    }
    let decode = Agent::start(config(Side::Decode, 0), KvMemory::Host { pages: 16, fill: 0 }).await.unwrap();
    for a in prefill.iter().chain([&decode]) {
        a.wait_connected(soon()).await.unwrap();
    }

    // A request that succeeds, in two chunks.
    let room = RequestId(42);
    let rx = decode.receiver(room).unwrap();
    assert_eq!(rx.trace_id(), None, "no trace id before the handoff");
    rx.send_metadata(&[3, 4, 5], None).unwrap();
    let trace = rx.trace_id().expect("handed off");
    assert_eq!(trace, TraceId::of(room, rx.generation().unwrap()));
    assert_eq!(trace.to_string().len(), 32);
    let txs: Vec<_> = prefill.iter().map(|a| a.sender(room).unwrap()).collect();
    for tx in &txs {
        tx.init(3).unwrap();
        while tx.status().phase != Phase::WaitingForInput {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(tx.trace_ids(), vec![(RankId::new(0, 0), trace)], "the prefill knows the decode's trace id");
        tx.send(&[0, 1]).unwrap();
        tx.send(&[2]).unwrap();
    }
    assert_eq!(rx.wait(soon()).await.unwrap().phase, Phase::Success);
    for tx in &txs {
        assert_eq!(tx.wait(soon()).await.unwrap().phase, Phase::Success);
    }
    rx.release().unwrap();
    for tx in txs {
        tx.release().unwrap();
    }
    let lines = log.lines_of(trace);
    let want: [&[&str]; 8] = [
        &["role=\"decode\"", "handoff: sending the page list"],
        &["role=\"prefill\"", "rank=0/0", "handoff received"],
        &["role=\"prefill\"", "rank=1/0", "handoff received"],
        &["role=\"prefill\"", "rank=0/0", "posting", "last=true"],
        &["role=\"prefill\"", "rank=1/0", "posting", "last=true"],
        &["role=\"decode\"", "received", "chunk 1 (last)"],
        &["role=\"prefill\"", "final: succeeded"],
        &["role=\"decode\"", "final: succeeded"],
    ];
    for parts in want {
        assert!(has(&lines, parts), "no line with {parts:?} for trace {trace}:\n{}", lines.join("\n"));
    }

    // An aborted request: the abort, its receipt on the prefill, and both sides' final status.
    let room = RequestId(43);
    let rx = decode.receiver(room).unwrap();
    rx.send_metadata(&[6, 7], None).unwrap();
    let trace = rx.trace_id().unwrap();
    let tx = prefill[0].sender(room).unwrap();
    tx.init(2).unwrap();
    while tx.status().phase != Phase::WaitingForInput {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    rx.abort("the client went away");
    let s = rx.wait(soon()).await.unwrap();
    assert_eq!(s.phase, Phase::Failed, "{s:?}");
    assert_eq!(tx.wait(soon()).await.unwrap().phase, Phase::Failed);
    rx.release().unwrap();
    tx.release().unwrap();
    let lines = log.lines_of(trace);
    let want: [&[&str]; 4] = [
        &["role=\"decode\"", "abort: the client went away"],
        &["role=\"prefill\"", "rank=0/0", "abort received"],
        &["role=\"prefill\"", "rank=0/0", "final: failed"],
        &["role=\"decode\"", "final: failed"],
    ];
    for parts in want {
        assert!(has(&lines, parts), "no line with {parts:?} for trace {trace}:\n{}", lines.join("\n"));
    }
    for a in prefill.into_iter().chain([decode]) {
        a.shutdown(soon()).await.unwrap();
    }
}

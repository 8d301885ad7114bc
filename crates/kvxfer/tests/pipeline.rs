//! The sender session keeps several batches per (prefill, decode) pair in flight, bounded by its
//! window, and posts the attached notification only once every earlier batch of the chunk is done.
//! Checked against a scripted backend whose transfers complete a few milliseconds after they are
//! posted, so the session's posting pattern is visible.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::session::{region_id, Chunk, KvPool, PoolBuffer, SenderSession, Window, WRITE_BATCH};
use kvxfer_core::{
    AbortTransfer, Attention, BackendError, BackendEvent, BoxFuture, BufferRef, Capabilities, CloseRegistration,
    EndpointMetadata, KvSpec, KvTransferBackend, Layout, MemDesc, Notification, NotifyStyle, Parallel, PeerId, RankId,
    RegionId, Registration, RequestId, Side, SideSpec, Topology, Transfer, TransferState, TransferStatus, WriteOp,
};

#[derive(Debug, Clone)]
struct Post {
    ops: usize,
    bytes: u64,
    notify: bool,
    /// Transfers of this peer not final when this one was posted.
    in_flight: usize,
    /// Ops of those.
    in_flight_ops: usize,
}

#[derive(Default)]
struct Script {
    posts: Mutex<Vec<Post>>,
    live: Mutex<Vec<(Arc<TransferState>, usize)>>,
    /// Fail the n-th post's transfer instead of completing it.
    fail_at: Option<usize>,
}

struct NoAbort;
impl AbortTransfer for NoAbort {
    fn abort(&self, s: &Arc<TransferState>) {
        s.aborted();
    }
}

struct NoClose;
impl CloseRegistration for NoClose {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }
    fn close_detached(self: Box<Self>) {}
}

struct Scripted(Arc<Script>);

#[async_trait::async_trait]
impl KvTransferBackend for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(true, true, true, true)
    }
    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        Ok(Registration::new("scripted", id, &mem, Box::new(NoClose)))
    }
    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        Ok(EndpointMetadata::new("scripted", 9, vec![]))
    }
    async fn connect(&self, _: &EndpointMetadata) -> Result<PeerId, BackendError> {
        Ok(PeerId(1))
    }
    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        let mut live = self.0.live.lock().unwrap();
        live.retain(|(s, _)| !s.status().is_final());
        let mut posts = self.0.posts.lock().unwrap();
        posts.push(Post {
            ops: ops.len(),
            bytes: ops.iter().map(WriteOp::bytes).sum(),
            notify: notify.is_some(),
            in_flight: live.len(),
            in_flight_ops: live.iter().map(|(_, n)| n).sum(),
        });
        let n = posts.len();
        let state = TransferState::new("scripted", peer);
        live.push((state.clone(), ops.len()));
        let fail = self.0.fail_at == Some(n);
        let s = state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(3 + (n % 3) as u64)).await;
            if fail {
                s.fail(BackendError::Closed { backend: "scripted" });
            } else {
                s.complete();
            }
        });
        Ok(Transfer::new(state, Arc::new(NoAbort), 0))
    }
    async fn notify(&self, _: PeerId, _: &Notification) -> Result<(), BackendError> {
        Ok(())
    }
    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        tokio::time::sleep(max_wait).await;
        Ok(vec![])
    }
    async fn disconnect(&self, _: PeerId) -> Result<(), BackendError> {
        Ok(())
    }
}

fn topo() -> Topology {
    topo_with(1)
}

/// One KV head of `head_dim` (pages of `2 * head_dim` bytes per kind).
fn topo_with(head_dim: u32) -> Topology {
    let side = SideSpec {
        kv: KvSpec {
            attention: Attention::Gqa { kv_heads: 1, head_dim_k: head_dim, head_dim_v: head_dim },
            layers: 4,
            dtype_bytes: 2,
            page_size: 1,
            layout: Layout::Nhd,
        },
        parallel: Parallel::new(1, 1),
    };
    Topology::new(&side, &side).unwrap()
}

fn pool(topo: &Topology, side: Side, pages: u32) -> KvPool {
    let buffers = (0..topo.stage_layers(side, 0))
        .flat_map(|layer| {
            topo.kv().kinds().iter().map(move |&kind| {
                let b = BufferRef { layer, kind };
                PoolBuffer { buffer: b, region: region_id(b), offset: 0, len: topo.buffer_bytes(side, kind, pages) }
            })
        })
        .collect();
    KvPool { pages, buffers }
}

/// A chunk of `pages` pages whose destination pages never form runs (one op per page per buffer).
fn chunk(pages: u32) -> Chunk {
    Chunk {
        index: 0,
        last: true,
        src_pages: (0..pages).collect(),
        dst_pages: (0..pages).map(|p| pages - 1 - p).collect(),
    }
}

async fn session(script: &Arc<Script>, window: Window, pages: u32) -> SenderSession {
    session_with(script, window, pages, topo()).await
}

async fn session_with(script: &Arc<Script>, window: Window, pages: u32, t: Topology) -> SenderSession {
    let backend: Arc<dyn KvTransferBackend> = Arc::new(Scripted(Arc::clone(script)));
    let s = SenderSession::new(backend, t, RankId::new(0, 0), pool(&t, Side::Prefill, pages), NotifyStyle::Attached)
        .unwrap()
        .with_window(window);
    let meta = EndpointMetadata::new("scripted", 7, vec![]);
    s.connect(RankId::new(0, 0), &meta, pool(&t, Side::Decode, pages)).await.unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_overlap_within_the_window_and_the_notification_waits() {
    let script = Arc::new(Script::default());
    let window = Window { bytes: u64::MAX, ops: 4 * WRITE_BATCH as u64 };
    let pages = 2 * WRITE_BATCH as u32; // 4 layers x K/V x pages = 16 batches of ops
    let s = session(&script, window, pages).await;
    let stats = s.send_chunk(RequestId(1), &chunk(pages), Instant::now() + Duration::from_secs(30)).await.unwrap();
    assert_eq!(stats.ops, 8 * u64::from(pages));
    let posts = script.posts.lock().unwrap().clone();
    assert_eq!(posts.len(), 16, "{posts:?}");
    assert_eq!(posts.iter().map(|p| p.ops).sum::<usize>(), 16 * WRITE_BATCH);
    assert!(posts.iter().all(|p| p.ops <= WRITE_BATCH));
    let most = posts.iter().map(|p| p.in_flight).max().unwrap();
    assert!(most >= 2, "batches never overlapped: {posts:?}");
    assert!(posts.iter().all(|p| p.in_flight_ops + p.ops <= window.ops as usize), "window exceeded: {posts:?}");
    let (last, rest) = posts.split_last().unwrap();
    assert!(last.notify && rest.iter().all(|p| !p.notify), "the notification rides on the last batch only");
    assert_eq!(last.in_flight, 0, "the notification was posted while earlier batches were in flight");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_of_one_batch_posts_one_at_a_time() {
    let script = Arc::new(Script::default());
    let pages = WRITE_BATCH as u32 / 2; // four batches
    let s = session(&script, Window { bytes: 1, ops: 1 }, pages).await;
    s.send_chunk(RequestId(2), &chunk(pages), Instant::now() + Duration::from_secs(30)).await.unwrap();
    let posts = script.posts.lock().unwrap().clone();
    assert!(posts.len() >= 4);
    assert!(posts.iter().all(|p| p.in_flight == 0), "{posts:?}");
}

/// Batches close at a quarter of the window's bytes too: 32 KiB pages per kind (one head of 16,384
/// two-byte values, one token per page), a 4 MiB window: batches of 1 MiB (the floor), at least two
/// in flight at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_close_at_a_quarter_of_the_window_in_bytes() {
    let script = Arc::new(Script::default());
    let window = Window { bytes: 4 << 20, ops: u64::MAX };
    assert_eq!(window.batch_bytes(), kvxfer::session::MIN_BATCH_BYTES);
    let pages = 64; // 4 layers x K/V x 64 pages x 32 KiB = 16 MiB
    let s = session_with(&script, window, pages, topo_with(16 << 10)).await;
    let stats = s.send_chunk(RequestId(4), &chunk(pages), Instant::now() + Duration::from_secs(30)).await.unwrap();
    assert_eq!(stats.bytes, 16 << 20);
    let posts = script.posts.lock().unwrap().clone();
    assert_eq!(posts.len(), 16, "1 MiB per post: {posts:?}");
    assert!(posts.iter().all(|p| p.bytes == 1 << 20 && p.ops == 32), "{posts:?}");
    assert!(posts.iter().map(|p| p.in_flight).max().unwrap() >= 2, "batches never overlapped: {posts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_fails_the_send_and_nothing_stays_in_flight() {
    let script = Arc::new(Script { fail_at: Some(3), ..Default::default() });
    let pages = 2 * WRITE_BATCH as u32;
    let s = session(&script, Window::default(), pages).await;
    let e = s.send_chunk(RequestId(3), &chunk(pages), Instant::now() + Duration::from_secs(30)).await.unwrap_err();
    assert!(e.to_string().contains("closed"), "{e}");
    let live = script.live.lock().unwrap();
    assert!(live.iter().all(|(st, _)| st.status() != TransferStatus::InFlight), "a transfer was left in flight");
    assert!(script.posts.lock().unwrap().iter().all(|p| !p.notify), "a failed send must not notify completion");
}

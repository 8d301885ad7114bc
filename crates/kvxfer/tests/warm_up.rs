//! `SenderSession::warm_up` writes exactly what a one-page request writes to a decode rank, into
//! that rank's warm-up region instead of its pool: checked byte for byte on the in-process backend
//! across heterogeneous TP, GQA replication, MLA, pipeline stages and both layouts. The region
//! holds one page of every decode buffer back to back; after the warm-up, a real one-page request
//! into decode page 0 must land the same bytes there, and nothing of the pool may change before it.

use std::time::{Duration, Instant};

use kvxfer::engine::identity;
use kvxfer::session::{warmup_bytes, KvPool, PoolMemory, SenderSession, WARMUP_REGION};
use kvxfer_core::{
    Attention, BackendConfig, HostBuffer, KvSpec, KvTransferBackend, Layout, NotifyStyle, Parallel, RankId,
    Registration, RequestId, Side, SideSpec, Topology,
};

const PAGES: u32 = 4;
const DECODE_FILL: u8 = 0xAA;

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn topo(attention: Attention, layout: Layout, p: Parallel, d: Parallel) -> Topology {
    let kv = KvSpec { attention, layers: 4, dtype_bytes: 2, page_size: 2, layout };
    Topology::new(&SideSpec { kv, parallel: p }, &SideSpec { kv, parallel: d }).unwrap()
}

fn ranks(p: Parallel) -> Vec<RankId> {
    (0..p.pp).flat_map(|pp| (0..p.tp).map(move |tp| RankId::new(tp, pp))).collect()
}

struct Decode {
    rank: RankId,
    backend: std::sync::Arc<dyn KvTransferBackend>,
    pool: KvPool,
    memory: Vec<PoolMemory>,
    scratch: HostBuffer,
    scratch_reg: Option<Registration>,
}

/// Every byte of every decode pool buffer, in pool order.
fn pool_bytes(d: &Decode) -> Vec<Vec<u8>> {
    d.memory
        .iter()
        .map(|m| {
            let mut out = vec![0u8; m.len() as usize];
            m.read(0, &mut out).unwrap();
            out
        })
        .collect()
}

/// Warm-up, then a real one-page request, on every (prefill, decode) pair of `t`.
async fn check(name: &str, t: Topology) {
    let mut decodes = Vec::new();
    for rank in ranks(t.parallel(Side::Decode)) {
        let backend = kvxfer::backends::create("local", &BackendConfig::new(identity(Side::Decode, rank))).unwrap();
        let (pool, memory) =
            KvPool::allocate(&t, Side::Decode, rank, PAGES, &*backend, &|_, b| b.fill(DECODE_FILL)).await.unwrap();
        let mut scratch = HostBuffer::zeroed(warmup_bytes(&t, rank) as usize);
        let scratch_reg = Some(backend.register(WARMUP_REGION, scratch.desc()).await.unwrap());
        decodes.push(Decode { rank, backend, pool, memory, scratch, scratch_reg });
    }
    let mut senders = Vec::new();
    for rank in ranks(t.parallel(Side::Prefill)) {
        let backend = kvxfer::backends::create("local", &BackendConfig::new(identity(Side::Prefill, rank))).unwrap();
        // A different byte per (prefill rank, layer, kind, offset).
        let init = move |b: kvxfer_core::BufferRef, bytes: &mut [u8]| {
            for (i, x) in bytes.iter_mut().enumerate() {
                *x = (i as u32 * 7 + rank.tp * 31 + rank.pp * 57 + b.layer * 13 + b.kind.index() * 3) as u8 | 1;
            }
        };
        let (pool, memory) = KvPool::allocate(&t, Side::Prefill, rank, PAGES, &*backend, &init).await.unwrap();
        let s = SenderSession::new(backend, t, rank, pool, NotifyStyle::Attached).unwrap();
        for dst in t.receivers(rank) {
            let d = decodes.iter().find(|d| d.rank == dst).unwrap();
            s.connect(dst, &d.backend.metadata().unwrap(), d.pool.clone()).await.unwrap();
        }
        senders.push((rank, s, memory));
    }
    let before: Vec<Vec<Vec<u8>>> = decodes.iter().map(pool_bytes).collect();
    // A replicated sender (GQA with fewer heads than prefill ranks) may write nothing to a decode
    // rank; all senders of a decode rank together write its whole page, once per round.
    let mut written = vec![0u64; decodes.len()];
    for (rank, s, _) in &senders {
        for dst in t.receivers(*rank) {
            let i = decodes.iter().position(|d| d.rank == dst).unwrap();
            let len = decodes[i].scratch_reg.as_ref().unwrap().len();
            written[i] += s.warm_up(dst, WARMUP_REGION, len, 2, soon()).await.unwrap().bytes;
        }
    }
    for (d, w) in decodes.iter().zip(&written) {
        assert_eq!(*w, 2 * warmup_bytes(&t, d.rank), "{name}: bytes written to decode rank {}", d.rank);
    }
    for (d, b) in decodes.iter().zip(&before) {
        assert_eq!(&pool_bytes(d), b, "{name}: the warm-up changed decode rank {}'s pool", d.rank);
    }
    for (rank, s, _) in &senders {
        for dst in t.receivers(*rank) {
            let layers = 0..t.stage_layers(Side::Prefill, rank.pp);
            let never = kvxfer::session::Cancel::new();
            s.send_to(RequestId(1), dst, &[0], &[0], layers, None, soon(), &never).await.unwrap();
        }
    }
    for d in &mut decodes {
        d.scratch_reg.take().unwrap().close(soon()).await.unwrap();
        let landed = pool_bytes(d);
        let mut expected = Vec::new();
        for (m, bytes) in d.memory.iter().zip(&landed) {
            let page = t.buffer_bytes(Side::Decode, m.buffer.kind, 1) as usize;
            expected.extend_from_slice(&bytes[..page]);
            assert!(
                bytes[page..].iter().all(|&x| x == DECODE_FILL),
                "{name}: decode rank {}: the one-page request wrote past page 0",
                d.rank
            );
        }
        let scratch = d.scratch.to_vec().unwrap();
        assert_eq!(scratch.len(), expected.len(), "{name}: decode rank {}: region size", d.rank);
        assert!(scratch == expected, "{name}: decode rank {}: the warm-up did not write what the request did", d.rank);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_up_writes_what_a_one_page_request_writes_into_the_region_only() {
    let gqa = |kv_heads| Attention::Gqa { kv_heads, head_dim_k: 4, head_dim_v: 4 };
    let mla = Attention::Mla { latent_dim: 6 };
    let cases: Vec<(&str, Attention, Parallel, Parallel)> = vec![
        ("P1->D1", gqa(8), Parallel::new(1, 1), Parallel::new(1, 1)),
        ("P2->D1", gqa(8), Parallel::new(2, 1), Parallel::new(1, 1)),
        ("P1->D2", gqa(8), Parallel::new(1, 1), Parallel::new(2, 1)),
        ("P4->D2 GQA 2 heads", gqa(2), Parallel::new(4, 1), Parallel::new(2, 1)),
        ("P2->D4 GQA 1 head", gqa(1), Parallel::new(2, 1), Parallel::new(4, 1)),
        ("P4->D1 GQA 2 heads", gqa(2), Parallel::new(4, 1), Parallel::new(1, 1)),
        ("MLA P2->D1", mla, Parallel::new(2, 1), Parallel::new(1, 1)),
        ("MLA P1->D2", mla, Parallel::new(1, 1), Parallel::new(2, 1)),
        ("PP2 P1->D1", gqa(8), Parallel::new(1, 2), Parallel::new(1, 1)),
        ("PP2 P2x2->D1x2", gqa(4), Parallel::new(2, 2), Parallel::new(1, 2)),
    ];
    for (name, attention, p, d) in cases {
        for layout in [Layout::Nhd, Layout::Hnd] {
            check(&format!("{name} {layout}"), topo(attention, layout, p, d)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_smaller_than_one_page_is_refused_and_nothing_is_written() {
    let t = topo(
        Attention::Gqa { kv_heads: 2, head_dim_k: 4, head_dim_v: 4 },
        Layout::Nhd,
        Parallel::new(1, 1),
        Parallel::new(1, 1),
    );
    let (p, d) = (RankId::new(0, 0), RankId::new(0, 0));
    let db = kvxfer::backends::create("local", &BackendConfig::new(identity(Side::Decode, d))).unwrap();
    let (dpool, _dmem) = KvPool::allocate(&t, Side::Decode, d, PAGES, &*db, &|_, _| {}).await.unwrap();
    let need = warmup_bytes(&t, d);
    let mut scratch = HostBuffer::zeroed(need as usize);
    let reg = db.register(WARMUP_REGION, scratch.desc()).await.unwrap();
    let pb = kvxfer::backends::create("local", &BackendConfig::new(identity(Side::Prefill, p))).unwrap();
    let (ppool, _pmem) = KvPool::allocate(&t, Side::Prefill, p, PAGES, &*pb, &|_, b| b.fill(7)).await.unwrap();
    let s = SenderSession::new(pb, t, p, ppool, NotifyStyle::Attached).unwrap();
    s.connect(d, &db.metadata().unwrap(), dpool).await.unwrap();
    let e = s.warm_up(d, WARMUP_REGION, need - 1, 2, soon()).await.unwrap_err();
    let text = e.to_string();
    assert!(text.contains("warm-up region has") && text.contains(&need.to_string()), "{text}");
    reg.close(soon()).await.unwrap();
    assert!(scratch.to_vec().unwrap().iter().all(|&b| b == 0), "a refused warm-up wrote");
}

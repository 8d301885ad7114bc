//! Issue 14, input validation: a host pool that would not fit in memory is refused before anything
//! is allocated, with the size it would need ("absurd sizes abort on allocation after up to 27 s and
//! 6 GiB" before). `KvPool::allocate` is the one place host pools are made (the engine's
//! `KvMemory::Host`, `kvxfer demo` and `kvxfer worker`, the Python package's host pools).

use std::time::{Duration, Instant};

use kvxfer::engine::identity;
use kvxfer::session::{available_memory, KvPool, SessionError};
use kvxfer_core::{Attention, BackendConfig, KvSpec, Layout, Parallel, RankId, Side, SideSpec, Topology};

fn topo(layers: u32) -> Topology {
    // llama3-8b's KV geometry with an absurd layer count (`kvxfer demo --layers 100000`).
    let kv = KvSpec {
        attention: Attention::Gqa { kv_heads: 8, head_dim_k: 128, head_dim_v: 128 },
        layers,
        dtype_bytes: 2,
        page_size: 16,
        layout: Layout::Nhd,
    };
    let side = SideSpec { kv, parallel: Parallel::new(1, 1) };
    Topology::new(&side, &side).unwrap()
}

#[tokio::test]
async fn a_pool_larger_than_available_memory_is_refused_before_allocation() {
    let available = available_memory().expect("this test runs on Linux with /proc/meminfo");
    let t = topo(100_000);
    let rank = RankId::new(0, 0);
    // 128 pages x 100,000 layers x 64 KiB per page and layer (K and V) = 800 GiB.
    let pages = 128;
    let needed = t.checked_pool_bytes(Side::Decode, 0, pages).unwrap();
    assert!(needed > available, "the test needs a pool larger than this machine ({needed} <= {available})");
    let backend = kvxfer::backends::create("local", &BackendConfig::new(identity(Side::Decode, rank))).unwrap();
    let started = Instant::now();
    let err = KvPool::allocate(&t, Side::Decode, rank, pages, &*backend, &|_, _| {}).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2), "refused only after {:?}", started.elapsed());
    match &err {
        SessionError::PoolTooLarge { needed: n, available: a, pages: p, layers, .. } => {
            assert_eq!((*n, *p, *layers), (needed, pages, 100_000));
            assert!(*a < *n);
        }
        other => panic!("expected PoolTooLarge, got {other:?}"),
    }
    let msg = err.to_string();
    for want in
        ["decode rank", &needed.to_string(), "100000 layers", "MemAvailable", "nothing was allocated", "fewer pages"]
    {
        assert!(msg.contains(want), "{want:?} missing from: {msg}");
    }
}

#[tokio::test]
async fn a_pool_that_fits_is_allocated() {
    let t = topo(2);
    let rank = RankId::new(0, 0);
    let backend = kvxfer::backends::create("local", &BackendConfig::new(identity(Side::Prefill, rank))).unwrap();
    let (pool, memory) = KvPool::allocate(&t, Side::Prefill, rank, 4, &*backend, &|_, _| {}).await.unwrap();
    assert_eq!(memory.len(), 4, "2 layers x K and V");
    assert_eq!(pool.pages, 4);
}

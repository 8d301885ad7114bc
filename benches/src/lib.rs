//! kvxfer benches: shared fixtures for the criterion benches in `benches/`.
//!
//! `planner` times [`kvxfer_core::plan::plan_chunk`] and the iteration of every op of its plan for a
//! Llama-3-70B-shaped request (80 layers, 8 KV heads of 128 elements, bf16, page size 16, 128k tokens),
//! and prints the op count next to the one-op-per-token count SGLang's transfer path emits.
//! Run: `cargo bench -p kvxfer-benches --bench planner -- --warm-up-time 1 --measurement-time 3`.

use kvxfer_core::plan::ChunkPlan;
use kvxfer_core::{Attention, ConfigError, KvSpec, Layout, Parallel, SideSpec, Topology};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// Layers of Llama-3-70B.
pub const LLAMA70B_LAYERS: u32 = 80;
/// KV heads of Llama-3-70B.
pub const LLAMA70B_KV_HEADS: u32 = 8;
/// Head dim of Llama-3-70B.
pub const LLAMA70B_HEAD_DIM: u32 = 128;
/// Tokens per page (SGLang's and vLLM's common page size on GPUs).
pub const PAGE_SIZE: u32 = 16;
/// Tokens of the request: 128k.
pub const TOKENS: u32 = 128 * 1024;
/// Pages of the request.
pub const PAGES: u32 = TOKENS / PAGE_SIZE;

/// The Llama-3-70B KV spec (bf16) in `layout`.
pub fn llama70b_kv(layout: Layout) -> KvSpec {
    KvSpec {
        attention: Attention::Gqa {
            kv_heads: LLAMA70B_KV_HEADS,
            head_dim_k: LLAMA70B_HEAD_DIM,
            head_dim_v: LLAMA70B_HEAD_DIM,
        },
        layers: LLAMA70B_LAYERS,
        dtype_bytes: 2,
        page_size: PAGE_SIZE,
        layout,
    }
}

/// Prefill TP `p` to decode TP `d`, PP 1 on both sides.
pub fn llama70b_topology(p: u32, d: u32, layout: Layout) -> Result<Topology, ConfigError> {
    let kv = llama70b_kv(layout);
    Topology::new(&SideSpec { kv, parallel: Parallel::new(p, 1) }, &SideSpec { kv, parallel: Parallel::new(d, 1) })
}

/// Source and destination page lists of `pages` pages. Contiguous: `0..pages` on both sides (one run).
/// Shuffled: `pages` distinct pages drawn from a pool twice that size on each side, in random order
/// (fixed seed), as a busy allocator hands them out: almost no two consecutive pairs coalesce.
pub fn page_lists(pages: u32, shuffled: bool) -> (Vec<u32>, Vec<u32>) {
    if !shuffled {
        let v: Vec<u32> = (0..pages).collect();
        return (v.clone(), v);
    }
    let mut rng = StdRng::seed_from_u64(0x6b76_7866_6572);
    let mut draw = || {
        let mut pool: Vec<u32> = (0..pages * 2).collect();
        pool.shuffle(&mut rng);
        pool.truncate(pages as usize);
        pool
    };
    let src = draw();
    let dst = draw();
    (src, dst)
}

/// Ops an engine posting one op per token per layer per K/V for every (prefill, decode) pair would post
/// (SGLang's head-slice transfer path): tokens x kinds x the sum over pairs of the sending stage's layers.
pub fn one_op_per_token(topo: &Topology, plan: &ChunkPlan) -> u64 {
    let tokens: u64 = plan.runs.iter().map(|r| u64::from(r.len)).sum::<u64>() * u64::from(topo.kv().page_size);
    let pair_layers: u64 = plan.pairs.iter().map(|p| u64::from(p.layers)).sum();
    tokens * pair_layers * topo.kv().kinds().len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_core::plan::{page_runs, plan_chunk};

    #[test]
    fn contiguous_is_one_run_and_shuffled_is_a_distinct_scatter() {
        let (s, d) = page_lists(PAGES, false);
        assert_eq!(page_runs(&s, &d).unwrap().len(), 1);
        let (s, d) = page_lists(PAGES, true);
        assert_eq!(s.len(), PAGES as usize);
        let mut sorted = d.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), PAGES as usize, "destination pages repeat");
        assert!(page_runs(&s, &d).unwrap().len() > PAGES as usize * 9 / 10);
    }

    #[test]
    fn per_token_count_of_a_small_plan() {
        // P=8 -> D=2: 8 pairs; 2 pages of 16 tokens, 80 layers, K and V.
        let topo = llama70b_topology(8, 2, Layout::Nhd).unwrap();
        let plan = plan_chunk(&topo, &[0, 1], &[5, 9]).unwrap();
        assert_eq!(one_op_per_token(&topo, &plan), 32 * 80 * 2 * 8);
    }
}

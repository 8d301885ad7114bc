//! The planner against the oracle, with no IO: every configuration of the matrix, every destination
//! byte checked against head ownership and counted (written exactly once), nothing outside the
//! request touched, and the byte totals of SEMANTICS §4.

use std::collections::HashMap;
use std::sync::Arc;

use kvxfer_core::oracle::{token_map, BufferGeom, SENTINEL};
use kvxfer_core::plan::{plan_chunk, plan_sender};
use kvxfer_core::{
    Attention, BufferRef, IndexedOp, KvSpec, Layout, PairPlan, Parallel, PlanError, PlannedOp, RankId, RegionId, Side,
    SideSpec, Topology, WriteOp,
};
use proptest::prelude::*;

fn spec(attention: Attention, layers: u32, page_size: u32, layout: Layout, tp: u32, pp: u32) -> SideSpec {
    SideSpec { kv: KvSpec { attention, layers, dtype_bytes: 2, page_size, layout }, parallel: Parallel::new(tp, pp) }
}

/// A side whose stages hold `stages[s]` layers each (an explicit, possibly uneven, partition).
fn staged(attention: Attention, page_size: u32, layout: Layout, tp: u32, stages: &[u32]) -> SideSpec {
    let layers = stages.iter().sum();
    SideSpec {
        kv: KvSpec { attention, layers, dtype_bytes: 2, page_size, layout },
        parallel: Parallel::with_stage_layers(tp, stages).unwrap(),
    }
}

/// Checks a topology's stage layout against the partition it was built from (the literal numbers, not
/// the topology's own arithmetic), and every pair of a plan against it: prefill stage s sends
/// `stages[s]` layers, landing at `sum(stages[..s])` on a decode PP 1 rank and at 0 on equal PP.
fn check_stages(topo: &Topology, stages: &[u32]) {
    let starts: Vec<u32> = stages.iter().scan(0, |acc, l| Some(std::mem::replace(acc, *acc + l))).collect();
    assert_eq!(topo.layer_partition(Side::Prefill), stages);
    let dpp = topo.parallel(Side::Decode).pp;
    for (s, (&l, &ls)) in stages.iter().zip(&starts).enumerate() {
        let s = s as u32;
        assert_eq!(topo.stage_layers(Side::Prefill, s), l);
        assert_eq!(topo.first_layer(Side::Prefill, s), ls);
        assert_eq!(topo.stage_range(Side::Prefill, s), ls..ls + l);
        let (dst_layers, dst_start) = if dpp == 1 { (topo.kv().layers, 0) } else { (l, ls) };
        assert_eq!(topo.stage_layers(Side::Decode, if dpp == 1 { 0 } else { s }), dst_layers);
        assert_eq!(topo.first_layer(Side::Decode, if dpp == 1 { 0 } else { s }), dst_start);
        assert_eq!(topo.dst_layer_offset(s), if dpp == 1 { ls } else { 0 });
    }
    let plan = plan_chunk(topo, &[0, 1], &[1, 0]).unwrap();
    for pair in &plan.pairs {
        let s = pair.src.pp as usize;
        assert_eq!(pair.layers, stages[s], "{pair:?}");
        assert_eq!(pair.dst.pp, if dpp == 1 { 0 } else { pair.src.pp });
        for op in pair.ops() {
            assert!(op.src_region.layer < stages[s]);
            let global = starts[s] + op.src_region.layer;
            assert_eq!(op.dst_region.layer, if dpp == 1 { global } else { op.src_region.layer }, "{op:?}");
        }
    }
}

fn write(op: &PlannedOp) -> WriteOp {
    WriteOp {
        src: RegionId(0),
        src_offset: op.src_offset,
        dst: RegionId(1),
        dst_offset: op.dst_offset,
        len: op.len,
        count: op.count,
        src_stride: op.src_stride,
        dst_stride: op.dst_stride,
    }
}

/// The indexed ops of a pair (one per layer and slice, the page template at every run) expand
/// into exactly the pair's plain ops, in order.
fn indexed_equals_plain(pair: &PairPlan) {
    let mut plain = pair.ops();
    for l in 0..pair.layers {
        for s in &pair.slices {
            let t = pair.page_template(l, s);
            let op = IndexedOp::new(write(&t), Arc::clone(&pair.runs));
            assert_eq!(op.write_ops(), pair.runs.len());
            let mut bytes = 0;
            for w in op.writes("planner test", None) {
                let p = plain.next().expect("no more plain ops than indexed writes");
                assert_eq!((t.src_region, t.dst_region), (p.src_region, p.dst_region));
                assert_eq!(w.expect("in range"), write(&p), "{pair:?} layer {l} {s:?}");
                bytes += p.bytes();
            }
            assert_eq!(op.bytes(), bytes);
        }
    }
    assert!(plain.next().is_none(), "as many plain ops as indexed writes");
}

struct Sim {
    topo: Topology,
    pool_pages: u32,
    src: HashMap<(RankId, BufferRef), Vec<u8>>,
    dst: HashMap<(RankId, BufferRef), (Vec<u8>, Vec<u8>)>,
}

impl Sim {
    fn new(topo: Topology, pool_pages: u32, src_pages: &[u32]) -> Self {
        let tokens = token_map(src_pages, topo.kv().page_size);
        let mut src = HashMap::new();
        for r in topo.ranks(Side::Prefill) {
            for l in 0..topo.stage_layers(Side::Prefill, r.pp) {
                for &kind in topo.kv().kinds() {
                    let g = BufferGeom::new(&topo, Side::Prefill, r, l, kind, pool_pages);
                    let mut b = vec![0u8; g.len() as usize];
                    g.fill(&mut b, &|p| tokens.get(&p).copied());
                    src.insert((r, BufferRef { layer: l, kind }), b);
                }
            }
        }
        let mut dst = HashMap::new();
        for r in topo.ranks(Side::Decode) {
            for l in 0..topo.stage_layers(Side::Decode, r.pp) {
                for &kind in topo.kv().kinds() {
                    let len = topo.buffer_bytes(Side::Decode, kind, pool_pages) as usize;
                    dst.insert((r, BufferRef { layer: l, kind }), (vec![SENTINEL; len], vec![0u8; len]));
                }
            }
        }
        Self { topo, pool_pages, src, dst }
    }

    fn apply(&mut self, src_pages: &[u32], dst_pages: &[u32]) -> Result<(), PlanError> {
        let plan = plan_chunk(&self.topo, src_pages, dst_pages)?;
        for pair in &plan.pairs {
            assert_eq!(
                plan_sender(&self.topo, pair.src, src_pages, dst_pages)?.iter().filter(|p| p.dst == pair.dst).count(),
                1
            );
            let mut ops = 0;
            for op in pair.ops() {
                ops += 1;
                let s = &self.src[&(pair.src, op.src_region)];
                let (d, w) = self.dst.get_mut(&(pair.dst, op.dst_region)).expect("destination buffer exists");
                assert!(op.src_end() <= s.len() as u64, "source range leaves its buffer: {op:?}");
                assert!(op.dst_end() <= d.len() as u64, "destination range leaves its buffer: {op:?}");
                for i in 0..op.count {
                    let so = (op.src_offset + i * op.src_stride) as usize;
                    let dso = (op.dst_offset + i * op.dst_stride) as usize;
                    let n = op.len as usize;
                    d[dso..dso + n].copy_from_slice(&s[so..so + n]);
                    for c in &mut w[dso..dso + n] {
                        *c += 1;
                    }
                }
            }
            assert_eq!(ops, pair.op_count());
            indexed_equals_plain(pair);
        }
        Ok(())
    }

    fn verify(&self, dst_pages: &[u32]) {
        let kv = *self.topo.kv();
        let tokens = token_map(dst_pages, kv.page_size);
        let requested: std::collections::HashSet<u32> = dst_pages.iter().copied().collect();
        for ((r, buf), (d, w)) in &self.dst {
            let g = BufferGeom::new(&self.topo, Side::Decode, *r, buf.layer, buf.kind, self.pool_pages);
            g.verify(0, d, &|p| tokens.get(&p).copied())
                .unwrap_or_else(|e| panic!("{:?} decode {r} {buf:?}: {e}", self.topo));
            let pb = g.page_bytes() as usize;
            for (i, c) in w.iter().enumerate() {
                let page = (i / pb) as u32;
                let want = u8::from(requested.contains(&page));
                assert_eq!(*c, want, "{:?}: decode {r} {buf:?} byte {i} written {c} times", self.topo);
            }
        }
        // SEMANTICS §4: bytes per decode rank = layers * pages * S * (hd*hk + hd*hv), MLA: latent bytes.
        for r in self.topo.ranks(Side::Decode) {
            let hd = u64::from(self.topo.local_heads(Side::Decode));
            let per_token: u64 = kv.kinds().iter().map(|k| hd * kv.head_bytes(*k)).sum();
            let want = u64::from(self.topo.stage_layers(Side::Decode, r.pp))
                * dst_pages.len() as u64
                * u64::from(kv.page_size)
                * per_token;
            let got: u64 = self
                .dst
                .iter()
                .filter(|((rr, _), _)| *rr == r)
                .map(|(_, (_, w))| w.iter().map(|c| u64::from(*c)).sum::<u64>())
                .sum();
            assert_eq!(got, want, "{:?}: decode rank {r} byte total", self.topo);
        }
    }
}

fn shuffled(n: u32, pool: u32, seed: u64) -> Vec<u32> {
    // A deterministic permutation of 0..pool, first n taken (non-contiguous, some runs).
    let mut v: Vec<u32> = (0..pool).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v.truncate(n as usize);
    v
}

const SIZES: [u32; 6] = [1, 2, 3, 4, 6, 8];
const HEADS: [u32; 6] = [1, 2, 4, 6, 8, 12];

fn run(topo: Topology, chunks: u32, pages_per_chunk: u32, seed: u64) {
    let pool = chunks * pages_per_chunk + 5;
    let src = shuffled(chunks * pages_per_chunk, pool, seed);
    let mut dst = shuffled(chunks * pages_per_chunk, pool, seed.wrapping_mul(31) + 7);
    if seed % 3 == 0 {
        dst = src.clone(); // identical lists coalesce into long runs
    }
    let mut sim = Sim::new(topo, pool, &src);
    for c in 0..chunks as usize {
        let r = c * pages_per_chunk as usize..(c + 1) * pages_per_chunk as usize;
        sim.apply(&src[r.clone()], &dst[r]).unwrap();
    }
    sim.verify(&dst);
}

#[test]
fn gqa_matrix_every_tp_pair_every_head_count_both_layouts() {
    let mut cases = 0;
    for p in SIZES {
        for d in SIZES {
            for h in HEADS {
                for layout in [Layout::Nhd, Layout::Hnd] {
                    for (page_size, hk, hv) in [(4, 4, 4), (1, 4, 2), (16, 2, 6)] {
                        let a = Attention::Gqa { kv_heads: h, head_dim_k: hk, head_dim_v: hv };
                        let Ok(topo) =
                            Topology::new(&spec(a, 2, page_size, layout, p, 1), &spec(a, 2, page_size, layout, d, 1))
                        else {
                            continue;
                        };
                        run(topo, 2, 3, u64::from(p * 131 + d * 17 + h + page_size));
                        cases += 1;
                    }
                }
            }
        }
    }
    assert!(cases > 300, "only {cases} valid configurations");
}

#[test]
fn pipeline_stages_into_decode_pp1_and_equal_pp() {
    for (pp, dpp) in [(2, 1), (4, 1), (2, 2), (4, 4)] {
        for (p, d, h) in [(2, 4, 8), (4, 2, 2), (8, 2, 4), (1, 1, 1), (6, 3, 12), (2, 8, 2)] {
            for layout in [Layout::Nhd, Layout::Hnd] {
                let a = Attention::Gqa { kv_heads: h, head_dim_k: 4, head_dim_v: 2 };
                let topo = Topology::new(&spec(a, 8, 4, layout, p, pp), &spec(a, 8, 4, layout, d, dpp)).unwrap();
                run(topo, 2, 2, u64::from(pp * 7 + p));
            }
        }
    }
}

/// Uneven partitions, per stage count and position of the long stage, into decode PP 1 and into equal PP
/// with the same partition: every destination byte from head ownership and the stage ranges.
#[test]
fn uneven_pipeline_stages_into_decode_pp1_and_equal_pp() {
    let partitions: [&[u32]; 9] =
        [&[3, 2], &[2, 3], &[1, 4], &[4, 1], &[1, 2, 4], &[3, 3, 1], &[5, 1, 1], &[1, 2, 2, 1], &[2, 1, 1, 3]];
    let mut cases = 0;
    for stages in partitions {
        let pp = stages.len() as u32;
        for dpp in [1, pp] {
            for (p, d, h) in [(2, 4, 8), (4, 2, 2), (8, 2, 4), (1, 1, 1), (6, 3, 12), (2, 8, 2)] {
                for layout in [Layout::Nhd, Layout::Hnd] {
                    let a = Attention::Gqa { kv_heads: h, head_dim_k: 4, head_dim_v: 2 };
                    let prefill = staged(a, 4, layout, p, stages);
                    let decode = if dpp == 1 {
                        staged(a, 4, layout, d, &[prefill.kv.layers])
                    } else {
                        staged(a, 4, layout, d, stages)
                    };
                    let topo = Topology::new(&prefill, &decode).unwrap_or_else(|e| panic!("{stages:?} {dpp}: {e}"));
                    check_stages(&topo, stages);
                    run(topo, 2, 2, u64::from(pp * 7 + p + stages[0]));
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 9 * 2 * 6 * 2);
}

/// An uneven prefill partition into a decode side that states no partition (decode PP 1: every layer),
/// and an explicit even partition, which is the default split.
#[test]
fn uneven_prefill_into_implicit_decode_and_explicit_even_split() {
    let a = Attention::Gqa { kv_heads: 4, head_dim_k: 2, head_dim_v: 2 };
    let topo = Topology::new(&staged(a, 2, Layout::Nhd, 2, &[4, 3]), &spec(a, 7, 2, Layout::Nhd, 4, 1)).unwrap();
    check_stages(&topo, &[4, 3]);
    run(topo, 2, 3, 11);
    // [2, 2] explicit on one side, implicit even split on the other: identical, so accepted.
    let topo = Topology::new(&staged(a, 2, Layout::Hnd, 2, &[2, 2]), &spec(a, 4, 2, Layout::Hnd, 1, 2)).unwrap();
    check_stages(&topo, &[2, 2]);
    run(topo, 1, 3, 12);
}

#[test]
fn uneven_mla_one_sender_per_stage() {
    let a = Attention::Mla { latent_dim: 9 };
    for stages in [&[3u32, 2][..], &[1, 1, 3]] {
        for (p, d) in [(1, 1), (2, 4), (4, 2)] {
            let topo = Topology::new(
                &staged(a, 4, Layout::Nhd, p, stages),
                &spec(a, stages.iter().sum(), 4, Layout::Nhd, d, 1),
            )
            .unwrap();
            for r in topo.ranks(Side::Decode) {
                assert_eq!(topo.expected_senders(r).len(), stages.len(), "one sender per stage");
            }
            check_stages(&topo, stages);
            run(topo, 1, 4, u64::from(p + d));
        }
    }
}

#[test]
fn mla_single_sender_whole_latent() {
    for p in SIZES {
        for d in SIZES {
            let a = Attention::Mla { latent_dim: 9 };
            let Ok(topo) = Topology::new(&spec(a, 2, 4, Layout::Nhd, p, 2), &spec(a, 2, 4, Layout::Nhd, d, 1)) else {
                continue;
            };
            for r in topo.ranks(Side::Decode) {
                assert_eq!(topo.expected_senders(r).len(), 2, "one sender per stage");
            }
            run(topo, 1, 4, u64::from(p + d));
        }
    }
}

#[test]
fn sglang_april_2026_regression_p_lt_h_lt_d() {
    // P=2, H=4, D=8: decode ranks 0..8 hold heads 0,0,1,1,2,2,3,3; prefill 0 holds 0,1.
    let a = Attention::Gqa { kv_heads: 4, head_dim_k: 2, head_dim_v: 2 };
    let topo = Topology::new(&spec(a, 1, 1, Layout::Nhd, 2, 1), &spec(a, 1, 1, Layout::Nhd, 8, 1)).unwrap();
    let slots: Vec<u32> = (0..4).map(|d| kvxfer_core::plan::head_slice(&topo, 0, d).unwrap().1).collect();
    assert_eq!(slots, vec![0, 0, 1, 1]);
    run(topo, 1, 2, 1);
}

#[test]
fn expected_sender_counts_follow_semantics() {
    for p in SIZES {
        for d in SIZES {
            for h in HEADS {
                for (pp, dpp) in [(1, 1), (2, 1), (2, 2)] {
                    let a = Attention::Gqa { kv_heads: h, head_dim_k: 1, head_dim_v: 1 };
                    let Ok(topo) =
                        Topology::new(&spec(a, 4, 1, Layout::Nhd, p, pp), &spec(a, 4, 1, Layout::Nhd, d, dpp))
                    else {
                        continue;
                    };
                    let n = (if p > d { p / d } else { 1 }) * (if dpp == 1 { pp } else { 1 });
                    for r in topo.ranks(Side::Decode) {
                        let keys = topo.expected_senders(r);
                        assert_eq!(keys.len() as u32, n);
                        let uniq: std::collections::BTreeSet<_> = keys.iter().map(|k| k.to_u64()).collect();
                        assert_eq!(uniq.len(), keys.len(), "sender keys unique across stages");
                    }
                }
            }
        }
    }
}

#[test]
fn strided_ops_are_one_per_run_not_per_token() {
    // llama3-70b-like: H=8, P=8 -> D=2, NHD, page 16: 1 head of 4 per token row.
    let a = Attention::Gqa { kv_heads: 8, head_dim_k: 128, head_dim_v: 128 };
    let topo = Topology::new(&spec(a, 4, 16, Layout::Nhd, 8, 1), &spec(a, 4, 16, Layout::Nhd, 2, 1)).unwrap();
    let src: Vec<u32> = vec![0, 1, 2, 10, 11, 20];
    let dst: Vec<u32> = vec![5, 6, 7, 3, 4, 9];
    let plan = plan_chunk(&topo, &src, &dst).unwrap();
    assert_eq!(plan.runs.len(), 3);
    let pair = &plan.pairs[0];
    let op = pair.ops().next().unwrap();
    assert_eq!((op.len, op.count, op.src_stride, op.dst_stride), (256, 48, 256, 1024));
    assert_eq!(pair.op_count(), 4 * 2 * 3);
    // Equal TP moves whole pages: one contiguous op per run.
    let topo = Topology::new(&spec(a, 4, 16, Layout::Hnd, 2, 1), &spec(a, 4, 16, Layout::Hnd, 2, 1)).unwrap();
    let plan = plan_chunk(&topo, &src, &dst).unwrap();
    let op = plan.pairs[0].ops().next().unwrap();
    assert_eq!((op.count, op.len), (1, 3 * 16 * 4 * 256));
}

#[test]
fn bad_page_lists_are_rejected() {
    let a = Attention::Gqa { kv_heads: 2, head_dim_k: 1, head_dim_v: 1 };
    let topo = Topology::new(&spec(a, 1, 1, Layout::Nhd, 1, 1), &spec(a, 1, 1, Layout::Nhd, 1, 1)).unwrap();
    assert_eq!(plan_chunk(&topo, &[1, 2], &[3]).unwrap_err(), PlanError::PageCountMismatch { src: 2, dst: 1 });
    assert_eq!(plan_chunk(&topo, &[1, 2], &[3, 3]).unwrap_err(), PlanError::DuplicateDestinationPage { page: 3 });
    let e = kvxfer_core::plan::check_pages(Side::Decode, RankId::new(0, 0), &[1, 9], 4).unwrap_err();
    assert!(e.to_string().contains("page 9") && e.to_string().contains("4 pages"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn random_configurations_match_the_oracle(
        pi in 0usize..6, di in 0usize..6, hi in 0usize..6, hnd in any::<bool>(), mla in any::<bool>(),
        pp_sel in 0u32..3, page_size in 1u32..5, hk in 1u32..4, hv in 1u32..4, chunks in 1u32..4, n in 0u32..5, seed in any::<u64>(),
    ) {
        let (p, d, h) = (SIZES[pi], SIZES[di], HEADS[hi]);
        let layout = if hnd { Layout::Hnd } else { Layout::Nhd };
        let a = if mla { Attention::Mla { latent_dim: hk + hv } } else { Attention::Gqa { kv_heads: h, head_dim_k: hk, head_dim_v: hv } };
        let (pp, dpp) = [(1, 1), (2, 1), (2, 2)][pp_sel as usize];
        if let Ok(topo) = Topology::new(&spec(a, 4, page_size, layout, p, pp), &spec(a, 4, page_size, layout, d, dpp)) {
            run(topo, chunks, n, seed);
        }
    }

    /// Random uneven partitions (1 to 4 stages of 1 to 3 layers), into decode PP 1 or the same partition.
    #[test]
    fn random_uneven_partitions_match_the_oracle(
        pi in 0usize..6, di in 0usize..6, hi in 0usize..6, hnd in any::<bool>(), mla in any::<bool>(),
        stages in proptest::collection::vec(1u32..4, 1..5), equal_pp in any::<bool>(), page_size in 1u32..4,
        hk in 1u32..4, hv in 1u32..4, chunks in 1u32..3, n in 0u32..4, seed in any::<u64>(),
    ) {
        let (p, d, h) = (SIZES[pi], SIZES[di], HEADS[hi]);
        let layout = if hnd { Layout::Hnd } else { Layout::Nhd };
        let a = if mla { Attention::Mla { latent_dim: hk + hv } } else { Attention::Gqa { kv_heads: h, head_dim_k: hk, head_dim_v: hv } };
        let layers: u32 = stages.iter().sum();
        let decode = if equal_pp { staged(a, page_size, layout, d, &stages) } else { spec(a, layers, page_size, layout, d, 1) };
        if let Ok(topo) = Topology::new(&staged(a, page_size, layout, p, &stages), &decode) {
            check_stages(&topo, &stages);
            run(topo, chunks, n, seed);
        }
    }
}

//! The end-to-end digest (issue 30) without IO, over the configuration matrix: a sender's digest of
//! its source, accumulated over chunks and layer parts in any order, equals the decode rank's digest
//! of the destination after the plan's ops were carried out; one flipped destination byte makes
//! exactly the pair that wrote it differ, at the (layer, kind) entry that holds the byte.

use std::collections::HashMap;

use kvxfer_core::digest::{accumulate, compare, entries, hash_span, merge, Piece};
use kvxfer_core::plan::plan_sender;
use kvxfer_core::{Attention, BufferRef, KvSpec, Layout, PairPlan, Parallel, RankId, Side, SideSpec, Topology};

fn spec(attention: Attention, layers: u32, page_size: u32, layout: Layout, tp: u32, pp: u32) -> SideSpec {
    SideSpec { kv: KvSpec { attention, layers, dtype_bytes: 2, page_size, layout }, parallel: Parallel::new(tp, pp) }
}

type Buffers = HashMap<(RankId, BufferRef), Vec<u8>>;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn buffers(topo: &Topology, side: Side, pages: u32, rng: &mut Rng) -> Buffers {
    let mut out = HashMap::new();
    for r in topo.ranks(side) {
        for layer in 0..topo.stage_layers(side, r.pp) {
            for &kind in topo.kv().kinds() {
                let len = topo.buffer_bytes(side, kind, pages) as usize;
                let b: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                out.insert((r, BufferRef { layer, kind }), b);
            }
        }
    }
    out
}

fn digest_of(pair: &PairPlan, side: Side, rank: RankId, layers: std::ops::Range<u32>, mem: &Buffers) -> Vec<u64> {
    let mut acc = vec![0; entries(pair)];
    let mut hash = |p: &Piece, seed: u64| -> Result<u64, String> {
        let b = mem.get(&(rank, p.buffer)).ok_or_else(|| format!("no buffer {:?}", p.buffer))?;
        Ok(hash_span(&b[p.offset as usize..p.end() as usize], p, seed))
    };
    accumulate(pair, side, layers, &mut acc, &mut hash).unwrap();
    acc
}

/// Carries out every op of `src`'s plan; returns (pair, byte written) marks for the flip.
fn transfer(topo: &Topology, src_pages: &[u32], dst_pages: &[u32], src: &Buffers, dst: &mut Buffers) {
    for p in topo.ranks(Side::Prefill) {
        for pair in plan_sender(topo, p, src_pages, dst_pages).unwrap() {
            for op in pair.ops() {
                let s = &src[&(p, op.src_region)];
                let d = dst.get_mut(&(pair.dst, op.dst_region)).unwrap();
                for i in 0..op.count {
                    let (so, dso, n) = (
                        (op.src_offset + i * op.src_stride) as usize,
                        (op.dst_offset + i * op.dst_stride) as usize,
                        op.len as usize,
                    );
                    d[dso..dso + n].copy_from_slice(&s[so..so + n]);
                }
            }
        }
    }
}

fn check(topo: &Topology, seed: u64) -> usize {
    let mut rng = Rng(seed | 1);
    let pool = 8;
    let src = buffers(topo, Side::Prefill, pool, &mut rng);
    let mut dst = buffers(topo, Side::Decode, pool, &mut rng);
    let src_pages = [5u32, 6, 0, 1, 2, 7];
    let dst_pages = [3u32, 4, 5, 0, 7, 1];
    transfer(topo, &src_pages, &dst_pages, &src, &mut dst);
    let mut checked = 0;
    // What each sender sends: two chunks (4 + 2 pages), each in two layer parts (in either order).
    let mut sent: HashMap<(RankId, RankId), Vec<u64>> = HashMap::new();
    for p in topo.ranks(Side::Prefill) {
        let layers = topo.stage_layers(Side::Prefill, p.pp);
        let half = layers / 2;
        for (s, d, parts) in [
            (&src_pages[..4], &dst_pages[..4], vec![half..layers, 0..half]),
            (&src_pages[4..], &dst_pages[4..], vec![0..half, half..layers]),
        ] {
            for pair in plan_sender(topo, p, s, d).unwrap() {
                for part in &parts {
                    let acc = sent.entry((p, pair.dst)).or_default();
                    merge(acc, &digest_of(&pair, Side::Prefill, p, part.clone(), &src));
                }
            }
        }
    }
    for p in topo.ranks(Side::Prefill) {
        for pair in plan_sender(topo, p, &dst_pages, &dst_pages).unwrap() {
            let landed = digest_of(&pair, Side::Decode, pair.dst, 0..pair.layers, &dst);
            let mut s = sent[&(p, pair.dst)].clone();
            s.resize(entries(&pair), 0);
            assert_eq!(compare(&pair, &s, &landed).unwrap(), None, "{p} -> {}", pair.dst);
            checked += 1;
            if !pair.writes() {
                continue;
            }
            // Flip one byte this pair wrote: only this pair's digest differs, at that entry.
            let ops: Vec<_> = pair.ops().collect();
            let op = ops[(rng.next() % ops.len() as u64) as usize];
            let at = (op.dst_offset + (rng.next() % op.count) * op.dst_stride + rng.next() % op.len) as usize;
            dst.get_mut(&(pair.dst, op.dst_region)).unwrap()[at] ^= 0x40;
            let bad = digest_of(&pair, Side::Decode, pair.dst, 0..pair.layers, &dst);
            let m = compare(&pair, &s, &bad).unwrap().expect("a flipped byte is seen");
            assert_eq!((m.dst_layer, m.kind), (op.dst_region.layer, op.dst_region.kind), "{m}");
            for q in topo.ranks(Side::Prefill).into_iter().filter(|q| *q != p) {
                for other in plan_sender(topo, q, &dst_pages, &dst_pages).unwrap() {
                    if other.dst != pair.dst {
                        continue;
                    }
                    let mut so = sent[&(q, other.dst)].clone();
                    so.resize(entries(&other), 0);
                    let got = digest_of(&other, Side::Decode, other.dst, 0..other.layers, &dst);
                    assert_eq!(compare(&other, &so, &got).unwrap(), None, "{q} did not write the flipped byte");
                }
            }
            dst.get_mut(&(pair.dst, op.dst_region)).unwrap()[at] ^= 0x40;
        }
    }
    checked
}

#[test]
fn sender_and_receiver_digests_agree_and_a_flip_names_its_pair_and_layer() {
    let mut cases = 0;
    let mut pairs = 0;
    for (p, d) in [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (8, 2), (2, 8)] {
        for heads in [1, 2, 4, 8] {
            for layout in [Layout::Nhd, Layout::Hnd] {
                for (pp, dpp) in [(1, 1), (2, 1), (2, 2)] {
                    let a = Attention::Gqa { kv_heads: heads, head_dim_k: 4, head_dim_v: 2 };
                    let Ok(topo) = Topology::new(&spec(a, 4, 2, layout, p, pp), &spec(a, 4, 2, layout, d, dpp)) else {
                        continue;
                    };
                    pairs += check(&topo, u64::from(p * 1000 + d * 100 + heads * 10 + pp));
                    cases += 1;
                }
            }
        }
    }
    for (p, d) in [(1, 2), (4, 2), (2, 4)] {
        let a = Attention::Mla { latent_dim: 12 };
        let topo = Topology::new(&spec(a, 3, 2, Layout::Nhd, p, 1), &spec(a, 3, 2, Layout::Nhd, d, 1)).unwrap();
        pairs += check(&topo, u64::from(p * 7 + d));
        cases += 1;
    }
    assert!(cases > 100 && pairs > 500, "{cases} configurations, {pairs} pairs");
}

#[test]
fn a_digest_of_another_plan_is_refused_by_name() {
    let a = Attention::Gqa { kv_heads: 2, head_dim_k: 4, head_dim_v: 4 };
    let topo = Topology::new(&spec(a, 2, 1, Layout::Nhd, 1, 1), &spec(a, 2, 1, Layout::Nhd, 1, 1)).unwrap();
    let pair = plan_sender(&topo, RankId::new(0, 0), &[0], &[0]).unwrap().remove(0);
    let e = compare(&pair, &[1, 2], &[0; 4]).unwrap_err();
    assert!(e.contains("2 entries") && e.contains("has 4"), "{e}");
}

//! The slice planner (SEMANTICS §3-4): for one request chunk, which byte ranges each prefill rank
//! writes into each decode rank.
//!
//! A plan is not a list of every byte range. It is the product of three small parts, each linear in
//! its input: the stage's layers, the chunk's page runs (consecutive source and destination pages
//! coalesced), and the head slice of the (prefill, decode) pair. [`PairPlan::ops`] iterates that
//! product lazily. Each op is strided: one op covers a whole page run, in either layout, so NHD
//! head slices are one op per run rather than one per token, and whole-page moves collapse to one
//! contiguous range per run.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::heads;
use crate::model::{KvKind, Layout, RankId, SenderKey, Side, Topology};

/// A run of consecutive pages: source pages `src..src+len` land on destination pages `dst..dst+len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRun {
    /// First source page.
    pub src: u32,
    /// First destination page.
    pub dst: u32,
    /// Pages in the run.
    pub len: u32,
}

/// The strided shape of a write (offsets, range length and count, strides), apart from which
/// buffers it joins: what [`PairPlan::op`] and [`crate::IndexedOp::write_of`] share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Strided {
    pub(crate) src_offset: u64,
    pub(crate) dst_offset: u64,
    pub(crate) len: u64,
    pub(crate) count: u64,
    pub(crate) src_stride: u64,
    pub(crate) dst_stride: u64,
}

impl Strided {
    /// A page template (the write of source page 0 to destination page 0, one page's ranges
    /// unmerged) moved to run `r`: a page spans `count * stride` bytes on each side and a run of
    /// `len` pages continues the same ranges; ranges that touch are merged into one, and a single
    /// range's strides are its length. The one place this rule lives; `None` when an offset
    /// overflows `u64`.
    pub(crate) fn at_run(self, r: &PageRun) -> Option<Strided> {
        let src_page = self.count.checked_mul(self.src_stride)?;
        let dst_page = self.count.checked_mul(self.dst_stride)?;
        let mut op = Strided {
            src_offset: src_page.checked_mul(u64::from(r.src))?.checked_add(self.src_offset)?,
            dst_offset: dst_page.checked_mul(u64::from(r.dst))?.checked_add(self.dst_offset)?,
            count: self.count.checked_mul(u64::from(r.len))?,
            ..self
        };
        if op.count > 1 && op.len == op.src_stride && op.len == op.dst_stride {
            op.len = op.len.checked_mul(op.count)?;
            op.count = 1;
        }
        if op.count == 1 {
            op.src_stride = op.len;
            op.dst_stride = op.len;
        }
        Some(op)
    }
}

/// Coalesces a chunk's page lists into runs. Rejects lists of different length and destination
/// pages that repeat (two source pages would land on one).
pub fn page_runs(src: &[u32], dst: &[u32]) -> Result<Vec<PageRun>, PlanError> {
    if src.len() != dst.len() {
        return Err(PlanError::PageCountMismatch { src: src.len(), dst: dst.len() });
    }
    // Strictly increasing lists (the common case) cannot repeat; otherwise sort a copy.
    if !dst.windows(2).all(|w| w[0] < w[1]) {
        let mut sorted = dst.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(PlanError::DuplicateDestinationPage { page: w[0] });
        }
    }
    let mut runs: Vec<PageRun> = Vec::new();
    for (&s, &d) in src.iter().zip(dst) {
        if let Some(last) = runs.last_mut() {
            if u64::from(last.src) + u64::from(last.len) == u64::from(s)
                && u64::from(last.dst) + u64::from(last.len) == u64::from(d)
            {
                last.len += 1;
                continue;
            }
        }
        runs.push(PageRun { src: s, dst: d, len: 1 });
    }
    Ok(runs)
}

/// Checks every page of `pages` against a pool of `capacity` pages.
pub fn check_pages(side: Side, rank: RankId, pages: &[u32], capacity: u32) -> Result<(), PlanError> {
    match pages.iter().find(|p| **p >= capacity) {
        Some(&page) => Err(PlanError::PageOutOfRange { side, rank, page, capacity }),
        None => Ok(()),
    }
}

/// One buffer of a rank: a rank-local layer and a kind. Offsets in ops are bytes inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BufferRef {
    /// Rank-local layer index.
    pub layer: u32,
    /// K, V or latent.
    pub kind: KvKind,
}

/// One strided copy: `count` ranges of `len` bytes, the i-th at `src_offset + i*src_stride` in the
/// source buffer and `dst_offset + i*dst_stride` in the destination buffer. `count == 1` is a plain
/// contiguous range (strides are then equal to `len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedOp {
    /// Source buffer (prefill rank-local layer and kind).
    pub src_region: BufferRef,
    /// Destination buffer (decode rank-local layer and kind).
    pub dst_region: BufferRef,
    /// Byte offset of the first range in the source buffer.
    pub src_offset: u64,
    /// Byte offset of the first range in the destination buffer.
    pub dst_offset: u64,
    /// Bytes per range.
    pub len: u64,
    /// Number of ranges.
    pub count: u64,
    /// Bytes between consecutive source ranges.
    pub src_stride: u64,
    /// Bytes between consecutive destination ranges.
    pub dst_stride: u64,
}

impl PlannedOp {
    /// Total bytes moved.
    pub fn bytes(&self) -> u64 {
        self.len * self.count
    }
    /// One past the last source byte touched.
    pub fn src_end(&self) -> u64 {
        self.src_offset + (self.count - 1) * self.src_stride + self.len
    }
    /// One past the last destination byte touched.
    pub fn dst_end(&self) -> u64 {
        self.dst_offset + (self.count - 1) * self.dst_stride + self.len
    }
}

/// The head slice of one (prefill, decode) pair for one kind of buffer (SEMANTICS §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindSlice {
    /// K, V or latent.
    pub kind: KvKind,
    /// Bytes of one head of one token (hk, hv or the latent).
    pub head_bytes: u64,
    /// Heads per token in the source buffer (local(P)).
    pub src_heads: u32,
    /// Heads per token in the destination buffer (local(D)).
    pub dst_heads: u32,
    /// Heads moved (n = |G|).
    pub n: u32,
    /// First moved head's slot in the source rank.
    pub src_slot: u32,
    /// First moved head's slot in the destination rank.
    pub dst_slot: u32,
}

/// The (n, src_slot, dst_slot) of a pair, or `None` when the pair moves no bytes
/// (a replica whose head is written by a lower-ranked holder; SEMANTICS §3).
pub fn head_slice(topo: &Topology, p: u32, d: u32) -> Option<(u32, u32, u32)> {
    let kv = topo.kv();
    if kv.is_mla() {
        return Some((1, 0, 0));
    }
    let h = kv.kv_heads();
    let (pt, dt) = (topo.parallel(Side::Prefill).tp, topo.parallel(Side::Decode).tp);
    let g = heads::intersect(heads::heads(h, pt, p), heads::heads(h, dt, d));
    if g.is_empty() {
        return None;
    }
    // Deduplicate replicas: the lowest-ranked sender of `d` that holds a head writes it.
    let senders = topo.sender_tps(d);
    if (senders.start..p).any(|q| !heads::intersect(heads::heads(h, pt, q), g.clone()).is_empty()) {
        return None;
    }
    Some((g.len() as u32, g.start - heads::first(h, pt, p), g.start - heads::first(h, dt, d)))
}

/// What one prefill rank writes into one decode rank for one chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairPlan {
    /// The prefill rank.
    pub src: RankId,
    /// The decode rank.
    pub dst: RankId,
    /// The sender key the prefill rank notifies with.
    pub key: SenderKey,
    /// Layers of the sending stage (source layers `0..layers`; stages may hold different counts).
    pub layers: u32,
    /// Destination layer of source layer 0 (the stage's first global layer `ls` when decode PP is 1,
    /// else 0).
    pub dst_layer_offset: u32,
    /// Head slice per kind; empty when this pair moves no bytes (it still notifies).
    pub slices: Vec<KindSlice>,
    /// The chunk's page runs (shared by every pair of the chunk).
    pub runs: Arc<[PageRun]>,
    /// Tokens per page.
    pub page_size: u32,
    /// Page layout.
    pub layout: Layout,
}

impl PairPlan {
    /// Whether the pair moves any bytes.
    pub fn writes(&self) -> bool {
        !self.slices.is_empty() && !self.runs.is_empty()
    }

    /// Number of ops [`Self::ops`] yields: layers x kinds x runs.
    pub fn op_count(&self) -> u64 {
        u64::from(self.layers) * self.slices.len() as u64 * self.runs.len() as u64
    }

    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        let pages: u64 = self.runs.iter().map(|r| u64::from(r.len)).sum();
        let per_page: u64 = self.slices.iter().map(|s| u64::from(s.n) * s.head_bytes * u64::from(self.page_size)).sum();
        u64::from(self.layers) * pages * per_page
    }

    /// Ops, layer-major, then kind, then page run. Lazily computed; nothing is materialised.
    pub fn ops(&self) -> impl Iterator<Item = PlannedOp> + '_ {
        (0..self.layers)
            .flat_map(move |l| self.slices.iter().flat_map(move |s| self.runs.iter().map(move |r| self.op(l, s, r))))
    }

    /// The op for source layer `l`, slice `s`, run `r`.
    pub fn op(&self, l: u32, s: &KindSlice, r: &PageRun) -> PlannedOp {
        let t = self.page_template(l, s);
        let g = Strided {
            src_offset: t.src_offset,
            dst_offset: t.dst_offset,
            len: t.len,
            count: t.count,
            src_stride: t.src_stride,
            dst_stride: t.dst_stride,
        }
        .at_run(r)
        .expect("a planned offset fits u64 (it would take a page of more than 4 GiB)");
        PlannedOp {
            src_offset: g.src_offset,
            dst_offset: g.dst_offset,
            len: g.len,
            count: g.count,
            src_stride: g.src_stride,
            dst_stride: g.dst_stride,
            ..t
        }
    }

    /// The template of the indexed op for source layer `l` and slice `s`: the write of source page
    /// 0 to destination page 0, with the ranges of one page unmerged, so that a page spans
    /// `count * stride` bytes on each side (what [`crate::IndexedOp`] requires). [`Self::op`] is it
    /// moved to a run (the one place the slice and page arithmetic lives; the move is `Strided::at_run`, shared with [`crate::IndexedOp`]).
    pub fn page_template(&self, l: u32, s: &KindSlice) -> PlannedOp {
        let sz = u64::from(self.page_size);
        let hb = s.head_bytes;
        let (hp, hd, n) = (u64::from(s.src_heads), u64::from(s.dst_heads), u64::from(s.n));
        let (src_offset, dst_offset, len, count, src_stride, dst_stride) = match self.layout {
            Layout::Nhd => (u64::from(s.src_slot) * hb, u64::from(s.dst_slot) * hb, n * hb, sz, hp * hb, hd * hb),
            Layout::Hnd => (
                u64::from(s.src_slot) * sz * hb,
                u64::from(s.dst_slot) * sz * hb,
                n * sz * hb,
                1,
                sz * hp * hb,
                sz * hd * hb,
            ),
        };
        PlannedOp {
            src_region: BufferRef { layer: l, kind: s.kind },
            dst_region: BufferRef { layer: self.dst_layer_offset + l, kind: s.kind },
            src_offset,
            dst_offset,
            len,
            count,
            src_stride,
            dst_stride,
        }
    }
}

/// Every pair's plan for one chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlan {
    /// The chunk's page runs.
    pub runs: Arc<[PageRun]>,
    /// One entry per (prefill rank, decode rank) pair that communicates, ordered by prefill rank.
    pub pairs: Vec<PairPlan>,
}

impl ChunkPlan {
    /// Total ops over all pairs.
    pub fn op_count(&self) -> u64 {
        self.pairs.iter().map(PairPlan::op_count).sum()
    }
}

fn pair(topo: &Topology, src: RankId, dst: RankId, runs: &Arc<[PageRun]>) -> PairPlan {
    let kv = topo.kv();
    let slices = match head_slice(topo, src.tp, dst.tp) {
        None => Vec::new(),
        Some((n, src_slot, dst_slot)) => kv
            .kinds()
            .iter()
            .map(|&kind| KindSlice {
                kind,
                head_bytes: kv.head_bytes(kind),
                src_heads: topo.local_heads(Side::Prefill),
                dst_heads: topo.local_heads(Side::Decode),
                n,
                src_slot,
                dst_slot,
            })
            .collect(),
    };
    PairPlan {
        src,
        dst,
        key: SenderKey::of(src),
        layers: topo.stage_layers(Side::Prefill, src.pp),
        dst_layer_offset: topo.dst_layer_offset(src.pp),
        slices,
        runs: Arc::clone(runs),
        page_size: kv.page_size,
        layout: kv.layout,
    }
}

/// The pairs of one prefill rank (one per decode rank it feeds) for a chunk.
pub fn plan_sender(
    topo: &Topology,
    src: RankId,
    src_pages: &[u32],
    dst_pages: &[u32],
) -> Result<Vec<PairPlan>, PlanError> {
    topo.check_rank(Side::Prefill, src)?;
    let runs: Arc<[PageRun]> = page_runs(src_pages, dst_pages)?.into();
    Ok(topo.receivers(src).into_iter().map(|dst| pair(topo, src, dst, &runs)).collect())
}

/// The whole chunk: every communicating pair.
pub fn plan_chunk(topo: &Topology, src_pages: &[u32], dst_pages: &[u32]) -> Result<ChunkPlan, PlanError> {
    let runs: Arc<[PageRun]> = page_runs(src_pages, dst_pages)?.into();
    let pairs = topo
        .ranks(Side::Prefill)
        .into_iter()
        .flat_map(|src| topo.receivers(src).into_iter().map(move |dst| (src, dst)))
        .map(|(src, dst)| pair(topo, src, dst, &runs))
        .collect();
    Ok(ChunkPlan { runs, pairs })
}

//! The reference content of KV buffers, written from head ownership (SEMANTICS §2) and never from the
//! planner: what every byte of a prefill buffer holds, and what every byte of a decode buffer must
//! hold after a request. Used by the core's planner tests, the conformance suite and the demo.
//!
//! A byte's value encodes (global layer, kind, global head, token, byte index), so a byte that lands
//! in the wrong layer, head slot, token, page or K/V buffer shows up as a mismatch that names where
//! it came from.

use crate::heads;
use crate::model::{KvKind, Layout, RankId, Side, Topology};

/// The byte written into decode memory that no request may touch (outside requested pages).
pub const SENTINEL: u8 = 0xA5;

/// Token numbers at and above this mark prefill pages that are not part of any request.
pub const FOREIGN_TOKEN: u64 = 1 << 40;

/// The value of byte `byte` of head `head` of token `token` in global layer `layer`, buffer `kind`.
pub fn pattern(layer: u32, kind: KvKind, head: u32, token: u64, byte: u64) -> u8 {
    let mut x = u64::from(layer).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(kind.index() + 1).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ u64::from(head).wrapping_mul(0x1656_67B1_9E37_79F9)
        ^ token.wrapping_mul(0x27D4_EB2F_1656_67C5)
        ^ byte.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    (x ^ (x >> 8)) as u8
}

/// Where a byte of a rank's buffer sits: the coordinates [`pattern`] takes, plus the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coord {
    /// Global layer.
    pub layer: u32,
    /// K, V or latent.
    pub kind: KvKind,
    /// Global head (0 for the latent).
    pub head: u32,
    /// Pool page.
    pub page: u32,
    /// Token slot within the page.
    pub slot: u32,
    /// Byte within the head.
    pub byte: u64,
}

/// The geometry of one rank's buffer for one (rank-local layer, kind).
#[derive(Debug, Clone, Copy)]
pub struct BufferGeom {
    global_layer: u32,
    kind: KvKind,
    heads: u32,
    first_head: u32,
    head_bytes: u64,
    page_size: u32,
    layout: Layout,
    pages: u32,
}

impl BufferGeom {
    /// The buffer of `side` rank `rank`, rank-local `layer`, `kind`, holding `pages` pages. Its global
    /// layer is `ls + layer`, `ls` the first layer of the rank's stage (stages may be uneven).
    pub fn new(topo: &Topology, side: Side, rank: RankId, layer: u32, kind: KvKind, pages: u32) -> Self {
        let kv = topo.kv();
        let t = topo.parallel(side).tp;
        let first_head = if kv.is_mla() { 0 } else { heads::first(kv.kv_heads(), t, rank.tp) };
        // The stage's first global layer, summed here from the per-stage counts (SEMANTICS §1) rather
        // than taken from the topology's `first_layer`, which the planner's destination offsets use.
        let stage_start: u32 = (0..rank.pp).map(|s| topo.stage_layers(side, s)).sum();
        Self {
            global_layer: stage_start + layer,
            kind,
            heads: topo.local_heads(side),
            first_head,
            head_bytes: kv.head_bytes(kind),
            page_size: kv.page_size,
            layout: kv.layout,
            pages,
        }
    }

    /// Bytes of the buffer.
    pub fn len(&self) -> u64 {
        u64::from(self.pages) * u64::from(self.page_size) * u64::from(self.heads) * self.head_bytes
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> u64 {
        u64::from(self.page_size) * u64::from(self.heads) * self.head_bytes
    }

    /// The coordinates of byte `offset`.
    pub fn coord(&self, offset: u64) -> Coord {
        let hb = self.head_bytes;
        let (s, h) = (u64::from(self.page_size), u64::from(self.heads));
        let byte = offset % hb;
        let unit = offset / hb;
        let (page, slot, j) = match self.layout {
            Layout::Nhd => {
                let j = unit % h;
                let row = unit / h;
                (row / s, row % s, j)
            }
            Layout::Hnd => {
                let t = unit % s;
                let ph = unit / s;
                (ph / h, t, ph % h)
            }
        };
        Coord {
            layer: self.global_layer,
            kind: self.kind,
            head: self.first_head + j as u32,
            page: page as u32,
            slot: slot as u32,
            byte,
        }
    }

    /// Fills `buf` (the whole buffer) as a prefill rank holds it: page `p` holds the request tokens
    /// `token_of_page(p)*S ..` when it is part of a request, foreign tokens otherwise.
    pub fn fill(&self, buf: &mut [u8], token_of_page: &dyn Fn(u32) -> Option<u64>) {
        self.fill_range(0, buf, token_of_page);
    }

    /// Like [`Self::fill`] for the part of the buffer starting at `offset`.
    pub fn fill_range(&self, offset: u64, buf: &mut [u8], token_of_page: &dyn Fn(u32) -> Option<u64>) {
        let s = u64::from(self.page_size);
        for (i, b) in buf.iter_mut().enumerate() {
            let c = self.coord(offset + i as u64);
            let base = token_of_page(c.page).unwrap_or(FOREIGN_TOKEN + u64::from(c.page) * s);
            *b = pattern(c.layer, c.kind, c.head, base + u64::from(c.slot), c.byte);
        }
    }

    /// The byte decode memory must hold at `offset`: the pattern for request pages, [`SENTINEL`] elsewhere.
    pub fn expected(&self, offset: u64, token_of_page: &dyn Fn(u32) -> Option<u64>) -> u8 {
        let c = self.coord(offset);
        match token_of_page(c.page) {
            Some(base) => pattern(c.layer, c.kind, c.head, base + u64::from(c.slot), c.byte),
            None => SENTINEL,
        }
    }

    /// Compares a decode buffer (starting at `offset`) with what it must hold. Returns the first
    /// mismatch and the number of mismatching bytes.
    pub fn verify(
        &self,
        offset: u64,
        buf: &[u8],
        token_of_page: &dyn Fn(u32) -> Option<u64>,
    ) -> Result<(), VerifyError> {
        let mut first = None;
        let mut count = 0u64;
        for (i, &got) in buf.iter().enumerate() {
            let off = offset + i as u64;
            let want = self.expected(off, token_of_page);
            if got != want {
                count += 1;
                if first.is_none() {
                    first = Some((off, got, want));
                }
            }
        }
        match first {
            None => Ok(()),
            Some((off, got, want)) => Err(VerifyError { offset: off, got, want, coord: self.coord(off), count }),
        }
    }
}

/// A decode byte that differs from the oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{count} wrong bytes; first at offset {offset} (layer {}, {}, head {}, page {}, slot {}, byte {}): got 0x{got:02x}, want 0x{want:02x}",
    coord.layer, coord.kind, coord.head, coord.page, coord.slot, coord.byte
)]
pub struct VerifyError {
    /// Offset in the buffer.
    pub offset: u64,
    /// Byte found.
    pub got: u8,
    /// Byte expected.
    pub want: u8,
    /// Where it is.
    pub coord: Coord,
    /// Number of wrong bytes in the buffer.
    pub count: u64,
}

/// Maps pages to the request's token numbers: position `i` of `pages` holds tokens `i*S..(i+1)*S`.
pub fn token_map(pages: &[u32], page_size: u32) -> std::collections::HashMap<u32, u64> {
    pages.iter().enumerate().map(|(i, p)| (*p, i as u64 * u64::from(page_size))).collect()
}

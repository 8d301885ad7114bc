//! The opt-in end-to-end digest of a request (SEMANTICS §5, "done"; issue 30): what each sender
//! wrote into one decode rank, hashed on both sides.
//!
//! A decode rank that verifies digests asks for them in its handoff; every prefill rank that feeds
//! it hashes the bytes it writes there (read from its own pool), sums the hashes per (stage-local
//! layer, kind slice) over every chunk and layer part of the request, and sends the sums in one
//! [`crate::NotificationBody::Digest`] once all its writes for the request completed. The decode
//! rank, once its tracker has every chunk and digest, hashes the same bytes in its own pool and
//! compares entry by entry: the first differing entry names the sender, the layer, the kind and
//! the head slice whose bytes differ.
//!
//! What is hashed is independent of how the request was split: per (layer, kind, page), one XXH3-64
//! per piece of that page's head slice (a token's heads in NHD, the slice's heads in HND), seeded
//! by where it lands (destination layer, kind, destination page) and the piece's index, and all of
//! them are added (wrapping). Chunks, layer-wise parts, merged page runs and the order in which they
//! finish do not change the sums, and a page's bytes landing in another page change them.
//!
//! Pure: the caller hands in a function that hashes one piece of its own memory.

use std::ops::Range;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::model::{KvKind, Side};
use crate::plan::{BufferRef, KindSlice, PageRun, PairPlan};

/// One contiguous-or-strided range of one buffer: `count` pieces of `len` bytes, `stride` apart,
/// from `offset` (what one page's head slice occupies in a layer buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The (rank-local layer, kind) buffer.
    pub buffer: BufferRef,
    /// Byte offset of the first piece in that buffer.
    pub offset: u64,
    /// Bytes per piece.
    pub len: u64,
    /// Pieces.
    pub count: u64,
    /// Distance between piece starts.
    pub stride: u64,
}

impl Piece {
    /// Bytes the pieces hold.
    pub fn bytes(&self) -> u64 {
        self.len * self.count
    }

    /// One past the last byte of the last piece.
    pub fn end(&self) -> u64 {
        self.offset + (self.count - 1) * self.stride + self.len
    }
}

/// The seed of one page's hash: where its bytes land.
pub fn seed(dst_layer: u32, kind: KvKind, dst_page: u32) -> u64 {
    (u64::from(dst_layer) << 40) ^ ((kind.index() as u64) << 32) ^ u64::from(dst_page) ^ 0x6b76_7866_6572_0000
}

/// The hash of `piece`'s bytes, read from `span`, which holds the buffer's bytes from
/// `piece.offset` to [`Piece::end`]: the wrapping sum of one XXH3-64 per piece, each seeded by
/// `seed` and its index (a one-shot hash per piece is faster than streaming the pieces through
/// one hasher, which copies short inputs into its buffer).
pub fn hash_span(span: &[u8], piece: &Piece, seed: u64) -> u64 {
    let mut h = 0u64;
    for i in 0..piece.count {
        let at = (i * piece.stride) as usize;
        let s = seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h = h.wrapping_add(xxh3_64_with_seed(&span[at..at + piece.len as usize], s));
    }
    h
}

/// Entries of a pair's digest: one per (stage-local layer, kind slice), layer-major.
pub fn entries(pair: &PairPlan) -> usize {
    pair.layers as usize * pair.slices.len()
}

/// Hashes what `pair` writes for `layers` (stage-local) of its pages, read on `side` (the
/// prefill reads its source, the decode its destination), and adds it into `acc` (sized
/// [`entries`], zeroed for a fresh digest). `hash` hashes one piece of the caller's memory with
/// the given seed (see [`hash_span`]). Returns the bytes hashed. A pair that writes nothing (a
/// replicated head served by another sender) adds nothing.
pub fn accumulate<E>(
    pair: &PairPlan,
    side: Side,
    layers: Range<u32>,
    acc: &mut [u64],
    hash: &mut dyn FnMut(&Piece, u64) -> Result<u64, E>,
) -> Result<u64, E> {
    assert_eq!(acc.len(), entries(pair), "a digest of this pair has one entry per (layer, kind slice)");
    let mut bytes = 0;
    let n = pair.slices.len();
    for l in layers.start.min(pair.layers)..layers.end.min(pair.layers) {
        for (si, s) in pair.slices.iter().enumerate() {
            for r in pair.runs.iter() {
                for j in 0..r.len {
                    let page = PageRun { src: r.src + j, dst: r.dst + j, len: 1 };
                    let (piece, at) = page_piece(pair, l, s, &page, side);
                    acc[l as usize * n + si] = acc[l as usize * n + si].wrapping_add(hash(&piece, at)?);
                    bytes += piece.bytes();
                }
            }
        }
    }
    Ok(bytes)
}

fn page_piece(pair: &PairPlan, l: u32, s: &KindSlice, page: &PageRun, side: Side) -> (Piece, u64) {
    let op = pair.op(l, s, page);
    let at = seed(op.dst_region.layer, s.kind, page.dst);
    let piece = match side {
        Side::Prefill => {
            Piece { buffer: op.src_region, offset: op.src_offset, len: op.len, count: op.count, stride: op.src_stride }
        }
        Side::Decode => {
            Piece { buffer: op.dst_region, offset: op.dst_offset, len: op.len, count: op.count, stride: op.dst_stride }
        }
    };
    (piece, at)
}

/// Adds `other` into `acc` entry by entry (the digests of two parts of one request).
pub fn merge(acc: &mut Vec<u64>, other: &[u64]) {
    if acc.len() < other.len() {
        acc.resize(other.len(), 0);
    }
    for (a, b) in acc.iter_mut().zip(other) {
        *a = a.wrapping_add(*b);
    }
}

/// Where a sender's digest and the decode rank's own differ first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The first differing entry's layer, on the decode rank.
    pub dst_layer: u32,
    /// Its kind.
    pub kind: KvKind,
    /// The decode rank's local heads of that slice.
    pub heads: Range<u32>,
    /// The sender's sum and the decode rank's.
    pub sent: u64,
    /// What the decode rank computed.
    pub landed: u64,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "first bad range: layer {} {}, local heads {}..{} of the request's pages (sent {:016x}, landed {:016x})",
            self.dst_layer, self.kind, self.heads.start, self.heads.end, self.sent, self.landed
        )
    }
}

/// Compares a sender's digest with the one the decode rank computed over the same pair. `Err`
/// with a description when the sender's has another number of entries (another plan).
pub fn compare(pair: &PairPlan, sent: &[u64], landed: &[u64]) -> Result<Option<Mismatch>, String> {
    if sent.len() != landed.len() {
        return Err(format!(
            "the digest has {} entries, this rank's plan for the pair has {} (layers x kind slices): the two sides \
             plan differently",
            sent.len(),
            landed.len()
        ));
    }
    let n = pair.slices.len().max(1);
    Ok(sent.iter().zip(landed).position(|(a, b)| a != b).map(|i| {
        let s = &pair.slices[i % n];
        Mismatch {
            dst_layer: pair.dst_layer_offset + (i / n) as u32,
            kind: s.kind,
            heads: s.dst_slot..s.dst_slot + s.n,
            sent: sent[i],
            landed: landed[i],
        }
    }))
}

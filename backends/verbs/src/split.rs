//! Splitting write ops into RDMA WRITE work requests.
//!
//! A work request writes one contiguous destination range from up to `max_sge` local pieces. A
//! strided op therefore becomes:
//! - one work request per destination-contiguous run, gathering source pieces (strided source,
//!   contiguous destination: up to `max_sge` ranges per request);
//! - pieces whose source is contiguous too merge into one SGE (a contiguous op is one request);
//! - no request exceeds `max_msg` bytes and no SGE exceeds `u32::MAX` bytes (long ranges are cut);
//! - requests of at most `max_inline` bytes are marked inline (copied into the WQE at post time).
//!
//! Pure code: the property tests check that the requests cover exactly the op's bytes.

use kvxfer_core::WriteOp;

/// Largest SGE length (`ibv_sge::length` is a u32).
pub const MAX_SGE_LEN: u64 = u32::MAX as u64;

/// Device and QP limits that bound a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Scatter/gather entries per request (at least 1).
    pub max_sge: usize,
    /// Bytes per request (the port's max message size; at least 1).
    pub max_msg: u64,
    /// Requests of at most this many bytes are posted inline (0 disables).
    pub max_inline: u32,
}

/// One local piece of a work request: `len` bytes at `src_offset` of the op's source region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset in the source region.
    pub src_offset: u64,
    /// Bytes (1..=u32::MAX).
    pub len: u32,
}

/// One RDMA WRITE work request of an op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrPlan {
    /// Index of the op in the batch.
    pub op: usize,
    /// Offset in the destination region.
    pub dst_offset: u64,
    /// Total bytes (sum of the pieces).
    pub len: u64,
    /// Local pieces, in destination order.
    pub pieces: Vec<Piece>,
    /// Post inline.
    pub inline: bool,
}

impl WrPlan {
    fn dst_end(&self) -> u64 {
        self.dst_offset + self.len
    }
}

/// Splits one op (already bounds-checked) into work requests, appending to `out`.
pub fn split_op(op: &WriteOp, index: usize, limits: &Limits, out: &mut Vec<WrPlan>) {
    let max_sge = limits.max_sge.max(1);
    let max_msg = limits.max_msg.max(1);
    let mut cur: Option<WrPlan> = None;
    let flush = |cur: &mut Option<WrPlan>, out: &mut Vec<WrPlan>| {
        if let Some(mut w) = cur.take() {
            w.inline = w.len <= u64::from(limits.max_inline);
            out.push(w);
        }
    };
    for (s, d, len) in op.ranges() {
        let mut off = 0u64;
        while off < len {
            let (ps, pd, left) = (s + off, d + off, len - off);
            if let Some(w) = cur.as_mut() {
                if w.dst_end() == pd && w.len < max_msg {
                    let room = max_msg - w.len;
                    let last = w.pieces.last_mut().expect("a plan has at least one piece");
                    if last.src_offset + u64::from(last.len) == ps && u64::from(last.len) < MAX_SGE_LEN {
                        let take = left.min(room).min(MAX_SGE_LEN - u64::from(last.len));
                        last.len += take as u32;
                        w.len += take;
                        off += take;
                        continue;
                    }
                    if w.pieces.len() < max_sge {
                        let take = left.min(room).min(MAX_SGE_LEN);
                        w.pieces.push(Piece { src_offset: ps, len: take as u32 });
                        w.len += take;
                        off += take;
                        continue;
                    }
                }
            }
            flush(&mut cur, out);
            let take = left.min(max_msg).min(MAX_SGE_LEN);
            cur = Some(WrPlan {
                op: index,
                dst_offset: pd,
                len: take,
                pieces: vec![Piece { src_offset: ps, len: take as u32 }],
                inline: false,
            });
            off += take;
        }
    }
    flush(&mut cur, out);
}

/// Splits a batch of ops.
pub fn split_ops(ops: &[WriteOp], limits: &Limits) -> Vec<WrPlan> {
    let mut out = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        split_op(op, i, limits, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_core::RegionId;
    use proptest::prelude::*;

    fn op(src_offset: u64, src_stride: u64, dst_offset: u64, dst_stride: u64, len: u64, count: u64) -> WriteOp {
        WriteOp { src: RegionId(1), src_offset, dst: RegionId(2), dst_offset, len, count, src_stride, dst_stride }
    }

    /// Every (source byte, destination byte) pair the op moves, sorted.
    fn op_pairs(op: &WriteOp) -> Vec<(u64, u64)> {
        let mut v: Vec<_> = op.ranges().flat_map(|(s, d, l)| (0..l).map(move |i| (s + i, d + i))).collect();
        v.sort_unstable();
        v
    }

    fn plan_pairs(plans: &[WrPlan]) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        for w in plans {
            let mut d = w.dst_offset;
            for p in &w.pieces {
                for i in 0..u64::from(p.len) {
                    v.push((p.src_offset + i, d + i));
                }
                d += u64::from(p.len);
            }
        }
        v.sort_unstable();
        v
    }

    fn check_limits(plans: &[WrPlan], l: &Limits) -> Result<(), TestCaseError> {
        for w in plans {
            prop_assert!(!w.pieces.is_empty());
            prop_assert!(w.pieces.len() <= l.max_sge.max(1), "{} pieces > max_sge {}", w.pieces.len(), l.max_sge);
            prop_assert!(w.len >= 1 && w.len <= l.max_msg.max(1), "wr of {} bytes, max_msg {}", w.len, l.max_msg);
            prop_assert_eq!(w.len, w.pieces.iter().map(|p| u64::from(p.len)).sum::<u64>());
            prop_assert!(w.pieces.iter().all(|p| p.len > 0));
            prop_assert_eq!(w.inline, w.len <= u64::from(l.max_inline));
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn requests_cover_exactly_the_ops_bytes(
            src_offset in 0u64..64, dst_offset in 0u64..64, len in 0u64..48, count in 1u64..12,
            src_gap in 0u64..3, dst_gap in 0u64..3, src_extra in 0u64..9, dst_extra in 0u64..9,
            max_sge in 1usize..5, max_msg in 1u64..100, max_inline in 0u32..40,
        ) {
            // gap 0: contiguous stride; 1: strided; 2: overlapping-free larger stride.
            let src_stride = len + if src_gap == 0 { 0 } else { src_extra + 1 };
            let dst_stride = len + if dst_gap == 0 { 0 } else { dst_extra + 1 };
            let o = op(src_offset, src_stride, dst_offset, dst_stride, len, count);
            let l = Limits { max_sge, max_msg, max_inline };
            let plans = split_ops(&[o], &l);
            check_limits(&plans, &l)?;
            prop_assert_eq!(plan_pairs(&plans), op_pairs(&o));
            // Requests are emitted in destination order and never overlap on the destination.
            for w in plans.windows(2) {
                prop_assert!(w[0].dst_end() <= w[1].dst_offset);
            }
        }

        #[test]
        fn batches_keep_op_indices(lens in proptest::collection::vec(1u64..50, 1..6)) {
            let ops: Vec<_> = lens.iter().enumerate().map(|(i, &l)| op(i as u64 * 100, l, i as u64 * 100, l, l, 1)).collect();
            let plans = split_ops(&ops, &Limits { max_sge: 2, max_msg: 16, max_inline: 0 });
            for (i, o) in ops.iter().enumerate() {
                let mine: Vec<_> = plans.iter().filter(|w| w.op == i).cloned().collect();
                prop_assert_eq!(plan_pairs(&mine), op_pairs(o));
                prop_assert_eq!(mine.len() as u64, o.len.div_ceil(16));
            }
        }
    }

    #[test]
    fn contiguous_op_is_one_request_and_strided_destination_is_one_per_range() {
        let l = Limits { max_sge: 4, max_msg: 1 << 30, max_inline: 0 };
        // A contiguous op expressed as a strided one (stride == len) is one request of one SGE.
        let p = split_ops(&[op(0, 64, 0, 64, 64, 16)], &l);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].pieces, vec![Piece { src_offset: 0, len: 1024 }]);
        // Strided source, contiguous destination: gathered 4 SGEs per request.
        let p = split_ops(&[op(0, 128, 0, 64, 64, 16)], &l);
        assert_eq!(p.len(), 4);
        assert!(p.iter().all(|w| w.pieces.len() == 4 && w.len == 256));
        // Strided destination: one request per range, whatever the source.
        let p = split_ops(&[op(0, 64, 0, 128, 64, 16)], &l);
        assert_eq!(p.len(), 16);
    }

    #[test]
    fn long_ranges_respect_message_and_sge_limits() {
        let l = Limits { max_sge: 30, max_msg: 1 << 31, max_inline: 64 };
        let big = 5u64 << 30; // 5 GiB contiguous
        let p = split_ops(&[op(0, big, 0, big, big, 1)], &l);
        assert_eq!(p.len(), 3);
        assert!(p.iter().all(|w| w.len <= 1 << 31 && w.pieces.len() == 1));
        assert_eq!(p.iter().map(|w| w.len).sum::<u64>(), big);
        // Tiny requests are inline, others not.
        let p = split_ops(&[op(0, 8, 0, 8, 8, 1), op(0, 65, 0, 65, 65, 1)], &l);
        assert!(p[0].inline);
        assert!(!p[1].inline);
        // Zero-length ranges produce nothing.
        assert!(split_ops(&[op(0, 0, 0, 0, 0, 5)], &l).is_empty());
    }
}

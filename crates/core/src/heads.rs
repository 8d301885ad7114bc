//! Head ownership, the ground truth of SEMANTICS §2: which KV heads each TP rank holds.
//!
//! ```text
//! local(T)    = max(1, H / T)
//! heads(T, r) = [r*H/T, (r+1)*H/T)   if T <= H   (requires H % T == 0)
//!             = { r / (T/H) }        if T >  H   (requires T % H == 0)
//! ```

use std::ops::Range;

/// Whether `t` ranks can shard `h` heads (exactly, or by whole replication).
pub fn divides(h: u32, t: u32) -> bool {
    h > 0 && t > 0 && if t <= h { h % t == 0 } else { t % h == 0 }
}

/// Heads held by each of `t` ranks.
pub fn local(h: u32, t: u32) -> u32 {
    (h / t).max(1)
}

/// The global heads held by rank `r` of `t` (callers validated `divides(h, t)`).
pub fn heads(h: u32, t: u32, r: u32) -> Range<u32> {
    if t <= h {
        let n = h / t;
        r * n..(r + 1) * n
    } else {
        let head = r / (t / h);
        head..head + 1
    }
}

/// The lowest global head of rank `r`.
pub fn first(h: u32, t: u32, r: u32) -> u32 {
    heads(h, t, r).start
}

/// Intersection of two head ranges (empty when disjoint).
pub fn intersect(a: Range<u32>, b: Range<u32>) -> Range<u32> {
    let s = a.start.max(b.start);
    let e = a.end.min(b.end);
    if s < e {
        s..e
    } else {
        s..s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_head_held_and_replicated_evenly() {
        for h in 1..=16 {
            for t in 1..=32 {
                if !divides(h, t) {
                    continue;
                }
                let mut holders = vec![0u32; h as usize];
                for r in 0..t {
                    let hs = heads(h, t, r);
                    assert_eq!(hs.len() as u32, local(h, t), "h={h} t={t} r={r}");
                    for x in hs {
                        holders[x as usize] += 1;
                    }
                }
                let rep = (t / h).max(1);
                assert!(holders.iter().all(|c| *c == rep), "h={h} t={t}: {holders:?}");
            }
        }
    }

    #[test]
    fn replicated_heads_are_contiguous_blocks() {
        // H=2, T=4: ranks 0,1 hold head 0; ranks 2,3 hold head 1 (0,0,1,1 and not 0,1,0,1).
        let got: Vec<u32> = (0..4).map(|r| first(2, 4, r)).collect();
        assert_eq!(got, vec![0, 0, 1, 1]);
    }

    #[test]
    fn divisibility() {
        assert!(divides(8, 2) && divides(8, 16) && divides(6, 3) && divides(12, 6));
        assert!(!divides(8, 3) && !divides(6, 4) && !divides(12, 8) && !divides(0, 1));
    }
}

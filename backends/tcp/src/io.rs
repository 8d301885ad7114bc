//! Zero-copy vectored IO between sockets and registered memory.
//!
//! This is the crate's only `unsafe` code, and it is here for one reason: to send from and receive
//! into the engine's registered KV memory without staging copies, the socket calls need slices of
//! that memory, which `MemRegion::slice` / `slice_mut` hand out under the region's contract (see
//! each block's SAFETY comment). Everything else in the crate is safe code.
#![allow(unsafe_code)]

use std::io::{self, IoSlice, IoSliceMut};

use kvxfer_core::MemRegion;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use crate::wire::OpDesc;

/// Most iovecs per system call (Linux's IOV_MAX).
const IOV: usize = 1024;

/// The source side of one op: `count` ranges of `len` bytes at `offset + i * stride` in `mem`.
#[derive(Debug, Clone)]
pub(crate) struct SrcOp {
    pub mem: MemRegion,
    pub offset: u64,
    pub stride: u64,
    pub len: u64,
    pub count: u64,
}

fn mem_err(e: kvxfer_core::MemError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e.to_string())
}

/// Writes `head` and then every source range of `ops`, in order, straight from registered memory:
/// vectored writes of up to [`IOV`] slices per call, no staging copy.
pub(crate) async fn write_frame(w: &mut OwnedWriteHalf, head: &[u8], ops: &[SrcOp]) -> io::Result<()> {
    let mut ranges = ops.iter().flat_map(|op| (0..op.count).map(move |i| (&op.mem, op.offset + i * op.stride, op.len)));
    let mut window: Vec<&[u8]> = Vec::with_capacity(IOV);
    if !head.is_empty() {
        window.push(head);
    }
    loop {
        while window.len() < IOV {
            let Some((mem, off, len)) = ranges.next() else { break };
            // SAFETY: the sender validated every source range against its region before queueing
            // the frame (and `slice` re-checks bounds). Per `MemRegion::from_raw_parts`' contract,
            // source pages are not written while a send that reads them is in flight, and
            // `HostBuffer` regions stay alive because `ops` holds a clone of the region.
            let s = unsafe { mem.slice(off, len) }.map_err(mem_err)?;
            window.push(s);
        }
        if window.is_empty() {
            return Ok(());
        }
        let iov: Vec<IoSlice<'_>> = window.iter().map(|s| IoSlice::new(s)).collect();
        let n = w.write_vectored(&iov).await?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket accepted no bytes"));
        }
        advance(&mut window, n);
    }
}

fn advance(window: &mut Vec<&[u8]>, mut n: usize) {
    let mut k = 0;
    while k < window.len() && n >= window[k].len() {
        n -= window[k].len();
        k += 1;
    }
    window.drain(..k);
    if n > 0 {
        window[0] = &window[0][n..];
    }
}

/// Reads a validated WRITE frame's payload straight into its destination ranges: vectored reads
/// of up to [`IOV`] slices per call, no staging copy. `mems[i]` is the region of `ops[i]`.
pub(crate) async fn read_payload(r: &OwnedReadHalf, ops: &[OpDesc], mems: &[MemRegion]) -> io::Result<()> {
    let mut ranges = ops.iter().zip(mems).flat_map(|(op, mem)| op.ranges().map(move |(off, len)| (mem, off, len)));
    let mut window: Vec<&mut [u8]> = Vec::with_capacity(IOV);
    loop {
        while window.len() < IOV {
            let Some((mem, off, len)) = ranges.next() else { break };
            // SAFETY: `wire::validate_write` checked before this call that every range lies inside
            // its registered region and that no two ranges of the frame overlap, so the views made
            // here are disjoint. Per `MemRegion::from_raw_parts`' contract, destination pages of a
            // pending request are touched by nobody else until it completes or fails, and the
            // sender (the authenticated peer) writes each destination byte once (the planner's
            // invariant). `mems` holds clones of the regions, keeping owned buffers alive.
            let s = unsafe { mem.slice_mut(off, len) }.map_err(mem_err)?;
            window.push(s);
        }
        if window.is_empty() {
            return Ok(());
        }
        let n = loop {
            r.readable().await?;
            let mut iov: Vec<IoSliceMut<'_>> = window.iter_mut().map(|s| IoSliceMut::new(s)).collect();
            match r.try_read_vectored(&mut iov) {
                Ok(0) => {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream inside a frame"))
                }
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
        let mut n = n;
        let mut k = 0;
        while k < window.len() && n >= window[k].len() {
            n -= window[k].len();
            k += 1;
        }
        window.drain(..k);
        if n > 0 {
            let first = std::mem::take(&mut window[0]);
            window[0] = &mut first[n..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_skips_whole_and_partial_slices() {
        let a = [1u8; 4];
        let b = [2u8; 4];
        let c = [3u8; 4];
        let mut w: Vec<&[u8]> = vec![&a, &b, &c];
        advance(&mut w, 6);
        assert_eq!(w.len(), 2);
        assert_eq!(w[0], &[2, 2]);
        advance(&mut w, 2);
        assert_eq!(w, vec![&c[..]]);
        advance(&mut w, 4);
        assert!(w.is_empty());
    }
}

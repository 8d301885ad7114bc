//! Zero-copy vectored IO between sockets and registered memory, through memory guards.
//!
//! The sender writes straight from [`ReadGuard`]s of the source ranges and the receiver reads
//! straight into [`StridedWriteGuard`]s of the destination ops: no staging copy and no `unsafe` (the
//! guards are the bounds-checked, mutually exclusive views `kvxfer_core::mem` hands out).

use std::io::{self, IoSlice, IoSliceMut};

use kvxfer_core::{ReadGuard, StridedWriteGuard};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// Most iovecs per system call (Linux's IOV_MAX).
const IOV: usize = 1024;

/// Writes `head` and then, for each guarded source span, its `(count, stride, len)` ranges (offsets
/// relative to the span), in order: vectored writes of up to [`IOV`] slices per call, no staging copy.
pub(crate) async fn write_frame(
    w: &mut OwnedWriteHalf,
    head: &[u8],
    src: &[(ReadGuard, u64, u64, u64)],
) -> io::Result<()> {
    let mut pieces = src
        .iter()
        .flat_map(|(g, count, stride, len)| {
            let span = g.as_slice();
            (0..*count).map(move |i| &span[(i * stride) as usize..(i * stride + len) as usize])
        })
        .filter(|s| !s.is_empty());
    let mut window: Vec<&[u8]> = Vec::with_capacity(IOV);
    if !head.is_empty() {
        window.push(head);
    }
    loop {
        window.extend(pieces.by_ref().take(IOV - window.len()));
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

/// Reads a validated WRITE frame's payload straight into its guarded destination pieces: vectored
/// reads of up to [`IOV`] slices per call, no staging copy.
pub(crate) async fn read_payload(r: &OwnedReadHalf, dst: &mut [StridedWriteGuard]) -> io::Result<()> {
    let mut pieces = dst.iter_mut().flat_map(StridedWriteGuard::pieces_mut).filter(|s| !s.is_empty());
    let mut window: Vec<&mut [u8]> = Vec::with_capacity(IOV);
    loop {
        window.extend(pieces.by_ref().take(IOV - window.len()));
        if window.is_empty() {
            return Ok(());
        }
        let mut n = loop {
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

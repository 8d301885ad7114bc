//! Zero-copy vectored IO between sockets and registered memory, through memory guards.
//!
//! The sender writes straight from [`ReadGuard`]s of the source ranges and the receiver reads
//! straight into [`StridedWriteGuard`]s of the destination ops: no staging copy and no `unsafe` (the
//! guards are the bounds-checked, mutually exclusive views `kvxfer_core::mem` hands out). With TLS
//! (`tls=on`) the same calls go through rustls, which encrypts from and decrypts into its own
//! record buffers (see [`crate::conn`]).

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::time::{Duration, Instant};

use kvxfer_core::{ReadGuard, StridedWriteGuard};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedReadHalf;

use crate::conn::{Rx, Tx};

/// Polling tries between yields to the runtime (which let the stream's other tasks and timers run,
/// and cost an IO-driver poll of their own).
const SPINS_PER_YIELD: u32 = 64;

/// Most bytes per write call of a polling writer. Over loopback a write's bytes are copied into
/// the socket and, in the same call, queued at the receiver, whose copy finds them in cache when
/// the write fits: `benches/socket/loopback_poll.py` (both sides spinning) moved 5.5-5.8 GB/s with
/// 1 MiB writes and 3.8-3.9 with 8 MiB. A sleeping writer is better off with few large calls (the
/// same cap cost the default 4-12%), so only polling writers take it.
const POLL_WRITE_BYTES: usize = 1 << 20;

/// Most iovecs per system call (Linux's IOV_MAX).
const IOV: usize = 1024;

/// Writes `head` and then, for each guarded source span, its `(count, stride, len)` ranges (offsets
/// relative to the span), in order: vectored writes of up to [`IOV`] slices per call, no staging copy.
/// The caller merges adjacent source ranges into one span, so a frame of many small ops read from
/// consecutive source bytes is one slice.
///
/// A full send buffer is retried for `poll` before the writer sleeps until the socket is writable,
/// as [`read_vectored_polling`] does with an empty socket.
pub(crate) async fn write_frame(
    w: &mut Tx,
    head: &[u8],
    src: &[(ReadGuard, u64, u64, u64)],
    poll: Duration,
) -> io::Result<()> {
    let mut pieces: Vec<&[u8]> = Vec::with_capacity(1 + src.len());
    pieces.extend(Some(head).filter(|h| !h.is_empty()));
    for (g, count, stride, len) in src {
        let span = g.as_slice();
        pieces.extend((0..*count).map(|i| &span[(i * stride) as usize..(i * stride + len) as usize]));
    }
    write_pieces(w, pieces, poll).await
}

/// Writes `pieces` in order (what [`write_frame`] does once it has sliced its guards; a staged
/// frame's pieces are host guard slices and pinned staging slices).
pub(crate) async fn write_pieces(w: &mut Tx, mut pieces: Vec<&[u8]>, poll: Duration) -> io::Result<()> {
    pieces.retain(|p| !p.is_empty());
    let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(IOV.min(pieces.len()));
    let mut k = 0;
    while k < pieces.len() {
        iov.clear();
        let cap = if poll.is_zero() { usize::MAX } else { POLL_WRITE_BYTES };
        let mut bytes = 0;
        for p in &pieces[k..pieces.len().min(k + IOV)] {
            if bytes >= cap {
                break;
            }
            let take = p.len().min(cap - bytes);
            iov.push(IoSlice::new(&p[..take]));
            bytes += take;
        }
        let n = w.write_vectored_polling(&iov, poll).await?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket accepted no bytes"));
        }
        advance(&mut pieces, &mut k, n);
    }
    // Plaintext: nothing to do (the bytes are in the socket). TLS: the last records may still be in
    // the session's buffer.
    w.flush().await
}

/// Moves the cursor `k` of `pieces` past `n` bytes (whole pieces skipped, a partial one shortened).
fn advance(pieces: &mut [&[u8]], k: &mut usize, mut n: usize) {
    while *k < pieces.len() && n >= pieces[*k].len() {
        n -= pieces[*k].len();
        *k += 1;
    }
    if n > 0 {
        pieces[*k] = &pieces[*k][n..];
    }
}

/// Retries the non-blocking system call `try_io` for `poll`, yielding to the runtime every
/// [`SPINS_PER_YIELD`] tries: `Some` with its first answer other than WouldBlock or Interrupted,
/// `None` when `poll` ran out (the caller then sleeps on the socket's readiness).
async fn spin<T>(poll: Duration, mut try_io: impl FnMut() -> io::Result<T>) -> Option<io::Result<T>> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        match try_io() {
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
            other => return Some(other),
        }
        spins += 1;
        if spins % SPINS_PER_YIELD == 0 {
            if start.elapsed() >= poll {
                return None;
            }
            tokio::task::yield_now().await;
        }
    }
}

/// One vectored read of whatever the socket holds (at least one byte, or 0 at the end of the
/// stream). With `poll` > 0, while the socket is empty it keeps trying for `poll` with plain
/// system calls on the borrowed socket (yielding to the runtime every [`SPINS_PER_YIELD`] tries)
/// before it sleeps until the socket is readable. Plain calls, because tokio's own `try_read`
/// answers from the readiness it cached at the last WouldBlock, which only the runtime's IO
/// driver refreshes: a spin over it costs a driver poll per try and mostly sees stale answers
/// (one stream, `poll_us=1000`, 1 MiB blocks: 3.1-3.6 GB/s that way, 4.5-5.2 with plain calls).
///
/// Why poll: on loopback and in virtual machines the wake-up of a sleeping receiver (an
/// inter-processor interrupt, a halted vCPU) can cost more than the bytes that arrive meanwhile.
/// It pays where a core would otherwise idle (one stream, or more cores than streams); when every
/// core is busy it only burns CPU and delays the other tasks of the runtime (the spin yields, but
/// takes its turns): with two streams on the 2-core development machine every polling setting was
/// slower, and with every rank of a cluster in one process on 2 cores (`kvxfer bench --through
/// engine`) it doubled a one-page request's latency. So it is bounded: a stream polls only for
/// `poll` (`poll_us`, default 200 us, 0 never polls) after its last byte, and a receiver waiting
/// for the next frame polls only while more of a batch is due (`recv::serve_frames`).
pub(crate) async fn read_vectored_polling(
    r: &OwnedReadHalf,
    iov: &mut [IoSliceMut<'_>],
    poll: Duration,
) -> io::Result<usize> {
    if !poll.is_zero() {
        // Spin with plain system calls: tokio's `try_read_vectored` would answer from readiness
        // cached since the last WouldBlock, refreshed only when the runtime polls its IO driver.
        let sock = socket2::SockRef::from(r.as_ref());
        if let Some(done) = spin(poll, || (&*sock).read_vectored(iov)).await {
            return done;
        }
    }
    loop {
        match r.try_read_vectored(iov) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => r.readable().await?,
            other => return other,
        }
    }
}

/// One vectored write of as much as the socket takes (at least one byte). With `poll` > 0 a full
/// send buffer is retried for `poll` with plain `sendmsg` calls (`MSG_NOSIGNAL`: a reset peer is
/// an error, never a SIGPIPE), as [`read_vectored_polling`] does with an empty socket, before the
/// writer sleeps until the socket is writable.
pub(crate) async fn write_vectored_polling(
    w: &tokio::net::tcp::OwnedWriteHalf,
    iov: &[IoSlice<'_>],
    poll: Duration,
) -> io::Result<usize> {
    if !poll.is_zero() {
        let sock = socket2::SockRef::from(w.as_ref());
        if let Some(done) = spin(poll, || sock.send_vectored_with_flags(iov, libc::MSG_NOSIGNAL)).await {
            return done;
        }
    }
    loop {
        match w.try_write_vectored(iov) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => w.writable().await?,
            other => return other,
        }
    }
}

/// Fills `buf` from the stream, polling as [`read_vectored_polling`] does.
pub(crate) async fn read_exact_polling(r: &mut Rx, mut buf: &mut [u8], poll: Duration) -> io::Result<()> {
    while !buf.is_empty() {
        match r.read_vectored_polling(&mut [IoSliceMut::new(buf)], poll).await? {
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream")),
            n => buf = &mut buf[n..],
        }
    }
    Ok(())
}

/// Reads a validated WRITE frame's payload straight into its guarded destination pieces: vectored
/// reads of up to [`IOV`] slices per call, no staging copy; an empty socket is polled for `poll`
/// before the task sleeps (see [`read_vectored_polling`]).
pub(crate) async fn read_payload(r: &mut Rx, dst: &mut [StridedWriteGuard], poll: Duration) -> io::Result<()> {
    // Sized up front: a flat_map's collect would grow the list from nothing, one reallocation per
    // doubling, on every frame.
    let mut pieces = Vec::with_capacity(dst.iter().map(|g| g.count() as usize).sum());
    pieces.extend(dst.iter_mut().flat_map(StridedWriteGuard::pieces_mut));
    read_pieces(r, pieces, poll).await
}

/// Fills `pieces` in order from the stream (what [`read_payload`] does with its guards' pieces; a
/// staged frame's pieces are host guard pieces and pinned staging slices).
pub(crate) async fn read_pieces(r: &mut Rx, mut pieces: Vec<&mut [u8]>, poll: Duration) -> io::Result<()> {
    pieces.retain(|p| !p.is_empty());
    let mut k = 0;
    while k < pieces.len() {
        let end = pieces.len().min(k + IOV);
        let mut iov: Vec<IoSliceMut<'_>> = pieces[k..end].iter_mut().map(|s| IoSliceMut::new(s)).collect();
        let mut n = match r.read_vectored_polling(&mut iov, poll).await? {
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream inside a frame")),
            n => n,
        };
        drop(iov);
        while k < pieces.len() && n >= pieces[k].len() {
            n -= pieces[k].len();
            k += 1;
        }
        if n > 0 {
            let first = std::mem::take(&mut pieces[k]);
            pieces[k] = &mut first[n..];
        }
    }
    Ok(())
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
        let mut k = 0;
        advance(&mut w, &mut k, 6);
        assert_eq!(k, 1);
        assert_eq!(w[k], &[2, 2]);
        advance(&mut w, &mut k, 2);
        assert_eq!((k, w[k]), (2, &c[..]));
        advance(&mut w, &mut k, 4);
        assert_eq!(k, 3);
    }
}

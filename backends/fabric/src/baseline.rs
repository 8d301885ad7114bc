//! The bench's reference: a plain `fi_write` loop between two endpoints of one process, polled from
//! one thread, with no backend around it (no batching, no progress thread, no notification).
//!
//! [`write_bandwidth`] is what the fabric backend is compared with at the same size and provider.

use std::time::{Duration, Instant};

use kvxfer_core::{BackendError, HostBuffer, MemDesc};

use crate::ffi::{Event, Hints, LocalRange, PostError, RdmEndpoint, RemoteIov};
use crate::NAME;

/// One baseline measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measurement {
    /// Bytes per write.
    pub size: usize,
    /// Writes timed (after the warm-up).
    pub writes: usize,
    /// Writes kept in flight.
    pub window: usize,
    /// Wall time of the timed writes.
    pub elapsed: Duration,
}

impl Measurement {
    /// Bytes per second.
    pub fn bytes_per_sec(&self) -> f64 {
        (self.size * self.writes) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Measures `writes` RMA writes of `size` bytes from one endpoint to another of the same process, with
/// up to `window` in flight, using `fi_write` and polling both completion queues (the target's too:
/// manual-progress providers move data only when polled). `provider` as in the backend's option (`tcp`
/// means `tcp;ofi_rxm`), `addr` the local address to bind. Checks the destination holds the source
/// bytes at the end. Fails after `limit`.
pub fn write_bandwidth(
    provider: &str,
    addr: Option<&str>,
    size: usize,
    writes: usize,
    window: usize,
    limit: Duration,
) -> Result<Measurement, BackendError> {
    let provider = if provider == "tcp" { "tcp;ofi_rxm" } else { provider };
    let hints = Hints { provider: Some(provider.to_owned()), node: addr.map(str::to_owned), wait_fd: false };
    let mut a = RdmEndpoint::open(&hints)?;
    let mut b = RdmEndpoint::open(&hints)?;
    let mut pattern: Vec<u8> = (0..size).map(|i| (i % 251) as u8 + 1).collect();
    pattern.resize(size.max(1), 1);
    let src = HostBuffer::from_slice(&pattern).desc();
    let dst = HostBuffer::zeroed(size.max(1)).desc();
    let (src_mr, _) = a.reg(&src)?;
    let (_, dst_info) = b.reg(&dst)?;
    let dest = a.av_insert(b.name())?;
    let local = LocalRange { mr: src_mr, offset: 0, len: size as u64 };
    let remote = RemoteIov { addr: dst_info.base, len: size as u64, key: dst_info.key };
    let window = window.max(1);
    let warmup = (writes / 10).clamp(1, 16);
    let total = writes + warmup;
    let deadline = Instant::now() + limit;
    let (mut posted, mut done) = (0usize, 0usize);
    let mut start = Instant::now();
    let mut events = Vec::new();
    while done < total {
        while posted < total && posted - done < window {
            match a.write_plain(dest, local, remote, posted as u64) {
                Ok(()) => posted += 1,
                Err(PostError::Again) => break,
                Err(PostError::Failed(e)) => return Err(e),
            }
        }
        a.poll(&mut events, 64)?;
        b.poll(&mut Vec::new(), 16)?;
        for e in events.drain(..) {
            if let Event::Done { error, .. } = e {
                if let Some(err) = error {
                    return Err(BackendError::Ffi {
                        backend: NAME,
                        call: "fi_write (completion)",
                        code: -i64::from(err.code),
                        detail: err.detail,
                    });
                }
                done += 1;
                if done == warmup {
                    start = Instant::now();
                }
            }
        }
        if Instant::now() > deadline {
            return Err(BackendError::Timeout {
                backend: NAME,
                what: format!("baseline: {done} of {total} writes of {size} bytes over {provider}"),
                after: limit,
            });
        }
    }
    let elapsed = start.elapsed();
    // Let the target finish placing bytes (providers without delivery completion) before checking.
    let check_end = Instant::now() + Duration::from_secs(5);
    while !holds(&dst, &pattern[..size]) {
        b.poll(&mut Vec::new(), 16)?;
        if Instant::now() > check_end {
            return Err(BackendError::Protocol {
                backend: NAME,
                peer: "baseline target".into(),
                detail: "the destination does not hold the written bytes".into(),
            });
        }
    }
    Ok(Measurement { size, writes, window, elapsed })
}

/// Whether `mem` starts with `want` (read under a guard; the provider writes without one).
fn holds(mem: &MemDesc, want: &[u8]) -> bool {
    mem.read_guard(0, want.len() as u64).is_ok_and(|g| g.as_slice() == want)
}

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
    // Touched (filled) before the clock starts, as the source is: first-touch page faults are not
    // transfer time (see `serve_target`).
    let dst = HostBuffer::filled(size.max(1), 0).desc();
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
        count_writes(&mut events, &mut done, warmup, &mut start)?;
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

/// What a two-process baseline target publishes (one line on its stdout): its endpoint address and
/// the registered buffer's remote address, key and length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetInfo {
    /// `fi_getname` of the target's endpoint.
    pub name: Vec<u8>,
    /// Remote address of the buffer (0 unless `FI_MR_VIRT_ADDR`).
    pub base: u64,
    /// Remote key.
    pub key: u64,
    /// Buffer length.
    pub len: u64,
}

impl TargetInfo {
    /// One line: `target <hex name> <base> <key> <len>`.
    pub fn to_line(&self) -> String {
        let hex: String = self.name.iter().map(|b| format!("{b:02x}")).collect();
        format!("target {hex} {} {} {}", self.base, self.key, self.len)
    }

    /// Parses [`TargetInfo::to_line`]'s line.
    pub fn parse(line: &str) -> Result<Self, BackendError> {
        let bad = |what: &str| BackendError::Protocol {
            backend: NAME,
            peer: "baseline target".into(),
            detail: format!("{what} in its published line {line:?}"),
        };
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 5 || f[0] != "target" || f[1].len() % 2 != 0 {
            return Err(bad("expected `target <hex name> <base> <key> <len>`"));
        }
        let name = (0..f[1].len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&f[1][i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| bad("a bad hex address"))?;
        let num = |s: &str| s.parse::<u64>().map_err(|_| bad("a bad number"));
        Ok(Self { name, base: num(f[2])?, key: num(f[3])?, len: num(f[4])? })
    }
}

/// Byte `i` of the two-process baseline's pattern.
fn pattern_byte(i: usize) -> u8 {
    (i % 251) as u8 + 1
}

/// The target side of the two-process baseline: opens an endpoint, registers a zeroed buffer of
/// `len` bytes, writes its [`TargetInfo`] line to `out`, then polls its completion queue (manual
/// progress: tcp;ofi_rxm places bytes only when the target polls) until `stop` reads true or
/// `limit` passes. Returns whether the buffer then holds the initiator's pattern.
pub fn serve_target(
    provider: &str,
    addr: Option<&str>,
    len: usize,
    out: &mut dyn std::io::Write,
    stop: &std::sync::atomic::AtomicBool,
    limit: Duration,
) -> Result<bool, BackendError> {
    let provider = if provider == "tcp" { "tcp;ofi_rxm" } else { provider };
    let hints = Hints { provider: Some(provider.to_owned()), node: addr.map(str::to_owned), wait_fd: false };
    let mut ep = RdmEndpoint::open(&hints)?;
    // Every page touched (filled) before the initiator starts its clock, as its source is: a fresh
    // buffer's first-touch faults would otherwise be timed as transfer. They can dominate: on the
    // development VM, where free memory is handed back to the host, faulting in huge pages of a
    // fresh 1 GiB target held this loop at 0.3-0.4 GB/s at every write size.
    let dst = HostBuffer::filled(len.max(1), 0).desc();
    let (_, info) = ep.reg(&dst)?;
    let line = TargetInfo { name: ep.name().to_vec(), base: info.base, key: info.key, len: len as u64 }.to_line();
    let io = |e: std::io::Error| BackendError::Protocol {
        backend: NAME,
        peer: "baseline initiator".into(),
        detail: format!("publishing the target line: {e}"),
    };
    writeln!(out, "{line}").map_err(io)?;
    out.flush().map_err(io)?;
    let deadline = Instant::now() + limit;
    let mut events = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        if ep.poll(&mut events, 64)? == 0 {
            std::thread::yield_now();
        }
        events.clear();
        if Instant::now() > deadline {
            return Err(BackendError::Timeout {
                backend: NAME,
                what: "baseline target: the initiator's end".into(),
                after: limit,
            });
        }
    }
    // A few more polls, for providers that still place bytes after the initiator's completion.
    for _ in 0..1000 {
        ep.poll(&mut events, 64)?;
        events.clear();
    }
    let g = dst.read_guard(0, len as u64).map_err(|e| BackendError::Protocol {
        backend: NAME,
        peer: "baseline initiator".into(),
        detail: format!("reading the target buffer back: {e}"),
    })?;
    Ok(g.as_slice().iter().enumerate().all(|(i, &b)| b == pattern_byte(i)))
}

/// The initiator side of the two-process baseline: writes `size`-byte `fi_write`s covering the
/// target's buffer in order (wrapping), up to `window` in flight, `writes` of them timed after a
/// warm-up, and polls its own completion queue. The source is a buffer of the target's length
/// holding the pattern [`serve_target`] checks. Fails after `limit`.
pub fn write_to_target(
    provider: &str,
    addr: Option<&str>,
    target: &TargetInfo,
    size: usize,
    writes: usize,
    window: usize,
    limit: Duration,
) -> Result<Measurement, BackendError> {
    let provider = if provider == "tcp" { "tcp;ofi_rxm" } else { provider };
    let size = size.max(1);
    let blocks = (target.len as usize / size).max(1);
    if (size as u64) > target.len {
        return Err(BackendError::Protocol {
            backend: NAME,
            peer: "baseline target".into(),
            detail: format!("writes of {size} bytes into a target buffer of {} bytes", target.len),
        });
    }
    let hints = Hints { provider: Some(provider.to_owned()), node: addr.map(str::to_owned), wait_fd: false };
    let mut ep = RdmEndpoint::open(&hints)?;
    let pattern: Vec<u8> = (0..target.len as usize).map(pattern_byte).collect();
    let src = HostBuffer::from_slice(&pattern).desc();
    let (src_mr, _) = ep.reg(&src)?;
    let dest = ep.av_insert(&target.name)?;
    let window = window.max(1);
    let warmup = (writes / 10).clamp(1, 16);
    // Every block at least once, so the target's check sees the whole pattern.
    let total = (writes + warmup).max(blocks);
    let deadline = Instant::now() + limit;
    let (mut posted, mut done) = (0usize, 0usize);
    let mut start = Instant::now();
    let mut events = Vec::new();
    while done < total {
        while posted < total && posted - done < window {
            let off = (posted % blocks * size) as u64;
            let local = LocalRange { mr: src_mr, offset: off, len: size as u64 };
            let remote = RemoteIov { addr: target.base + off, len: size as u64, key: target.key };
            match ep.write_plain(dest, local, remote, posted as u64) {
                Ok(()) => posted += 1,
                Err(PostError::Again) => break,
                Err(PostError::Failed(e)) => return Err(e),
            }
        }
        ep.poll(&mut events, 64)?;
        count_writes(&mut events, &mut done, warmup, &mut start)?;
        if Instant::now() > deadline {
            return Err(BackendError::Timeout {
                backend: NAME,
                what: format!("baseline: {done} of {total} writes of {size} bytes over {provider}"),
                after: limit,
            });
        }
    }
    Ok(Measurement { size, writes: total - warmup, window, elapsed: start.elapsed() })
}

/// Counts the write completions in `events` (draining it); the clock restarts when the warm-up
/// writes are done. A failed completion is the error.
fn count_writes(
    events: &mut Vec<Event>,
    done: &mut usize,
    warmup: usize,
    start: &mut Instant,
) -> Result<(), BackendError> {
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
            *done += 1;
            if *done == warmup {
                *start = Instant::now();
            }
        }
    }
    Ok(())
}

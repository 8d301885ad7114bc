//! What a write completion means on each provider (libfabric 1.17, this machine), found out rather
//! than assumed: one write between two endpoints of this process, the completion polled on the
//! initiator only, the target's memory read the moment it arrives. The backend reports
//! `Completion::Remote` only where the provider granted `FI_DELIVERY_COMPLETE`; this checks that,
//! with it requested, no completion ever comes before the bytes are in the target's memory.

use std::time::{Duration, Instant};

use kvxfer_core::{BackendError, HostBuffer, MemDesc};
use kvxfer_fabric::ffi::{Event, Hints, LocalRange, PostError, RdmEndpoint, RemoteIov};

const NAME: &str = "fabric";

/// Whether `mem` starts with `want` (read under a guard; the provider writes without one).
fn holds(mem: &MemDesc, want: &[u8]) -> bool {
    mem.read_guard(0, want.len() as u64).is_ok_and(|g| g.as_slice() == want)
}

const SIZES: [usize; 5] = [8, 200, 4096, 65536, 1 << 20];

#[test]
fn with_delivery_complete_the_bytes_are_there_at_completion() {
    for prov in ["tcp", "shm"] {
        let addr = (prov == "tcp").then_some("127.0.0.1");
        for dc in [true, false] {
            for size in SIZES {
                let r = probe_completion(prov, addr, size, dc, Duration::from_millis(300), Duration::from_secs(10))
                    .unwrap_or_else(|e| panic!("{prov} {size}: {e}"));
                eprintln!(
                    "{prov:<4} {size:>8} B  delivery_complete {:<5} completion without target progress {:<5} bytes visible at completion {}",
                    r.delivery_complete, r.without_target_progress, r.visible_at_completion
                );
                if dc {
                    assert!(r.delivery_complete, "{prov}: FI_DELIVERY_COMPLETE not granted");
                    assert!(r.visible_at_completion, "{prov} {size}: a delivery completion before the bytes: {r:?}");
                }
            }
        }
    }
}

/// What one write's completion meant (see [`probe_completion`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CompletionProbe {
    /// Bytes written.
    size: usize,
    /// Whether the write asked for `FI_DELIVERY_COMPLETE`.
    delivery_complete: bool,
    /// Whether the completion arrived while only the initiator was progressed (the target never
    /// polled after the post).
    without_target_progress: bool,
    /// Whether every byte was in the target's memory when the completion was read.
    visible_at_completion: bool,
}

/// Posts one write of `size` bytes between two endpoints of this process (after a warm-up write that
/// sets the connection up), then polls only the initiator for up to `quiet`: a completion that comes
/// without the target making progress cannot mean the target placed the bytes, unless the initiator
/// placed them itself (shm's CMA path). If none came, polls both until it does (bounded by
/// `limit`). Reads the target's memory the moment the completion is read.
fn probe_completion(
    provider: &str,
    addr: Option<&str>,
    size: usize,
    delivery_complete: bool,
    quiet: Duration,
    limit: Duration,
) -> Result<CompletionProbe, BackendError> {
    let provider = if provider == "tcp" { "tcp;ofi_rxm" } else { provider };
    let hints = Hints { provider: Some(provider.to_owned()), node: addr.map(str::to_owned), wait_fd: false };
    let mut a = RdmEndpoint::open(&hints)?;
    let mut b = RdmEndpoint::open(&hints)?;
    a.set_delivery_complete(delivery_complete);
    let size = size.max(1);
    let src = HostBuffer::filled(size, 0x11).desc();
    let dst = HostBuffer::zeroed(size).desc();
    let (src_mr, _) = a.reg(&src)?;
    let (_, dst_info) = b.reg(&dst)?;
    let dest = a.av_insert(b.name())?;
    let local = LocalRange { mr: src_mr, offset: 0, len: size as u64 };
    let remote = RemoteIov { addr: dst_info.base, len: size as u64, key: dst_info.key };
    let deadline = Instant::now() + limit;
    let timeout = |what: &str| BackendError::Timeout { backend: NAME, what: format!("probe: {what}"), after: limit };
    let mut events = Vec::new();
    // Warm-up (connection setup needs both sides), then wait until the bytes are there.
    let mut wait_done =
        |a: &mut RdmEndpoint, b: &mut RdmEndpoint, poll_b: bool, until: Instant| -> Result<bool, BackendError> {
            loop {
                a.poll(&mut events, 16)?;
                if poll_b {
                    b.poll(&mut Vec::new(), 16)?;
                }
                for e in events.drain(..) {
                    if let Event::Done { error: Some(err), .. } = e {
                        return Err(BackendError::Ffi {
                            backend: NAME,
                            call: "fi_writemsg (completion)",
                            code: -i64::from(err.code),
                            detail: err.detail,
                        });
                    } else if let Event::Done { .. } = e {
                        return Ok(true);
                    }
                }
                if Instant::now() > until {
                    return Ok(false);
                }
            }
        };
    post_until(&mut a, &mut b, dest, &[local], &[remote], deadline)?;
    if !wait_done(&mut a, &mut b, true, deadline)? {
        return Err(timeout("warm-up write"));
    }
    while !holds(&dst, &vec![0x11; size]) {
        b.poll(&mut Vec::new(), 16)?;
        if Instant::now() > deadline {
            return Err(timeout("warm-up bytes"));
        }
    }
    src.write_guard(0, size as u64).map_err(|e| timeout(&e.to_string()))?.as_mut_slice().fill(0x22);
    let want = vec![0x22; size];
    post_until(&mut a, &mut b, dest, &[local], &[remote], deadline)?;
    let quiet_done = wait_done(&mut a, &mut b, false, Instant::now() + quiet)?;
    let visible = if quiet_done {
        holds(&dst, &want)
    } else {
        if !wait_done(&mut a, &mut b, true, deadline)? {
            return Err(timeout("probe write"));
        }
        holds(&dst, &want)
    };
    Ok(CompletionProbe {
        size,
        delivery_complete: a.delivery_complete_requested(),
        without_target_progress: quiet_done,
        visible_at_completion: visible,
    })
}

/// Posts one write, progressing both endpoints while the queue is full (rxm sets its connection up
/// on the first post, which needs the target's progress).
fn post_until(
    a: &mut RdmEndpoint,
    b: &mut RdmEndpoint,
    dest: u64,
    local: &[LocalRange],
    remote: &[RemoteIov],
    deadline: Instant,
) -> Result<(), BackendError> {
    loop {
        match a.write(dest, local, remote, None, 1) {
            Ok(()) => return Ok(()),
            Err(PostError::Failed(e)) => return Err(e),
            Err(PostError::Again) => {
                a.poll(&mut Vec::new(), 16)?;
                b.poll(&mut Vec::new(), 16)?;
                if Instant::now() > deadline {
                    return Err(BackendError::Timeout {
                        backend: NAME,
                        what: "probe: posting".into(),
                        after: Duration::ZERO,
                    });
                }
            }
        }
    }
}

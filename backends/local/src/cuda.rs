//! CUDA memory in the local backend: a transfer whose source or destination lies in CUDA memory is
//! copied by the CUDA copy engine on a stream of its own (one per device, shared by the process's
//! endpoints): device to device directly, host to device and back with the driver's own staging.
//! Both sides are in this process, so no bounce buffer of ours is needed (the tcp backend's
//! pinned-slot pipeline is for the socket in between).
//!
//! Copies are queued in plans of at most [`PLAN_BYTES`], at most [`IN_FLIGHT`] plans ahead of the
//! one completing, each holding reservations of its ranges (and its regions) until it completed;
//! an abort stops queueing between two plans and resolves once the queued ones completed. The
//! attached notification is delivered, and the transfer done, only after every copy completed.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use kvxfer_core::{BackendError, MemKind, Notification, TransferState};
use kvxfer_cuda::{context, CopyPlan, CudaError, Pending, Shape, Stream};

use crate::{DeviceWrite, Endpoint, Resolved, NAME};

/// Bytes queued per plan.
const PLAN_BYTES: u64 = 64 << 20;
/// Plans queued ahead of the one being waited for.
const IN_FLIGHT: usize = 2;
/// How long a plan's copies may take.
const COPY_DEADLINE: Duration = Duration::from_secs(120);

fn device(kind: MemKind) -> Option<u32> {
    match kind {
        MemKind::Cuda { device } => Some(device),
        _ => None,
    }
}

/// Whether a transfer touches CUDA memory (and so runs here).
pub(crate) fn touches_device(ops: &[Resolved]) -> bool {
    ops.iter().any(|r| device(r.src.desc().kind()).or(device(r.dst.desc().kind())).is_some())
}

/// The copy stream of `device`, made on first use.
fn stream(device: u32) -> Result<Arc<Stream>, CudaError> {
    static S: OnceLock<Mutex<HashMap<u32, Arc<Stream>>>> = OnceLock::new();
    let mut m = S.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = m.get(&device) {
        return Ok(Arc::clone(s));
    }
    let s = Arc::new(Stream::new(&context(device)?)?);
    m.insert(device, Arc::clone(&s));
    Ok(s)
}

fn failed(what: &str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Protocol { backend: NAME, peer: "local peer".into(), detail: format!("{what}: {e}") }
}

/// Queues one op's copies into `plans` (cut at [`PLAN_BYTES`]).
fn plan_op(r: &Resolved, plans: &mut Vec<CopyPlan>) -> Result<(), BackendError> {
    let op = r.op;
    if op.len == 0 {
        return Ok(());
    }
    let (src, dst) = (r.src.desc(), r.dst.desc());
    let contiguous = op.count == 1 || (op.src_stride == op.len && op.dst_stride == op.len);
    // Rows of `len` bytes: a contiguous op is one long row cut in pieces; a strided one keeps its rows.
    let (len, count, ss, ds) = if contiguous {
        (op.len * op.count, 1, op.len * op.count, op.len * op.count)
    } else {
        (op.len, op.count, op.src_stride, op.dst_stride)
    };
    let rows_per = if count == 1 { 1 } else { (PLAN_BYTES / len).max(1) };
    let piece = if count == 1 { PLAN_BYTES } else { len };
    let mut row = 0;
    while row < count {
        let n = rows_per.min(count - row);
        let mut at = 0;
        while at < len {
            let l = if count == 1 { piece.min(len - at) } else { len };
            let so = op.src_offset + row * ss + at;
            let d = op.dst_offset + row * ds + at;
            let span = (n - 1) * ss + l;
            let s_res = src.reserve(so, span, 1, span, false).map_err(|e| failed("copy refused", e))?;
            let d_res = if n == 1 { dst.reserve(d, l, 1, l, true) } else { dst.reserve(d, l, n, ds, true) }
                .map_err(|e| failed("copy refused", e))?;
            let d_shape = Shape::of(&d_res);
            let s_shape = Shape { offset: 0, len: l, count: n, stride: if n == 1 { l } else { ss } };
            if !plans.last().is_some_and(|p| p.bytes() < PLAN_BYTES) {
                plans.push(CopyPlan::new());
            }
            let p = plans.last_mut().expect("pushed");
            p.copy(s_res, s_shape, d_res, d_shape).map_err(|e| failed("copy refused", e))?;
            p.keep((r.src.clone(), r.dst.clone()));
            at += l;
        }
        row += n;
    }
    Ok(())
}

async fn settle(stream: &Stream, p: Pending) -> Result<(), BackendError> {
    p.wait(stream, Instant::now() + COPY_DEADLINE).await.map_err(|e| failed("CUDA copy", e))?;
    drop(p.finish());
    Ok(())
}

/// [`settle`] of a plan writing into a peer's memory. The admission ends with the copy; if the copy
/// did not complete (its deadline passed), it stays admitted, so a cut-off of this endpoint cannot
/// be confirmed and the peer's pages stay quarantined rather than reported safe.
async fn settle_admitted(stream: &Stream, (p, admitted): (Pending, DeviceWrite)) -> Result<(), BackendError> {
    match settle(stream, p).await {
        Ok(()) => Ok(()),
        Err(e) => {
            std::mem::forget(admitted);
            Err(e)
        }
    }
}

/// Runs `task` (a host transfer) once `gate` (the send's GPU order) completed, waiting on the host:
/// host memory the engine fills with its own GPU copy is read only after that copy.
pub(crate) async fn after_gate(
    gate: Option<Arc<kvxfer_cuda::Event>>,
    state: Arc<TransferState>,
    task: impl std::future::Future<Output = ()>,
) {
    if let Some(g) = gate {
        if let Err(e) = g.wait_host(Instant::now() + COPY_DEADLINE).await {
            state.fail(failed("the send's GPU order", e));
            return;
        }
    }
    task.await
}

/// Runs a transfer that touches CUDA memory to its end (see the module docs).
pub(crate) async fn run(
    state: Arc<TransferState>,
    ops: Vec<Resolved>,
    from: Arc<Endpoint>,
    to: Weak<Endpoint>,
    notify: Option<Notification>,
    gate: Option<Arc<kvxfer_cuda::Event>>,
) {
    let dev = ops
        .iter()
        .find_map(|r| device(r.src.desc().kind()).or(device(r.dst.desc().kind())))
        .expect("runs only for transfers that touch CUDA memory");
    let stream = match stream(dev) {
        Ok(s) => s,
        Err(e) => {
            state.fail(failed("CUDA stream", e));
            return;
        }
    };
    if let Some(g) = &gate {
        // No byte is read before the engine's GPU work completed; the host does not wait.
        if let Err(e) = stream.wait_event(g) {
            state.fail(failed("waiting for the send's GPU order", e));
            return;
        }
    }
    // Each queued plan with its admission into the destination's memory (see `DeviceWrite`).
    let mut queued: VecDeque<(Pending, DeviceWrite)> = VecDeque::new();
    let mut outcome: Result<(), BackendError> = Ok(());
    'ops: for r in &ops {
        let mut plans = Vec::new();
        if let Err(e) = plan_op(r, &mut plans) {
            outcome = Err(e);
            break;
        }
        for plan in plans {
            if state.abort_requested() {
                break 'ops;
            }
            let Some(dst_ep) = to.upgrade() else {
                outcome = Err(BackendError::PeerLost {
                    backend: NAME,
                    peer: "local peer".into(),
                    detail: "dropped during the transfer".into(),
                });
                break 'ops;
            };
            let admitted = match dst_ep.begin_device_write(&from) {
                Ok(a) => a,
                Err(e) => {
                    outcome = Err(e);
                    break 'ops;
                }
            };
            match stream.submit(plan) {
                Ok(p) => queued.push_back((p, admitted)),
                Err(e) => {
                    outcome = Err(failed("queueing CUDA copies", e));
                    break 'ops;
                }
            }
            while queued.len() > IN_FLIGHT {
                if let Err(e) = settle_admitted(&stream, queued.pop_front().expect("non-empty")).await {
                    outcome = Err(e);
                    break 'ops;
                }
            }
        }
    }
    // Nothing queued may be left running when the state turns final.
    while let Some(p) = queued.pop_front() {
        if let Err(e) = settle_admitted(&stream, p).await {
            outcome = outcome.and(Err(e));
        }
    }
    drop(ops);
    if let Err(e) = outcome {
        state.fail(e);
        return;
    }
    if state.abort_requested() {
        state.aborted();
        return;
    }
    // As the host path ends: the attached notification after the bytes, then the final state.
    if let Some(n) = notify {
        match to.upgrade() {
            Some(ep) => {
                if let Err(e) = ep.deliver(&from, n) {
                    state.fail(e);
                    return;
                }
            }
            None => {
                state.fail(BackendError::PeerLost {
                    backend: NAME,
                    peer: "local peer".into(),
                    detail: "dropped before the notification".into(),
                });
                return;
            }
        }
    }
    state.complete();
}

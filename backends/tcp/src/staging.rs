//! CUDA memory over TCP: pinned bounce buffers and CUDA copies on a stream of their own, pipelined
//! on both sides by [`kvxfer_core::toolkit::staging::Pipeline`].
//!
//! - **Sending.** A stream's writer looks ahead in its queue: each WRITE frame whose source lies in
//!   CUDA memory is started early and its device ranges are copied (device to host, on the writer's
//!   CUDA stream) into a free staging slot, up to [`SLOTS`] frames ahead, while the writer puts the
//!   previous frame on the wire. A frame is written once its copy completed: its header, then its
//!   pieces in wire order (host ranges straight from their read guards, device ranges from the slot).
//!   Device source ranges are held by read reservations from the start of the copy until the frame
//!   was written, so an incoming transfer cannot write them meanwhile.
//! - **Receiving.** A WRITE frame into CUDA memory is checked like any other, its device ranges held
//!   by write reservations; its payload is read into a free slot (host pieces straight into their
//!   guards), then copied host to device on the stream's CUDA stream while the next frame is read.
//!   The frame is acknowledged (and counts towards its batch's attached notification) only after
//!   its copy completed: a sender's transfer is done, and a notification delivered, only once every
//!   byte is in device memory. Acknowledgements stay in frame order; a frame that is not staged, and
//!   every frame that is not a WRITE, first waits for the staged frames before it.
//! - CUDA is loaded at run time ([`kvxfer_cuda`]); without a driver, CUDA memory is refused at
//!   registration naming the library, and nothing here runs.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::staging::{Action, Pipeline};
use kvxfer_core::toolkit::RegionRef;
use kvxfer_core::{BackendError, MemKind, ReadGuard, Reservation, StridedWriteGuard};
use kvxfer_cuda::{context, Context, CopyPlan, CudaError, Pending, PinnedBuffer, Shape, Stream};
use tokio::sync::mpsc;

use crate::conn::{Rx, Tx};
use crate::recv::{within, Ending, Shared};
use crate::send::{self, Holding, Job, SrcOp, Xfer};
use crate::wire::{self, FrameType, Header, Hello, OpDesc, WireError};
use crate::{io, NAME};

/// Staging slots per stream and direction (frames in flight through the bounce buffers).
pub(crate) const SLOTS: usize = 4;
/// Bytes of a staging slot: a whole frame ([`send::FRAME_BYTES`]).
pub(crate) const SLOT_BYTES: usize = send::FRAME_BYTES as usize;
/// Largest device payload of one incoming frame (a peer's frames may be larger than ours).
const MAX_STAGED_FRAME: usize = 64 << 20;

/// The staging slots of one stream: a CUDA stream and up to [`SLOTS`] pinned buffers, made on first
/// use on the device of the first frame that needed them (copies to or from other devices run on
/// the same stream: the driver routes them).
struct Slots {
    ctx: Arc<Context>,
    stream: Stream,
    bufs: Vec<Option<PinnedBuffer>>,
    pipe: Pipeline,
}

impl Slots {
    fn new(device: u32, max_fills: usize, max_drains: usize) -> Result<Self, CudaError> {
        let ctx = context(device)?;
        let stream = Stream::new(&ctx)?;
        Ok(Self {
            ctx,
            stream,
            bufs: (0..SLOTS).map(|_| None).collect(),
            pipe: Pipeline::new(SLOTS, max_fills, max_drains),
        })
    }

    /// The slot's buffer, of at least `len` bytes (allocated on first use; a lost one is remade).
    fn take(&mut self, slot: usize, len: usize) -> Result<PinnedBuffer, CudaError> {
        match self.bufs[slot].take() {
            Some(b) if b.len() >= len => Ok(b),
            _ => PinnedBuffer::new(&self.ctx, len.max(SLOT_BYTES)),
        }
    }

    /// Takes the oldest chunk through the rest of its life at once (a frame that was dropped or
    /// failed), without starting anything for later chunks.
    fn skip(&mut self, chunk: u64) {
        if self.pipe.filled(chunk).is_err() {
            match self.pipe.poll() {
                Some(Action::Fill { chunk: c, .. }) if c == chunk => {
                    let _ = self.pipe.filled(c);
                }
                other => tracing::error!(chunk, ?other, "tcp staging: cannot skip a chunk"),
            }
        }
        match self.pipe.poll() {
            Some(Action::Drain { chunk: c, .. }) if c == chunk => {
                let _ = self.pipe.drained(c);
            }
            other => tracing::error!(chunk, ?other, "tcp staging: cannot skip a chunk"),
        }
        while self.pipe.landed().is_some() {}
    }
}

fn device_of(kind: MemKind) -> Option<u32> {
    match kind {
        MemKind::Cuda { device } => Some(device),
        _ => None,
    }
}

fn cuda_io(context: String) -> impl Fn(CudaError) -> BackendError {
    move |e| BackendError::Io { backend: NAME, context: context.clone(), detail: e.to_string() }
}

// ---------------------------------------------------------------------------------------------
// Sending.

/// One piece of a staged frame's payload, in wire order.
enum Run {
    Host(ReadGuard, u64, u64, u64),
    /// `bytes` bytes at `at` of the slot.
    Device {
        at: usize,
        bytes: usize,
    },
}

enum Staged {
    /// The frame's copy is queued.
    Copying { pending: Pending, runs: Vec<Run>, _holding: Holding },
    /// Not sent: the transfer was aborted or failed before the frame started, or its source could
    /// not be held or copied (the transfer was failed with the reason).
    Dropped,
}

/// A queued job, and for a frame with device sources, its chunk of the pipeline and staging.
struct Queued {
    job: Job,
    chunk: Option<u64>,
    staged: Option<Staged>,
}

/// What a writer hands to [`write_staged`]: the frame's chunk and staging.
pub(crate) struct Prefetched {
    chunk: u64,
    staged: Option<Staged>,
}

/// A writer's lookahead: the jobs it took from its queue and the frames it is staging.
#[derive(Default)]
pub(crate) struct Sending {
    queue: VecDeque<Queued>,
    slots: Option<Slots>,
}

impl Sending {
    /// The next job, in queue order, and its staging when it is a frame with device sources. Takes
    /// whatever else is queued (without waiting) and starts staging those frames into free slots.
    pub(crate) async fn next(&mut self, jobs: &mut mpsc::UnboundedReceiver<Job>) -> Option<(Job, Option<Prefetched>)> {
        if self.queue.is_empty() {
            let job = jobs.recv().await?;
            self.push(job);
        }
        while self.queue.len() < 2 * SLOTS {
            match jobs.try_recv() {
                Ok(job) => self.push(job),
                Err(_) => break,
            }
        }
        self.prefetch();
        let q = self.queue.pop_front()?;
        let pre = q.chunk.map(|chunk| Prefetched { chunk, staged: q.staged });
        Some((q.job, pre))
    }

    fn push(&mut self, job: Job) {
        let device = match &job {
            Job::Write { xfer, ops, .. } => xfer.source_device(ops),
            _ => None,
        };
        let chunk = device.and_then(|d| {
            if self.slots.is_none() {
                match Slots::new(d, SLOTS, 1) {
                    Ok(s) => self.slots = Some(s),
                    // Without slots the frame goes the host way, whose read guard refuses device
                    // memory: the transfer fails naming the memory kind.
                    Err(e) => {
                        tracing::warn!(error = %e, "tcp: cannot set up CUDA staging");
                        return None;
                    }
                }
            }
            self.slots.as_mut().map(|s| s.pipe.push())
        });
        self.queue.push_back(Queued { job, chunk, staged: None });
    }

    /// Starts the copies the pipeline allows now.
    fn prefetch(&mut self) {
        let Some(slots) = self.slots.as_mut() else { return };
        while let Some(a) = slots.pipe.poll() {
            let Action::Fill { chunk, slot } = a else {
                unreachable!("a drain starts only after `filled`, which the writer reports when it writes the frame")
            };
            let q = self.queue.iter_mut().find(|q| q.chunk == Some(chunk)).expect("a queued chunk");
            let Job::Write { xfer, ops, .. } = &q.job else { unreachable!("only WRITE frames are chunks") };
            q.staged = Some(stage(slots, slot, xfer, ops));
        }
    }
}

/// Starts a frame and queues the device-to-host copy of its device ranges into `slot`.
fn stage(slots: &mut Slots, slot: usize, xfer: &Arc<Xfer>, ops: &[SrcOp]) -> Staged {
    let Some(refs) = xfer.start(true) else { return Staged::Dropped };
    let holding = Holding(Arc::clone(xfer));
    let fail = |e: BackendError| {
        xfer.unstart(e);
        Staged::Dropped
    };
    let buf = match slots.take(slot, SLOT_BYTES) {
        Ok(b) => b,
        Err(e) => return fail(cuda_io("allocating a pinned staging buffer".into())(e)),
    };
    let mut plan = CopyPlan::with_pinned(buf);
    let mut runs = Vec::new();
    let mut at = 0usize;
    for (slot_idx, offset, count, stride, len) in send::source_runs(ops) {
        let span = (count - 1) * stride + len;
        let desc = refs[slot_idx].desc();
        if desc.kind() == MemKind::Host {
            match desc.read_guard(offset, span) {
                Ok(g) => runs.push(Run::Host(g, count, stride, len)),
                Err(e) => return fail(busy(&refs[slot_idx], e)),
            }
            continue;
        }
        let bytes = (len * count) as usize;
        if at + bytes > SLOT_BYTES {
            return fail(BackendError::Io {
                backend: NAME,
                context: "staging a frame".into(),
                detail: format!("{} device bytes do not fit a {SLOT_BYTES}-byte slot", at + bytes),
            });
        }
        let res = match desc.reserve(offset, span, 1, span, false) {
            Ok(r) => r,
            Err(e) => return fail(busy(&refs[slot_idx], e)),
        };
        if let Err(e) = plan.to_pinned(res, Shape { offset: 0, len, count, stride }, at as u64) {
            return fail(cuda_io(format!("copying source {} out of CUDA memory", refs[slot_idx].id()))(e));
        }
        runs.push(Run::Device { at, bytes });
        at += bytes;
    }
    plan.keep(refs);
    if let Some(g) = &xfer.gate {
        // The send's GPU order: the copy waits for the engine's work, the host does not.
        if let Err(e) = slots.stream.wait_event(g) {
            return fail(cuda_io("waiting for the send's GPU order".into())(e));
        }
    }
    match slots.stream.submit(plan) {
        Ok(pending) => Staged::Copying { pending, runs, _holding: holding },
        Err(e) => fail(cuda_io("queueing a frame's device-to-host copy".into())(e)),
    }
}

fn busy(r: &RegionRef, e: kvxfer_core::MemError) -> BackendError {
    BackendError::Io {
        backend: NAME,
        context: format!("reading source {}", r.id()),
        detail: format!("{e} (a transfer into this endpoint is writing a source range)"),
    }
}

/// Writes a staged frame once its copy completed, or its DROP PART when it was dropped (what
/// `send::write_job` does for a frame in host memory).
pub(crate) async fn write_staged(
    w: &mut Tx,
    acks: &send::Acks,
    sending: &mut Sending,
    xfer: Arc<Xfer>,
    head: Vec<u8>,
    pre: Prefetched,
    note_part: bool,
    poll: Duration,
    timeout: Duration,
) -> std::io::Result<()> {
    let slots = sending.slots.as_mut().expect("a staged frame has slots");
    let dropped = send::drop_frame(xfer.batch, wire::DROP_PART, 0);
    let dropped = if note_part { &dropped[..] } else { &[] };
    let (pending, runs, holding) = match pre.staged {
        Some(Staged::Copying { pending, runs, _holding }) => (pending, runs, _holding),
        Some(Staged::Dropped) => {
            slots.skip(pre.chunk);
            return w.send(dropped).await;
        }
        None => {
            // Never staged (the pipeline fills in order, so the oldest frame always has a slot by
            // now): fail it rather than leave its transfer waiting.
            if xfer.start(true).is_some() {
                xfer.unstart(BackendError::Io {
                    backend: NAME,
                    context: "staging a frame".into(),
                    detail: "no staging slot was assigned to the frame".into(),
                });
                drop(Holding(Arc::clone(&xfer)));
            }
            slots.skip(pre.chunk);
            return w.send(dropped).await;
        }
    };
    if let Err(e) = pending.wait(&slots.stream, Instant::now() + timeout).await {
        xfer.unstart(cuda_io("copying a frame's source out of CUDA memory".into())(e));
        drop((runs, holding));
        slots.skip(pre.chunk);
        return w.send(dropped).await;
    }
    let buf = match pending.finish() {
        Ok(done) => done.pinned.expect("a staging plan has its buffer"),
        Err(_) => unreachable!("waited for"),
    };
    slots.pipe.filled(pre.chunk).expect("a filling chunk");
    let slot = match slots.pipe.poll() {
        Some(Action::Drain { chunk, slot }) if chunk == pre.chunk => slot,
        other => unreachable!("the writer drains in order: {other:?}"),
    };
    crate::send::lock(acks).push_back((xfer.batch, Arc::clone(&xfer)));
    let mut pieces: Vec<&[u8]> = Vec::with_capacity(1 + runs.len());
    pieces.push(&head);
    for r in &runs {
        match r {
            Run::Host(g, count, stride, len) => {
                let span = g.as_slice();
                pieces.extend((0..*count).map(|i| &span[(i * stride) as usize..(i * stride + len) as usize]));
            }
            Run::Device { at, bytes } => pieces.push(&buf.as_slice()[*at..at + bytes]),
        }
    }
    let r = io::write_pieces(w, pieces, poll).await;
    drop((runs, holding));
    slots.bufs[slot] = Some(buf);
    slots.pipe.drained(pre.chunk).expect("a draining chunk");
    while slots.pipe.landed().is_some() {}
    sending.prefetch();
    r
}

// ---------------------------------------------------------------------------------------------
// Receiving.

/// A staged frame whose host-to-device copy is queued.
struct Landing {
    chunk: u64,
    slot: usize,
    pending: Pending,
    batch: u64,
    flags: u8,
}

/// Whether a WRITE frame writes CUDA memory (an unknown region is the host path's to refuse).
pub(crate) fn touches_device(shared: &Shared, ops: &[OpDesc]) -> bool {
    ops.iter().any(|op| shared.regions.get(op.region, None).is_ok_and(|r| device_of(r.desc().kind()).is_some()))
}

/// A receiving stream's staged frames.
#[derive(Default)]
pub(crate) struct Receiving {
    slots: Option<Slots>,
    landing: VecDeque<Landing>,
}

/// How long a receiving stream that ends waits for its queued host-to-device copies.
const LANDING_ON_EXIT: Duration = Duration::from_secs(30);

impl Receiving {
    /// Waits for the copies this stream queued into device memory, once its frame loop ended
    /// (closed, failed, or its peer cut off): the stream counts as closed (what a cut-off waits
    /// for) only once nothing it read can still land. The wait is the copies' own (microseconds to
    /// milliseconds for 1 MiB frames), blocking this task's thread, and bounded by
    /// [`LANDING_ON_EXIT`] per copy. Returns `false` when a copy did not complete in time: its
    /// bytes may still land, and the caller must not let a cut-off of this peer be confirmed.
    pub(crate) fn finish(&mut self) -> bool {
        let Some(slots) = self.slots.as_ref() else { return true };
        let mut landed = true;
        for l in self.landing.drain(..) {
            if let Err(e) = l.pending.wait_blocking(&slots.stream, Instant::now() + LANDING_ON_EXIT) {
                landed = false;
                tracing::error!(
                    target: "kvxfer_tcp",
                    chunk = l.chunk,
                    "a frame's copy into CUDA memory did not complete within {LANDING_ON_EXIT:?} after its stream \
                     ended ({e}): its bytes may still land, so a cut-off of its peer cannot be confirmed"
                );
            }
        }
        landed
    }
}

impl Drop for Receiving {
    /// A stream dropped without [`Receiving::finish`] (its task aborted at shutdown) still waits for
    /// its queued copies, so that its slots are not reused or freed under a running copy.
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

enum Next {
    Read(std::io::Result<usize>),
    Landed(Result<(), CudaError>),
}

fn placing(e: CudaError) -> Ending {
    Ending::Protocol(WireError(format!("placing a frame into CUDA memory failed: {e}")))
}

impl Receiving {
    /// The first bytes of the next frame header (one read, as `serve_frames` does), acknowledging
    /// staged frames as their copies complete meanwhile.
    pub(crate) async fn read_header(
        &mut self,
        shared: &Shared,
        hello: &Hello,
        r: &mut Rx,
        w: &mut Tx,
        hb: &mut [u8],
        poll: Duration,
    ) -> Result<std::io::Result<usize>, Ending> {
        loop {
            let (Some(front), Some(slots)) = (self.landing.front(), self.slots.as_ref()) else {
                return Ok(r.read_vectored_polling(&mut [std::io::IoSliceMut::new(hb)], poll).await);
            };
            let deadline = Instant::now() + shared.timeout;
            let mut iov = [std::io::IoSliceMut::new(&mut hb[..])];
            let next = tokio::select! {
                biased;
                n = r.read_vectored_polling(&mut iov, poll) => Next::Read(n),
                done = front.pending.wait(&slots.stream, deadline) => Next::Landed(done),
            };
            match next {
                Next::Read(n) => return Ok(n),
                Next::Landed(done) => {
                    done.map_err(placing)?;
                    self.land_front(shared, hello, w).await?;
                }
            }
        }
    }

    /// Waits for every staged frame and acknowledges it (before a frame that is not staged).
    pub(crate) async fn drain(&mut self, shared: &Shared, hello: &Hello, w: &mut Tx) -> Result<(), Ending> {
        while !self.landing.is_empty() {
            self.land_front(shared, hello, w).await?;
        }
        Ok(())
    }

    /// Waits for the oldest staged frame's copy, then counts its part and acknowledges it.
    async fn land_front(&mut self, shared: &Shared, hello: &Hello, w: &mut Tx) -> Result<(), Ending> {
        let (Some(l), Some(slots)) = (self.landing.pop_front(), self.slots.as_mut()) else { return Ok(()) };
        l.pending.wait(&slots.stream, Instant::now() + shared.timeout).await.map_err(placing)?;
        let done = l.pending.finish().map_err(|_| placing(CudaError::invalid("copy not complete")))?;
        slots.bufs[l.slot] = done.pinned;
        slots.pipe.drained(l.chunk).map_err(|e| Ending::Protocol(WireError(e.to_string())))?;
        while slots.pipe.landed().is_some() {}
        if l.flags & wire::FLAG_LAST != 0 && l.flags & wire::FLAG_NOTE_FOLLOWS != 0 {
            shared.part(hello.link, l.batch, false)?;
        }
        within(shared.timeout, "sending an ACK", w.send(&Header::new(FrameType::Ack, l.batch).encode())).await
    }

    /// Receives a WRITE frame that writes CUDA memory (see the module docs); its acknowledgement
    /// follows once its copy completed.
    pub(crate) async fn write(
        &mut self,
        shared: &Shared,
        hello: &Hello,
        r: &mut Rx,
        w: &mut Tx,
        h: &Header,
        ops: &[OpDesc],
        poll: Duration,
    ) -> Result<(), Ending> {
        // Regions held for the whole frame, checked as every frame is.
        let mut refs: Vec<RegionRef> = Vec::new();
        let mut slots_of = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let slot = match refs.iter().position(|x| x.id() == op.region) {
                Some(s) => s,
                None => {
                    let x = shared
                        .regions
                        .get(op.region, None)
                        .map_err(|_| WireError(format!("op {i} names {}, which is not registered", op.region)))?;
                    refs.push(x);
                    refs.len() - 1
                }
            };
            slots_of.push(slot);
        }
        let lens: Vec<u64> = slots_of.iter().map(|s| refs[*s].len()).collect();
        wire::validate_write(ops, h.payload, &lens)?;
        // Host pieces are guarded (and read into directly); device pieces are reserved.
        let mut host: Vec<StridedWriteGuard> = Vec::new();
        let mut device: Vec<(Reservation, Shape)> = Vec::new();
        let mut order: Vec<bool> = Vec::with_capacity(ops.len());
        let mut device_bytes = 0usize;
        let mut dev_no = None;
        for (i, (op, slot)) in ops.iter().zip(&slots_of).enumerate() {
            let (len, count, stride) = if wire::contiguous(op.stride, op.len, op.count) {
                (op.len * op.count, 1, op.len * op.count)
            } else {
                (op.len, op.count, op.stride)
            };
            let desc = refs[*slot].desc();
            let refused = |e: kvxfer_core::MemError| {
                WireError(format!(
                    "op {i} into {}: {e} (ranges overlap within this frame or with a frame in flight on another stream)",
                    op.region
                ))
            };
            match device_of(desc.kind()) {
                None => host.push(desc.write_guard_strided(op.offset, len, count, stride).map_err(refused)?),
                Some(d) => {
                    dev_no.get_or_insert(d);
                    let res = desc.reserve(op.offset, len, count, stride, true).map_err(refused)?;
                    device.push((res, Shape { offset: 0, len, count, stride }));
                    device_bytes += (len * count) as usize;
                }
            }
            order.push(device_of(desc.kind()).is_some());
        }
        if device_bytes > MAX_STAGED_FRAME {
            return Err(WireError(format!(
                "a frame of {device_bytes} bytes into CUDA memory is over the staging limit of {MAX_STAGED_FRAME}"
            ))
            .into());
        }
        if self.slots.is_none() {
            let d = dev_no.expect("a staged frame writes device memory");
            self.slots = Some(Slots::new(d, 1, SLOTS).map_err(placing)?);
        }
        while !self.slots.as_ref().expect("made").pipe.has_room() {
            self.land_front(shared, hello, w).await?;
        }
        let slots = self.slots.as_mut().expect("made");
        let chunk = slots.pipe.push();
        let slot = match slots.pipe.poll() {
            Some(Action::Fill { chunk: c, slot }) if c == chunk => slot,
            other => unreachable!("a free slot for the new chunk: {other:?}"),
        };
        let mut buf = slots.take(slot, device_bytes).map_err(placing)?;
        {
            // The payload's pieces in wire order: host guards' pieces, or the next bytes of the slot.
            let mut host_pieces = host.iter_mut().map(|g| g.pieces_mut().collect::<Vec<_>>());
            let mut rest = &mut buf.as_mut_slice()[..device_bytes];
            let mut dev_sizes = device.iter().map(|(_, s)| (s.len * s.count) as usize);
            let mut pieces: Vec<&mut [u8]> = Vec::new();
            for is_dev in &order {
                if *is_dev {
                    let n = dev_sizes.next().expect("one size per device op");
                    let (a, b) = std::mem::take(&mut rest).split_at_mut(n);
                    pieces.push(a);
                    rest = b;
                } else {
                    pieces.extend(host_pieces.next().expect("one guard per host op"));
                }
            }
            within(shared.timeout, "reading a WRITE payload", io::read_pieces(r, pieces, poll)).await?;
        }
        drop(host);
        slots.pipe.filled(chunk).map_err(|e| Ending::Protocol(WireError(e.to_string())))?;
        match slots.pipe.poll() {
            Some(Action::Drain { chunk: c, .. }) if c == chunk => {}
            other => unreachable!("the new chunk drains at once: {other:?}"),
        }
        let mut plan = CopyPlan::with_pinned(buf);
        let mut at = 0u64;
        for (res, shape) in device {
            let n = shape.len * shape.count;
            plan.from_pinned(at, res, shape).map_err(placing)?;
            at += n;
        }
        plan.keep(refs);
        let pending = slots.stream.submit(plan).map_err(placing)?;
        self.landing.push_back(Landing { chunk, slot, pending, batch: h.batch, flags: h.flags });
        Ok(())
    }
}

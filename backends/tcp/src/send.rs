//! The sending side: a link (data streams plus a control stream) per connected peer, a writer and
//! a reader task per stream, and the books of every posted transfer.
//!
//! A transfer is cut into WRITE frames (at most [`wire::MAX_OPS`] descriptors, [`FRAME_BYTES`]
//! payload bytes and [`wire::MAX_FRAME_RANGES`] guard pieces each) dealt over the data streams. A
//! writer *starts* a frame by taking it from the transfer's books (refused once the transfer is
//! aborted or failed: the frame is dropped) and read-guarding its source pieces, then writes it
//! straight from them. The receiver acknowledges every WRITE frame after placing it, in stream
//! order. So a transfer is complete when every frame was acknowledged (remote completion), and an
//! abort is fenced when every started frame was acknowledged: no byte of it can land afterwards,
//! and no source byte is read (a frame being written holds the transfer open).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer_core::toolkit::{segments, EventQueue, RegionRef};
use kvxfer_core::{AbortTransfer, BackendError, BackendEvent, RegionId, TransferState, WriteOp};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use crate::conn::{Conn, Rx, Tx};
use crate::wire::{self, FrameType, Header, OpDesc};
use crate::{io, sock, NAME};

/// Payload bytes of one WRITE frame at most: an abort waits for at most one frame per stream.
///
/// 1 MiB, where loopback TCP is fastest: a frame is written with one vectored call, whose bytes
/// the receiver copies out while they are still in cache (`benches/socket/loopback_poll.py`: 1 MiB
/// sends 5.5-5.8 GB/s, 8 MiB 3.8-3.9). On 2026-12-03, one polling stream, 1 GiB shuffled, two
/// rounds: 8 MiB frames moved 3.9-4.0 GB/s at 64 KiB blocks and 5.2 at 1 MiB, 1 MiB frames
/// 5.4-6.0 and 6.3-6.4.
pub(crate) const FRAME_BYTES: u64 = 1 << 20;

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The source side of one piece of an op: `count` ranges of `len` bytes at `offset + i * stride`
/// of the transfer's source region number `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SrcOp {
    pub slot: usize,
    pub offset: u64,
    pub stride: u64,
    pub len: u64,
    pub count: u64,
}

/// One piece of a posted op: where it is read and where it lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Item {
    pub src: SrcOp,
    pub dst: OpDesc,
}

impl Item {
    fn bytes(&self) -> u64 {
        self.src.len * self.src.count
    }

    /// Guard pieces the receiver takes for it.
    fn pieces(&self) -> u64 {
        wire::guard_count(self.dst.stride, self.dst.len, self.dst.count).unwrap_or(u64::MAX)
    }
}

/// Cuts `item` into pieces of at most `piece` bytes and [`wire::MAX_FRAME_RANGES`] guard pieces:
/// contiguous ops by length (the toolkit's segments), strided ops by count (a strided piece stays
/// one descriptor), ranges longer than `piece` by length.
fn split(item: Item, piece: u64, mut put: impl FnMut(Item)) {
    let (s, d) = (item.src, item.dst);
    let contiguous = wire::contiguous(s.stride, s.len, s.count) && wire::contiguous(d.stride, d.len, d.count);
    if contiguous && item.bytes() <= piece {
        // The common case (a block, a page run): one piece, without the segmenter's allocation.
        let len = item.bytes();
        return put(Item {
            src: SrcOp { len, stride: len, count: 1, ..s },
            dst: OpDesc { len, stride: len, count: 1, ..d },
        });
    }
    if contiguous || s.len > piece {
        for k in 0..if contiguous { 1 } else { s.count } {
            let op = WriteOp::contiguous(
                RegionId(0),
                s.offset + k * s.stride,
                d.region,
                d.offset + k * d.stride,
                if contiguous { s.len * s.count } else { s.len },
            );
            for g in segments(std::slice::from_ref(&op), piece) {
                put(Item {
                    src: SrcOp { offset: g.src_offset, len: g.len, stride: g.len, count: 1, ..s },
                    dst: OpDesc { offset: g.dst_offset, len: g.len, stride: g.len, count: 1, ..d },
                });
            }
        }
        return;
    }
    let per = (piece / s.len).min(wire::MAX_FRAME_RANGES / s.len.div_ceil(wire::MAX_GUARD)).max(1);
    let mut i = 0;
    while i < s.count {
        let count = per.min(s.count - i);
        put(Item {
            src: SrcOp { offset: s.offset + i * s.stride, count, ..s },
            dst: OpDesc { offset: d.offset + i * d.stride, count, ..d },
        });
        i += count;
    }
}

/// Packs the items, in post order, into frames and deals the frames over `streams` streams (least
/// loaded first, order kept per stream). Returns, per stream, its frames.
///
/// Frames carry consecutive items, so a post of small blocks read in source order keeps its source
/// contiguous within a frame (one read guard and one slice per run, see [`source_runs`]); frames
/// hold at most a quarter of a stream's share of the post (at least 64 KiB, at most
/// [`FRAME_BYTES`]), so the streams stay balanced and a stream's first frame is on the wire early.
pub(crate) fn plan(items: Vec<Item>, streams: usize, total: u64) -> Vec<Vec<Vec<Item>>> {
    let piece = if streams == 1 { FRAME_BYTES } else { (total / (streams as u64 * 4)).clamp(64 << 10, FRAME_BYTES) };
    let mut frames: Vec<Vec<Item>> = Vec::new();
    let (mut bytes, mut pieces) = (0u64, 0u64);
    for item in items {
        split(item, piece, |it| {
            let fits = frames.last().is_some_and(|f| {
                f.len() < wire::MAX_OPS as usize
                    && bytes + it.bytes() <= piece
                    && pieces + it.pieces() <= wire::MAX_FRAME_RANGES
            });
            if !fits {
                frames.push(Vec::new());
                (bytes, pieces) = (0, 0);
            }
            bytes += it.bytes();
            pieces += it.pieces();
            frames.last_mut().expect("pushed").push(it);
        });
    }
    let mut per: Vec<Vec<Vec<Item>>> = vec![Vec::new(); streams];
    let mut load = vec![0u64; streams];
    for f in frames {
        let i = (0..streams).min_by_key(|i| load[*i]).expect("at least one stream");
        load[i] += f.iter().map(Item::bytes).sum::<u64>();
        per[i].push(f);
    }
    per
}

// ---------------------------------------------------------------------------------------------
// A transfer's books.

struct XferInner {
    /// Source regions, held until the transfer is final.
    srcs: Vec<RegionRef>,
    /// Frames (WRITE and NOTE) not yet started or dropped by a writer.
    queued: u32,
    /// WRITE frames started and not yet acknowledged.
    unacked: u32,
    /// Frames a writer holds (reading source memory or writing the NOTE).
    writing: u32,
    error: Option<BackendError>,
    /// The link failed: acknowledgements will not come.
    link_dead: bool,
}

/// One posted transfer on the sending side; also its [`AbortTransfer`].
pub(crate) struct Xfer {
    pub state: Arc<TransferState>,
    pub batch: u64,
    inner: Mutex<XferInner>,
    /// The send's GPU order: no source byte is read before it completed (see `crate::staging`).
    pub gate: Option<Arc<kvxfer_cuda::Event>>,
}

impl Xfer {
    pub fn new(
        state: Arc<TransferState>,
        batch: u64,
        srcs: Vec<RegionRef>,
        frames: u32,
        gate: Option<Arc<kvxfer_cuda::Event>>,
    ) -> Self {
        let inner = XferInner { srcs, queued: frames, unacked: 0, writing: 0, error: None, link_dead: false };
        Self { state, batch, inner: Mutex::new(inner), gate }
    }

    /// Makes the state final when the books allow it: complete when every frame was acknowledged,
    /// aborted when every started frame was, failed when no acknowledgement is missing or none can
    /// come. Never while a writer holds a frame (it may be reading source memory).
    fn settle(&self, i: &mut XferInner) {
        if i.writing == 0 && !self.state.status().is_final() {
            if i.error.is_none() && i.queued == 0 && i.unacked == 0 {
                self.state.complete();
            } else if self.state.abort_requested() && i.unacked == 0 {
                self.state.aborted();
            } else if let Some(e) = i.error.as_ref().filter(|_| i.unacked == 0 || i.link_dead) {
                self.state.fail(e.clone());
            }
        }
        if self.state.status().is_final() {
            i.srcs.clear();
        }
    }

    /// A writer starts a frame: the source regions, or `None` when the frame is dropped (the
    /// transfer is aborted, failed or final).
    pub(crate) fn start(&self, write: bool) -> Option<Vec<RegionRef>> {
        let mut i = lock(&self.inner);
        i.queued = i.queued.saturating_sub(1);
        if i.error.is_some() || self.state.abort_requested() || self.state.status().is_final() {
            self.settle(&mut i);
            return None;
        }
        i.writing += 1;
        i.unacked += u32::from(write);
        Some(i.srcs.clone())
    }

    /// A started WRITE frame was not sent after all (a source guard was refused).
    pub(crate) fn unstart(&self, e: BackendError) {
        let mut i = lock(&self.inner);
        i.unacked -= 1;
        i.error.get_or_insert(e);
    }

    /// The CUDA device of the first of `ops`' source regions that lies in CUDA memory (such a frame
    /// goes through the staging slots of [`crate::staging`]), if any.
    pub(crate) fn source_device(&self, ops: &[SrcOp]) -> Option<u32> {
        let i = lock(&self.inner);
        ops.iter().find_map(|op| match i.srcs.get(op.slot).map(|r| r.desc().kind()) {
            Some(kvxfer_core::MemKind::Cuda { device }) => Some(device),
            _ => None,
        })
    }

    fn released(&self) {
        let mut i = lock(&self.inner);
        i.writing -= 1;
        self.settle(&mut i);
    }

    fn acked(&self) {
        let mut i = lock(&self.inner);
        i.unacked = i.unacked.saturating_sub(1);
        self.settle(&mut i);
    }

    fn link_failed(&self, e: BackendError) {
        let mut i = lock(&self.inner);
        i.link_dead = true;
        i.error.get_or_insert(e);
        self.settle(&mut i);
    }
}

impl AbortTransfer for Xfer {
    fn abort(&self, _state: &Arc<TransferState>) {
        // Frames not started are dropped by the writers when they reach them; the state is final
        // once every started frame was acknowledged (or the link failed).
        self.settle(&mut lock(&self.inner));
    }
}

/// A writer holds a frame; dropping it (frame written, or the writer stopped) lets the transfer settle.
pub(crate) struct Holding(pub(crate) Arc<Xfer>);

impl Drop for Holding {
    fn drop(&mut self) {
        self.0.released();
    }
}

// ---------------------------------------------------------------------------------------------
// Links.

pub(crate) enum Job {
    /// A WRITE frame; `note_part`: it is the LAST | NOTE_FOLLOWS frame of its stream.
    Write {
        xfer: Arc<Xfer>,
        head: Vec<u8>,
        ops: Vec<SrcOp>,
        note_part: bool,
    },
    /// A NOTE: attached (of `xfer`, waiting for `parts`) or out of band (`done` when written).
    Note {
        xfer: Option<Arc<Xfer>>,
        head: Vec<u8>,
        parts: u32,
        done: Option<oneshot::Sender<()>>,
    },
    Bye,
}

/// Started WRITE frames of one stream awaiting their ACK, in order.
pub(crate) type Acks = Arc<Mutex<VecDeque<(u64, Arc<Xfer>)>>>;

#[derive(Default)]
struct LinkInner {
    dead: Option<BackendError>,
    closing: bool,
    live: Vec<Arc<Xfer>>,
}

pub(crate) struct LinkState {
    inner: Mutex<LinkInner>,
    tasks: Mutex<Vec<AbortHandle>>,
    /// The peer's identity and the local event queue: a failed outgoing link is reported as
    /// [`BackendEvent::PeerLost`] too, so a sender learns of it without posting.
    identity: u64,
    events: Arc<EventQueue>,
    peer: String,
    timeout: Duration,
}

impl LinkState {
    /// Fails the link: every transfer on it fails (once no writer holds one of its frames), the
    /// tasks stop. Reports the loss unless the link is being closed.
    pub fn fail(&self, err: BackendError) {
        let (live, err) = {
            let mut i = lock(&self.inner);
            if i.dead.is_none() {
                if !i.closing {
                    // Reported to the caller as an event (the engine names it in the requests it fails).
                    tracing::info!(error = %err, "tcp: link failed");
                    self.events.push(BackendEvent::PeerLost { identity: self.identity, reason: err.to_string() });
                }
                i.dead = Some(err.clone());
            }
            (std::mem::take(&mut i.live), i.dead.clone().unwrap_or(err))
        };
        for x in live {
            x.link_failed(err.clone());
        }
        for t in lock(&self.tasks).iter() {
            t.abort();
        }
    }

    fn is_closing(&self) -> bool {
        lock(&self.inner).closing
    }

    pub fn check(&self) -> Result<(), BackendError> {
        lock(&self.inner).dead.clone().map_or(Ok(()), Err)
    }

    fn lost(&self, detail: String) -> BackendError {
        BackendError::PeerLost { backend: NAME, peer: self.peer.clone(), detail }
    }

    /// Adds a transfer to the link's books, unless the link is dead.
    fn admit(&self, x: &Arc<Xfer>) -> Result<(), BackendError> {
        let mut i = lock(&self.inner);
        if let Some(e) = &i.dead {
            return Err(e.clone());
        }
        i.live.retain(|x| !x.state.status().is_final());
        i.live.push(Arc::clone(x));
        Ok(())
    }

    /// Marks the link as closing (no loss is reported) and returns its transfers.
    pub fn closing(&self) -> Vec<Arc<Xfer>> {
        let mut i = lock(&self.inner);
        i.closing = true;
        i.live.clone()
    }
}

struct Stream {
    tx: mpsc::UnboundedSender<Job>,
}

/// An outgoing connection to one peer.
pub(crate) struct Link {
    pub regions: std::collections::HashMap<RegionId, u64>,
    /// The peer endpoint: identity and instance (from its metadata).
    pub peer: (u64, u64),
    data: Vec<Stream>,
    control: Stream,
    pub state: Arc<LinkState>,
    next_batch: std::sync::atomic::AtomicU64,
}

impl Link {
    /// Starts a writer and a reader per stream (`streams`: data streams, then the control stream).
    pub fn start(
        streams: Vec<Conn>,
        regions: std::collections::HashMap<RegionId, u64>,
        peer_endpoint: (u64, u64),
        events: Arc<EventQueue>,
        peer: String,
        timeout: Duration,
        poll: Duration,
    ) -> Self {
        let state = Arc::new(LinkState {
            inner: Mutex::new(LinkInner::default()),
            tasks: Mutex::new(Vec::new()),
            identity: peer_endpoint.0,
            events,
            peer,
            timeout,
        });
        let mut out = Vec::with_capacity(streams.len());
        for (i, s) in streams.into_iter().enumerate() {
            let (tx, rx) = mpsc::unbounded_channel();
            // Each stream's writer and acknowledgement reader run on a thread of their own (see
            // `sock::on_own_thread`).
            let st = Arc::clone(&state);
            let started = sock::on_own_thread(s, &format!("kvxfer-tcp-tx{i}"), move |s| {
                let (r, w) = s.into_split();
                let acks = Acks::default();
                vec![
                    tokio::spawn(writer(w, rx, Arc::clone(&acks), Arc::clone(&st), poll)),
                    tokio::spawn(reader(r, acks, st)),
                ]
            });
            match started {
                Ok(tasks) => lock(&state.tasks).extend(tasks),
                Err(e) => state.fail(state.lost(format!("starting the stream's thread: {e}"))),
            }
            out.push(Stream { tx });
        }
        let control = out.pop().expect("control stream");
        Self {
            regions,
            peer: peer_endpoint,
            data: out,
            control,
            state,
            next_batch: std::sync::atomic::AtomicU64::new(1),
        }
    }

    pub fn streams(&self) -> usize {
        self.data.len()
    }

    fn enqueue(&self, s: &Stream, job: Job) {
        if s.tx.send(job).is_err() {
            self.state.fail(self.state.lost("the stream's writer has stopped".into()));
        }
    }

    /// Queues a planned transfer (frames per stream, attached notification) and returns its books.
    pub fn send(
        &self,
        state: Arc<TransferState>,
        srcs: Vec<RegionRef>,
        frames: Vec<Vec<Vec<Item>>>,
        note: Option<Vec<u8>>,
        gate: Option<Arc<kvxfer_cuda::Event>>,
    ) -> Result<Arc<Xfer>, BackendError> {
        let batch = self.next_batch.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let count = frames.iter().map(Vec::len).sum::<usize>() + usize::from(note.is_some());
        let xfer = Arc::new(Xfer::new(state, batch, srcs, count as u32, gate));
        self.state.admit(&xfer)?;
        let parts = frames.iter().filter(|f| !f.is_empty()).count() as u32;
        for (s, frames) in frames.into_iter().enumerate() {
            let last = frames.len().saturating_sub(1);
            for (k, items) in frames.into_iter().enumerate() {
                let mut h = Header::new(FrameType::Write, batch);
                h.n = items.len() as u32;
                h.payload = items.iter().map(Item::bytes).sum();
                let note_part = k == last && note.is_some();
                if k == last {
                    h.flags = wire::FLAG_LAST | if note_part { wire::FLAG_NOTE_FOLLOWS } else { 0 };
                }
                let mut head = Vec::with_capacity(wire::HEADER_LEN + items.len() * wire::OP_LEN);
                head.extend_from_slice(&h.encode());
                items.iter().for_each(|it| it.dst.encode_into(&mut head));
                let ops = items.into_iter().map(|it| it.src).collect();
                self.enqueue(&self.data[s], Job::Write { xfer: Arc::clone(&xfer), head, ops, note_part });
            }
        }
        if let Some(body) = note {
            let mut h = Header::new(FrameType::Note, batch);
            h.n = body.len() as u32;
            h.parts = parts;
            let mut head = h.encode().to_vec();
            head.extend_from_slice(&body);
            self.enqueue(&self.data[0], Job::Note { xfer: Some(Arc::clone(&xfer)), head, parts, done: None });
        }
        Ok(xfer)
    }

    /// Queues an out-of-band notification on the control stream; resolves when it is in the socket.
    pub async fn notify(&self, body: Vec<u8>) -> Result<(), BackendError> {
        self.state.check()?;
        let mut h = Header::new(FrameType::Note, 0);
        h.n = body.len() as u32;
        let mut head = h.encode().to_vec();
        head.extend_from_slice(&body);
        let (tx, rx) = oneshot::channel();
        self.enqueue(&self.control, Job::Note { xfer: None, head, parts: 0, done: Some(tx) });
        let t = self.state.timeout;
        match tokio::time::timeout(t, rx).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(self.state.check().err().unwrap_or_else(|| self.state.lost("link closed".into()))),
            Err(_) => Err(BackendError::Timeout {
                backend: NAME,
                what: format!("notification to {}", self.state.peer),
                after: t,
            }),
        }
    }

    /// Sends BYE on every stream after what is queued.
    pub fn bye(&self) {
        for s in self.data.iter().chain(std::iter::once(&self.control)) {
            let _ = s.tx.send(Job::Bye);
        }
    }
}

pub(crate) fn drop_frame(batch: u64, flags: u8, parts: u32) -> [u8; wire::HEADER_LEN] {
    let mut h = Header::new(FrameType::Drop, batch);
    h.flags = flags;
    h.parts = parts;
    h.encode()
}

/// A frame's source pieces as `(slot, offset, count, stride, len)` runs, in wire order: contiguous
/// pieces that continue the previous contiguous run in the same source region extend it (one
/// range); a strided piece stays its own run.
pub(crate) fn source_runs(ops: &[SrcOp]) -> Vec<(usize, u64, u64, u64, u64)> {
    let mut runs: Vec<(usize, u64, u64, u64, u64)> = Vec::with_capacity(ops.len());
    for op in ops {
        let contiguous = wire::contiguous(op.stride, op.len, op.count);
        if let Some(last) = runs.last_mut() {
            let (slot, offset, count, _, len) = *last;
            if contiguous && count == 1 && slot == op.slot && offset + len == op.offset {
                let len = len + op.len * op.count;
                *last = (slot, offset, 1, len, len);
                continue;
            }
        }
        if contiguous {
            let len = op.len * op.count;
            runs.push((op.slot, op.offset, 1, len, len));
        } else {
            runs.push((op.slot, op.offset, op.count, op.stride, op.len));
        }
    }
    runs
}

/// Starts and writes one WRITE frame, or drops it (a DROP PART in its place when it carried the
/// stream's part of an attached notification).
async fn write_job(
    w: &mut Tx,
    acks: &Acks,
    xfer: Arc<Xfer>,
    head: Vec<u8>,
    ops: Vec<SrcOp>,
    note_part: bool,
    poll: Duration,
) -> std::io::Result<()> {
    let dropped = drop_frame(xfer.batch, wire::DROP_PART, 0);
    let dropped = if note_part { &dropped[..] } else { &[] };
    let Some(refs) = xfer.start(true) else { return w.send(dropped).await };
    let _holding = Holding(Arc::clone(&xfer));
    if let Some(g) = &xfer.gate {
        // Host memory the engine fills with its own GPU copy: read it only once that completed.
        if let Err(e) = g.wait_host(std::time::Instant::now() + Duration::from_secs(120)).await {
            xfer.unstart(BackendError::Io {
                backend: NAME,
                context: "the send's GPU order".into(),
                detail: e.to_string(),
            });
            return w.send(dropped).await;
        }
    }
    // One read guard per run of source bytes: reads exclude only writes, so the ranges are sliced
    // out of it (a guard per range would cost more than sending a short range), and contiguous ops
    // that continue each other in the same source region (a post of many small blocks read in
    // order, landing anywhere) share one guard and one slice.
    let mut guards = Vec::with_capacity(ops.len());
    for (slot, offset, count, stride, len) in source_runs(&ops) {
        let span = (count - 1) * stride + len;
        match refs[slot].desc().read_guard(offset, span) {
            Ok(g) => guards.push((g, count, stride, len)),
            Err(e) => {
                xfer.unstart(BackendError::Io {
                    backend: NAME,
                    context: format!("reading source {}", refs[slot].id()),
                    detail: format!("{e} (a transfer into this endpoint is writing a source range)"),
                });
                drop(guards);
                return w.send(dropped).await;
            }
        }
    }
    lock(acks).push_back((xfer.batch, Arc::clone(&xfer)));
    io::write_frame(w, &head, &guards, poll).await
}

async fn writer(mut w: Tx, mut jobs: mpsc::UnboundedReceiver<Job>, acks: Acks, state: Arc<LinkState>, poll: Duration) {
    // Frames with CUDA sources are staged ahead through pinned slots (crate::staging).
    let mut staging = crate::staging::Sending::default();
    while let Some((job, staged)) = staging.next(&mut jobs).await {
        let r = match job {
            Job::Write { xfer, head, ops: _, note_part } if staged.is_some() => {
                let pre = staged.expect("checked");
                let t = state.timeout;
                crate::staging::write_staged(&mut w, &acks, &mut staging, xfer, head, pre, note_part, poll, t).await
            }
            Job::Write { xfer, head, ops, note_part } => {
                write_job(&mut w, &acks, xfer, head, ops, note_part, poll).await
            }
            Job::Note { xfer, head, parts, done } => {
                let holding = match xfer {
                    None => None,
                    Some(x) if x.start(false).is_some() => Some(Holding(x)),
                    Some(x) => {
                        if parts > 0 {
                            if let Err(e) = w.send(&drop_frame(x.batch, wire::DROP_NOTE, parts)).await {
                                state.fail(state.lost(format!("sending: {e}")));
                                return;
                            }
                        }
                        continue;
                    }
                };
                let r = w.send(&head).await;
                drop(holding);
                if let Some(d) = done.filter(|_| r.is_ok()) {
                    let _ = d.send(());
                }
                r
            }
            Job::Bye => {
                let _ = w.send(&Header::new(FrameType::Bye, 0).encode()).await;
                let _ = w.shutdown().await;
                return;
            }
        };
        if let Err(e) = r {
            state.fail(state.lost(format!("sending: {e}")));
            return;
        }
    }
}

/// Reads ACK and ERROR frames. A stream with unacknowledged frames that hears nothing for the
/// link's timeout fails the link (so an abort or a transfer never waits forever), and so does a
/// frame header that stops after its first bytes.
async fn reader(mut r: Rx, acks: Acks, state: Arc<LinkState>) {
    let protocol = |detail: String| BackendError::Protocol { backend: NAME, peer: state.peer.clone(), detail };
    loop {
        let mut hb = [0u8; wire::HEADER_LEN];
        let mut got = 0;
        while got < hb.len() {
            match tokio::time::timeout(state.timeout, r.read(&mut hb[got..])).await {
                // After BYE the receiver closes the stream once it acknowledged everything on it.
                Ok(Ok(0)) if state.is_closing() && lock(&acks).is_empty() => return,
                // A TLS stream whose peer closed the socket without close_notify.
                Ok(Err(e))
                    if e.kind() == std::io::ErrorKind::UnexpectedEof
                        && state.is_closing()
                        && lock(&acks).is_empty() =>
                {
                    return
                }
                Ok(Ok(0)) => return state.fail(state.lost("connection closed by the peer".into())),
                Ok(Ok(n)) => got += n,
                Ok(Err(e)) => return state.fail(state.lost(format!("receiving: {e}"))),
                // Idle with nothing outstanding is fine; a header cut off after its first bytes is not.
                Err(_) if got == 0 && lock(&acks).is_empty() => {}
                Err(_) if got > 0 => {
                    return state.fail(state.lost(format!(
                        "{got} of a frame header's {} bytes, then nothing for {:?}",
                        wire::HEADER_LEN,
                        state.timeout
                    )));
                }
                Err(_) => {
                    return state.fail(state.lost(format!("no acknowledgement within {:?}", state.timeout)));
                }
            }
        }
        let h = match Header::decode(&hb) {
            Ok(h) => h,
            Err(e) => return state.fail(protocol(e.0)),
        };
        match h.ty {
            FrameType::Ack => match lock(&acks).pop_front() {
                Some((batch, x)) if batch == h.batch => x.acked(),
                _ => return state.fail(protocol(format!("unexpected ACK for batch {}", h.batch))),
            },
            FrameType::Error => {
                let mut msg = vec![0u8; h.n as usize];
                let _ = tokio::time::timeout(Duration::from_secs(5), r.read_exact(&mut msg)).await;
                let msg = String::from_utf8_lossy(&msg).into_owned();
                return state.fail(protocol(format!("peer rejected a frame: {msg}")));
            }
            other => return state.fail(protocol(format!("unexpected {other:?} frame from the receiver"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(so: u64, ss: u64, d: u64, ds: u64, len: u64, count: u64) -> Item {
        Item {
            src: SrcOp { slot: 0, offset: so, stride: ss, len, count },
            dst: OpDesc { region: RegionId(1), offset: d, len, count, stride: ds },
        }
    }

    #[test]
    fn source_runs_merge_only_continuing_contiguous_pieces() {
        let op = |slot, offset, len, count, stride| SrcOp { slot, offset, stride, len, count };
        let ops = [
            op(0, 0, 4096, 1, 4096),
            op(0, 4096, 4096, 1, 4096),
            op(0, 8192, 1024, 4, 1024),  // contiguous strided form: continues the run
            op(1, 12288, 4096, 1, 4096), // another region
            op(1, 20480, 4096, 1, 4096), // a gap
            op(1, 24576, 256, 8, 512),   // strided: its own run
            op(1, 28672, 256, 1, 256),   // continues the strided piece's last range, but not a run
            op(1, 28928, 256, 1, 256),
        ];
        assert_eq!(
            source_runs(&ops),
            vec![
                (0, 0, 1, 12288, 12288),
                (1, 12288, 1, 4096, 4096),
                (1, 20480, 1, 4096, 4096),
                (1, 24576, 8, 512, 256),
                (1, 28672, 1, 512, 512),
            ]
        );
        let bytes = |r: &[(usize, u64, u64, u64, u64)]| r.iter().map(|r| r.2 * r.4).sum::<u64>();
        assert_eq!(bytes(&source_runs(&ops)), ops.iter().map(|o| o.len * o.count).sum::<u64>());
    }

    #[test]
    fn planning_covers_every_byte_once_within_frame_limits() {
        let items = vec![
            item(0, 3 << 20, 0, 3 << 20, 3 << 20, 1),
            item(0, 512, 8, 1024, 256, 2000),
            item(0, 16, 0, 16, 16, 100_000), // contiguous on both sides: merged
            item(0, 32 << 20, 0, 32 << 20, 20 << 20, 2), // ranges longer than a frame
            item(0, 8, 0, 64, 1, 300_000),   // many tiny strided ranges
        ];
        let total: u64 = items.iter().map(Item::bytes).sum();
        for streams in [1, 3] {
            let out = plan(items.clone(), streams, total);
            assert!(out.iter().all(|f| !f.is_empty()));
            let mut sum = 0;
            for f in out.iter().flatten() {
                assert!(f.len() <= wire::MAX_OPS as usize);
                assert!(f.iter().map(Item::bytes).sum::<u64>() <= FRAME_BYTES);
                assert!(f.iter().map(Item::pieces).sum::<u64>() <= wire::MAX_FRAME_RANGES);
                for it in f {
                    assert_eq!(it.src.len * it.src.count, it.dst.len * it.dst.count);
                    sum += it.bytes();
                }
            }
            assert_eq!(sum, total, "{streams} streams");
        }
        // Small blocks read in source order (landing anywhere): every frame reads one source run,
        // and the streams carry equal shares.
        let blocks: Vec<Item> =
            (0..4096u64).map(|i| item(i << 12, 4096, ((i * 7919) % 4096) << 12, 4096, 4096, 1)).collect();
        let out = plan(blocks, 2, 16 << 20);
        for f in out.iter().flatten() {
            let ops: Vec<SrcOp> = f.iter().map(|i| i.src).collect();
            assert_eq!(source_runs(&ops).len(), 1);
        }
        let shares: Vec<u64> = out.iter().map(|s| s.iter().flatten().map(Item::bytes).sum()).collect();
        assert_eq!(shares, vec![8 << 20, 8 << 20]);
        // The strided op keeps its source/destination correspondence.
        let out = plan(vec![item(0, 512, 8, 1024, 256, 2000)], 3, 512_000);
        let mut pairs: Vec<(u64, u64)> = out.iter().flatten().flatten().map(|i| (i.dst.offset, i.src.offset)).collect();
        pairs.sort_unstable();
        assert_eq!(pairs[0], (8, 0));
        assert!(pairs.iter().all(|(d, s)| (d - 8) / 1024 * 512 == *s));
    }
}

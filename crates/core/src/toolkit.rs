//! The toolkit for backend authors: the scaffolding every backend needs, written once.
//!
//! - [`RegionTable`]: registered regions by id, with use counting so a registration's close can
//!   wait until no local operation holds the memory ([`RegionTable::remove`] + [`Drained`]).
//! - [`PeerTable`]: connected peers by [`PeerId`].
//! - [`handshake`]: limits on incoming connections before they authenticate (in total and per
//!   source address), with refusal counters.
//! - [`EventQueue`]: the receive side's event queue with its bounded [`EventQueue::recv`] drain.
//! - [`Options`]: option parsing with `KVXFER_<BACKEND>_<OPTION>` environment fallbacks against the
//!   backend's one list of [`OptionDoc`]s; an unknown option is an error that lists the known ones.
//! - [`segments`] and [`Segment`]: [`WriteOp`] lowering into contiguous segments under a size limit.
//! - [`staging`]: the bounce-buffer pipeline (device memory through pinned host slots), pure.
//! - [`Fragmenter`] and [`Reassembler`]: notifications split into transport-sized fragments and put
//!   back together, bounded in size and in pending messages.
//!
//! Plus, in [`crate::backend`]: [`crate::TransferState`] (a transfer's completion state),
//! [`crate::Registration`] and [`crate::register_backend!`]. Nothing here does IO; waits use
//! tokio's sync and time types inside the caller's runtime.

pub mod handshake;
pub mod staging;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backend::{BackendConfig, BackendError, BackendEvent, OptionDoc, PeerId, RegionId, WriteOp};
use crate::error::CodecError;
use crate::mem::MemDesc;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Regions.

#[derive(Debug, Default)]
struct Uses {
    count: AtomicUsize,
    idle: tokio::sync::Notify,
}

/// A registered region held by an operation: the memory cannot be reported closed while this lives.
#[derive(Debug)]
pub struct RegionRef {
    id: RegionId,
    /// Always `Some` until drop, which lets the descriptor go before the use count falls, so that
    /// once a close's [`Drained`] resolves no descriptor of the memory is left here.
    desc: Option<MemDesc>,
    uses: Arc<Uses>,
}

impl RegionRef {
    /// The region id.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// The registered memory.
    pub fn desc(&self) -> &MemDesc {
        self.desc.as_ref().expect("present until drop")
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.desc().len() as u64
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.desc().is_empty()
    }
}

impl Clone for RegionRef {
    fn clone(&self) -> Self {
        self.uses.count.fetch_add(1, Ordering::AcqRel);
        Self { id: self.id, desc: self.desc.clone(), uses: self.uses.clone() }
    }
}

impl Drop for RegionRef {
    fn drop(&mut self) {
        drop(self.desc.take());
        if self.uses.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.uses.idle.notify_waiters();
        }
    }
}

/// Resolves when no [`RegionRef`] of a removed region is alive any more.
#[derive(Debug)]
pub struct Drained {
    uses: Arc<Uses>,
    desc: Option<MemDesc>,
}

impl Drained {
    /// Operations still holding the region.
    pub fn in_use(&self) -> usize {
        self.uses.count.load(Ordering::Acquire)
    }

    /// Waits until no operation holds the region. The table's own descriptor is dropped then.
    pub async fn wait(mut self) {
        loop {
            let mut idle = std::pin::pin!(self.uses.idle.notified());
            idle.as_mut().enable();
            if self.in_use() == 0 {
                break;
            }
            idle.await;
        }
        self.desc = None;
    }
}

#[derive(Debug)]
struct RegionEntry {
    desc: MemDesc,
    uses: Arc<Uses>,
}

/// Registered regions by id. Lookups hand out [`RegionRef`]s; a removed region answers
/// [`BackendError::UnknownRegion`] at once, and its [`Drained`] resolves when the last reference is
/// gone.
#[derive(Debug)]
pub struct RegionTable {
    backend: &'static str,
    max_regions: u64,
    regions: Mutex<HashMap<RegionId, RegionEntry>>,
    generation: AtomicU64,
}

impl RegionTable {
    /// An empty table holding at most `max_regions` regions.
    pub fn new(backend: &'static str, max_regions: u64) -> Self {
        Self { backend, max_regions, regions: Mutex::new(HashMap::new()), generation: AtomicU64::new(0) }
    }

    /// Adds a region. [`BackendError::RegionInUse`] if the id is taken, [`BackendError::Limit`] when
    /// the table is full; nothing changes then.
    pub fn insert(&self, id: RegionId, desc: MemDesc) -> Result<(), BackendError> {
        let mut r = lock(&self.regions);
        if r.contains_key(&id) {
            return Err(BackendError::RegionInUse { backend: self.backend, region: id });
        }
        if r.len() as u64 >= self.max_regions {
            return Err(BackendError::Limit {
                backend: self.backend,
                what: "registered regions",
                asked: r.len() as u64 + 1,
                limit: self.max_regions,
            });
        }
        r.insert(id, RegionEntry { desc, uses: Arc::default() });
        self.generation.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The region `id` (a local one, or with `peer`, named in an error as the peer's).
    pub fn get(&self, id: RegionId, peer: Option<PeerId>) -> Result<RegionRef, BackendError> {
        let r = lock(&self.regions);
        let e = r.get(&id).ok_or(BackendError::UnknownRegion { backend: self.backend, region: id, peer })?;
        e.uses.count.fetch_add(1, Ordering::AcqRel);
        Ok(RegionRef { id, desc: Some(e.desc.clone()), uses: e.uses.clone() })
    }

    /// Removes `id`: new lookups fail at once; await the returned [`Drained`] for the operations that
    /// still hold it.
    pub fn remove(&self, id: RegionId) -> Result<Drained, BackendError> {
        let e = lock(&self.regions).remove(&id).ok_or(BackendError::UnknownRegion {
            backend: self.backend,
            region: id,
            peer: None,
        })?;
        self.generation.fetch_add(1, Ordering::Relaxed);
        Ok(Drained { uses: e.uses, desc: Some(e.desc) })
    }

    /// `(id, length)` of every region, sorted by id (for metadata).
    pub fn snapshot(&self) -> Vec<(RegionId, u64)> {
        let mut v: Vec<_> = lock(&self.regions).iter().map(|(k, e)| (*k, e.desc.len() as u64)).collect();
        v.sort();
        v
    }

    /// Every region's id and descriptor, sorted by id.
    pub fn descs(&self) -> Vec<(RegionId, MemDesc)> {
        let mut v: Vec<_> = lock(&self.regions).iter().map(|(k, e)| (*k, e.desc.clone())).collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Regions registered now.
    pub fn len(&self) -> usize {
        lock(&self.regions).len()
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A counter that changes with every insert and remove (to notice a stale metadata snapshot).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }
}

// ---------------------------------------------------------------------------------------------
// Peers.

/// Connected peers by id; ids are never reused by one table.
#[derive(Debug)]
pub struct PeerTable<T> {
    backend: &'static str,
    next: AtomicU64,
    peers: Mutex<HashMap<PeerId, Arc<T>>>,
}

impl<T> PeerTable<T> {
    /// An empty table.
    pub fn new(backend: &'static str) -> Self {
        Self { backend, next: AtomicU64::new(1), peers: Mutex::new(HashMap::new()) }
    }

    /// Adds a peer under a fresh id.
    pub fn insert(&self, peer: T) -> PeerId {
        let id = PeerId(self.next.fetch_add(1, Ordering::Relaxed));
        lock(&self.peers).insert(id, Arc::new(peer));
        id
    }

    /// Adds a peer under a fresh id made before the peer (for peers that need their own id).
    pub fn reserve(&self) -> PeerId {
        PeerId(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Adds a peer under an id from [`Self::reserve`].
    pub fn insert_at(&self, id: PeerId, peer: T) {
        lock(&self.peers).insert(id, Arc::new(peer));
    }

    /// The peer, or [`BackendError::UnknownPeer`].
    pub fn get(&self, id: PeerId) -> Result<Arc<T>, BackendError> {
        lock(&self.peers).get(&id).cloned().ok_or(BackendError::UnknownPeer { backend: self.backend, peer: id })
    }

    /// Removes the peer, or [`BackendError::UnknownPeer`].
    pub fn remove(&self, id: PeerId) -> Result<Arc<T>, BackendError> {
        lock(&self.peers).remove(&id).ok_or(BackendError::UnknownPeer { backend: self.backend, peer: id })
    }

    /// Every peer, sorted by id.
    pub fn all(&self) -> Vec<(PeerId, Arc<T>)> {
        let mut v: Vec<_> = lock(&self.peers).iter().map(|(k, p)| (*k, p.clone())).collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Removes and returns every peer.
    pub fn drain(&self) -> Vec<(PeerId, Arc<T>)> {
        let mut v: Vec<_> = lock(&self.peers).drain().collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Peers connected now.
    pub fn len(&self) -> usize {
        lock(&self.peers).len()
    }

    /// Whether no peer is connected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// ---------------------------------------------------------------------------------------------
// Events.

/// The receive side's event queue: transports push, [`KvTransferBackend::recv`] drains.
///
/// [`KvTransferBackend::recv`]: crate::KvTransferBackend::recv
#[derive(Debug, Default)]
pub struct EventQueue {
    queue: Mutex<VecDeque<BackendEvent>>,
    wake: tokio::sync::Notify,
}

/// Most events one [`EventQueue::recv`] returns (the rest stay for the next call).
pub const RECV_BATCH: usize = 4096;

impl EventQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an event and wakes a waiting `recv`. Callable from any thread.
    pub fn push(&self, e: BackendEvent) {
        lock(&self.queue).push_back(e);
        self.wake.notify_one();
    }

    /// Events queued now.
    pub fn len(&self) -> usize {
        lock(&self.queue).len()
    }

    /// Whether no event is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits up to `max_wait` for events and returns up to [`RECV_BATCH`] of them (possibly none).
    pub async fn recv(&self, max_wait: Duration) -> Vec<BackendEvent> {
        let deadline = Instant::now() + max_wait;
        loop {
            let mut woken = std::pin::pin!(self.wake.notified());
            woken.as_mut().enable();
            {
                let mut q = lock(&self.queue);
                if !q.is_empty() {
                    let n = q.len().min(RECV_BATCH);
                    return q.drain(..n).collect();
                }
            }
            if tokio::time::timeout_at(deadline.into(), woken).await.is_err() {
                return Vec::new();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Options.

/// The environment variable an option of `backend` falls back to: `KVXFER_<BACKEND>_<OPTION>`,
/// upper case, with '-' as '_' (a shell cannot export `KVXFER_CUDA-IPC_LISTEN`).
pub fn option_env_name(backend: &str, key: &str) -> String {
    format!("KVXFER_{}_{}", backend.to_uppercase(), key.to_uppercase()).replace('-', "_")
}

/// A backend's options: `BackendConfig::options` first, then the environment variable
/// `KVXFER_<BACKEND>_<OPTION>` (upper case), then the default.
#[derive(Debug)]
pub struct Options<'a> {
    backend: &'static str,
    config: &'a BackendConfig,
}

impl<'a> Options<'a> {
    /// Checks that every option in `config` is named in `known`, the backend's one list of options
    /// (the one it registers, [`crate::BackendDescriptor::options`]); an unknown one is an error that
    /// lists the known options.
    pub fn new(backend: &'static str, config: &'a BackendConfig, known: &[OptionDoc]) -> Result<Self, BackendError> {
        if let Some(k) = config.options.keys().find(|k| !known.iter().any(|o| o.name == k.as_str())) {
            let names: Vec<&str> = known.iter().map(|o| o.name).collect();
            let list = if names.is_empty() { "none".to_owned() } else { names.join(", ") };
            return Err(BackendError::Config {
                backend,
                detail: format!("unknown option {k:?}; known options: {list}"),
            });
        }
        Ok(Self { backend, config })
    }

    /// The environment variable that backs `key` ([`option_env_name`]).
    pub fn env_name(&self, key: &str) -> String {
        option_env_name(self.backend, key)
    }

    /// The raw value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<String> {
        self.config.options.get(key).cloned().or_else(|| std::env::var(self.env_name(key)).ok())
    }

    fn bad(&self, key: &str, value: &str, expect: &str) -> BackendError {
        BackendError::Config { backend: self.backend, detail: format!("option {key}={value}: expected {expect}") }
    }

    /// `key` parsed as `T`, or `default` when unset.
    pub fn parse<T: FromStr>(&self, key: &str, default: T, expect: &str) -> Result<T, BackendError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.trim().parse().map_err(|_| self.bad(key, &v, expect)),
        }
    }

    /// An integer in `range`, or `default` when unset.
    pub fn int_in<T>(&self, key: &str, default: T, range: std::ops::RangeInclusive<T>) -> Result<T, BackendError>
    where
        T: FromStr + PartialOrd + std::fmt::Display + Copy,
    {
        let expect = format!("an integer in {}..={}", range.start(), range.end());
        match self.get(key) {
            None => Ok(default),
            Some(v) => {
                v.trim().parse::<T>().ok().filter(|x| range.contains(x)).ok_or_else(|| self.bad(key, &v, &expect))
            }
        }
    }

    /// A positive, finite number of seconds of at most `max_s`, or `default` when unset.
    pub fn seconds(&self, key: &str, default: Duration, max_s: f64) -> Result<Duration, BackendError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0 && *s <= max_s)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| self.bad(key, &v, &format!("a number of seconds in (0, {max_s}]"))),
        }
    }

    /// A boolean (`true`/`false`, `1`/`0`, `on`/`off`, `yes`/`no`), or `default` when unset.
    pub fn flag(&self, key: &str, default: bool) -> Result<bool, BackendError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "on" | "yes" => Ok(true),
                "0" | "false" | "off" | "no" => Ok(false),
                _ => Err(self.bad(key, &v, "true or false")),
            },
        }
    }

    /// One of `choices`, or `default` when unset.
    pub fn choice(
        &self,
        key: &str,
        default: &'static str,
        choices: &[&'static str],
    ) -> Result<&'static str, BackendError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => choices
                .iter()
                .find(|c| **c == v.trim())
                .copied()
                .ok_or_else(|| self.bad(key, &v, &format!("one of {}", choices.join(", ")))),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Segments.

/// One contiguous piece of a [`WriteOp`]: `len` bytes from `src_offset` of region `src` to
/// `dst_offset` of the peer's region `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Index of the op in the posted slice.
    pub op: usize,
    /// Local source region.
    pub src: RegionId,
    /// Source offset.
    pub src_offset: u64,
    /// Peer's destination region.
    pub dst: RegionId,
    /// Destination offset.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Lowers `ops` into contiguous segments of at most `max_len` bytes each (a transport's largest
/// message or RDMA write), in op order. Consecutive ranges of one op that are contiguous on both
/// sides are merged first (a strided op whose strides equal its length is one range). Zero-length
/// ranges yield nothing.
pub fn segments(ops: &[WriteOp], max_len: u64) -> impl Iterator<Item = Segment> + '_ {
    let max_len = max_len.max(1);
    ops.iter().enumerate().flat_map(move |(i, op)| {
        let merged = op.src_stride == op.len && op.dst_stride == op.len;
        let (count, len) = if merged { (1, op.len.saturating_mul(op.count)) } else { (op.count, op.len) };
        (0..count).flat_map(move |k| {
            let so = op.src_offset + k * op.src_stride;
            let d = op.dst_offset + k * op.dst_stride;
            let pieces = len.div_ceil(max_len);
            (0..pieces).map(move |p| {
                let at = p * max_len;
                Segment {
                    op: i,
                    src: op.src,
                    src_offset: so + at,
                    dst: op.dst,
                    dst_offset: d + at,
                    len: (len - at).min(max_len),
                }
            })
        })
    })
}

// ---------------------------------------------------------------------------------------------
// Notification fragments.

const FRAG_MAGIC: u8 = 0x46;
const FRAG_VERSION: u8 = 1;
/// Bytes of a fragment header: magic, version, message id (u64), index (u16), count (u16).
pub const FRAGMENT_HEADER: usize = 14;

/// Splits messages (encoded notifications) into fragments of at most `max_fragment` bytes,
/// header included, for transports whose messages are small (immediate data, inline sends).
#[derive(Debug)]
pub struct Fragmenter {
    max_fragment: usize,
    next: AtomicU64,
}

impl Fragmenter {
    /// A fragmenter for fragments of at most `max_fragment` bytes (at least header + 1).
    pub fn new(max_fragment: usize) -> Self {
        Self { max_fragment: max_fragment.max(FRAGMENT_HEADER + 1), next: AtomicU64::new(1) }
    }

    /// Largest message this fragmenter can split (65535 fragments).
    pub fn max_message(&self) -> usize {
        (self.max_fragment - FRAGMENT_HEADER) * u16::MAX as usize
    }

    /// The fragments of `message`, each with its header.
    pub fn split(&self, message: &[u8]) -> Result<Vec<Vec<u8>>, CodecError> {
        let body = self.max_fragment - FRAGMENT_HEADER;
        let count = message.len().div_ceil(body).max(1);
        if count > u16::MAX as usize {
            return Err(CodecError::TooLong { len: message.len(), max: self.max_message() });
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut out = Vec::with_capacity(count);
        for i in 0..count {
            let part = &message[(i * body).min(message.len())..((i + 1) * body).min(message.len())];
            let mut f = Vec::with_capacity(FRAGMENT_HEADER + part.len());
            f.push(FRAG_MAGIC);
            f.push(FRAG_VERSION);
            f.extend_from_slice(&id.to_le_bytes());
            f.extend_from_slice(&(i as u16).to_le_bytes());
            f.extend_from_slice(&(count as u16).to_le_bytes());
            f.extend_from_slice(part);
            out.push(f);
        }
        Ok(out)
    }
}

#[derive(Debug)]
struct Partial {
    count: u16,
    /// The fragments that arrived, by index: memory follows what the peer sent, not the count it
    /// claims (a slot per claimed fragment made 15 bytes cost 1.5 MiB).
    parts: BTreeMap<u16, Vec<u8>>,
    bytes: usize,
    started: Instant,
}

/// Puts fragments back together, per source (a peer), bounded in message size and in pending
/// messages; fragments of one message may arrive in any order.
#[derive(Debug)]
pub struct Reassembler {
    max_message: usize,
    max_pending: usize,
    pending: HashMap<(u64, u64), Partial>,
}

impl Reassembler {
    /// A reassembler for messages of at most `max_message` bytes and `max_pending` incomplete
    /// messages at once (over that, the oldest is dropped and counted by [`Self::push`]'s error).
    pub fn new(max_message: usize, max_pending: usize) -> Self {
        Self { max_message, max_pending: max_pending.max(1), pending: HashMap::new() }
    }

    /// Incomplete messages held now.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Forgets every incomplete message of `source` (a peer that went away).
    pub fn forget(&mut self, source: u64) {
        self.pending.retain(|(s, _), _| *s != source);
    }

    /// Adds a fragment from `source`; returns the whole message when this fragment completed it.
    /// A malformed fragment, a message over the size limit, or a fragment that disagrees with the
    /// earlier ones is an error and changes nothing else.
    pub fn push(&mut self, source: u64, fragment: &[u8], now: Instant) -> Result<Option<Vec<u8>>, CodecError> {
        if fragment.len() < FRAGMENT_HEADER {
            return Err(CodecError::Truncated { needed: FRAGMENT_HEADER, offset: 0, len: fragment.len() });
        }
        if fragment[0] != FRAG_MAGIC {
            return Err(CodecError::Magic { found: fragment[0], expected: FRAG_MAGIC });
        }
        if fragment[1] != FRAG_VERSION {
            return Err(CodecError::Version {
                what: "fragment",
                found: fragment[1],
                oldest: FRAG_VERSION,
                newest: FRAG_VERSION,
            });
        }
        let id = u64::from_le_bytes(fragment[2..10].try_into().expect("8 bytes"));
        let index = u16::from_le_bytes([fragment[10], fragment[11]]);
        let count = u16::from_le_bytes([fragment[12], fragment[13]]);
        let part = &fragment[FRAGMENT_HEADER..];
        if count == 0 || index >= count {
            return Err(CodecError::Fragment(format!("index {index} of {count}")));
        }
        if count == 1 {
            if part.len() > self.max_message {
                return Err(CodecError::TooLong { len: part.len(), max: self.max_message });
            }
            return Ok(Some(part.to_vec()));
        }
        let key = (source, id);
        if !self.pending.contains_key(&key) && self.pending.len() >= self.max_pending {
            if let Some(oldest) = self.pending.iter().min_by_key(|(_, p)| p.started).map(|(k, _)| *k) {
                self.pending.remove(&oldest);
            }
        }
        let p = self.pending.entry(key).or_insert_with(|| Partial {
            count,
            parts: BTreeMap::new(),
            bytes: 0,
            started: now,
        });
        if p.count != count {
            let detail = format!("message {id}: fragment says {count} fragments, earlier ones {}", p.count);
            self.pending.remove(&key);
            return Err(CodecError::Fragment(detail));
        }
        if p.parts.contains_key(&index) {
            return Ok(None);
        }
        if p.bytes + part.len() > self.max_message {
            let len = p.bytes + part.len();
            self.pending.remove(&key);
            return Err(CodecError::TooLong { len, max: self.max_message });
        }
        p.bytes += part.len();
        p.parts.insert(index, part.to_vec());
        if p.parts.len() < usize::from(p.count) {
            return Ok(None);
        }
        let p = self.pending.remove(&key).expect("present");
        Ok(Some(p.parts.into_values().flatten().collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::HostBuffer;

    #[test]
    fn segments_split_and_merge() {
        let op = WriteOp {
            src: RegionId(1),
            src_offset: 0,
            dst: RegionId(2),
            dst_offset: 100,
            len: 10,
            count: 3,
            src_stride: 10,
            dst_stride: 10,
        };
        let s: Vec<_> = segments(&[op], 1 << 20).collect();
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].src_offset, s[0].dst_offset, s[0].len), (0, 100, 30));
        let s: Vec<_> = segments(&[op], 7).collect();
        assert_eq!(s.iter().map(|x| x.len).collect::<Vec<_>>(), vec![7, 7, 7, 7, 2]);
        assert_eq!(s.iter().map(|x| x.len).sum::<u64>(), 30);
        let strided = WriteOp { src_stride: 16, ..op };
        let s: Vec<_> = segments(&[strided], 1 << 20).collect();
        assert_eq!(
            s.iter().map(|x| (x.src_offset, x.dst_offset, x.len)).collect::<Vec<_>>(),
            vec![(0, 100, 10), (16, 110, 10), (32, 120, 10)]
        );
    }

    #[test]
    fn fragments_round_trip_in_any_order() {
        let f = Fragmenter::new(FRAGMENT_HEADER + 4);
        let msg: Vec<u8> = (0..23).collect();
        let mut parts = f.split(&msg).unwrap();
        assert_eq!(parts.len(), 6);
        parts.reverse();
        let mut r = Reassembler::new(1024, 4);
        let now = Instant::now();
        let mut out = None;
        for (i, p) in parts.iter().enumerate() {
            let got = r.push(9, p, now).unwrap();
            assert_eq!(got.is_some(), i == parts.len() - 1);
            out = out.or(got);
            if i + 1 < parts.len() {
                assert!(r.push(9, p, now).unwrap().is_none(), "duplicate fragment ignored");
            }
        }
        assert_eq!(out.unwrap(), msg);
        assert_eq!(r.pending(), 0);
        assert!(r.push(9, &[1, 2], now).is_err());
        let small = Reassembler::new(8, 4).push(1, &parts[0], now);
        assert!(small.is_ok(), "one fragment within limits");
        let mut tiny = Reassembler::new(5, 4);
        let e = parts.iter().map(|p| tiny.push(1, p, now)).find(|r| r.is_err());
        assert!(e.is_some(), "over-long message refused");
    }

    #[tokio::test]
    async fn region_table_drains() {
        let t = RegionTable::new("test", 2);
        let mut b = HostBuffer::zeroed(8);
        t.insert(RegionId(1), b.desc()).unwrap();
        assert!(matches!(t.insert(RegionId(1), b.desc()), Err(BackendError::RegionInUse { .. })));
        t.insert(RegionId(2), b.desc()).unwrap();
        assert!(matches!(t.insert(RegionId(3), b.desc()), Err(BackendError::Limit { .. })));
        let held = t.get(RegionId(1), None).unwrap();
        let d = t.remove(RegionId(1)).unwrap();
        assert!(matches!(t.get(RegionId(1), None), Err(BackendError::UnknownRegion { .. })));
        assert_eq!(d.in_use(), 1);
        let w = tokio::spawn(d.wait());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!w.is_finished());
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), w).await.unwrap().unwrap();
        drop(t.remove(RegionId(2)).unwrap());
        assert!(b.as_slice().is_ok(), "every descriptor is gone once drained");
    }

    #[test]
    fn options_fall_back_to_env_and_list_known() {
        const KNOWN: &[OptionDoc] =
            &[OptionDoc::new("depth", "1", "queue depth"), OptionDoc::new("wait_s", "3", "wait in seconds")];
        let c = BackendConfig::new(1).with("depth", "9").with("bogus", "1");
        let e = Options::new("toolkit", &c, &KNOWN[..1]).unwrap_err().to_string();
        assert!(e.contains("bogus") && e.contains("known options: depth"), "{e}");
        let e = Options::new("toolkit", &c, KNOWN).unwrap_err().to_string();
        assert!(e.ends_with("unknown option \"bogus\"; known options: depth, wait_s"), "{e}");
        let e = Options::new("toolkit", &c, &[]).unwrap_err().to_string();
        assert!(e.contains("known options: none"), "{e}");
        let c = BackendConfig::new(1).with("depth", "99");
        let o = Options::new("toolkit", &c, KNOWN).unwrap();
        assert!(o.int_in("depth", 1u32, 1..=64).unwrap_err().to_string().contains("1..=64"));
        assert_eq!(o.env_name("wait_s"), "KVXFER_TOOLKIT_WAIT_S");
        assert_eq!(option_env_name("cuda-ipc", "listen"), "KVXFER_CUDA_IPC_LISTEN");
        assert_eq!(o.seconds("wait_s", Duration::from_secs(3), 10.0).unwrap(), Duration::from_secs(3));
    }
}

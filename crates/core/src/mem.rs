//! Memory that backends read from and write into: the engine's KV pool, described once.
//!
//! # Memory lifetime, in one place
//!
//! - A [`MemDesc`] describes memory: (address, length, [`MemKind`]). It is made either by the one
//!   `unsafe` constructor [`MemDesc::from_raw_parts`] (an engine's own pool: host memory, a CUDA
//!   allocation, a dmabuf) or by [`HostBuffer::desc`] (memory kvxfer allocated and keeps alive).
//! - [`crate::KvTransferBackend::register`] takes the descriptor and returns a
//!   [`crate::Registration`]. From then on the memory belongs to the transfer layer: the engine must
//!   not free or unmap it, and safe code cannot read or write it (a [`HostBuffer`]'s accessors
//!   refuse while any descriptor of it is alive).
//! - Source pages of a posted transfer must not change until the transfer's status is final
//!   ([`crate::TransferStatus::is_final`]); destination pages of a request must not be reused until
//!   the request completed, or its transfers were aborted (the abort resolved) or failed.
//! - [`crate::Registration::close`] resolves when no local operation can touch the memory and no
//!   connected peer can write into it any more. Only then may the engine free raw memory. Dropping a
//!   registration without closing it does the same in the background; memory described by
//!   `from_raw_parts` must then stay valid until the backend endpoint itself is dropped.
//!
//! # Access from backends
//!
//! In-process data paths (the local and TCP backends) touch host memory only through
//! [`MemDesc::read_guard`] and [`MemDesc::write_guard`]: bounds-checked views that exclude each
//! other. A write guard is refused while any guard overlaps it, and a read guard while a write guard
//! overlaps it, so two frames on two streams can never alias one byte, whatever a peer sends.
//! One-sided transports (RDMA, cma) write without guards; their ordering is the registration and
//! transfer protocol above.
//!
//! This module holds kvxfer-core's only `unsafe` code: the raw-memory constructor, the owned
//! allocation behind [`HostBuffer`], and the guarded views whose soundness rests on the
//! constructor's contract and on the guard table.
#![allow(unsafe_code)]

use std::alloc::Layout as AllocLayout;
use std::collections::BTreeMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// Where memory lives. Host memory is all backends take today; device kinds are described so that
/// backends that can register them (UCX with CUDA, verbs with dmabuf) can say so in their
/// capabilities without a breaking change.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemKind {
    /// Ordinary (pageable or pinned) host memory of this process.
    Host,
    /// CUDA device memory on device `device` (the address is a device pointer).
    Cuda {
        /// CUDA device ordinal.
        device: u32,
    },
    /// Memory exported as a dmabuf file descriptor (GPU memory for RDMA NICs); the address is the
    /// virtual address the registration uses, `offset` the offset into the dmabuf.
    DmaBuf {
        /// The dmabuf fd (owned by the engine; valid while registered).
        fd: i32,
        /// Offset of the described range inside the dmabuf.
        offset: u64,
    },
}

impl MemKind {
    /// The bit of this kind in a [`MemKinds`] set.
    pub const fn bit(&self) -> MemKinds {
        match self {
            MemKind::Host => MemKinds::HOST,
            MemKind::Cuda { .. } => MemKinds::CUDA,
            MemKind::DmaBuf { .. } => MemKinds::DMABUF,
        }
    }
}

impl fmt::Display for MemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemKind::Host => f.write_str("host memory"),
            MemKind::Cuda { device } => write!(f, "CUDA memory of device {device}"),
            MemKind::DmaBuf { fd, offset } => write!(f, "dmabuf fd {fd} at offset {offset}"),
        }
    }
}

/// A set of memory kinds (what a backend can register).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemKinds(u32);

impl MemKinds {
    /// No kind.
    pub const NONE: MemKinds = MemKinds(0);
    /// [`MemKind::Host`].
    pub const HOST: MemKinds = MemKinds(1);
    /// [`MemKind::Cuda`].
    pub const CUDA: MemKinds = MemKinds(2);
    /// [`MemKind::DmaBuf`].
    pub const DMABUF: MemKinds = MemKinds(4);

    /// Both sets.
    pub const fn union(self, other: MemKinds) -> MemKinds {
        MemKinds(self.0 | other.0)
    }

    /// Whether `kind` is in the set.
    pub const fn contains(&self, kind: &MemKind) -> bool {
        self.0 & kind.bit().0 != 0
    }

    /// The names of the kinds in the set.
    pub fn names(&self) -> Vec<&'static str> {
        [(Self::HOST, "host"), (Self::CUDA, "cuda"), (Self::DMABUF, "dmabuf")]
            .into_iter()
            .filter(|(k, _)| self.0 & k.0 != 0)
            .map(|(_, n)| n)
            .collect()
    }
}

impl fmt::Debug for MemKinds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemKinds({})", self.names().join("|"))
    }
}

/// An access that memory does not allow: out of bounds, conflicting with a transfer in progress,
/// of a kind that cannot be read from the host, or of a buffer that is registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MemError {
    /// Outside the region.
    #[error("access of {len} bytes at offset {offset} is outside the region of {region_len} bytes")]
    OutOfBounds {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// Overlaps bytes another guard holds (a write in progress, or a read while writing).
    #[error("access of {len} bytes at offset {offset} overlaps a {} in progress", if *other_write { "write" } else { "read" })]
    Busy {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Whether the conflicting guard writes.
        other_write: bool,
    },
    /// Not host memory: the CPU cannot read or write it.
    #[error("{kind} cannot be accessed from the host")]
    NotHost {
        /// The kind.
        kind: MemKind,
    },
    /// A strided range whose pieces overlap each other.
    #[error("pieces of {len} bytes {stride} apart overlap each other")]
    SelfOverlap {
        /// Piece length.
        len: u64,
        /// Stride.
        stride: u64,
    },
    /// The buffer is described by a live descriptor (registered, or about to be): close the
    /// registration (and drop every descriptor) first.
    #[error("the buffer is registered ({descs} live descriptor(s)); close its registrations before touching it")]
    Registered {
        /// Live descriptors.
        descs: usize,
    },
}

impl MemError {
    /// The out-of-bounds error for `[offset, offset+len)` in a region of `region_len` bytes.
    pub fn out_of_bounds(offset: u64, len: u64, region_len: u64) -> Self {
        MemError::OutOfBounds { offset, len, region_len }
    }
}

/// A held range: `count` pieces of `len` bytes, `stride` apart, from `start` (one piece for a
/// contiguous guard); `end` is the end of the last piece.
#[derive(Clone, Copy)]
struct Held {
    end: u64,
    len: u64,
    stride: u64,
    count: u64,
    write: bool,
}

impl Held {
    /// Whether any piece of `self` (starting at `start`) intersects `[s, e)`.
    fn hits(&self, start: u64, s: u64, e: u64) -> bool {
        if self.count == 1 || self.stride == self.len {
            return start < e && self.end > s;
        }
        // The first piece whose end lies past `s`.
        let first = if s >= start + self.len { (s - start - self.len) / self.stride + 1 } else { 0 };
        first < self.count && start + first * self.stride < e
    }
}

#[derive(Default)]
struct Busy {
    /// (start, guard id) -> what is held there
    ranges: BTreeMap<(u64, u64), Held>,
    /// Longest extent held since the table was last empty (bounds the overlap scan).
    max_len: u64,
}

impl Busy {
    /// The conflicting guard's `write` flag, if any held range conflicts with the new one.
    fn conflict(&self, start: u64, new: &Held) -> Option<bool> {
        let lo = start.saturating_sub(self.max_len);
        for (&(os, _), old) in self.ranges.range((lo, 0)..(new.end, 0)) {
            if old.end <= start || !(new.write || old.write) {
                continue;
            }
            // Walk the pieces of whichever has fewer inside the common extent.
            let (a_start, a, b_start, b) =
                if old.count <= new.count { (os, old, start, new) } else { (start, new, os, old) };
            let hit = (0..a.count).any(|i| {
                let ps = a_start + i * a.stride.max(a.len);
                let pe = ps + if a.count == 1 { a.end - a_start } else { a.len };
                ps < b.end && pe > b_start && b.hits(b_start, ps, pe)
            });
            if hit {
                return Some(old.write);
            }
        }
        None
    }
}

struct MemInner {
    ptr: NonNull<u8>,
    len: usize,
    kind: MemKind,
    /// Whose allocation it is: the engine's (borrowed), or ours (a [`HostBuffer`]'s, freed on drop).
    owned: Alloc,
    busy: Mutex<Busy>,
    /// The buffer a labelled descriptor describes (kept alive and counted as described).
    #[allow(dead_code)] // held for its Drop and its reference count only
    parent: Option<Arc<MemInner>>,
    /// What keeps the memory of [`MemDesc::from_owner`] valid (dropped with the last descriptor).
    #[allow(dead_code)] // held for its Drop only
    owner: Option<Box<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: the inner type is a description plus a guard table; all access to the bytes goes through
// guards (which exclude conflicting local access) or through FFI registration under the
// constructor's contract.
unsafe impl Send for MemInner {}
// SAFETY: as for Send; shared references only hand out guarded views or raw addresses.
unsafe impl Sync for MemInner {}

const ALIGN: usize = 4096;

/// Size of a transparent huge page on x86-64 and arm64 with 4 KiB pages: [`HostBuffer`]s of at
/// least this many bytes are mapped and advised as huge-page candidates.
const HUGE: usize = 2 << 20;

/// Who allocated the bytes a [`MemInner`] describes, and so how they are freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Alloc {
    /// The engine's memory (a raw descriptor or a labelled view): never freed here.
    Borrowed,
    /// `std::alloc` with `(len, ALIGN)`.
    Heap,
    /// An anonymous private mapping of `len` bytes (Linux, large buffers).
    #[cfg(target_os = "linux")]
    Mapped,
}

impl Drop for MemInner {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        match self.owned {
            Alloc::Borrowed => {}
            // SAFETY: allocated in HostBuffer::zeroed with exactly this layout; dropped once, when the
            // last descriptor and the HostBuffer are gone.
            Alloc::Heap => unsafe {
                std::alloc::dealloc(self.ptr.as_ptr(), AllocLayout::from_size_align_unchecked(self.len, ALIGN))
            },
            #[cfg(target_os = "linux")]
            Alloc::Mapped => {
                // SAFETY: mapped in HostBuffer::zeroed with exactly this address and length; unmapped
                // once, when the last descriptor and the HostBuffer are gone (no view outlives them).
                let r = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
                debug_assert_eq!(r, 0, "munmap of a HostBuffer failed");
            }
        }
    }
}

/// `len` (> 0) zeroed bytes in an anonymous private mapping advised for transparent huge pages
/// (`MADV_HUGEPAGE`), or `None` if the kernel refuses the mapping (the caller falls back to the
/// heap). The pages are zero and untouched until first use, so a buffer costs nothing until it is
/// written; the advice is best effort (a kernel with THP off keeps 4 KiB pages).
#[cfg(target_os = "linux")]
fn map_zeroed(len: usize) -> Option<NonNull<u8>> {
    // SAFETY: FFI. An anonymous private mapping at an address of the kernel's choosing aliases
    // nothing; the result is checked before use.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: FFI on the mapping just made, of exactly its length; advice changes no contents.
    let _ = unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
    NonNull::new(p.cast())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A description of memory: address, length and kind. Cloning is cheap and shares the description
/// (and, for a [`HostBuffer`], keeps the allocation alive).
#[derive(Clone)]
pub struct MemDesc {
    inner: Arc<MemInner>,
}

impl fmt::Debug for MemDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemDesc({:p}, {} bytes, {})", self.inner.ptr, self.inner.len, self.inner.kind)
    }
}

impl MemDesc {
    /// Describes memory the caller owns (an engine's KV pool, a CUDA allocation, a dmabuf mapping).
    ///
    /// # Safety
    /// The caller promises that, from this call until the registration made from this descriptor
    /// (or any clone of it) is closed, or, when it is dropped without closing, until the backend
    /// endpoint it was registered with is dropped:
    /// - `ptr` is valid for `len` bytes of `kind` memory (for [`MemKind::Host`]: readable and
    ///   writable by this process) and is not freed or unmapped;
    /// - destination bytes of a pending request are not read or written by anyone else until the
    ///   request completed, or its transfers finished, failed or were aborted;
    /// - source bytes of a transfer are not written until the transfer's status is final;
    /// - no other descriptor of overlapping memory is used at the same time (the guard table that
    ///   keeps local accesses apart lives in the descriptor).
    pub unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize, kind: MemKind) -> Self {
        Self {
            inner: Arc::new(MemInner {
                ptr,
                len,
                kind,
                owned: Alloc::Borrowed,
                busy: Mutex::new(Busy::default()),
                parent: None,
                owner: None,
            }),
        }
    }

    /// Describes memory whose validity `owner` holds (an allocation the caller made for this
    /// descriptor, e.g. a CUDA device buffer whose `Drop` frees it): the descriptor and every clone
    /// of it keep `owner` alive, so the memory outlives every registration and transfer made from it.
    ///
    /// # Safety
    /// `ptr` is valid for `len` bytes of `kind` memory for as long as `owner` lives, and the rules of
    /// [`MemDesc::from_raw_parts`] about other users of the bytes hold.
    pub unsafe fn from_owner(
        ptr: NonNull<u8>,
        len: usize,
        kind: MemKind,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        Self {
            inner: Arc::new(MemInner {
                ptr,
                len,
                kind,
                owned: Alloc::Borrowed,
                busy: Mutex::new(Busy::default()),
                parent: None,
                owner: Some(owner),
            }),
        }
    }

    /// The start address (for FFI registration: a host or device virtual address).
    pub fn addr(&self) -> *mut u8 {
        self.inner.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the described range is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The memory kind.
    pub fn kind(&self) -> MemKind {
        self.inner.kind
    }

    /// Whether two descriptors share one description (clones of each other).
    pub fn same(&self, other: &MemDesc) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Checks that `[offset, offset + len)` lies inside the region.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.inner.len as u64 => Ok(()),
            _ => Err(MemError::out_of_bounds(offset, len, self.inner.len as u64)),
        }
    }

    fn acquire(&self, offset: u64, len: u64, stride: u64, count: u64, write: bool) -> Result<u64, MemError> {
        if self.inner.kind != MemKind::Host {
            return Err(MemError::NotHost { kind: self.inner.kind });
        }
        self.acquire_any(offset, len, stride, count, write)
    }

    /// [`Self::acquire`] for memory of any kind (the caller hands out no host view of it).
    fn acquire_any(&self, offset: u64, len: u64, stride: u64, count: u64, write: bool) -> Result<u64, MemError> {
        let total = len.saturating_mul(count);
        let oob = || MemError::out_of_bounds(offset, total, self.inner.len as u64);
        if count == 0 {
            return Err(oob());
        }
        if count > 1 && stride < len {
            return Err(MemError::SelfOverlap { len, stride });
        }
        let end = stride
            .checked_mul(count - 1)
            .and_then(|x| x.checked_add(offset))
            .and_then(|x| x.checked_add(len))
            .filter(|e| *e <= self.inner.len as u64)
            .ok_or_else(oob)?;
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        if len == 0 {
            return Ok(id);
        }
        let held = Held { end, len, stride, count, write };
        let mut b = lock(&self.inner.busy);
        if let Some(other_write) = b.conflict(offset, &held) {
            return Err(MemError::Busy { offset, len: total, other_write });
        }
        b.max_len = b.max_len.max(end - offset);
        b.ranges.insert((offset, id), held);
        Ok(id)
    }

    fn release(&self, offset: u64, len: u64, id: u64) {
        if len == 0 {
            return;
        }
        let mut b = lock(&self.inner.busy);
        b.ranges.remove(&(offset, id));
        if b.ranges.is_empty() {
            b.max_len = 0;
        }
    }

    /// A shared view of `[offset, offset + len)` of host memory, for sending it without a copy.
    /// Refused while a write guard overlaps it.
    pub fn read_guard(&self, offset: u64, len: u64) -> Result<ReadGuard, MemError> {
        let id = self.acquire(offset, len, len, 1, false)?;
        Ok(ReadGuard { mem: self.clone(), offset, len, id })
    }

    /// An exclusive view of `[offset, offset + len)` of host memory, for receiving into it without a
    /// copy. Refused while any guard overlaps it.
    pub fn write_guard(&self, offset: u64, len: u64) -> Result<WriteGuard, MemError> {
        let id = self.acquire(offset, len, len, 1, true)?;
        Ok(WriteGuard { mem: self.clone(), offset, len, id })
    }

    /// Exclusive views of `count` pieces of `len` bytes, `stride` apart, from `offset` (a strided
    /// op's destination: the per-token head slices of a page), held as one guard. Refused while any
    /// guard overlaps a piece; bytes between the pieces stay free for other writers (another
    /// sender's heads of the same tokens).
    pub fn write_guard_strided(
        &self,
        offset: u64,
        len: u64,
        count: u64,
        stride: u64,
    ) -> Result<StridedWriteGuard, MemError> {
        let id = self.acquire(offset, len, stride, count, true)?;
        Ok(StridedWriteGuard { mem: self.clone(), offset, len, count, stride, id })
    }

    /// Reserves `count` pieces of `len` bytes, `stride` apart, from `offset`, for reading or (with
    /// `write`) writing, in memory of any kind, without a host view: what a device copy engine
    /// holds while it reads or writes the range. Reservations and guards exclude each other exactly
    /// as guards do (a write excludes everything overlapping it, a read excludes writes), so a CUDA
    /// copy into a range can never race a host guard or another copy of the same bytes.
    pub fn reserve(
        &self,
        offset: u64,
        len: u64,
        count: u64,
        stride: u64,
        write: bool,
    ) -> Result<Reservation, MemError> {
        let id = self.acquire_any(offset, len, stride, count, write)?;
        Ok(Reservation { mem: self.clone(), offset, len, count, stride, write, id })
    }

    /// Copies `len` bytes from `self[src_offset..]` into `dst[dst_offset..]` under a read guard and
    /// a write guard (an in-process transfer). The two may be the same descriptor when the ranges do
    /// not overlap.
    pub fn copy_to(&self, src_offset: u64, dst: &MemDesc, dst_offset: u64, len: u64) -> Result<(), MemError> {
        let s = self.read_guard(src_offset, len)?;
        let mut d = dst.write_guard(dst_offset, len)?;
        d.as_mut_slice().copy_from_slice(s.as_slice());
        Ok(())
    }
}

/// A held range of memory of any kind, with no host view ([`MemDesc::reserve`]): while it lives no
/// guard or reservation that conflicts with it can be taken. It gives out the range's address for
/// a device copy engine (the descriptor's contract is what makes that address valid).
pub struct Reservation {
    mem: MemDesc,
    offset: u64,
    len: u64,
    count: u64,
    stride: u64,
    write: bool,
    id: u64,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Reservation({} x {} bytes, {} apart, at {} of {:?}, {})",
            self.count,
            self.len,
            self.stride,
            self.offset,
            self.mem,
            if self.write { "write" } else { "read" }
        )
    }
}

impl Reservation {
    /// The described memory.
    pub fn desc(&self) -> &MemDesc {
        &self.mem
    }

    /// Offset of the first piece in the region.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes per piece.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the pieces are empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Pieces.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Distance between the starts of two pieces.
    pub fn stride(&self) -> u64 {
        self.stride
    }

    /// Whether the range is held for writing.
    pub fn is_write(&self) -> bool {
        self.write
    }

    /// The address of the first byte (`desc().addr() + offset()`): a host or device virtual address,
    /// by the descriptor's kind.
    pub fn addr(&self) -> u64 {
        self.mem.addr() as u64 + self.offset
    }

    /// The memory kind.
    pub fn kind(&self) -> MemKind {
        self.mem.kind()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.mem.release(self.offset, self.len, self.id);
    }
}

/// A shared, bounds-checked view of host memory; the bytes cannot be written through any guard
/// while it lives.
pub struct ReadGuard {
    mem: MemDesc,
    offset: u64,
    len: u64,
    id: u64,
}

impl ReadGuard {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: host memory, in bounds (checked at acquisition), valid per the descriptor's
        // contract; no write guard overlaps while this guard lives.
        unsafe { std::slice::from_raw_parts(self.mem.inner.ptr.as_ptr().add(self.offset as usize), self.len as usize) }
    }
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        self.mem.release(self.offset, self.len, self.id);
    }
}

/// An exclusive, bounds-checked view of host memory; no other guard overlaps it while it lives.
pub struct WriteGuard {
    mem: MemDesc,
    offset: u64,
    len: u64,
    id: u64,
}

impl WriteGuard {
    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: host memory, in bounds (checked at acquisition), valid per the descriptor's
        // contract; no other guard overlaps while this one lives, and `&mut self` makes the slice
        // unique.
        unsafe {
            std::slice::from_raw_parts_mut(self.mem.inner.ptr.as_ptr().add(self.offset as usize), self.len as usize)
        }
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        self.mem.release(self.offset, self.len, self.id);
    }
}

/// Exclusive, bounds-checked views of the pieces of a strided range; no other guard overlaps a
/// piece while it lives.
pub struct StridedWriteGuard {
    mem: MemDesc,
    offset: u64,
    len: u64,
    count: u64,
    stride: u64,
    id: u64,
}

impl StridedWriteGuard {
    /// The pieces, in order, writable (disjoint: the stride is at least the length).
    pub fn pieces_mut(&mut self) -> impl Iterator<Item = &mut [u8]> + '_ {
        let inner: &MemInner = &self.mem.inner;
        let (offset, len, stride) = (self.offset as usize, self.len as usize, self.stride as usize);
        (0..self.count as usize).filter(move |_| len > 0).map(move |i| {
            // SAFETY: host memory; every piece is in bounds (checked at acquisition) and valid per
            // the descriptor's contract; pieces are disjoint (stride >= len, checked) and no other
            // guard overlaps them while this one lives; `&mut self` makes the borrows unique.
            unsafe { std::slice::from_raw_parts_mut(inner.ptr.as_ptr().add(offset + i * stride), len) }
        })
    }

    /// Bytes guarded (all pieces).
    pub fn bytes(&self) -> u64 {
        self.len * self.count
    }

    /// Pieces guarded (what [`Self::pieces_mut`] yields, unless they are empty).
    pub fn count(&self) -> u64 {
        self.count
    }
}

impl Drop for StridedWriteGuard {
    fn drop(&mut self) {
        self.mem.release(self.offset, self.len, self.id);
    }
}

/// An owned, zeroed, page-aligned host allocation (for tests, the demo, and engines without their
/// own pool).
///
/// Its bytes are readable and writable through the buffer only while no descriptor of it is alive:
/// [`HostBuffer::desc`] hands one out (to register), and the accessors answer
/// [`MemError::Registered`] until every registration made from it is closed and every descriptor
/// dropped. The allocation lives until the buffer and every descriptor are gone, so a backend that
/// still holds a descriptor never touches freed memory.
pub struct HostBuffer {
    inner: Arc<MemInner>,
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBuffer({} bytes)", self.inner.len)
    }
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to 4096. Panics only if the allocator fails (as `Vec` does).
    ///
    /// On Linux a buffer of 2 MiB or more is its own anonymous mapping, advised for transparent huge
    /// pages (`MADV_HUGEPAGE`, which the kernel's default `madvise` mode honours), as numpy does
    /// for large arrays and PyTorch's pinned allocator gets from the CUDA driver: copies into and
    /// out of it then walk 2 MiB pages, not 4 KiB ones. Its pages are faulted in (zeroed) on first
    /// touch, not here.
    pub fn zeroed(len: usize) -> Self {
        let (ptr, owned) = if len == 0 {
            (NonNull::dangling(), Alloc::Heap)
        } else {
            #[cfg(target_os = "linux")]
            let mapped = if len >= HUGE { map_zeroed(len) } else { None };
            #[cfg(not(target_os = "linux"))]
            let mapped: Option<NonNull<u8>> = None;
            match mapped {
                #[cfg(target_os = "linux")]
                Some(p) => (p, Alloc::Mapped),
                _ => {
                    let layout = AllocLayout::from_size_align(len, ALIGN).expect("allocation size overflows isize");
                    // SAFETY: layout has non-zero size.
                    let p = unsafe { std::alloc::alloc_zeroed(layout) };
                    (NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout)), Alloc::Heap)
                }
            }
        };
        Self {
            inner: Arc::new(MemInner {
                ptr,
                len,
                kind: MemKind::Host,
                owned,
                busy: Mutex::new(Busy::default()),
                parent: None,
                owner: None,
            }),
        }
    }

    /// Allocates and fills with `byte`.
    pub fn filled(len: usize, byte: u8) -> Self {
        let mut b = Self::zeroed(len);
        b.as_mut_slice().expect("fresh buffer has no descriptor").fill(byte);
        b
    }

    /// Allocates and copies `data` in.
    pub fn from_slice(data: &[u8]) -> Self {
        let mut b = Self::zeroed(data.len());
        b.as_mut_slice().expect("fresh buffer has no descriptor").copy_from_slice(data);
        b
    }

    /// A descriptor of the whole buffer, to register. While it (or a clone, or a registration made
    /// from it) lives, the buffer's accessors refuse.
    pub fn desc(&mut self) -> MemDesc {
        MemDesc { inner: self.inner.clone() }
    }

    /// A descriptor of this host buffer labelled as memory of `kind`, for tests of the kind checks:
    /// a backend whose capabilities lack `kind` must refuse to register it. The memory stays valid
    /// host memory, so this is safe, but a backend that does take `kind` would treat host memory
    /// as device memory: register it only where `kind` is not claimed.
    pub fn desc_labelled(&mut self, kind: MemKind) -> MemDesc {
        MemDesc {
            inner: Arc::new(MemInner {
                ptr: self.inner.ptr,
                len: self.inner.len,
                kind,
                owned: Alloc::Borrowed,
                busy: Mutex::new(Busy::default()),
                parent: Some(self.inner.clone()),
                owner: None,
            }),
        }
    }

    /// Live descriptors of this buffer.
    pub fn descriptors(&self) -> usize {
        Arc::strong_count(&self.inner) - 1
    }

    fn unshared(&self) -> Result<(), MemError> {
        match self.descriptors() {
            0 => Ok(()),
            descs => Err(MemError::Registered { descs }),
        }
    }

    /// The bytes, while no descriptor is alive.
    pub fn as_slice(&self) -> Result<&[u8], MemError> {
        self.unshared()?;
        if self.inner.len == 0 {
            return Ok(&[]);
        }
        // SAFETY: we own the allocation and no descriptor exists; new descriptors need `&mut self`,
        // which cannot coexist with the returned borrow.
        Ok(unsafe { std::slice::from_raw_parts(self.inner.ptr.as_ptr(), self.inner.len) })
    }

    /// The bytes, writable, while no descriptor is alive.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], MemError> {
        self.unshared()?;
        if self.inner.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.inner.ptr.as_ptr(), self.inner.len) })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// A copy of the whole content, while no descriptor is alive.
    pub fn to_vec(&self) -> Result<Vec<u8>, MemError> {
        self.as_slice().map(<[u8]>::to_vec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The VmFlags of the mapping of `/proc/self/smaps` that starts at `addr`.
    #[cfg(target_os = "linux")]
    fn vm_flags(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut found = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-')) {
                let start = range.split('-').next().and_then(|a| usize::from_str_radix(a, 16).ok());
                found = start == Some(addr);
            } else if found {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.trim().to_string());
                }
            }
        }
        None
    }

    #[test]
    fn large_buffers_are_zeroed_mappings_advised_for_huge_pages_and_small_ones_heap() {
        for len in [HUGE - 1, HUGE, 3 * HUGE + 4096 + 1] {
            let mut b = HostBuffer::zeroed(len);
            assert_eq!(b.inner.ptr.as_ptr() as usize % ALIGN, 0);
            let s = b.as_mut_slice().unwrap();
            assert!(s.iter().all(|&x| x == 0), "{len} bytes not zeroed");
            s[len - 1] = 9;
            s[0] = 8;
            #[cfg(target_os = "linux")]
            {
                let addr = b.inner.ptr.as_ptr() as usize;
                if len >= HUGE {
                    assert_eq!(b.inner.owned, Alloc::Mapped);
                    let flags = vm_flags(addr).expect("the buffer is a mapping of its own");
                    // A kernel built without THP refuses the advice (and has no such directory).
                    if std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
                        assert!(flags.split(' ').any(|f| f == "hg"), "no MADV_HUGEPAGE on {len} bytes: {flags}");
                    }
                } else {
                    assert_eq!(b.inner.owned, Alloc::Heap);
                }
            }
            // A descriptor keeps the allocation alive after the buffer is gone.
            let d = b.desc();
            drop(b);
            assert_eq!(d.read_guard(len as u64 - 1, 1).unwrap().as_slice(), &[9]);
        }
    }

    #[test]
    fn guards_check_bounds_and_exclude_each_other() {
        let mut b = HostBuffer::filled(64, 7);
        let d = b.desc();
        assert!(matches!(b.as_slice(), Err(MemError::Registered { descs: 1 })));
        assert!(matches!(d.write_guard(60, 8), Err(MemError::OutOfBounds { .. })));
        assert!(matches!(d.write_guard(u64::MAX, 1), Err(MemError::OutOfBounds { .. })));
        let w = d.write_guard(8, 8).unwrap();
        assert!(matches!(d.read_guard(15, 1), Err(MemError::Busy { other_write: true, .. })));
        assert!(matches!(d.write_guard(0, 9), Err(MemError::Busy { .. })));
        let r = d.read_guard(16, 8).unwrap();
        let r2 = d.read_guard(20, 8).unwrap();
        assert!(matches!(d.write_guard(23, 1), Err(MemError::Busy { other_write: false, .. })));
        drop((w, r, r2));
        d.write_guard(0, 64).unwrap().as_mut_slice()[8..11].copy_from_slice(&[1, 2, 3]);
        d.copy_to(8, &d, 40, 3).unwrap();
        assert!(d.copy_to(0, &d, 4, 8).is_err(), "overlapping self-copy is refused");
        drop(d);
        let v = b.to_vec().unwrap();
        assert_eq!(&v[7..12], &[7, 1, 2, 3, 7]);
        assert_eq!(&v[39..44], &[7, 1, 2, 3, 7]);
        assert_eq!(b.inner.ptr.as_ptr() as usize % ALIGN, 0);
    }

    #[test]
    fn strided_guards_interleave_and_exclude_exactly() {
        let mut b = HostBuffer::zeroed(4096);
        let d = b.desc();
        // Two senders' head slices of the same 16 tokens: 64 bytes each, 128 apart, interleaved.
        let mut a = d.write_guard_strided(0, 64, 16, 128).unwrap();
        let mut c = d.write_guard_strided(64, 64, 16, 128).unwrap();
        assert!(matches!(d.write_guard_strided(32, 64, 16, 128), Err(MemError::Busy { .. })));
        assert!(matches!(d.write_guard(127, 2), Err(MemError::Busy { .. })), "straddles two pieces");
        assert!(matches!(d.read_guard(1900, 8), Err(MemError::Busy { .. })), "inside the last piece of c");
        d.read_guard(2048, 8).unwrap();
        assert!(matches!(d.write_guard_strided(0, 65, 2, 64), Err(MemError::SelfOverlap { .. })));
        assert!(matches!(d.write_guard_strided(4000, 64, 2, 64), Err(MemError::OutOfBounds { .. })));
        a.pieces_mut().for_each(|p| p.fill(1));
        c.pieces_mut().for_each(|p| p.fill(2));
        assert_eq!(a.pieces_mut().count(), 16);
        drop((a, c));
        let w = d.write_guard(0, 2048).unwrap();
        drop(w);
        drop(d);
        let v = b.to_vec().unwrap();
        assert!(v[..2048].chunks(128).all(|t| t[..64].iter().all(|x| *x == 1) && t[64..].iter().all(|x| *x == 2)));
        assert!(v[2048..].iter().all(|x| *x == 0));
    }

    proptest::proptest! {
        /// The guard table decides exactly as a byte-by-byte ownership map would.
        #[test]
        fn guard_table_matches_a_byte_map(
            reqs in proptest::collection::vec((0u64..512, 1u64..40, 1u64..6, 1u64..80, proptest::bool::ANY, proptest::bool::ANY), 1..24)
        ) {
            let mut b = HostBuffer::zeroed(1024);
            let d = b.desc();
            // 0 free, otherwise (readers, writer) per byte
            let mut map = vec![(0u32, false); 1024];
            type Held = (Vec<usize>, bool, Option<StridedWriteGuard>, Option<ReadGuard>);
            let mut held: Vec<Held> = Vec::new();
            for (offset, len, count, stride, write, release_first) in reqs {
                if release_first && !held.is_empty() {
                    let (bytes, w, _, _) = held.remove(0);
                    for i in bytes { if w { map[i].1 = false } else { map[i].0 -= 1 } }
                }
                let (count, stride) = if write { (count, stride.max(len)) } else { (1, len) };
                let bytes: Vec<usize> = (0..count).flat_map(|k| (0..len).map(move |i| (offset + k * stride + i) as usize)).collect();
                let in_bounds = bytes.iter().all(|i| *i < 1024);
                let free = in_bounds && bytes.iter().all(|i| !map[*i].1 && (!write || map[*i].0 == 0));
                if write {
                    let r = d.write_guard_strided(offset, len, count, stride);
                    proptest::prop_assert_eq!(r.is_ok(), free, "write {} {} {} {}", offset, len, count, stride);
                    if let Ok(g) = r { for i in &bytes { map[*i].1 = true } held.push((bytes, true, Some(g), None)); }
                } else {
                    let r = d.read_guard(offset, len);
                    proptest::prop_assert_eq!(r.is_ok(), free, "read {} {}", offset, len);
                    if let Ok(g) = r { for i in &bytes { map[*i].0 += 1 } held.push((bytes, false, None, Some(g))); }
                }
            }
        }
    }

    #[test]
    fn reservations_hold_any_kind_and_exclude_guards() {
        let mut b = HostBuffer::zeroed(4096);
        let dev = b.desc_labelled(MemKind::Cuda { device: 0 });
        let w = dev.reserve(0, 64, 4, 128, true).unwrap();
        assert_eq!((w.addr(), w.count(), w.stride(), w.len()), (dev.addr() as u64, 4, 128, 64));
        assert!(matches!(dev.reserve(100, 64, 1, 64, false), Err(MemError::Busy { other_write: true, .. })));
        let r = dev.reserve(64, 64, 1, 64, false).unwrap();
        assert!(matches!(dev.reserve(64, 1, 1, 1, true), Err(MemError::Busy { other_write: false, .. })));
        assert!(matches!(dev.reserve(4000, 64, 2, 64, false), Err(MemError::OutOfBounds { .. })));
        assert!(matches!(dev.read_guard(0, 1), Err(MemError::NotHost { .. })), "still no host view");
        drop((w, r));
        dev.reserve(0, 4096, 1, 4096, true).unwrap();
        let host = b.desc();
        let g = host.read_guard(0, 8).unwrap();
        assert!(matches!(host.reserve(4, 8, 1, 8, true), Err(MemError::Busy { .. })));
        drop(g);
    }

    #[test]
    fn device_memory_is_described_not_touched() {
        let mut b = HostBuffer::zeroed(16);
        let dev = b.desc_labelled(MemKind::Cuda { device: 1 });
        assert_eq!(b.descriptors(), 1);
        assert!(matches!(dev.read_guard(0, 1), Err(MemError::NotHost { .. })));
        assert!(MemKinds::HOST.union(MemKinds::CUDA).contains(&dev.kind()));
        assert!(!MemKinds::HOST.contains(&dev.kind()));
        drop(dev);
        assert!(b.as_slice().is_ok());
    }
}

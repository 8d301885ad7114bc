//! Memory that backends read from and write into: the engine's KV pool, described once.
//!
//! This module holds kvxfer-core's only `unsafe` code: the raw-memory constructor
//! [`MemRegion::from_raw_parts`], the owned page-aligned allocation [`HostBuffer`], and the
//! bounds-checked accessors whose soundness rests on the constructor's contract. Everything outside
//! this module (and every backend that uses the safe accessors) is safe code.
#![allow(unsafe_code)]

use std::alloc::Layout as AllocLayout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

/// An access outside a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("access of {len} bytes at offset {offset} is outside the region of {region_len} bytes")]
pub struct MemError {
    /// Offset asked for.
    pub offset: u64,
    /// Length asked for.
    pub len: u64,
    /// The region's length.
    pub region_len: u64,
}

/// A described range of memory: a pointer, a length, and (for owned memory) what keeps it alive.
///
/// Cloning is cheap and shares the memory. Concurrent transfers into disjoint byte ranges are the
/// normal case; the planner and the tracker guarantee that a decode byte is written exactly once and
/// read only after its request completes.
#[derive(Clone)]
pub struct MemRegion {
    ptr: NonNull<u8>,
    len: usize,
    _owner: Option<Arc<HostBufferInner>>,
}

// SAFETY: a MemRegion is a description of memory whose validity the constructor's caller promised
// (or that HostBuffer owns); all access goes through bounds-checked copies or `unsafe` accessors
// whose callers uphold the no-conflicting-access contract.
unsafe impl Send for MemRegion {}
// SAFETY: as for Send: shared references only hand out raw pointers or perform bounded copies.
unsafe impl Sync for MemRegion {}

impl fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemRegion({:p}, {} bytes)", self.ptr, self.len)
    }
}

impl MemRegion {
    /// Describes memory the caller owns (an engine's KV pool, a GPU-mapped host buffer).
    ///
    /// # Safety
    /// The caller promises that, for as long as this region or any clone of it (including the copy a
    /// backend keeps after registration) exists:
    /// - `ptr` is valid for reads and writes of `len` bytes and is not freed or unmapped;
    /// - bytes a transfer may write (destination pages of a pending request) are not read or written
    ///   by anyone else until the request completes, fails, or is aborted and its writes drained;
    /// - bytes a transfer reads (source pages) are not written until the send returns.
    pub unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize) -> Self {
        Self { ptr, len, _owner: None }
    }

    /// The start of the region (for FFI registration).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks that `[offset, offset + len)` lies inside the region.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(MemError { offset, len, region_len: self.len as u64 }),
        }
    }

    /// Copies `out.len()` bytes at `offset` into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.check(offset, out.len() as u64)?;
        // SAFETY: the range is inside the region (checked above), valid per the constructor's
        // contract; `out` is a distinct Rust allocation, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset as usize), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        self.check(offset, data.len() as u64)?;
        // SAFETY: bounds checked above; `data` is a Rust slice that cannot alias registered memory
        // that the contract reserves for transfers.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset as usize), data.len()) };
        Ok(())
    }

    /// Copies `len` bytes from `self[src_offset..]` to `dst[dst_offset..]` (memmove semantics, so
    /// the two may be the same region).
    pub fn copy_to(&self, src_offset: u64, dst: &MemRegion, dst_offset: u64, len: u64) -> Result<(), MemError> {
        self.check(src_offset, len)?;
        dst.check(dst_offset, len)?;
        // SAFETY: both ranges are inside their regions (checked above) and valid per the
        // constructor's contract; `copy` tolerates overlap.
        unsafe {
            std::ptr::copy(
                self.ptr.as_ptr().add(src_offset as usize),
                dst.ptr.as_ptr().add(dst_offset as usize),
                len as usize,
            )
        };
        Ok(())
    }

    /// A shared view of `[offset, offset + len)`, for sending it without a copy.
    ///
    /// # Safety
    /// Nobody may write these bytes while the returned slice lives (the constructor's contract for
    /// source pages during a send).
    pub unsafe fn slice(&self, offset: u64, len: u64) -> Result<&[u8], MemError> {
        self.check(offset, len)?;
        // SAFETY: bounds checked; the caller promises no concurrent writer.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), len as usize) })
    }

    /// An exclusive view of `[offset, offset + len)`, for receiving into it without a copy.
    ///
    /// # Safety
    /// Nobody else may read or write these bytes while the returned slice lives (the constructor's
    /// contract for destination pages of a pending request), and the caller must not create two
    /// overlapping views.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: u64) -> Result<&mut [u8], MemError> {
        self.check(offset, len)?;
        // SAFETY: bounds checked; the caller promises exclusivity.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset as usize), len as usize) })
    }
}

struct HostBufferInner {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the inner type only owns the allocation; access goes through MemRegion.
unsafe impl Send for HostBufferInner {}
// SAFETY: as above.
unsafe impl Sync for HostBufferInner {}

const ALIGN: usize = 4096;

impl Drop for HostBufferInner {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in HostBuffer::zeroed with exactly this layout; dropped once, when the
            // last MemRegion referring to it is gone.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), AllocLayout::from_size_align_unchecked(self.len, ALIGN)) }
        }
    }
}

/// An owned, zeroed, page-aligned host allocation (for tests, the demo, and engines without their own
/// pool). Its [`region`](HostBuffer::region) keeps it alive.
#[derive(Clone)]
pub struct HostBuffer {
    region: MemRegion,
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBuffer({} bytes)", self.region.len)
    }
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to 4096. Panics only if the allocator fails (as `Vec` does).
    pub fn zeroed(len: usize) -> Self {
        let ptr = if len == 0 {
            NonNull::dangling()
        } else {
            let layout = AllocLayout::from_size_align(len, ALIGN).expect("allocation size overflows isize");
            // SAFETY: layout has non-zero size.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
        };
        let inner = Arc::new(HostBufferInner { ptr, len });
        Self { region: MemRegion { ptr, len, _owner: Some(inner) } }
    }

    /// Allocates and fills with `byte`.
    pub fn filled(len: usize, byte: u8) -> Self {
        let b = Self::zeroed(len);
        if byte != 0 && len > 0 {
            // SAFETY: freshly allocated, nobody else has seen it.
            unsafe { std::ptr::write_bytes(b.region.ptr.as_ptr(), byte, len) };
        }
        b
    }

    /// The region describing this buffer (shares ownership).
    pub fn region(&self) -> MemRegion {
        self.region.clone()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// A copy of the whole content.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        self.region.read(0, &mut v).expect("whole buffer is in bounds");
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked_and_nothing_changes_on_error() {
        let b = HostBuffer::filled(64, 7);
        let r = b.region();
        assert!(r.write(60, &[1; 8]).is_err());
        assert!(r.write(u64::MAX, &[1]).is_err());
        assert_eq!(b.to_vec(), vec![7; 64]);
        r.write(8, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 4];
        r.read(7, &mut out).unwrap();
        assert_eq!(out, [7, 1, 2, 3]);
        let c = HostBuffer::zeroed(16);
        r.copy_to(8, &c.region(), 4, 3).unwrap();
        assert_eq!(&c.to_vec()[3..8], &[0, 1, 2, 3, 0]);
        assert!(r.copy_to(0, &c.region(), 10, 8).is_err());
        assert_eq!(b.region().as_ptr() as usize % ALIGN, 0);
    }
}

//! Owned allocations: device memory and page-locked (pinned) host memory, freed on drop.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use kvxfer_core::{MemDesc, MemKind};

use crate::ffi::{CuDevicePtr, CU_MEMHOSTALLOC_PORTABLE};
use crate::{Context, CudaError};

/// Device memory this process allocated (`cuMemAlloc`), freed on drop.
pub struct DeviceBuffer {
    ctx: Arc<Context>,
    ptr: CuDevicePtr,
    len: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes, device {})", self.ptr, self.len, self.ctx.device())
    }
}

impl DeviceBuffer {
    /// Allocates `len` bytes (at least one) of device memory on the context's device. The bytes are
    /// not initialised.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<Self, CudaError> {
        let d = ctx.enter()?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: FFI writing one device pointer we own.
        let r = unsafe { (d.api().mem_alloc)(&mut ptr, len.max(1)) };
        d.check(r, "cuMemAlloc", || format!("; {len} bytes on device {}", ctx.device()))?;
        Ok(Self { ctx: Arc::clone(ctx), ptr, len })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device.
    pub fn device(&self) -> u32 {
        self.ctx.device()
    }

    /// A descriptor of the whole buffer, of kind `Cuda`, that owns it: the allocation lives until
    /// the last clone of the descriptor (and every registration made from it) is gone.
    pub fn into_desc(self) -> MemDesc {
        let (ptr, len, kind) = (self.ptr, self.len, MemKind::Cuda { device: self.ctx.device() });
        let p = NonNull::new(ptr as *mut u8).expect("cuMemAlloc returned a null pointer with success");
        // SAFETY: the descriptor owns the allocation (this buffer, freed by its Drop only when the
        // last descriptor is gone); the memory is device memory of `kind` for `len` bytes; nothing
        // else of this process knows the address.
        unsafe { MemDesc::from_owner(p, len, kind, Box::new(self)) }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        match self.ctx.enter() {
            Ok(d) => {
                // SAFETY: FFI freeing our allocation once; no copy uses it any more (copies hold
                // the descriptor, and so this buffer, until they completed).
                let r = unsafe { (d.api().mem_free)(self.ptr) };
                if r != 0 {
                    tracing::warn!(ptr = self.ptr, code = r, "cuMemFree failed");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot free a device buffer"),
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`, portable between contexts), freed on drop: what the
/// copy engines read and write at full speed, the staging slot of a bounce-buffer pipeline.
///
/// Its bytes are reachable only through `&self`/`&mut self`; a [`crate::CopyPlan`] takes the buffer
/// by value while its copies run and gives it back once they completed, so the host never touches
/// bytes a copy is reading or writing.
pub struct PinnedBuffer {
    ctx: Arc<Context>,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an owned allocation; access follows Rust's borrow rules through the accessors.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared references only read.
unsafe impl Sync for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedBuffer({:p}, {} bytes)", self.ptr, self.len)
    }
}

impl PinnedBuffer {
    /// Allocates `len` bytes (at least one) of zeroed page-locked host memory.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<Self, CudaError> {
        let d = ctx.enter()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: FFI writing one pointer we own.
        let r = unsafe { (d.api().mem_host_alloc)(&mut p, len.max(1), CU_MEMHOSTALLOC_PORTABLE) };
        d.check(r, "cuMemHostAlloc", || format!("; {len} bytes of pinned host memory"))?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| CudaError::invalid("cuMemHostAlloc returned null"))?;
        // SAFETY: `len` bytes we own, not yet shared with any copy.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(Self { ctx: Arc::clone(ctx), ptr, len })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address (for the copy engine).
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: our allocation of `len` bytes; no copy runs on it while we hold it (plans take it
        // by value).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        match self.ctx.enter() {
            Ok(d) => {
                // SAFETY: FFI freeing our allocation once.
                let r = unsafe { (d.api().mem_free_host)(self.ptr.as_ptr().cast()) };
                if r != 0 {
                    tracing::warn!(code = r, "cuMemFreeHost failed");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot free a pinned buffer"),
        }
    }
}

//! Legacy CUDA IPC: a decode process exports the allocations under its registered regions
//! ([`export`]), a prefill process on the same node imports each once ([`import`]) and copies into
//! the mapping with [`crate::CopyPlan::to_mapping`].
//!
//! A handle names a whole allocation (`cuMemAlloc`/`cudaMalloc` block; PyTorch's caching allocator
//! hands out tensors inside such blocks), so an export carries the region's offset in it, and one
//! process opens each allocation once however many regions live in it (opening the same handle
//! twice in a process is an error in CUDA). A handle exported by this very process cannot be opened
//! here: such an import resolves through this process's table of exports instead (never from an
//! address the peer sent). Allocations made with the VMM API (PyTorch's `expandable_segments`) have
//! no legacy handle: the export says so.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use kvxfer_core::{MemDesc, MemKind};

use crate::ffi::{CuDevicePtr, IpcMemHandle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS};
use crate::{context, driver, Context, CudaError};

/// Bytes of an IPC handle.
pub const HANDLE_BYTES: usize = 64;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Allocations this process exported: handle -> (base, size, live exports).
type Exports = HashMap<[u8; HANDLE_BYTES], (u64, u64, usize)>;

fn exports() -> &'static Mutex<Exports> {
    static E: OnceLock<Mutex<Exports>> = OnceLock::new();
    E.get_or_init(Default::default)
}

/// Mappings this process imported, by handle.
fn imports() -> &'static Mutex<HashMap<[u8; HANDLE_BYTES], Weak<IpcMapping>>> {
    static I: OnceLock<Mutex<HashMap<[u8; HANDLE_BYTES], Weak<IpcMapping>>>> = OnceLock::new();
    I.get_or_init(Default::default)
}

/// A registered region's export: the handle of its allocation and where the region lies in it.
/// Dropping it withdraws the allocation from this process's table of exports (when no other
/// export of it is left).
#[derive(Debug)]
pub struct Export {
    /// The allocation's IPC handle.
    pub handle: [u8; HANDLE_BYTES],
    /// Offset of the region's first byte in the allocation.
    pub offset: u64,
    /// Bytes of the allocation.
    pub alloc_len: u64,
    /// The device.
    pub device: u32,
}

impl Drop for Export {
    fn drop(&mut self) {
        let mut e = lock(exports());
        if let Some(x) = e.get_mut(&self.handle) {
            x.2 -= 1;
            if x.2 == 0 {
                e.remove(&self.handle);
            }
        }
    }
}

/// Exports the allocation under `desc` (CUDA memory): its IPC handle and the region's place in it.
/// Refused, naming why, for other kinds, for a range that spans allocations, and for memory that has
/// no legacy IPC handle (VMM allocations).
pub fn export(desc: &MemDesc) -> Result<Export, CudaError> {
    let MemKind::Cuda { device } = desc.kind() else {
        return Err(CudaError::invalid(format!("{} cannot be exported with CUDA IPC", desc.kind())));
    };
    let ctx = context(device)?;
    let d = ctx.enter()?;
    let addr = desc.addr() as u64;
    let info = d.pointer_info(addr)?;
    if info.device != Some(device) {
        return Err(CudaError::invalid(format!(
            "{addr:#x} is described as memory of CUDA device {device} but the driver knows it as {}",
            info.device.map_or("host (or unknown) memory".to_owned(), |o| format!("memory of device {o}"))
        )));
    }
    if !info.ipc_capable {
        return Err(CudaError::invalid(format!(
            "the allocation under {addr:#x} has no legacy CUDA IPC handle (a VMM allocation: with PyTorch, unset \
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the KV pool)"
        )));
    }
    let (mut base, mut size): (CuDevicePtr, usize) = (0, 0);
    // SAFETY: FFI writing two values we own; the address is only looked up.
    let r = unsafe { (d.api().mem_get_address_range)(&mut base, &mut size, addr) };
    d.check(r, "cuMemGetAddressRange", || format!("; region at {addr:#x}"))?;
    let end = addr + desc.len() as u64;
    if end > base + size as u64 {
        return Err(CudaError::invalid(format!(
            "the region {addr:#x}..{end:#x} spans more than one allocation (its first one ends at {:#x}): register \
             each allocation as its own region",
            base + size as u64
        )));
    }
    let mut h = IpcMemHandle { reserved: [0; HANDLE_BYTES] };
    // SAFETY: FFI writing one handle we own, for an allocation base the driver just named.
    let r = unsafe { (d.api().ipc_get_mem_handle)(&mut h, base) };
    d.check(r, "cuIpcGetMemHandle", || format!("; allocation at {base:#x} ({size} bytes) on device {device}"))?;
    lock(exports()).entry(h.reserved).or_insert((base, size as u64, 0)).2 += 1;
    Ok(Export { handle: h.reserved, offset: addr - base, alloc_len: size as u64, device })
}

/// An imported allocation of another process (or, for a handle this process exported, the
/// allocation itself), closed on drop when it was opened here.
pub struct IpcMapping {
    ctx: Arc<Context>,
    handle: [u8; HANDLE_BYTES],
    base: u64,
    len: u64,
    opened: bool,
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IpcMapping({:#x}, {} bytes, device {}, opened: {})",
            self.base,
            self.len,
            self.ctx.device(),
            self.opened
        )
    }
}

impl IpcMapping {
    /// The mapped address (device memory, reachable from this process's context).
    pub(crate) fn addr(&self) -> u64 {
        self.base
    }

    /// Bytes mapped.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this process opened the handle (false: the allocation is this process's own).
    pub fn is_opened(&self) -> bool {
        self.opened
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // The table stays locked until the handle is closed, so an import of the same handle
        // cannot open it again in between (a second open of an open handle fails).
        let mut m = lock(imports());
        if m.get(&self.handle).is_some_and(|w| w.strong_count() == 0) {
            m.remove(&self.handle);
        }
        if self.opened {
            close(&self.ctx, self.base);
        }
    }
}

fn close(ctx: &Context, base: u64) {
    match ctx.enter() {
        Ok(d) => {
            // SAFETY: FFI closing a mapping this process opened, once (its only owner); no copy
            // uses it any more (plans hold the mapping until their copies completed).
            let r = unsafe { (d.api().ipc_close_mem_handle)(base) };
            if r != 0 {
                tracing::warn!(code = r, "cuIpcCloseMemHandle failed");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot close an IPC mapping"),
    }
}

/// Imports the allocation `handle` names into `ctx` (once per process: a second import of the same
/// handle shares the first mapping). `alloc_len` is the size its exporter reported; the mapping is
/// the smaller of that and what the driver reports. `exporter_pid` is the exporting process: this
/// process's own exports resolve through its table of exports.
pub fn import(
    ctx: &Arc<Context>,
    handle: [u8; HANDLE_BYTES],
    alloc_len: u64,
    exporter_pid: u32,
) -> Result<Arc<IpcMapping>, CudaError> {
    let mut m = lock(imports());
    if let Some(x) = m.get(&handle).and_then(Weak::upgrade) {
        return Ok(x);
    }
    let d = driver()?;
    let own = exporter_pid == std::process::id() && !d.is_emulated();
    let mapping = if own {
        let (base, size, _) = *lock(exports()).get(&handle).ok_or_else(|| {
            CudaError::invalid(
                "the peer's metadata names this process but an allocation it did not export (stale metadata?)",
            )
        })?;
        IpcMapping { ctx: Arc::clone(ctx), handle, base, len: size.min(alloc_len), opened: false }
    } else {
        let d = ctx.enter()?;
        let mut base: CuDevicePtr = 0;
        // SAFETY: FFI writing one device pointer we own; the handle is 64 opaque bytes the driver
        // validates (a forged one is an error, not a mapping).
        let r = unsafe {
            (d.api().ipc_open_mem_handle)(
                &mut base,
                IpcMemHandle { reserved: handle },
                CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
            )
        };
        d.check(r, "cuIpcOpenMemHandle", || {
            format!(
                "; an allocation of process {exporter_pid} on device {} (both processes must be on this node, with \
                 the same GPUs visible: cuda-ipc is for same-node peers)",
                ctx.device()
            )
        })?;
        let (mut b, mut size): (CuDevicePtr, usize) = (0, 0);
        // SAFETY: FFI writing two values we own; the address was just mapped.
        let r = unsafe { (d.api().mem_get_address_range)(&mut b, &mut size, base) };
        if let Err(e) = d.check(r, "cuMemGetAddressRange", || "; an imported allocation".into()) {
            close(ctx, base);
            return Err(e);
        }
        IpcMapping { ctx: Arc::clone(ctx), handle, base, len: alloc_len.min(size as u64), opened: true }
    };
    let mapping = Arc::new(mapping);
    m.insert(handle, Arc::downgrade(&mapping));
    Ok(mapping)
}

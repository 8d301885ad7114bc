//! kvxfer's CUDA: the driver API loaded at run time, behind a small safe surface.
//!
//! Nothing of CUDA is needed to build or test this crate: [`driver`] opens the driver library
//! (`libcuda.so.1`, or the path in `KVXFER_CUDA_LIBRARY`) with `dlopen` on first use and resolves the
//! ~35 entry points kvxfer calls; a host without a driver gets [`CudaError::Load`] naming the
//! library, never a crash. (Why not `cudarc`: its dynamic loading panics when the library is
//! missing and fixes a CUDA version at build time; these calls are the ABI-stable driver API.)
//!
//! - [`Context`]: a device's primary context (the one PyTorch and every runtime-API user share),
//!   retained once per process and made current on the calling thread before every call.
//! - [`DeviceBuffer`], [`PinnedBuffer`]: device and page-locked host allocations, freed on drop;
//!   a device buffer becomes a [`kvxfer_core::MemDesc`] of kind `Cuda` that keeps it alive.
//! - [`Stream`], [`CopyPlan`], [`Pending`]: copies between reserved ranges of registered memory
//!   ([`kvxfer_core::Reservation`]), pinned staging slots and imported IPC mappings, queued on a
//!   stream of their own; a plan holds everything it touches until its copies completed (a host
//!   function queued after them signals the waiter), so no copy can outlive its memory.
//! - [`ipc`]: legacy CUDA IPC handles, exported per allocation and imported once per process.
//! - `emulation` (feature): an in-process model of these calls, for tests on machines without a GPU.
//! - `mirror` (feature): a backend adapter that runs a backend's conformance suite on device pools.
//!
//! `unsafe` lives only here, each block with a `SAFETY` comment; every C handle is owned by a type
//! whose `Drop` releases it; no panic crosses the FFI boundary (host functions catch them).
#![allow(unsafe_code)]

pub mod dmabuf;
mod error;
mod ffi;
pub mod ipc;
pub mod kernel;
mod memory;
pub mod order;
pub mod stream;

#[cfg(feature = "emulation")]
pub mod emulation;
#[cfg(feature = "mirror")]
pub mod mirror;

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};

use kvxfer_core::{BackendError, MemDesc, MemKind, MemKinds};

pub use error::CudaError;
pub use memory::{DeviceBuffer, PinnedBuffer};
pub use stream::{CopyPlan, Done, Event, Pending, Shape, Stream};

use crate::ffi::{Api, CuContext, CuResult, CUDA_SUCCESS};

/// The environment variable naming the driver library to load (default [`DEFAULT_LIBRARY`]).
pub const LIBRARY_ENV: &str = "KVXFER_CUDA_LIBRARY";
/// The driver library loaded when [`LIBRARY_ENV`] is unset.
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

/// The loaded driver: its entry points and where they came from.
pub struct Driver {
    api: Api,
    library: String,
    version: i32,
    emulated: bool,
    /// The entry points of the copy kernel path, where the driver has them (see [`kernel`]).
    kernels: Option<kernel::KernelApi>,
    /// Keeps the library mapped for the life of the process (the entry points point into it).
    _lib: Option<libloading::Library>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Driver({}, CUDA {})", self.library, self.version_string())
    }
}

static DRIVER: OnceLock<Result<Driver, CudaError>> = OnceLock::new();

/// The process's driver, loaded on first use from [`LIBRARY_ENV`] or [`DEFAULT_LIBRARY`] (and
/// initialised with `cuInit`). The outcome is kept: a host without a driver answers the same
/// [`CudaError::Load`] every time, cheaply.
pub fn driver() -> Result<&'static Driver, CudaError> {
    DRIVER
        .get_or_init(|| {
            let lib = std::env::var(LIBRARY_ENV).ok().filter(|s| !s.trim().is_empty());
            Driver::load(lib.as_deref().unwrap_or(DEFAULT_LIBRARY))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether a driver is loaded and sees at least one device (what a backend's capabilities say
/// about CUDA memory). Loads the driver on first call.
pub fn available() -> bool {
    driver().and_then(|d| d.device_count()).is_ok_and(|n| n > 0)
}

/// The memory kinds a backend that moves CUDA memory through this crate takes on this host: host
/// memory, plus CUDA memory where a driver is loaded and sees a device.
pub fn memory_kinds() -> MemKinds {
    if available() {
        MemKinds::HOST.union(MemKinds::CUDA)
    } else {
        MemKinds::HOST
    }
}

/// The registration check of such a backend: host memory is taken; CUDA memory where the driver is
/// loaded and knows the address as memory of the device the descriptor names; nothing else. Every
/// refusal is [`BackendError::Unsupported`] saying why (the library that could not be loaded, the
/// device the address really belongs to).
pub fn check_register(backend: &'static str, mem: &MemDesc) -> Result<(), BackendError> {
    let refuse =
        |why: String| BackendError::Unsupported { backend, what: format!("registering {} ({why})", mem.kind()) };
    match mem.kind() {
        MemKind::Host => Ok(()),
        MemKind::Cuda { device } => {
            let d = driver().map_err(|e| refuse(e.to_string()))?;
            let count = d.device_count().map_err(|e| refuse(e.to_string()))?;
            if device >= count {
                return Err(refuse(CudaError::NoDevice { device, count }.to_string()));
            }
            let info = d.pointer_info(mem.addr() as u64).map_err(|e| refuse(e.to_string()))?;
            match info.device {
                Some(x) if x == device => Ok(()),
                Some(x) => Err(refuse(format!(
                    "the driver knows {:p} as memory of device {x}; describe it as such",
                    mem.addr()
                ))),
                None => Err(refuse(format!(
                    "the driver does not know {:p} as device memory (host memory is registered as kind host)",
                    mem.addr()
                ))),
            }
        }
        other => Err(refuse(format!("{} moves host and CUDA memory only ({other} is not supported)", backend))),
    }
}

#[cfg(feature = "emulation")]
fn install(d: Driver) -> bool {
    DRIVER.set(Ok(d)).is_ok() || DRIVER.get().is_some_and(|r| r.as_ref().is_ok_and(|d| d.emulated))
}

impl Driver {
    /// Opens `library`, resolves the entry points and calls `cuInit(0)`.
    pub fn load(library: &str) -> Result<Driver, CudaError> {
        // SAFETY: loading the NVIDIA driver library runs its initialisers, which is what every CUDA
        // program does; nothing else of ours runs concurrently with them.
        let lib = unsafe { libloading::Library::new(library) }
            .map_err(|e| CudaError::Load { library: library.to_owned(), detail: e.to_string() })?;
        let api = Api::load(&lib, library)?;
        let kernels = kernel::KernelApi::load(&lib);
        let mut d = Driver { api, library: library.to_owned(), version: 0, emulated: false, kernels, _lib: Some(lib) };
        d.init()?;
        Ok(d)
    }

    #[cfg(feature = "emulation")]
    fn from_api(api: Api, library: &str) -> Result<Driver, CudaError> {
        let mut d = Driver { api, library: library.to_owned(), version: 0, emulated: true, kernels: None, _lib: None };
        d.init()?;
        Ok(d)
    }

    fn init(&mut self) -> Result<(), CudaError> {
        // SAFETY: FFI without pointers.
        let r = unsafe { (self.api.init)(0) };
        self.check(r, "cuInit", || format!("; initialising the driver of {}", self.library))?;
        let mut v: c_int = 0;
        // SAFETY: FFI writing one int we own.
        let r = unsafe { (self.api.driver_get_version)(&mut v) };
        self.check(r, "cuDriverGetVersion", String::new)?;
        self.version = v;
        Ok(())
    }

    /// The entry points.
    pub(crate) fn api(&self) -> &Api {
        &self.api
    }

    /// The copy kernel's entry points, where the driver has them.
    pub(crate) fn kernels(&self) -> Option<&kernel::KernelApi> {
        self.kernels.as_ref()
    }

    /// The library the entry points came from ("emulation" for the model).
    pub fn library(&self) -> &str {
        &self.library
    }

    /// The CUDA version the driver supports (e.g. 13000 for 13.0).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// The version as `major.minor`.
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version / 1000, (self.version % 1000) / 10)
    }

    /// Whether this is the in-process model (feature `emulation`), not a real driver.
    pub fn is_emulated(&self) -> bool {
        self.emulated
    }

    /// `Ok` for `CUDA_SUCCESS`, else [`CudaError::Call`] naming `call`, the code's name and
    /// description, and `context()`.
    pub(crate) fn check(
        &self,
        r: CuResult,
        call: &'static str,
        context: impl FnOnce() -> String,
    ) -> Result<(), CudaError> {
        if r == CUDA_SUCCESS {
            return Ok(());
        }
        Err(self.error(r, call, context()))
    }

    pub(crate) fn error(&self, r: CuResult, call: &'static str, context: String) -> CudaError {
        let text = |f: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult| {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: FFI writing one pointer we own; on success it points to a static C string.
            let ok = unsafe { f(r, &mut p) } == CUDA_SUCCESS && !p.is_null();
            // SAFETY: a static NUL-terminated string of the driver (checked non-null).
            ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        CudaError::Call {
            call,
            code: r,
            name: text(self.api.get_error_name).unwrap_or_else(|| format!("CUresult {r}")),
            description: text(self.api.get_error_string).unwrap_or_else(|| "no description".into()),
            context,
        }
    }

    /// Devices visible to this process.
    pub fn device_count(&self) -> Result<u32, CudaError> {
        let mut n: c_int = 0;
        // SAFETY: FFI writing one int we own.
        let r = unsafe { (self.api.device_get_count)(&mut n) };
        self.check(r, "cuDeviceGetCount", String::new)?;
        Ok(n.max(0) as u32)
    }

    fn device(&self, ordinal: u32) -> Result<ffi::CuDevice, CudaError> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { device: ordinal, count });
        }
        let mut d: ffi::CuDevice = 0;
        // SAFETY: FFI writing one int we own.
        let r = unsafe { (self.api.device_get)(&mut d, ordinal as c_int) };
        self.check(r, "cuDeviceGet", || format!("; device {ordinal}"))?;
        Ok(d)
    }

    /// What a device is: name, UUID, PCI bus id and the GPUDirect features the verbs backend asks about.
    pub fn device_info(&self, ordinal: u32) -> Result<DeviceInfo, CudaError> {
        let dev = self.device(ordinal)?;
        let mut name = [0 as c_char; 256];
        // SAFETY: FFI writing at most 256 bytes (NUL-terminated) into our buffer.
        let r = unsafe { (self.api.device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev) };
        self.check(r, "cuDeviceGetName", || format!("; device {ordinal}"))?;
        let mut uuid = ffi::CuUuid::default();
        // SAFETY: FFI writing one CUuuid we own.
        let r = unsafe { (self.api.device_get_uuid)(&mut uuid, dev) };
        self.check(r, "cuDeviceGetUuid", || format!("; device {ordinal}"))?;
        let mut bus = [0 as c_char; 64];
        // SAFETY: FFI writing at most 64 bytes (NUL-terminated) into our buffer.
        let r = unsafe { (self.api.device_get_pci_bus_id)(bus.as_mut_ptr(), bus.len() as c_int, dev) };
        self.check(r, "cuDeviceGetPCIBusId", || format!("; device {ordinal}"))?;
        let attr = |a: c_int| -> bool {
            let mut v: c_int = 0;
            // SAFETY: FFI writing one int we own; an unknown attribute is an error, read as "no".
            (unsafe { (self.api.device_get_attribute)(&mut v, a, dev) }) == CUDA_SUCCESS && v != 0
        };
        // SAFETY: both buffers are NUL-terminated by the driver (zeroed, and the driver writes
        // fewer bytes than their length).
        let (name, bus) = unsafe { (CStr::from_ptr(name.as_ptr()), CStr::from_ptr(bus.as_ptr())) };
        Ok(DeviceInfo {
            ordinal,
            name: name.to_string_lossy().into_owned(),
            uuid: uuid.bytes,
            pci_bus_id: bus.to_string_lossy().into_owned(),
            unified_addressing: attr(ffi::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING),
            dma_buf: attr(ffi::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED),
            gpudirect_rdma: attr(ffi::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED),
        })
    }

    /// What the driver knows of `addr`: device memory (and of which device) or not.
    pub fn pointer_info(&self, addr: u64) -> Result<PointerInfo, CudaError> {
        let mut ty: u64 = 0;
        // SAFETY: FFI writing at most 8 bytes (an unsigned int) into our u64; the driver only
        // looks the address up, it does not dereference it.
        let r = unsafe {
            (self.api.pointer_get_attribute)(
                (&mut ty as *mut u64).cast::<c_void>(),
                ffi::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        if r == ffi::CUDA_ERROR_INVALID_VALUE {
            return Ok(PointerInfo { device: None, ipc_capable: false });
        }
        self.check(r, "cuPointerGetAttribute", || format!("; memory type of {addr:#x}"))?;
        if ty as u32 != ffi::CU_MEMORYTYPE_DEVICE {
            return Ok(PointerInfo { device: None, ipc_capable: false });
        }
        let mut ord: u64 = 0;
        // SAFETY: as above (an int).
        let r = unsafe {
            (self.api.pointer_get_attribute)(
                (&mut ord as *mut u64).cast::<c_void>(),
                ffi::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        };
        self.check(r, "cuPointerGetAttribute", || format!("; device ordinal of {addr:#x}"))?;
        let mut ipc: u64 = 0;
        // SAFETY: as above (a boolean); an older driver without the attribute answers an error,
        // read as "capable" (the export then says why not, if not).
        let r = unsafe {
            (self.api.pointer_get_attribute)(
                (&mut ipc as *mut u64).cast::<c_void>(),
                ffi::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                addr,
            )
        };
        Ok(PointerInfo { device: Some(ord as u32), ipc_capable: r != CUDA_SUCCESS || ipc as u8 != 0 })
    }
}

/// A device, as [`Driver::device_info`] describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Ordinal in this process (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u32,
    /// Product name.
    pub name: String,
    /// UUID: the same device in every process, whatever its ordinal there.
    pub uuid: [u8; 16],
    /// PCI bus id, `domain:bus:device.function`.
    pub pci_bus_id: String,
    /// Unified virtual addressing (every 64-bit Linux system).
    pub unified_addressing: bool,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: device memory can be exported as a dma-buf.
    pub dma_buf: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpudirect_rdma: bool,
}

impl DeviceInfo {
    /// The UUID in the `GPU-xxxxxxxx-xxxx-...` form `nvidia-smi -L` prints.
    pub fn uuid_string(&self) -> String {
        let h: Vec<String> = self.uuid.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "GPU-{}-{}-{}-{}-{}",
            h[..4].concat(),
            h[4..6].concat(),
            h[6..8].concat(),
            h[8..10].concat(),
            h[10..].concat()
        )
    }
}

/// What the driver knows of an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    /// The device whose memory it is; `None` for host (or unknown) memory.
    pub device: Option<u32>,
    /// Whether a legacy IPC handle can be made for its allocation (false for VMM allocations,
    /// e.g. PyTorch's `expandable_segments`).
    pub ipc_capable: bool,
}

/// A device's primary context, retained for this process.
pub struct Context {
    driver: &'static Driver,
    device: u32,
    dev: ffi::CuDevice,
    raw: CuContext,
    /// The copy kernel, loaded on first use (`None`: not available here, copies are driver calls).
    copy_kernel: OnceLock<Option<kernel::CopyKernel>>,
}

// SAFETY: a CUcontext handle may be used from any thread (made current there first, as `enter`
// does); the type only hands the handle to driver calls.
unsafe impl Send for Context {}
// SAFETY: as above; driver calls on one context from several threads are thread-safe.
unsafe impl Sync for Context {}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context(device {})", self.device)
    }
}

/// The primary context of `device`, retained once per process and kept (creating a primary context
/// costs a large fraction of a second; PyTorch holds the same one).
pub fn context(device: u32) -> Result<Arc<Context>, CudaError> {
    static CONTEXTS: OnceLock<Mutex<HashMap<u32, Arc<Context>>>> = OnceLock::new();
    let d = driver()?;
    let mut m = CONTEXTS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = m.get(&device) {
        return Ok(Arc::clone(c));
    }
    let dev = d.device(device)?;
    let mut raw: CuContext = std::ptr::null_mut();
    // SAFETY: FFI writing one handle we own.
    let r = unsafe { (d.api.primary_ctx_retain)(&mut raw, dev) };
    d.check(r, "cuDevicePrimaryCtxRetain", || format!("; device {device}"))?;
    let c = Arc::new(Context { driver: d, device, dev, raw, copy_kernel: OnceLock::new() });
    m.insert(device, Arc::clone(&c));
    Ok(c)
}

impl Context {
    /// The device ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The driver.
    pub fn driver(&self) -> &'static Driver {
        self.driver
    }

    /// The copy kernel of this context, loaded on first use (the context must be current); `None`
    /// unless `KVXFER_CUDA_COPY_KERNEL=1`, where the driver lacks the entry points, or where loading
    /// failed (logged once).
    pub(crate) fn copy_kernel(&self) -> Option<kernel::CopyKernel> {
        *self.copy_kernel.get_or_init(|| {
            let k = self.driver.kernels()?;
            if !kernel::enabled() {
                return None;
            }
            match kernel::CopyKernel::load(k, self.driver) {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::warn!(device = self.device, error = %e, "the copy kernel did not load; copies are one driver call each");
                    None
                }
            }
        })
    }

    /// Makes the context current on this thread (every call below needs it) and returns the driver.
    pub(crate) fn enter(&self) -> Result<&'static Driver, CudaError> {
        // SAFETY: FFI with a context we retained.
        let r = unsafe { (self.driver.api.ctx_set_current)(self.raw) };
        self.driver.check(r, "cuCtxSetCurrent", || format!("; device {}", self.device))?;
        Ok(self.driver)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: FFI releasing the retain made in `context` (once: this is its only owner).
        let r = unsafe { (self.driver.api.primary_ctx_release)(self.dev) };
        if r != CUDA_SUCCESS {
            tracing::warn!(device = self.device, code = r, "cuDevicePrimaryCtxRelease failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_typed_error_naming_it() {
        let e = Driver::load("libcuda-kvxfer-test-missing.so.1").unwrap_err();
        assert!(matches!(e, CudaError::Load { .. }), "{e:?}");
        let s = e.to_string();
        assert!(s.contains("libcuda-kvxfer-test-missing.so.1") && s.contains(LIBRARY_ENV), "{s}");
    }

    #[test]
    fn a_library_without_the_entry_points_is_a_typed_error_naming_the_call() {
        // libc is loaded everywhere and has no cuInit.
        let e = Driver::load("libc.so.6").unwrap_err();
        assert!(matches!(e, CudaError::Symbol { symbol: "cuInit", .. }), "{e:?}");
        assert!(e.to_string().contains("too old"), "{e}");
    }

    #[test]
    fn uuid_prints_like_nvidia_smi() {
        let info = DeviceInfo {
            ordinal: 0,
            name: String::new(),
            uuid: [0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 1, 2, 3, 4, 5, 6, 7, 8],
            pci_bus_id: String::new(),
            unified_addressing: true,
            dma_buf: false,
            gpudirect_rdma: false,
        };
        assert_eq!(info.uuid_string(), "GPU-12345678-9abc-def0-0102-030405060708");
    }
}

//! An in-process model of the driver calls this crate makes (feature `emulation`, tests only).
//!
//! [`install`] makes it the process's driver (before anything asked for the real one). "Device"
//! memory is host memory the model allocated and tracks (two devices); each stream is a worker
//! thread that runs its queue in order, with a small random delay before each item so that code
//! which reads a buffer before its copy completed fails here as it would on a GPU; host functions
//! run on that thread after the copies queued before them, like the driver's. The model is strict
//! where the driver is undefined: a copy that names device memory outside a live allocation, or
//! whose allocation was freed before the copy ran, puts the stream in an error state (reported by
//! `cuStreamQuery`) instead of touching memory; an IPC handle opened twice in a process is refused.
//! IPC handles work within the process only.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use crate::ffi::*;
use crate::Driver;

const DEVICES: c_int = 2;
const MAGIC: &[u8; 8] = b"KVXFEMU1";
const CUDA_ERROR_INVALID_CONTEXT: CuResult = 201;
const CUDA_ERROR_ALREADY_MAPPED: CuResult = 208;
const CUDA_ERROR_INVALID_HANDLE: CuResult = 400;
const CUDA_ERROR_ILLEGAL_ADDRESS: CuResult = 700;

/// Makes the model the process's driver. Call it before anything asks for a driver (first thing in a
/// test); calling it again is harmless. Panics if a real driver was loaded first.
pub fn install() {
    let api = Api {
        init: emu_init,
        driver_get_version: emu_driver_get_version,
        device_get_count: emu_device_get_count,
        device_get: emu_device_get,
        device_get_name: emu_device_get_name,
        device_get_uuid: emu_device_get_uuid,
        device_get_attribute: emu_device_get_attribute,
        device_get_pci_bus_id: emu_device_get_pci_bus_id,
        primary_ctx_retain: emu_primary_ctx_retain,
        primary_ctx_release: emu_primary_ctx_release,
        ctx_set_current: emu_ctx_set_current,
        pointer_get_attribute: emu_pointer_get_attribute,
        mem_get_address_range: emu_mem_get_address_range,
        mem_alloc: emu_mem_alloc,
        mem_free: emu_mem_free,
        mem_host_alloc: emu_mem_host_alloc,
        mem_free_host: emu_mem_free_host,
        memcpy_async: emu_memcpy_async,
        memcpy_2d_async: emu_memcpy_2d_async,
        stream_create: emu_stream_create,
        stream_destroy: emu_stream_destroy,
        stream_synchronize: emu_stream_synchronize,
        stream_query: emu_stream_query,
        stream_wait_event: emu_stream_wait_event,
        launch_host_func: emu_launch_host_func,
        event_create: emu_event_create,
        event_record: emu_event_record,
        event_query: emu_event_query,
        event_destroy: emu_event_destroy,
        ipc_get_mem_handle: emu_ipc_get_mem_handle,
        ipc_open_mem_handle: emu_ipc_open_mem_handle,
        ipc_close_mem_handle: emu_ipc_close_mem_handle,
        get_error_name: emu_get_error_name,
        get_error_string: emu_get_error_string,
        mem_get_handle_for_address_range: None,
    };
    let d = Driver::from_api(api, "emulation").expect("the model initialises");
    assert!(crate::install(d), "a real CUDA driver was loaded before emulation::install()");
}

/// Bytes of "device" memory the model holds now (to check that tests free what they allocate).
pub fn device_bytes() -> u64 {
    state().allocs.values().filter(|a| a.device.is_some()).map(|a| a.len).sum()
}

/// Makes `stream` stall for `d` before anything queued after this call (a long kernel, for tests of
/// GPU-ordered sends).
pub fn stall(stream: &crate::Stream, d: Duration) {
    // SAFETY: a live stream of the model (the caller holds it).
    let _ = push(unsafe { stream_of(stream.raw() as CuStream) }, Job::Stall(d));
}

#[derive(Clone, Copy)]
struct Alloc {
    len: u64,
    /// `None`: pinned host memory.
    device: Option<u32>,
}

#[derive(Default)]
struct State {
    allocs: BTreeMap<u64, Alloc>,
    /// Handles open in this process, by base address.
    opened: HashMap<u64, u32>,
}

fn state() -> std::sync::MutexGuard<'static, State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner())
}

thread_local! {
    static CURRENT: Cell<Option<u32>> = const { Cell::new(None) };
}

/// The allocation holding `[addr, addr + len)`, if any (and whether it holds all of it).
fn find(s: &State, addr: u64, len: u64) -> Option<(u64, Alloc, bool)> {
    let (&base, a) = s.allocs.range(..=addr).next_back()?;
    if addr >= base + a.len.max(1) {
        return None;
    }
    Some((base, *a, addr + len <= base + a.len))
}

/// Checks a side of a copy: device memory must lie wholly inside a live device allocation; host
/// memory is taken as given (pageable memory is unknown to a driver too).
fn check_side(addr: u64, extent: u64, device: bool) -> bool {
    let s = state();
    match find(&s, addr, extent) {
        Some((_, a, whole)) => whole && (a.device.is_some() == device || !device),
        None => !device,
    }
}

fn run(f: impl FnOnce() -> CuResult) -> CuResult {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(CUDA_ERROR_UNKNOWN)
}

unsafe extern "C" fn emu_init(_flags: c_uint) -> CuResult {
    CUDA_SUCCESS
}

unsafe extern "C" fn emu_driver_get_version(v: *mut c_int) -> CuResult {
    // SAFETY: the caller passes a writable int.
    run(|| unsafe {
        *v = 12080;
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_device_get_count(n: *mut c_int) -> CuResult {
    // SAFETY: the caller passes a writable int.
    run(|| unsafe {
        *n = DEVICES;
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_device_get(d: *mut CuDevice, ordinal: c_int) -> CuResult {
    if !(0..DEVICES).contains(&ordinal) {
        return 101;
    }
    // SAFETY: the caller passes a writable int.
    run(|| unsafe {
        *d = ordinal;
        CUDA_SUCCESS
    })
}

fn write_cstr(dst: *mut c_char, cap: c_int, s: &str) {
    let n = s.len().min(cap.max(1) as usize - 1);
    // SAFETY: the caller passes `cap` writable bytes; we write `n + 1 <= cap`.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), dst, n);
        *dst.add(n) = 0;
    }
}

unsafe extern "C" fn emu_device_get_name(name: *mut c_char, cap: c_int, d: CuDevice) -> CuResult {
    run(|| {
        write_cstr(name, cap, &format!("kvxfer emulated device {d}"));
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_device_get_uuid(u: *mut CuUuid, d: CuDevice) -> CuResult {
    // SAFETY: the caller passes a writable CUuuid.
    run(|| unsafe {
        let mut b = [0xEEu8; 16];
        b[15] = d as u8;
        (*u).bytes = b;
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_device_get_attribute(v: *mut c_int, attr: c_int, _d: CuDevice) -> CuResult {
    // SAFETY: the caller passes a writable int.
    run(|| unsafe {
        *v = c_int::from(attr == CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING);
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_device_get_pci_bus_id(bus: *mut c_char, cap: c_int, d: CuDevice) -> CuResult {
    run(|| {
        write_cstr(bus, cap, &format!("0000:{d:02x}:00.0"));
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_primary_ctx_retain(c: *mut CuContext, d: CuDevice) -> CuResult {
    // SAFETY: the caller passes a writable handle.
    run(|| unsafe {
        *c = (d as usize + 1) as CuContext;
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_primary_ctx_release(_d: CuDevice) -> CuResult {
    CUDA_SUCCESS
}

unsafe extern "C" fn emu_ctx_set_current(c: CuContext) -> CuResult {
    let d = c as usize;
    if d == 0 || d > DEVICES as usize {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    CURRENT.with(|x| x.set(Some(d as u32 - 1)));
    CUDA_SUCCESS
}

fn current() -> Option<u32> {
    CURRENT.with(Cell::get)
}

unsafe extern "C" fn emu_pointer_get_attribute(data: *mut c_void, attr: c_int, ptr: CuDevicePtr) -> CuResult {
    run(|| {
        let s = state();
        let Some((base, a, _)) = find(&s, ptr, 1) else { return CUDA_ERROR_INVALID_VALUE };
        let v: u64 = match attr {
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE => {
                u64::from(if a.device.is_some() { CU_MEMORYTYPE_DEVICE } else { CU_MEMORYTYPE_HOST })
            }
            CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL => u64::from(a.device.unwrap_or(0)),
            CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE => u64::from(a.device.is_some()),
            11 => base,
            12 => a.len,
            _ => return CUDA_ERROR_INVALID_VALUE,
        };
        // SAFETY: the caller passes room for the attribute: 4 bytes for ints, 8 for addresses.
        unsafe {
            if matches!(attr, 11 | 12) {
                *data.cast::<u64>() = v;
            } else {
                *data.cast::<u32>() = v as u32;
            }
        }
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_mem_get_address_range(base: *mut CuDevicePtr, size: *mut usize, ptr: CuDevicePtr) -> CuResult {
    run(|| {
        let s = state();
        match find(&s, ptr, 1) {
            Some((b, a, _)) if a.device.is_some() => {
                // SAFETY: the caller passes writable values.
                unsafe {
                    *base = b;
                    *size = a.len as usize;
                }
                CUDA_SUCCESS
            }
            _ => 1,
        }
    })
}

fn layout(len: u64) -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(len.max(1) as usize, 256).expect("allocation size")
}

fn alloc(len: usize, device: Option<u32>, fill: u8) -> Result<u64, CuResult> {
    // SAFETY: a non-zero-sized layout.
    let p = unsafe { std::alloc::alloc(layout(len as u64)) };
    if p.is_null() {
        return Err(2);
    }
    // SAFETY: `len` bytes we just allocated.
    unsafe { std::ptr::write_bytes(p, fill, len) };
    state().allocs.insert(p as u64, Alloc { len: len as u64, device });
    Ok(p as u64)
}

fn free(p: u64, device: bool) -> CuResult {
    let mut s = state();
    match s.allocs.get(&p) {
        Some(a) if a.device.is_some() == device => {
            let len = a.len;
            s.allocs.remove(&p);
            drop(s);
            // SAFETY: allocated by `alloc` with this layout, removed from the table once.
            unsafe { std::alloc::dealloc(p as *mut u8, layout(len)) };
            CUDA_SUCCESS
        }
        _ => CUDA_ERROR_INVALID_VALUE,
    }
}

unsafe extern "C" fn emu_mem_alloc(p: *mut CuDevicePtr, len: usize) -> CuResult {
    run(|| {
        let Some(d) = current() else { return CUDA_ERROR_INVALID_CONTEXT };
        // Uninitialised device memory is garbage, not zeros.
        match alloc(len, Some(d), 0xCD) {
            Ok(a) => {
                // SAFETY: the caller passes a writable pointer.
                unsafe { *p = a };
                CUDA_SUCCESS
            }
            Err(e) => e,
        }
    })
}

unsafe extern "C" fn emu_mem_free(p: CuDevicePtr) -> CuResult {
    run(|| free(p, true))
}

unsafe extern "C" fn emu_mem_host_alloc(p: *mut *mut c_void, len: usize, _flags: c_uint) -> CuResult {
    run(|| match alloc(len, None, 0) {
        Ok(a) => {
            // SAFETY: the caller passes a writable pointer.
            unsafe { *p = a as *mut c_void };
            CUDA_SUCCESS
        }
        Err(e) => e,
    })
}

unsafe extern "C" fn emu_mem_free_host(p: *mut c_void) -> CuResult {
    run(|| free(p as u64, false))
}

// ------------------------------------------------------------------------------------ streams

enum Job {
    /// `rows` rows of `width` bytes; each side: (address, pitch, is device memory).
    Copy {
        dst: (u64, u64, bool),
        src: (u64, u64, bool),
        width: u64,
        rows: u64,
    },
    HostFn(HostFn, usize),
    Record(Arc<EmuEvent>, u64),
    Wait(Arc<EmuEvent>, u64),
    Marker(mpsc::Sender<()>),
    Stall(Duration),
}

struct EmuStream {
    tx: Mutex<mpsc::Sender<Job>>,
    queued: Arc<AtomicU64>,
    error: Arc<Mutex<Option<CuResult>>>,
}

#[derive(Default)]
struct EmuEvent {
    /// (recorded generation, completed generation)
    gens: Mutex<(u64, u64)>,
    cv: Condvar,
}

fn jitter(seed: &mut u64) {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    if *seed % 4 == 0 {
        std::thread::sleep(Duration::from_micros(*seed % 200));
    }
}

fn worker(rx: mpsc::Receiver<Job>, queued: Arc<AtomicU64>, error: Arc<Mutex<Option<CuResult>>>) {
    static SEED: AtomicU64 = AtomicU64::new(0x9E37_79B9_7F4A_7C15);
    let mut seed = SEED.fetch_add(0x2545_F491_4F6C_DD1D, Ordering::Relaxed) | 1;
    while let Ok(job) = rx.recv() {
        jitter(&mut seed);
        match job {
            Job::Copy { dst, src, width, rows } => {
                let extent = |(_, pitch, _): (u64, u64, bool)| (rows - 1) * pitch + width;
                // Device memory freed since the copy was queued: an error, never a touch.
                let ok = check_side(dst.0, extent(dst), dst.2) && check_side(src.0, extent(src), src.2);
                let failed = error.lock().unwrap_or_else(|p| p.into_inner()).is_some();
                if !ok {
                    error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(CUDA_ERROR_ILLEGAL_ADDRESS);
                } else if !failed {
                    for r in 0..rows {
                        // SAFETY: both ranges were checked just now (device memory live, host memory
                        // as the caller vouched when queueing, as with a real driver); `copy`
                        // tolerates overlap.
                        unsafe {
                            std::ptr::copy(
                                (src.0 + r * src.1) as *const u8,
                                (dst.0 + r * dst.1) as *mut u8,
                                width as usize,
                            )
                        };
                    }
                }
            }
            Job::HostFn(f, user) => {
                // A stream in the error state runs no more work, host functions included (as CUDA).
                if error.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
                    // SAFETY: the host function and its argument as queued by the caller.
                    unsafe { f(user as *mut c_void) };
                }
            }
            Job::Record(ev, generation) => {
                let mut g = ev.gens.lock().unwrap_or_else(|p| p.into_inner());
                g.1 = g.1.max(generation);
                ev.cv.notify_all();
            }
            Job::Wait(ev, generation) => {
                let mut g = ev.gens.lock().unwrap_or_else(|p| p.into_inner());
                while g.1 < generation {
                    g = ev.cv.wait(g).unwrap_or_else(|p| p.into_inner());
                }
            }
            Job::Marker(done) => {
                let _ = done.send(());
            }
            Job::Stall(d) => std::thread::sleep(d),
        }
        queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The stream behind a handle.
///
/// # Safety
/// `s` is a handle `emu_stream_create` made and `emu_stream_destroy` has not freed.
unsafe fn stream_of<'a>(s: CuStream) -> &'a EmuStream {
    // SAFETY: per the function's contract.
    unsafe { &*(s as *const EmuStream) }
}

fn push(s: &EmuStream, job: Job) -> CuResult {
    s.queued.fetch_add(1, Ordering::AcqRel);
    if s.tx.lock().unwrap_or_else(|p| p.into_inner()).send(job).is_err() {
        s.queued.fetch_sub(1, Ordering::AcqRel);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    CUDA_SUCCESS
}

unsafe extern "C" fn emu_stream_create(s: *mut CuStream, _flags: c_uint) -> CuResult {
    run(|| {
        if current().is_none() {
            return CUDA_ERROR_INVALID_CONTEXT;
        }
        let (tx, rx) = mpsc::channel();
        let queued = Arc::new(AtomicU64::new(0));
        let error = Arc::new(Mutex::new(None));
        let (q, e) = (Arc::clone(&queued), Arc::clone(&error));
        if std::thread::Builder::new().name("emu-cuda-stream".into()).spawn(move || worker(rx, q, e)).is_err() {
            return 2;
        }
        let b = Box::new(EmuStream { tx: Mutex::new(tx), queued, error });
        // SAFETY: the caller passes a writable handle.
        unsafe { *s = Box::into_raw(b).cast() };
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_stream_destroy(s: CuStream) -> CuResult {
    // SAFETY: a handle of `emu_stream_create`, destroyed once; the worker drains its queue and ends
    // when the sender goes.
    run(|| {
        drop(unsafe { Box::from_raw(s.cast::<EmuStream>()) });
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_stream_synchronize(s: CuStream) -> CuResult {
    run(|| {
        // SAFETY: a live handle (caller's contract).
        let st = unsafe { stream_of(s) };
        let (tx, rx) = mpsc::channel();
        let r = push(st, Job::Marker(tx));
        if r != CUDA_SUCCESS {
            return r;
        }
        let _ = rx.recv();
        st.error.lock().unwrap_or_else(|p| p.into_inner()).unwrap_or(CUDA_SUCCESS)
    })
}

unsafe extern "C" fn emu_stream_query(s: CuStream) -> CuResult {
    run(|| {
        // SAFETY: a live handle (caller's contract).
        let st = unsafe { stream_of(s) };
        if let Some(e) = *st.error.lock().unwrap_or_else(|p| p.into_inner()) {
            return e;
        }
        if st.queued.load(Ordering::Acquire) == 0 {
            CUDA_SUCCESS
        } else {
            CUDA_ERROR_NOT_READY
        }
    })
}

fn queue_copy(s: CuStream, dst: (u64, u64, bool), src: (u64, u64, bool), width: u64, rows: u64) -> CuResult {
    if current().is_none() {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if width == 0 || rows == 0 {
        return CUDA_SUCCESS;
    }
    if rows > 1 && (dst.1 < width || src.1 < width) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let extent = |pitch: u64| (rows - 1) * pitch + width;
    if !check_side(dst.0, extent(dst.1), dst.2) || !check_side(src.0, extent(src.1), src.2) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: a live handle (caller's contract).
    push(unsafe { stream_of(s) }, Job::Copy { dst, src, width, rows })
}

fn is_device(addr: u64) -> bool {
    let s = state();
    find(&s, addr, 1).is_some_and(|(_, a, _)| a.device.is_some())
}

unsafe extern "C" fn emu_memcpy_async(dst: CuDevicePtr, src: CuDevicePtr, len: usize, s: CuStream) -> CuResult {
    run(|| queue_copy(s, (dst, len as u64, is_device(dst)), (src, len as u64, is_device(src)), len as u64, 1))
}

unsafe extern "C" fn emu_memcpy_2d_async(p: *const Memcpy2D, s: CuStream) -> CuResult {
    run(|| {
        // SAFETY: the caller passes a valid descriptor for the duration of the call.
        let p = unsafe { *p };
        let side = |ty: c_uint, host: u64, dev: u64, pitch: usize, x: usize, y: usize| -> Option<(u64, u64, bool)> {
            let (addr, device) = match ty {
                CU_MEMORYTYPE_HOST => (host, false),
                CU_MEMORYTYPE_DEVICE => (dev, true),
                _ => return None,
            };
            Some((addr + (y * pitch + x) as u64, pitch as u64, device))
        };
        let (Some(src), Some(dst)) = (
            side(p.src_memory_type, p.src_host as u64, p.src_device, p.src_pitch, p.src_x_in_bytes, p.src_y),
            side(p.dst_memory_type, p.dst_host as u64, p.dst_device, p.dst_pitch, p.dst_x_in_bytes, p.dst_y),
        ) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        queue_copy(s, dst, src, p.width_in_bytes as u64, p.height as u64)
    })
}

unsafe extern "C" fn emu_launch_host_func(s: CuStream, f: HostFn, user: *mut c_void) -> CuResult {
    // SAFETY: a live handle (caller's contract).
    run(|| push(unsafe { stream_of(s) }, Job::HostFn(f, user as usize)))
}

unsafe extern "C" fn emu_event_create(e: *mut CuEvent, _flags: c_uint) -> CuResult {
    // SAFETY: the caller passes a writable handle.
    run(|| unsafe {
        *e = Arc::into_raw(Arc::new(EmuEvent::default())) as CuEvent;
        CUDA_SUCCESS
    })
}

/// The event behind a handle, as a new reference.
///
/// # Safety
/// `e` is a handle `emu_event_create` made and `emu_event_destroy` has not released.
unsafe fn event(e: CuEvent) -> Arc<EmuEvent> {
    let p = e as *const EmuEvent;
    // SAFETY: per the contract; the handle's own reference stays with the handle.
    unsafe {
        Arc::increment_strong_count(p);
        Arc::from_raw(p)
    }
}

unsafe extern "C" fn emu_event_record(e: CuEvent, s: CuStream) -> CuResult {
    run(|| {
        // SAFETY: live handles (caller's contract).
        let ev = unsafe { event(e) };
        let generation = {
            let mut g = ev.gens.lock().unwrap_or_else(|p| p.into_inner());
            g.0 += 1;
            g.0
        };
        // SAFETY: as above.
        push(unsafe { stream_of(s) }, Job::Record(ev, generation))
    })
}

unsafe extern "C" fn emu_event_query(e: CuEvent) -> CuResult {
    run(|| {
        // SAFETY: a live handle (caller's contract).
        let ev = unsafe { event(e) };
        let g = ev.gens.lock().unwrap_or_else(|p| p.into_inner());
        if g.1 >= g.0 {
            CUDA_SUCCESS
        } else {
            CUDA_ERROR_NOT_READY
        }
    })
}

unsafe extern "C" fn emu_stream_wait_event(s: CuStream, e: CuEvent, _flags: c_uint) -> CuResult {
    run(|| {
        // SAFETY: live handles (caller's contract).
        let ev = unsafe { event(e) };
        let target = ev.gens.lock().unwrap_or_else(|p| p.into_inner()).0;
        // SAFETY: as above.
        push(unsafe { stream_of(s) }, Job::Wait(ev, target))
    })
}

unsafe extern "C" fn emu_event_destroy(e: CuEvent) -> CuResult {
    // SAFETY: a handle of `emu_event_create`, released once (queued records keep their own reference).
    run(|| {
        drop(unsafe { Arc::from_raw(e as *const EmuEvent) });
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_ipc_get_mem_handle(h: *mut IpcMemHandle, ptr: CuDevicePtr) -> CuResult {
    run(|| {
        let s = state();
        match s.allocs.get(&ptr) {
            Some(a) if a.device.is_some() => {
                let mut b = [0u8; 64];
                b[..8].copy_from_slice(MAGIC);
                b[8..16].copy_from_slice(&ptr.to_le_bytes());
                b[16..24].copy_from_slice(&a.len.to_le_bytes());
                b[24..28].copy_from_slice(&std::process::id().to_le_bytes());
                // SAFETY: the caller passes a writable handle.
                unsafe { (*h).reserved = b };
                CUDA_SUCCESS
            }
            _ => CUDA_ERROR_INVALID_VALUE,
        }
    })
}

unsafe extern "C" fn emu_ipc_open_mem_handle(p: *mut CuDevicePtr, h: IpcMemHandle, _flags: c_uint) -> CuResult {
    run(|| {
        let b = h.reserved;
        if &b[..8] != MAGIC || u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")) != std::process::id() {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        let base = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let mut s = state();
        if !s.allocs.get(&base).is_some_and(|a| a.device.is_some()) {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        if s.opened.contains_key(&base) {
            return CUDA_ERROR_ALREADY_MAPPED;
        }
        s.opened.insert(base, 1);
        // SAFETY: the caller passes a writable pointer.
        unsafe { *p = base };
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_ipc_close_mem_handle(p: CuDevicePtr) -> CuResult {
    run(|| if state().opened.remove(&p).is_some() { CUDA_SUCCESS } else { CUDA_ERROR_INVALID_VALUE })
}

fn name_of(r: CuResult) -> &'static [u8] {
    match r {
        0 => b"CUDA_SUCCESS\0",
        1 => b"CUDA_ERROR_INVALID_VALUE\0",
        2 => b"CUDA_ERROR_OUT_OF_MEMORY\0",
        101 => b"CUDA_ERROR_INVALID_DEVICE\0",
        201 => b"CUDA_ERROR_INVALID_CONTEXT\0",
        208 => b"CUDA_ERROR_ALREADY_MAPPED\0",
        400 => b"CUDA_ERROR_INVALID_HANDLE\0",
        600 => b"CUDA_ERROR_NOT_READY\0",
        700 => b"CUDA_ERROR_ILLEGAL_ADDRESS\0",
        _ => b"CUDA_ERROR_UNKNOWN\0",
    }
}

unsafe extern "C" fn emu_get_error_name(r: CuResult, s: *mut *const c_char) -> CuResult {
    // SAFETY: the caller passes a writable pointer; the string is static.
    run(|| unsafe {
        *s = name_of(r).as_ptr().cast();
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn emu_get_error_string(r: CuResult, s: *mut *const c_char) -> CuResult {
    let text: &'static [u8] = match r {
        700 => b"an illegal memory access was encountered (emulation: device memory outside a live allocation)\0",
        208 => b"resource already mapped (emulation: an IPC handle opened twice in one process)\0",
        _ => b"emulated driver error\0",
    };
    // SAFETY: the caller passes a writable pointer; the string is static.
    run(|| unsafe {
        *s = text.as_ptr().cast();
        CUDA_SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use kvxfer_core::{HostBuffer, MemKind};

    use super::*;
    use crate::{context, CopyPlan, DeviceBuffer, PinnedBuffer, Shape, Stream};

    fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[tokio::test]
    async fn host_to_device_and_back_through_pinned_slots_strided() {
        install();
        let ctx = context(1).unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let dev = DeviceBuffer::new(&ctx, 4096).unwrap().into_desc();
        assert_eq!(dev.kind(), MemKind::Cuda { device: 1 });
        let info = crate::driver().unwrap().pointer_info(dev.addr() as u64).unwrap();
        assert_eq!(info.device, Some(1));
        // Host -> device (contiguous), then device rows (strided) -> a pinned slot, packed.
        let mut host = HostBuffer::from_slice(&(0..4096u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
        let h = host.desc();
        let mut plan = CopyPlan::new();
        plan.copy(
            h.reserve(0, 4096, 1, 4096, false).unwrap(),
            Shape::contiguous(0, 4096),
            dev.reserve(0, 4096, 1, 4096, true).unwrap(),
            Shape::contiguous(0, 4096),
        )
        .unwrap();
        let p = stream.submit(plan).unwrap();
        p.wait(&stream, deadline()).await.unwrap();
        drop(p.finish().unwrap());
        let mut plan = CopyPlan::with_pinned(PinnedBuffer::new(&ctx, 1024).unwrap());
        let rows = dev.reserve(100, 16, 8, 300, false).unwrap();
        // A write through the reserved rows is refused while the copy holds them.
        assert!(dev.reserve(400, 1, 1, 1, true).is_err());
        plan.to_pinned(rows, Shape { offset: 0, len: 16, count: 8, stride: 300 }, 10).unwrap();
        let p = stream.submit(plan).unwrap();
        p.wait(&stream, deadline()).await.unwrap();
        drop(p);
        drop(h);
        let want: Vec<u8> =
            (0..8u32).flat_map(|r| (0..16u32).map(move |i| ((100 + r * 300 + i) % 251) as u8)).collect();
        let mut plan = CopyPlan::with_pinned(PinnedBuffer::new(&ctx, 1024).unwrap());
        plan.to_pinned(
            dev.reserve(100, 16, 8, 300, false).unwrap(),
            Shape { offset: 0, len: 16, count: 8, stride: 300 },
            10,
        )
        .unwrap();
        let p = stream.submit(plan).unwrap();
        p.wait(&stream, deadline()).await.unwrap();
        let pinned = p.finish().unwrap().pinned.unwrap();
        assert_eq!(&pinned.as_slice()[10..10 + 128], &want[..]);
        assert!(dev.reserve(0, 4096, 1, 4096, true).is_ok(), "released with the plan");
    }

    #[test]
    fn plans_refuse_what_would_reach_outside_their_memory() {
        install();
        let ctx = context(0).unwrap();
        let dev = DeviceBuffer::new(&ctx, 256).unwrap().into_desc();
        let mut plan = CopyPlan::with_pinned(PinnedBuffer::new(&ctx, 64).unwrap());
        let r = dev.reserve(0, 128, 1, 128, false).unwrap();
        let e = plan.to_pinned(r, Shape::contiguous(0, 128), 0).unwrap_err();
        assert!(e.to_string().contains("staging buffer"), "{e}");
        let r = dev.reserve(0, 16, 4, 32, false).unwrap();
        assert!(
            plan.to_pinned(r, Shape { offset: 0, len: 16, count: 4, stride: 16 }, 0).is_err(),
            "not the reservation's rows"
        );
        let r = dev.reserve(0, 64, 1, 64, false).unwrap();
        assert!(plan.from_pinned(0, r, Shape::contiguous(0, 64)).unwrap_err().to_string().contains("read reservation"));
        let r = dev.reserve(0, 64, 1, 64, true).unwrap();
        assert!(plan.from_pinned(0, r, Shape::contiguous(32, 64)).is_err(), "past the reservation");
        let mut host = HostBuffer::zeroed(64);
        let d = host.desc_labelled(MemKind::DmaBuf { fd: 3, offset: 0 });
        assert!(plan.to_pinned(d.reserve(0, 8, 1, 8, false).unwrap(), Shape::contiguous(0, 8), 0).is_err());
    }

    #[tokio::test]
    async fn a_copy_into_freed_device_memory_fails_the_stream_instead_of_writing() {
        install();
        let ctx = context(0).unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let d = crate::driver().unwrap();
        let buf = DeviceBuffer::new(&ctx, 64).unwrap();
        let (ptr, mut host) = (buf.ptr(), [7u8; 64]);
        drop(buf);
        ctx.enter().unwrap();
        let p = Memcpy2D {
            src_x_in_bytes: 0,
            src_y: 0,
            src_memory_type: CU_MEMORYTYPE_HOST,
            src_host: host.as_mut_ptr().cast(),
            src_device: 0,
            src_array: std::ptr::null_mut(),
            src_pitch: 16,
            dst_x_in_bytes: 0,
            dst_y: 0,
            dst_memory_type: CU_MEMORYTYPE_DEVICE,
            dst_host: std::ptr::null_mut(),
            dst_device: ptr,
            dst_array: std::ptr::null_mut(),
            dst_pitch: 16,
            width_in_bytes: 16,
            height: 4,
        };
        // SAFETY: the test's own host array; the device address is dead on purpose (the model
        // refuses it instead of writing).
        let r = unsafe { (d.api().memcpy_2d_async)(&p, stream.raw_for_tests()) };
        assert_eq!(r, CUDA_ERROR_INVALID_VALUE);
        stream.synchronize().unwrap();
    }

    #[test]
    fn ipc_handles_open_once_per_process() {
        install();
        let ctx = context(0).unwrap();
        let dev = DeviceBuffer::new(&ctx, 1 << 16).unwrap().into_desc();
        let mut sub = vec![];
        // Two regions in one allocation share a handle; the second import shares the mapping.
        for (off, len) in [(0u64, 4096usize), (8192, 4096)] {
            let p = std::ptr::NonNull::new((dev.addr() as u64 + off) as *mut u8).unwrap();
            // SAFETY: a sub-range of a live allocation, kept alive by `dev` for the test.
            sub.push(unsafe { kvxfer_core::MemDesc::from_raw_parts(p, len, dev.kind()) });
        }
        let a = crate::ipc::export(&sub[0]).unwrap();
        let b = crate::ipc::export(&sub[1]).unwrap();
        assert_eq!((a.handle, a.offset, b.offset, a.alloc_len), (b.handle, 0, 8192, 1 << 16));
        let m1 = crate::ipc::import(&ctx, a.handle, a.alloc_len, std::process::id()).unwrap();
        let m2 = crate::ipc::import(&ctx, b.handle, b.alloc_len, std::process::id()).unwrap();
        assert!(Arc::ptr_eq(&m1, &m2) && m1.is_opened() && m1.len() == 1 << 16);
        drop((m1, m2));
        let m3 = crate::ipc::import(&ctx, a.handle, a.alloc_len, std::process::id()).unwrap();
        drop(m3);
        let mut forged = a.handle;
        forged[30] ^= 1;
        forged[8] ^= 0x10;
        assert!(crate::ipc::import(&ctx, forged, 64, std::process::id()).is_err());
    }
}

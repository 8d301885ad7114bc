//! One kernel launch for many device-to-device copies.
//!
//! A scattered KV request is thousands of small strided copies (a 16-token page of one layer's K
//! heads is one 2-D copy of 16 rows of 256 bytes). Queued one driver call each, they are bound by
//! the call rate (measured on an H200, 2026-12-04: cuda-ipc moved a scattered 512 MiB request at
//! 5.2 GB/s, 0.003x of torch's device-to-device copy). Here the plan's copies become a table of
//! descriptors (source, destination, row bytes, rows, pitches) that one launch of a small copy
//! kernel works through: a block per descriptor, a warp per row, 16 bytes per lane where every
//! address and length is 16-byte aligned (bytes otherwise). The table lives in stream-ordered
//! device memory (`cuMemAllocAsync`, freed with `cuMemFreeAsync` after the launch), filled from
//! host memory with `cuMemcpyHtoDAsync` (the driver stages a pageable source before it returns).
//!
//! The kernel is PTX, compiled by the driver for the device on first use per context (no NVRTC and
//! no CUDA toolkit needed). It is **off unless `KVXFER_CUDA_COPY_KERNEL=1`**: written after the only
//! GPU run of its session, it has not run on a GPU yet (`scripts/gpu-check.sh` runs the cuda-ipc
//! transfers and conformance suite with it on, byte for byte, beside the default path). Where it is
//! off or anything it needs is missing (the emulated driver, an old driver without stream-ordered
//! allocation), plans use one copy call per copy.

use std::ffi::{c_uint, c_void, CString};

use crate::ffi::{CuDevicePtr, CuResult, CuStream};
use crate::CudaError;

/// The environment variable that turns the kernel on (`1`); otherwise every copy is a driver call.
pub const ENV: &str = "KVXFER_CUDA_COPY_KERNEL";

/// `CUmodule`.
type CuModule = *mut c_void;
/// `CUfunction`.
type CuFunction = *mut c_void;

/// The driver entry points the kernel path needs, all optional (resolved where the driver has them).
#[derive(Clone, Copy)]
pub(crate) struct KernelApi {
    pub module_load_data: unsafe extern "C" fn(*mut CuModule, *const c_void) -> CuResult,
    pub module_get_function: unsafe extern "C" fn(*mut CuFunction, CuModule, *const std::ffi::c_char) -> CuResult,
    #[allow(clippy::type_complexity)]
    pub launch_kernel: unsafe extern "C" fn(
        CuFunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CuStream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    pub mem_alloc_async: unsafe extern "C" fn(*mut CuDevicePtr, usize, CuStream) -> CuResult,
    pub mem_free_async: unsafe extern "C" fn(CuDevicePtr, CuStream) -> CuResult,
    pub memcpy_htod_async: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult,
}

impl KernelApi {
    /// Resolves the entry points in `lib`; `None` when one is missing (older drivers).
    pub(crate) fn load(lib: &libloading::Library) -> Option<KernelApi> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the driver API function of this name, whose C signature (cuda.h) is the
                // field's; the library stays loaded for the life of the process.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.ok()?
            };
        }
        Some(KernelApi {
            module_load_data: sym!("cuModuleLoadData"),
            module_get_function: sym!("cuModuleGetFunction"),
            launch_kernel: sym!("cuLaunchKernel"),
            mem_alloc_async: sym!("cuMemAllocAsync"),
            mem_free_async: sym!("cuMemFreeAsync"),
            memcpy_htod_async: sym!("cuMemcpyHtoDAsync_v2"),
        })
    }
}

/// Whether the environment turns the kernel on (`KVXFER_CUDA_COPY_KERNEL=1`).
pub(crate) fn enabled() -> bool {
    std::env::var(ENV).is_ok_and(|v| v.trim() == "1")
}

/// The copy kernel's entry point in a context (a loaded module's function; the module is kept for
/// the life of the process, like the primary context it lives in).
#[derive(Clone, Copy)]
pub(crate) struct CopyKernel(CuFunction);

// SAFETY: a CUfunction handle may be launched from any thread with its context current.
unsafe impl Send for CopyKernel {}
// SAFETY: as above.
unsafe impl Sync for CopyKernel {}

const NAME: &str = "kvxfer_copy";

/// Threads per block: 8 warps, each taking one row of the block's descriptor at a time.
pub(crate) const BLOCK: u32 = 256;
/// Most blocks one launch starts (the kernel strides over the rest of the table).
pub(crate) const MAX_GRID: u32 = 1 << 16;
/// Most rows per descriptor and most bytes a descriptor's rows carry together (work per block).
pub(crate) const ROWS_PER_DESC: u64 = 64;
pub(crate) const BYTES_PER_DESC: u64 = 64 << 10;

/// The kernel: parameters (descriptor table, count). A descriptor is six u64: source, destination,
/// row bytes, rows, source pitch, destination pitch.
const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry kvxfer_copy(
	.param .u64 p_descs,
	.param .u32 p_n
)
{
	.reg .pred 	%p<6>;
	.reg .b16 	%rs<2>;
	.reg .b32 	%r<16>;
	.reg .b64 	%rd<48>;

	ld.param.u64 	%rd1, [p_descs];
	ld.param.u32 	%r1, [p_n];
	cvta.to.global.u64 	%rd1, %rd1;
	mov.u32 	%r2, %ctaid.x;
	mov.u32 	%r3, %nctaid.x;
	mov.u32 	%r4, %tid.x;
	mov.u32 	%r5, %ntid.x;
	shr.u32 	%r6, %r4, 5;
	shr.u32 	%r7, %r5, 5;
	and.b32 	%r8, %r4, 31;
	cvt.u64.u32 	%rd40, %r6;
	cvt.u64.u32 	%rd41, %r7;
	cvt.u64.u32 	%rd42, %r8;
	shl.b64 	%rd43, %rd42, 4;

DESC:
	setp.ge.u32 	%p1, %r2, %r1;
	@%p1 bra 	DONE;
	mul.wide.u32 	%rd2, %r2, 48;
	add.s64 	%rd3, %rd1, %rd2;
	ld.global.u64 	%rd4, [%rd3];
	ld.global.u64 	%rd5, [%rd3+8];
	ld.global.u64 	%rd6, [%rd3+16];
	ld.global.u64 	%rd7, [%rd3+24];
	ld.global.u64 	%rd8, [%rd3+32];
	ld.global.u64 	%rd9, [%rd3+40];
	or.b64 	%rd10, %rd4, %rd5;
	or.b64 	%rd10, %rd10, %rd6;
	or.b64 	%rd10, %rd10, %rd8;
	or.b64 	%rd10, %rd10, %rd9;
	and.b64 	%rd10, %rd10, 15;
	setp.eq.s64 	%p2, %rd10, 0;
	mov.u64 	%rd11, %rd40;

ROW:
	setp.ge.u64 	%p3, %rd11, %rd7;
	@%p3 bra 	NEXT;
	mul.lo.s64 	%rd12, %rd11, %rd8;
	add.s64 	%rd13, %rd4, %rd12;
	mul.lo.s64 	%rd14, %rd11, %rd9;
	add.s64 	%rd15, %rd5, %rd14;
	@!%p2 bra 	BYTES;
	mov.u64 	%rd16, %rd43;

VEC:
	setp.ge.u64 	%p4, %rd16, %rd6;
	@%p4 bra 	ROWDONE;
	add.s64 	%rd17, %rd13, %rd16;
	add.s64 	%rd18, %rd15, %rd16;
	ld.v4.u32 	{%r10, %r11, %r12, %r13}, [%rd17];
	st.v4.u32 	[%rd18], {%r10, %r11, %r12, %r13};
	add.s64 	%rd16, %rd16, 512;
	bra 	VEC;

BYTES:
	mov.u64 	%rd16, %rd42;

BYTE:
	setp.ge.u64 	%p4, %rd16, %rd6;
	@%p4 bra 	ROWDONE;
	add.s64 	%rd17, %rd13, %rd16;
	add.s64 	%rd18, %rd15, %rd16;
	ld.u8 	%rs1, [%rd17];
	st.u8 	[%rd18], %rs1;
	add.s64 	%rd16, %rd16, 32;
	bra 	BYTE;

ROWDONE:
	add.s64 	%rd11, %rd11, %rd41;
	bra 	ROW;

NEXT:
	add.s32 	%r2, %r2, %r3;
	bra 	DESC;

DONE:
	ret;
}
"#;

impl CopyKernel {
    /// Loads the module (the driver compiles the PTX for the current context's device) and finds
    /// the function. The context must be current.
    pub(crate) fn load(k: &KernelApi, driver: &crate::Driver) -> Result<CopyKernel, CudaError> {
        let image = CString::new(PTX).map_err(|_| CudaError::invalid("the copy kernel's PTX holds a NUL"))?;
        let mut module: CuModule = std::ptr::null_mut();
        // SAFETY: FFI reading a NUL-terminated PTX image we own for the duration of the call and
        // writing one handle we own.
        let r = unsafe { (k.module_load_data)(&mut module, image.as_ptr() as *const c_void) };
        driver.check(r, "cuModuleLoadData", || "; the copy kernel".into())?;
        let name = CString::new(NAME).map_err(|_| CudaError::invalid("kernel name"))?;
        let mut f: CuFunction = std::ptr::null_mut();
        // SAFETY: FFI with the module just loaded and a NUL-terminated name; writes one handle.
        let r = unsafe { (k.module_get_function)(&mut f, module, name.as_ptr()) };
        driver.check(r, "cuModuleGetFunction", || format!("; {NAME}"))?;
        Ok(CopyKernel(f))
    }

    pub(crate) fn raw(&self) -> CuFunction {
        self.0
    }
}

/// One descriptor of the table: six u64 (see [`PTX`]).
pub(crate) type Desc = [u64; 6];

/// Cuts one copy (`height` rows of `width` bytes, pitches apart) into descriptors of bounded work.
pub(crate) fn push_descs(out: &mut Vec<Desc>, src: u64, dst: u64, width: u64, height: u64, sp: u64, dp: u64) {
    if width == 0 || height == 0 {
        return;
    }
    if height == 1 || (sp == width && dp == width) {
        // Contiguous: pieces of at most BYTES_PER_DESC.
        let total = width * height;
        let mut off = 0;
        while off < total {
            let n = (total - off).min(BYTES_PER_DESC);
            out.push([src + off, dst + off, n, 1, n, n]);
            off += n;
        }
        return;
    }
    let rows = (BYTES_PER_DESC / width).clamp(1, ROWS_PER_DESC);
    let mut r = 0;
    while r < height {
        let h = (height - r).min(rows);
        out.push([src + r * sp, dst + r * dp, width, h, sp, dp]);
        r += h;
    }
}

/// Grid size for `n` descriptors.
pub(crate) fn grid(n: usize) -> u32 {
    (n.min(MAX_GRID as usize) as u32).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The descriptors cover exactly the copy's bytes, each within the work bound.
    #[test]
    fn descriptors_cover_every_row_once() {
        for (width, height, sp, dp) in
            [(256u64, 16u64, 2048u64, 1024u64), (1 << 20, 1, 1 << 20, 1 << 20), (7, 300, 9, 7)]
        {
            let mut v = Vec::new();
            push_descs(&mut v, 1000, 5_000_000, width, height, sp, dp);
            let mut covered = std::collections::BTreeSet::new();
            for d in &v {
                assert!(d[2] * d[3] <= BYTES_PER_DESC.max(width));
                for row in 0..d[3] {
                    for b in 0..d[2] {
                        assert!(covered.insert((d[0] + row * d[4] + b, d[1] + row * d[5] + b)));
                    }
                }
            }
            let want: std::collections::BTreeSet<(u64, u64)> = (0..height)
                .flat_map(|r| (0..width).map(move |b| (1000 + r * sp + b, 5_000_000 + r * dp + b)))
                .collect();
            assert_eq!(covered, want, "{width} x {height}");
        }
    }
}

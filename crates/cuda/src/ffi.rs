//! The driver API entry points this crate calls, as a table of function pointers: loaded from the
//! driver library with `dlopen`/`dlsym` ([`Api::load`]), or (feature `emulation`) the in-process
//! model's. Types and constants follow `cuda.h` (64-bit Linux); only what is used is declared.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

use libloading::Library;

use crate::CudaError;

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdevice`.
pub type CuDevice = c_int;
/// `CUcontext`.
pub type CuContext = *mut c_void;
/// `CUstream`.
pub type CuStream = *mut c_void;
/// `CUevent`.
pub type CuEvent = *mut c_void;
/// `CUdeviceptr` (64-bit).
pub type CuDevicePtr = c_ulonglong;
/// `CUhostFn`.
pub type HostFn = unsafe extern "C" fn(*mut c_void);

pub const CUDA_SUCCESS: CuResult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
pub const CUDA_ERROR_NOT_READY: CuResult = 600;
pub const CUDA_ERROR_NOT_SUPPORTED: CuResult = 801;
#[cfg_attr(not(feature = "emulation"), allow(dead_code))]
pub const CUDA_ERROR_UNKNOWN: CuResult = 999;

pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;

pub const CU_MEMORYTYPE_HOST: c_uint = 1;
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;

pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
pub const CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: c_int = 10;

pub const CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: c_int = 41;
pub const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: c_int = 116;
pub const CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;

/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
pub const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle {
    pub reserved: [u8; 64],
}

/// `CUuuid`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CuUuid {
    pub bytes: [u8; 16],
}

/// `CUDA_MEMCPY2D` (`srcArray`/`dstArray` unused, null).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Memcpy2D {
    pub src_x_in_bytes: usize,
    pub src_y: usize,
    pub src_memory_type: c_uint,
    pub src_host: *const c_void,
    pub src_device: CuDevicePtr,
    pub src_array: *mut c_void,
    pub src_pitch: usize,
    pub dst_x_in_bytes: usize,
    pub dst_y: usize,
    pub dst_memory_type: c_uint,
    pub dst_host: *mut c_void,
    pub dst_device: CuDevicePtr,
    pub dst_array: *mut c_void,
    pub dst_pitch: usize,
    pub width_in_bytes: usize,
    pub height: usize,
}

/// Declares the table and its loader: `field = "symbol" | "fallback symbol": (argument types);`.
macro_rules! api {
    ($( $(#[$doc:meta])* $field:ident = $sym:literal $(| $alt:literal)* : ($($arg:ty),*); )*) => {
        /// The driver entry points (function pointers into the driver library or the model).
        #[derive(Clone, Copy)]
        pub struct Api {
            $( $(#[$doc])* pub $field: unsafe extern "C" fn($($arg),*) -> CuResult, )*
            /// `cuMemGetHandleForAddressRange` (CUDA 11.7+; `None` on older drivers).
            pub mem_get_handle_for_address_range:
                Option<unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, c_int, c_ulonglong) -> CuResult>,
        }

        impl Api {
            /// Resolves every entry point in `lib` (named `name` in errors).
            pub fn load(lib: &Library, name: &str) -> Result<Api, CudaError> {
                Ok(Api {
                    $( $field: {
                        let names: &[&str] = &[$sym $(, $alt)*];
                        let mut found = None;
                        for n in names {
                            let c = format!("{n}\0");
                            // SAFETY: the symbol is the driver API function of this name, whose C
                            // signature is the one declared for the field (cuda.h); the library
                            // stays loaded for the life of the process (the Driver keeps it).
                            if let Ok(s) = unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> CuResult>(c.as_bytes()) } {
                                found = Some(*s);
                                break;
                            }
                        }
                        found.ok_or_else(|| CudaError::Symbol { library: name.to_owned(), symbol: $sym })?
                    }, )*
                    mem_get_handle_for_address_range: {
                        // SAFETY: as above; optional (absent before CUDA 11.7).
                        unsafe { lib.get::<unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, c_int, c_ulonglong) -> CuResult>(b"cuMemGetHandleForAddressRange\0") }
                            .ok()
                            .map(|s| *s)
                    },
                })
            }
        }
    };
}

api! {
    init = "cuInit": (c_uint);
    driver_get_version = "cuDriverGetVersion": (*mut c_int);
    device_get_count = "cuDeviceGetCount": (*mut c_int);
    device_get = "cuDeviceGet": (*mut CuDevice, c_int);
    device_get_name = "cuDeviceGetName": (*mut c_char, c_int, CuDevice);
    device_get_uuid = "cuDeviceGetUuid_v2" | "cuDeviceGetUuid": (*mut CuUuid, CuDevice);
    device_get_attribute = "cuDeviceGetAttribute": (*mut c_int, c_int, CuDevice);
    device_get_pci_bus_id = "cuDeviceGetPCIBusId": (*mut c_char, c_int, CuDevice);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain": (*mut CuContext, CuDevice);
    primary_ctx_release = "cuDevicePrimaryCtxRelease_v2" | "cuDevicePrimaryCtxRelease": (CuDevice);
    ctx_set_current = "cuCtxSetCurrent": (CuContext);
    pointer_get_attribute = "cuPointerGetAttribute": (*mut c_void, c_int, CuDevicePtr);
    mem_get_address_range = "cuMemGetAddressRange_v2": (*mut CuDevicePtr, *mut usize, CuDevicePtr);
    mem_alloc = "cuMemAlloc_v2": (*mut CuDevicePtr, usize);
    mem_free = "cuMemFree_v2": (CuDevicePtr);
    mem_host_alloc = "cuMemHostAlloc": (*mut *mut c_void, usize, c_uint);
    mem_free_host = "cuMemFreeHost": (*mut c_void);
    memcpy_async = "cuMemcpyAsync": (CuDevicePtr, CuDevicePtr, usize, CuStream);
    memcpy_2d_async = "cuMemcpy2DAsync_v2": (*const Memcpy2D, CuStream);
    stream_create = "cuStreamCreate": (*mut CuStream, c_uint);
    stream_destroy = "cuStreamDestroy_v2": (CuStream);
    stream_synchronize = "cuStreamSynchronize": (CuStream);
    stream_query = "cuStreamQuery": (CuStream);
    stream_wait_event = "cuStreamWaitEvent": (CuStream, CuEvent, c_uint);
    launch_host_func = "cuLaunchHostFunc": (CuStream, HostFn, *mut c_void);
    event_create = "cuEventCreate": (*mut CuEvent, c_uint);
    event_record = "cuEventRecord": (CuEvent, CuStream);
    event_query = "cuEventQuery": (CuEvent);
    event_destroy = "cuEventDestroy_v2": (CuEvent);
    ipc_get_mem_handle = "cuIpcGetMemHandle": (*mut IpcMemHandle, CuDevicePtr);
    ipc_open_mem_handle = "cuIpcOpenMemHandle_v2" | "cuIpcOpenMemHandle": (*mut CuDevicePtr, IpcMemHandle, c_uint);
    ipc_close_mem_handle = "cuIpcCloseMemHandle": (CuDevicePtr);
    get_error_name = "cuGetErrorName": (CuResult, *mut *const c_char);
    get_error_string = "cuGetErrorString": (CuResult, *mut *const c_char);
}

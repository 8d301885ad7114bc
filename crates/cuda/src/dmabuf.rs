//! GPU memory as a dma-buf (`cuMemGetHandleForAddressRange`): what an RDMA NIC registers for
//! GPUDirect RDMA without `nvidia-peermem` (`ibv_reg_dmabuf_mr`).

use std::ffi::{c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};

use kvxfer_core::{MemDesc, MemKind};

use crate::ffi::{CUDA_ERROR_NOT_SUPPORTED, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD};
use crate::{context, CudaError};

/// Host page size the range must be aligned to.
const PAGE: u64 = 4096;

/// A dma-buf file descriptor for the device memory `desc` describes, and the offset of `desc`'s
/// first byte in it (the exported range is widened to whole host pages). Refused, naming why, for
/// other kinds, for drivers older than CUDA 11.7, and for devices or kernels without dma-buf
/// support (then `nvidia-peermem` and a plain registration of the device address are the way).
pub fn export(desc: &MemDesc) -> Result<(OwnedFd, u64), CudaError> {
    let MemKind::Cuda { device } = desc.kind() else {
        return Err(CudaError::invalid(format!("{} is not CUDA memory", desc.kind())));
    };
    let ctx = context(device)?;
    let d = ctx.enter()?;
    let f = d.api().mem_get_handle_for_address_range.ok_or_else(|| {
        CudaError::invalid(format!(
            "the CUDA driver ({}, CUDA {}) has no cuMemGetHandleForAddressRange: dma-buf export needs a CUDA 11.7 or newer driver",
            d.library(),
            d.version_string()
        ))
    })?;
    let addr = desc.addr() as u64;
    let start = addr & !(PAGE - 1);
    let end = (addr + desc.len() as u64).div_ceil(PAGE) * PAGE;
    let mut fd: c_int = -1;
    // SAFETY: FFI writing one int we own; the range is looked up by the driver, not dereferenced.
    let r = unsafe {
        f(
            (&mut fd as *mut c_int).cast::<c_void>(),
            start,
            (end - start) as usize,
            CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    if r == CUDA_ERROR_NOT_SUPPORTED {
        return Err(d.error(
            r,
            "cuMemGetHandleForAddressRange",
            format!("; device {device} or this kernel does not export dma-bufs (open GPU kernel modules and Linux 5.12+ needed)"),
        ));
    }
    d.check(r, "cuMemGetHandleForAddressRange", || format!("; {start:#x}..{end:#x} on device {device}"))?;
    if fd < 0 {
        return Err(CudaError::invalid("cuMemGetHandleForAddressRange returned no file descriptor"));
    }
    // SAFETY: a fresh file descriptor the driver just opened for us; we own it from here.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, addr - start))
}

/// What this host offers for GPUDirect RDMA with CUDA device `device`, in one sentence for an error
/// or a capability listing: whether the driver loads, whether the device exports dma-bufs
/// (`ibv_reg_dmabuf_mr`, `FI_HMEM` over dma-buf) and whether `nvidia-peermem` is loaded (plain
/// registration of device addresses).
pub fn gpudirect_status(device: u32) -> String {
    let peermem = std::path::Path::new("/sys/module/nvidia_peermem").exists();
    let peermem = if peermem { "nvidia-peermem is loaded" } else { "nvidia-peermem is not loaded" };
    match crate::driver().and_then(|d| d.device_info(device)) {
        Err(e) => format!("{e}; {peermem}"),
        Ok(i) => format!(
            "device {device} ({}) {} dma-buf export and {} GPUDirect RDMA; {peermem}",
            i.name,
            if i.dma_buf { "supports" } else { "does not support" },
            if i.gpudirect_rdma { "supports" } else { "does not report" },
        ),
    }
}

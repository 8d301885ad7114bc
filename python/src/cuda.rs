//! GPU memory from Python: KV buffers given as torch tensors (on `cuda:N` or on the host) or as any
//! object with `__cuda_array_interface__`, the memory kinds engines name (`"cuda"`, `"cuda:1"`,
//! NIXL's `"VRAM"`/`"DRAM"`, `"auto"`), the device read from the pointer itself (the driver is loaded
//! at run time: without one, CUDA memory is an error naming the library), and, when a backend
//! refuses the kind at start, the backends compiled in that take it.

use kvxfer::MemKind;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::err;

/// What a registration keeps alive until the agent closed: a buffer export, or the object itself
/// (a tensor: it is not resized in place, and keeping it keeps its storage allocated).
pub(crate) enum Kept {
    Buffer(PyUntypedBuffer),
    Object(Py<PyAny>),
}

impl Kept {
    /// Lets go (with the GIL).
    pub(crate) fn release(self, py: Python<'_>) {
        match self {
            Kept::Buffer(b) => b.release(py),
            Kept::Object(o) => drop(o.into_bound(py)),
        }
    }
}

/// The CUDA device whose memory `addr` is, from the driver.
pub(crate) fn device_of(addr: usize) -> PyResult<u32> {
    let d = kvxfer_cuda::driver().map_err(err)?;
    match d.pointer_info(addr as u64).map_err(err)?.device {
        Some(dev) => Ok(dev),
        None => Err(err(format!(
            "{addr:#x} is not CUDA device memory (the driver knows it as host memory): register it with kind=\"host\""
        ))),
    }
}

/// A KV buffer's (kept object, address, length, memory kind): a torch tensor (`data_ptr()`, CUDA
/// when `is_cuda`), an object with `__cuda_array_interface__` (CUDA), or a buffer-protocol object
/// (host, as before). C-contiguous only; `writable` refuses read-only memory.
pub(crate) fn export_any(obj: &Bound<'_, PyAny>, i: usize, writable: bool) -> PyResult<(Kept, usize, usize, MemKind)> {
    if obj.hasattr("data_ptr")? && obj.hasattr("is_cuda")? && obj.hasattr("element_size")? {
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(PyValueError::new_err(format!("buffer {i}: tensor is not contiguous")));
        }
        let addr: usize = obj.call_method0("data_ptr")?.extract()?;
        let len =
            obj.call_method0("numel")?.extract::<usize>()? * obj.call_method0("element_size")?.extract::<usize>()?;
        let kind = if obj.getattr("is_cuda")?.extract::<bool>()? {
            MemKind::Cuda { device: device_of(addr)? }
        } else {
            MemKind::Host
        };
        return Ok((Kept::Object(obj.clone().unbind()), addr, len, kind));
    }
    if let Ok(cai) = obj.getattr("__cuda_array_interface__") {
        let d = cai
            .cast::<PyDict>()
            .map_err(|_| PyValueError::new_err(format!("buffer {i}: bad __cuda_array_interface__")))?;
        let get = |k: &str| {
            d.get_item(k)?
                .ok_or_else(|| PyValueError::new_err(format!("buffer {i}: __cuda_array_interface__ has no {k:?}")))
        };
        let (addr, readonly): (usize, bool) = get("data")?.extract()?;
        let shape: Vec<usize> = get("shape")?.extract()?;
        let typestr: String = get("typestr")?.extract()?;
        let item: usize = typestr
            .get(2..)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| PyValueError::new_err(format!("buffer {i}: typestr {typestr:?} names no item size")))?;
        let strides: Option<Vec<isize>> = d.get_item("strides")?.and_then(|s| s.extract().ok());
        if let Some(st) = strides {
            let mut want = item as isize;
            for (dim, s) in shape.iter().zip(&st).rev() {
                if *dim > 1 && *s != want {
                    return Err(PyValueError::new_err(format!("buffer {i}: not C-contiguous (strides {st:?})")));
                }
                want *= *dim as isize;
            }
        }
        if writable && readonly {
            return Err(PyValueError::new_err(format!("buffer {i}: read-only (this rank writes into it)")));
        }
        let len = shape.iter().product::<usize>() * item;
        return Ok((Kept::Object(obj.clone().unbind()), addr, len, MemKind::Cuda { device: device_of(addr)? }));
    }
    let (b, addr, len) = crate::export(obj, i, writable)?;
    Ok((Kept::Buffer(b), addr, len, MemKind::Host))
}

/// A memory kind as engines name it: `"host"`/`"cpu"`/`"DRAM"`, `"cuda"`/`"gpu"`/`"VRAM"` (device
/// `device`, else the device of `first`), `"cuda:N"`, or `"auto"` (CUDA if the driver knows `first`
/// as device memory, else host).
pub(crate) fn mem_kind(kind: &str, device: Option<u32>, first: Option<usize>) -> PyResult<MemKind> {
    let from_pointer = || -> PyResult<u32> {
        match (device, first) {
            (Some(d), _) => Ok(d),
            (None, Some(a)) => device_of(a),
            (None, None) => Ok(0),
        }
    };
    match kind.to_ascii_lowercase().as_str() {
        "host" | "cpu" | "dram" | "cpu_pinned" => Ok(MemKind::Host),
        "cuda" | "gpu" | "vram" => Ok(MemKind::Cuda { device: from_pointer()? }),
        "auto" => Ok(match first.map(|a| kvxfer_cuda::driver().ok().and_then(|d| d.pointer_info(a as u64).ok())) {
            Some(Some(kvxfer_cuda::PointerInfo { device: Some(d), .. })) => MemKind::Cuda { device: d },
            _ => MemKind::Host,
        }),
        k => match k.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(d) => Ok(MemKind::Cuda { device: d }),
            None => Err(PyValueError::new_err(format!(
                "memory kind must be \"host\", \"cuda\", \"cuda:N\", \"VRAM\", \"DRAM\" or \"auto\", not {kind:?}"
            ))),
        },
    }
}

/// The backends compiled into this build that take memory of `kind` (cuda-ipc and the C-library
/// backends with what they need), for an error that says what to use instead.
pub(crate) fn capable_backends(kind: MemKind) -> String {
    let linked: Vec<&str> = kvxfer::backends::linked().into_iter().map(|(n, _)| n).collect();
    let cuda = matches!(kind, MemKind::Cuda { .. });
    let names: Vec<String> = linked
        .iter()
        .filter_map(|n| match (*n, cuda) {
            ("cuda-ipc", true) => Some("cuda-ipc (peers on the same node)".to_owned()),
            ("cuda-ipc", false) => None,
            ("tcp" | "local", _) => Some((*n).to_owned()),
            ("ucx", true) => Some("ucx (with a UCX built with CUDA: its capabilities say)".to_owned()),
            ("fabric", true) => Some("fabric (with a provider that supports FI_HMEM_CUDA)".to_owned()),
            ("verbs", true) => Some("verbs (with dma-buf or nvidia-peermem)".to_owned()),
            (n, _) => Some(n.to_owned()),
        })
        .collect();
    format!(
        "backends compiled in that take {kind}: {}",
        if names.is_empty() { "none".into() } else { names.join(", ") }
    )
}

//! GPU-ordered sends: a send whose source bytes are produced by GPU work the engine queued but did
//! not wait for (vLLM's `save_kv_layer` returns before the layer's KV is written; the layer's CUDA
//! event marks it). With a [`GpuOrder`] the backend reads no byte before that work completed, and
//! nobody blocks the host for it: a backend with a CUDA stream of its own makes the stream wait for
//! the event (`cuStreamWaitEvent`); a backend that reads host memory waits for the event on the host
//! before reading.
//!
//! The order is captured when the send is called: a backend records the wait on the event's most
//! recent record (or records an event of its own on the given stream) before `post_ordered`
//! returns, so the engine may record the event again, or destroy it, right after.

/// A CUDA handle of this process: a `CUevent`/`cudaEvent_t` or a `CUstream`/`cudaStream_t` (the
/// runtime's and the driver's handles are the same pointers), and the device of its context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CudaHandle {
    raw: u64,
    device: u32,
}

impl CudaHandle {
    /// A handle from its raw value (`torch.cuda.Event.cuda_event`, `torch.cuda.Stream.cuda_stream`).
    ///
    /// # Safety
    /// `raw` is a live `CUevent` or `CUstream` (as the [`GpuOrder`] variant that carries it says) of
    /// a context of CUDA device `device` in this process, and stays live until the call that
    /// receives it returned. (A forged value makes the driver dereference an arbitrary pointer.)
    #[allow(unsafe_code)] // the one constructor of a raw CUDA handle; its contract is above
    pub unsafe fn from_raw(raw: u64, device: u32) -> Self {
        Self { raw, device }
    }

    /// The raw handle.
    pub fn raw(&self) -> u64 {
        self.raw
    }

    /// The CUDA device of the handle's context.
    pub fn device(&self) -> u32 {
        self.device
    }
}

/// What a send waits for on the GPU before it reads its source bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuOrder {
    /// Nothing: the bytes are in place when the send is called (the engine synchronized).
    #[default]
    Ready,
    /// The work recorded in this `CUevent` (its most recent record at the time of the call).
    AfterEvent(CudaHandle),
    /// The work queued on this `CUstream` so far (an event is recorded on it during the call).
    AfterStream(CudaHandle),
}

impl GpuOrder {
    /// Whether the send waits for anything.
    pub fn is_ready(&self) -> bool {
        matches!(self, GpuOrder::Ready)
    }
}

//! GPU-ordered sends ([`kvxfer_core::order`]): the order a send carries becomes an event of ours,
//! captured during the call, that the backend's copy stream waits for ([`Stream::wait_event`]) or,
//! for host memory, the host ([`Event::wait_host`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvxfer_core::GpuOrder;

use crate::stream::{raw_stream, Event};
use crate::{context, CudaError, Stream};

/// A stream per device that only forwards engine events to ours.
fn helper(device: u32) -> Result<Arc<Stream>, CudaError> {
    static S: OnceLock<Mutex<HashMap<u32, Arc<Stream>>>> = OnceLock::new();
    let mut m = S.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = m.get(&device) {
        return Ok(Arc::clone(s));
    }
    let s = Arc::new(Stream::new(&context(device)?)?);
    m.insert(device, Arc::clone(&s));
    Ok(s)
}

/// [`gate`] for a host backend's send (tcp, local): a CUDA failure becomes
/// [`kvxfer_core::BackendError::Io`] of `backend`, naming the send's GPU order.
pub fn send_gate(backend: &'static str, order: GpuOrder) -> Result<Option<Arc<Event>>, kvxfer_core::BackendError> {
    gate(order).map_err(|e| kvxfer_core::BackendError::Io {
        backend,
        context: "the send's GPU order".into(),
        detail: e.to_string(),
    })
}

/// The event a send waits for: `None` for [`GpuOrder::Ready`]; else an event of ours that completes
/// when the work `order` names completed, recorded now (so the engine may reuse its event or stream
/// at once).
pub fn gate(order: GpuOrder) -> Result<Option<Arc<Event>>, CudaError> {
    match order {
        GpuOrder::Ready => Ok(None),
        GpuOrder::AfterEvent(h) => {
            let ctx = context(h.device())?;
            let s = helper(h.device())?;
            let d = ctx.enter()?;
            // SAFETY: FFI with our stream and the engine's event, live during this call by the
            // contract of `CudaHandle::from_raw`; the wait is captured by the call.
            let r = unsafe { (d.api().stream_wait_event)(raw_stream(&s), h.raw() as crate::ffi::CuEvent, 0) };
            d.check(r, "cuStreamWaitEvent", || {
                format!("; the send's CUDA event {:#x} on device {}", h.raw(), h.device())
            })?;
            let ev = Event::new(&ctx)?;
            ev.record(&s)?;
            Ok(Some(Arc::new(ev)))
        }
        GpuOrder::AfterStream(h) => {
            let ctx = context(h.device())?;
            let ev = Event::new(&ctx)?;
            ev.record_raw(h.raw())?;
            Ok(Some(Arc::new(ev)))
        }
    }
}

impl Event {
    /// Waits on the host until the event completed, or `deadline` ([`CudaError::Timeout`]):
    /// checks every 100 us (a send from host memory that the engine fills with its own copy).
    pub async fn wait_host(&self, deadline: Instant) -> Result<(), CudaError> {
        loop {
            if self.is_done()? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(CudaError::Timeout { what: "the send's CUDA event".into(), after: Duration::ZERO });
            }
            if tokio::runtime::Handle::try_current().is_ok() {
                tokio::time::sleep(Duration::from_micros(100)).await;
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

//! `kvxfer._native`: the engine API of kvxfer (`kvxfer::engine`) for Python.
//!
//! The pure-Python package `kvxfer` re-exports these classes; the adapters for SGLang and vLLM are
//! built on them. What this layer adds to the Rust API, and nothing else:
//!
//! - an agent owns a small tokio runtime (2 worker threads) on which its progress, connections and
//!   transfers run, so nothing needs the Python thread between calls;
//! - memory: SGLang's `KVArgs` order (every layer's K buffer, then every layer's V buffer; MLA: one
//!   buffer per layer) mapped onto `BufferRef { layer, kind }`, from raw addresses or from any
//!   buffer-protocol object (kept alive while registered);
//! - aux rows (SGLang's metadata buffers): the prefill reads its row (`aux_index * item_len` of each aux
//!   buffer) and sends it as the request's aux payload after the last chunk; the decode copies the
//!   payload into its row before it reports `Success`;
//! - `KVPoll` integers, `failure_exception()`, and a `clear()` that never frees a request whose pages
//!   may still be written (it aborts and releases once the fence closed).
//!
//! Every call that can block releases the GIL; every call returns a Python exception for a Rust
//! error (its message is the Rust error) and for a Rust panic (caught before it reaches Python).

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::bootstrap::BootstrapServer as RsBootstrap;
use kvxfer::engine::{
    Agent as RsAgent, AgentConfig, KvMemory, Phase, Receiver as RsReceiver, RequestStatus, Sender as RsSender,
};
use kvxfer::metadata::MetadataAddr;
use kvxfer::{
    Attention, BufferRef, KvKind, KvSpec, Layout, MemDesc, MemKind, NotifyStyle, Parallel, RankId, RequestId, Side,
    SideSpec, Topology as RsTopology,
};
use pyo3::buffer::{PyBuffer, PyUntypedBuffer};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

mod cuda;

create_exception!(
    _native,
    KvxferError,
    PyRuntimeError,
    "A kvxfer failure: the message is the Rust error (it names the rank, the peer and the request)."
);

create_exception!(
    _native,
    StoreUnreachable,
    KvxferError,
    "`Agent.start()` could not reach the metadata store (the bootstrap service or etcd): the one start \
     failure that a retry can fix, once the store is up. Every other start failure is a plain \
     `KvxferError`, which retrying does not fix."
);

/// `KVPoll` values (SGLang's `disaggregation/base/conn.py`).
mod kvpoll {
    pub const FAILED: i32 = 0;
    pub const BOOTSTRAPPING: i32 = 1;
    pub const WAITING_FOR_INPUT: i32 = 2;
    pub const TRANSFERRING: i32 = 3;
    pub const SUCCESS: i32 = 4;
}

/// `Phase` -> `KVPoll`. `Aborting` reports `Transferring`: the request failed, but a sender may still
/// write into its pages, and an engine frees a request's pages when it sees `Failed`. It turns
/// `Failed` once the fence closed (`pages_reusable`), so `Failed` always means "pages free".
fn kvpoll_of(phase: Phase) -> i32 {
    match phase {
        Phase::Bootstrapping => kvpoll::BOOTSTRAPPING,
        Phase::WaitingForInput => kvpoll::WAITING_FOR_INPUT,
        Phase::Transferring | Phase::Aborting => kvpoll::TRANSFERRING,
        Phase::Success => kvpoll::SUCCESS,
        Phase::Failed => kvpoll::FAILED,
    }
}

fn phase_name(phase: Phase) -> &'static str {
    match phase {
        Phase::Bootstrapping => "bootstrapping",
        Phase::WaitingForInput => "waiting_for_input",
        Phase::Transferring => "transferring",
        Phase::Success => "success",
        Phase::Aborting => "aborting",
        Phase::Failed => "failed",
    }
}

fn err(e: impl std::fmt::Display) -> PyErr {
    KvxferError::new_err(e.to_string())
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}

/// Runs `f`, turning a Rust panic into a `KvxferError` so that no panic unwinds into Python.
fn guarded<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(KvxferError::new_err(format!(
            "kvxfer internal error in {what}: {} (a Rust panic, caught; please report it)",
            panic_message(&*p)
        ))),
    }
}

fn runtime(threads: usize, name: &str) -> PyResult<Arc<tokio::runtime::Runtime>> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .map(Arc::new)
        .map_err(|e| err(format!("cannot start the kvxfer runtime: {e}")))
}

fn parse_side(s: &str) -> PyResult<Side> {
    match s {
        "prefill" => Ok(Side::Prefill),
        "decode" => Ok(Side::Decode),
        _ => Err(PyValueError::new_err(format!("role/side must be \"prefill\" or \"decode\", not {s:?}"))),
    }
}

fn secs(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| PyValueError::new_err(format!("{what} must be >= 0 seconds, not {s}")))
}

/// Page indices from an int32/int64/uint32/uint64 buffer (a numpy array) or any sequence of ints.
fn pages_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    fn conv<T: Copy + TryInto<u32> + std::fmt::Display>(v: Vec<T>) -> PyResult<Vec<u32>> {
        v.into_iter()
            .map(|x| x.try_into().map_err(|_| PyValueError::new_err(format!("page index {x} is not in [0, 2^32)"))))
            .collect()
    }
    if let Ok(b) = PyBuffer::<i32>::get(obj) {
        return conv(b.to_vec(py)?);
    }
    if let Ok(b) = PyBuffer::<i64>::get(obj) {
        return conv(b.to_vec(py)?);
    }
    if let Ok(b) = PyBuffer::<u32>::get(obj) {
        return b.to_vec(py);
    }
    if let Ok(b) = PyBuffer::<u64>::get(obj) {
        return conv(b.to_vec(py)?);
    }
    let v: Vec<i64> = obj.extract().map_err(|_| {
        PyValueError::new_err("page indices must be an int32/int64 array (buffer protocol) or a sequence of ints")
    })?;
    conv(v)
}

/// Describes raw memory the engine owns. The one place this crate uses `unsafe`.
///
/// The caller (the Python engine) promises what `MemDesc::from_raw_parts` needs, for as long as the
/// agent is open: every `(address, length)` is memory of `kind` that stays allocated and mapped until
/// `Agent.close()` returned (or, without `close()`, until the agent was garbage-collected: its runtime
/// is shut down before it lets go of any buffer it keeps alive); destination pages of a pending
/// request are not touched by the engine until `poll()` says `Success` or `Failed`, and source pages
/// of a sender are not written until its `poll()` is `Success` or `Failed`. `register_kv_buffers` and
/// `register_aux_buffers` keep the exporting Python objects alive (a buffer export also stops them
/// from being resized) for exactly that long.
fn describe(raw: &[(usize, usize)], kind: MemKind) -> PyResult<Vec<MemDesc>> {
    let mut ptrs = Vec::with_capacity(raw.len());
    for (i, &(addr, len)) in raw.iter().enumerate() {
        let p =
            NonNull::new(addr as *mut u8).ok_or_else(|| PyValueError::new_err(format!("buffer {i}: null address")))?;
        if len == 0 {
            return Err(PyValueError::new_err(format!("buffer {i}: length 0")));
        }
        ptrs.push((p, len));
    }
    #[allow(unsafe_code)]
    // SAFETY: the engine's lifetime contract above: each range is valid `kind` memory that the engine
    // keeps allocated (or that this agent keeps alive through a buffer export) until the agent closed
    // and its runtime, the only place its backend runs, is shut down; the engine does not touch pages
    // of a pending request (the KVPoll contract); no other descriptor of the same memory is used.
    let descs = unsafe { ptrs.into_iter().map(|(p, len)| MemDesc::from_raw_parts(p, len, kind)).collect() };
    Ok(descs)
}

/// A buffer-protocol object's (address, length), C-contiguous only.
fn export(obj: &Bound<'_, PyAny>, i: usize, writable: bool) -> PyResult<(PyUntypedBuffer, usize, usize)> {
    let b = PyUntypedBuffer::get(obj)
        .map_err(|e| PyValueError::new_err(format!("buffer {i}: not a buffer-protocol object ({e})")))?;
    if !b.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("buffer {i}: not C-contiguous")));
    }
    if writable && b.readonly() {
        return Err(PyValueError::new_err(format!("buffer {i}: read-only (this rank writes into it)")));
    }
    let (addr, len) = (b.buf_ptr() as usize, b.len_bytes());
    Ok((b, addr, len))
}

// ------------------------------------------------------------------------------------------ Topology

/// Both sides' KV layout and parallelism (SEMANTICS §1-§4), validated.
#[pyclass(module = "kvxfer._native", name = "Topology", frozen)]
struct Topology {
    topo: RsTopology,
}

fn kind_name(k: KvKind) -> &'static str {
    match k {
        KvKind::K => "k",
        KvKind::V => "v",
        KvKind::Latent => "latent",
    }
}

fn parse_kind(s: &str) -> PyResult<KvKind> {
    match s {
        "k" => Ok(KvKind::K),
        "v" => Ok(KvKind::V),
        "latent" => Ok(KvKind::Latent),
        _ => Err(PyValueError::new_err(format!("kind must be \"k\", \"v\" or \"latent\", not {s:?}"))),
    }
}

#[pymethods]
impl Topology {
    #[new]
    #[pyo3(signature = (kv_heads=0, head_dim=0, layers=0, page_size=0, dtype_bytes=0, prefill_tp=1, decode_tp=1,
                        v_head_dim=None, prefill_pp=1, decode_pp=1, mla_latent_dim=None, layout="nhd",
                        prefill_layers=None, decode_layers=None))]
    fn new(
        kv_heads: u32,
        head_dim: u32,
        layers: u32,
        page_size: u32,
        dtype_bytes: u32,
        prefill_tp: u32,
        decode_tp: u32,
        v_head_dim: Option<u32>,
        prefill_pp: u32,
        decode_pp: u32,
        mla_latent_dim: Option<u32>,
        layout: &str,
        prefill_layers: Option<Vec<u32>>,
        decode_layers: Option<Vec<u32>>,
    ) -> PyResult<Self> {
        guarded("Topology()", || {
            let layout = match layout {
                "nhd" => Layout::Nhd,
                "hnd" => Layout::Hnd,
                _ => return Err(PyValueError::new_err(format!("layout must be \"nhd\" or \"hnd\", not {layout:?}"))),
            };
            let attention = match mla_latent_dim {
                Some(latent_dim) => Attention::Mla { latent_dim },
                None => Attention::Gqa { kv_heads, head_dim_k: head_dim, head_dim_v: v_head_dim.unwrap_or(head_dim) },
            };
            let kv = KvSpec { attention, layers, dtype_bytes, page_size, layout };
            let par = |tp: u32, pp: u32, stages: Option<Vec<u32>>| -> PyResult<Parallel> {
                match stages {
                    None => Ok(Parallel::new(tp, pp)),
                    Some(s) => {
                        if s.len() as u32 != pp {
                            return Err(err(format!("{} stage layer counts given for PP {pp}", s.len())));
                        }
                        Parallel::with_stage_layers(tp, &s).map_err(err)
                    }
                }
            };
            let p = SideSpec { kv, parallel: par(prefill_tp, prefill_pp, prefill_layers)? };
            let d = SideSpec { kv, parallel: par(decode_tp, decode_pp, decode_layers)? };
            let topo = RsTopology::new(&p, &d).map_err(err)?;
            Ok(Self { topo })
        })
    }

    /// Total KV heads H (1 for MLA).
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.topo.kv().kv_heads()
    }
    /// Elements of one K head (the latent for MLA).
    #[getter]
    fn head_dim(&self) -> u32 {
        (self.topo.kv().head_bytes(if self.is_mla() { KvKind::Latent } else { KvKind::K })
            / u64::from(self.topo.kv().dtype_bytes)) as u32
    }
    /// Elements of one V head (0 for MLA).
    #[getter]
    fn v_head_dim(&self) -> u32 {
        (self.topo.kv().head_bytes(KvKind::V) / u64::from(self.topo.kv().dtype_bytes)) as u32
    }
    /// Model layers.
    #[getter]
    fn layers(&self) -> u32 {
        self.topo.kv().layers
    }
    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.topo.kv().page_size
    }
    /// Bytes per element.
    #[getter]
    fn dtype_bytes(&self) -> u32 {
        self.topo.kv().dtype_bytes
    }
    /// `"nhd"` or `"hnd"`.
    #[getter]
    fn layout(&self) -> &'static str {
        match self.topo.kv().layout {
            Layout::Nhd => "nhd",
            Layout::Hnd => "hnd",
        }
    }
    /// Whether this is MLA.
    #[getter]
    fn is_mla(&self) -> bool {
        self.topo.kv().is_mla()
    }
    /// Prefill TP size.
    #[getter]
    fn prefill_tp(&self) -> u32 {
        self.topo.parallel(Side::Prefill).tp
    }
    /// Decode TP size.
    #[getter]
    fn decode_tp(&self) -> u32 {
        self.topo.parallel(Side::Decode).tp
    }
    /// Prefill PP size.
    #[getter]
    fn prefill_pp(&self) -> u32 {
        self.topo.parallel(Side::Prefill).pp
    }
    /// Decode PP size.
    #[getter]
    fn decode_pp(&self) -> u32 {
        self.topo.parallel(Side::Decode).pp
    }

    /// The buffer kinds of a layer, in SGLang's order: `["k", "v"]` or `["latent"]`.
    fn kinds(&self) -> Vec<&'static str> {
        self.topo.kv().kinds().iter().map(|k| kind_name(*k)).collect()
    }

    /// Heads one rank of `side` holds (1 for MLA).
    fn local_heads(&self, side: &str) -> PyResult<u32> {
        Ok(self.topo.local_heads(parse_side(side)?))
    }

    /// Layers stage `pp_rank` of `side` holds.
    #[pyo3(signature = (side, pp_rank=0))]
    fn stage_layers(&self, side: &str, pp_rank: u32) -> PyResult<u32> {
        Ok(self.topo.stage_layers(parse_side(side)?, pp_rank))
    }

    /// The first (global) layer of stage `pp_rank` of `side`.
    #[pyo3(signature = (side, pp_rank=0))]
    fn first_layer(&self, side: &str, pp_rank: u32) -> PyResult<u32> {
        Ok(self.topo.first_layer(parse_side(side)?, pp_rank))
    }

    /// Bytes of one page of one buffer of `kind` on a rank of `side` (SGLang's `kv_item_lens` entry).
    fn page_bytes(&self, side: &str, kind: &str) -> PyResult<u64> {
        Ok(self.topo.buffer_bytes(parse_side(side)?, parse_kind(kind)?, 1))
    }

    /// Bytes prefill rank `(tp_rank, pp_rank)` writes per page of a request, summed over the decode
    /// ranks it feeds (kvxfer's plan: a replicated head is written by one holder only). A request of
    /// `n` pages that succeeded moved `n` times this from that rank (the engines' transfer stats).
    #[pyo3(signature = (tp_rank, pp_rank=0))]
    fn sent_page_bytes(&self, tp_rank: u32, pp_rank: u32) -> PyResult<u64> {
        let pairs = kvxfer::plan::plan_sender(&self.topo, RankId::new(tp_rank, pp_rank), &[0], &[0]).map_err(err)?;
        Ok(pairs.iter().map(|p| p.bytes()).sum())
    }

    /// SGLang's `kv_item_lens` for a rank of stage `pp_rank` of `side`: every layer's K, then every
    /// layer's V (MLA: one per layer).
    #[pyo3(signature = (side, pp_rank=0))]
    fn item_lens(&self, side: &str, pp_rank: u32) -> PyResult<Vec<u64>> {
        let s = parse_side(side)?;
        let n = self.topo.stage_layers(s, pp_rank);
        Ok(self
            .topo
            .kv()
            .kinds()
            .iter()
            .flat_map(|k| std::iter::repeat_n(self.topo.buffer_bytes(s, *k, 1), n as usize))
            .collect())
    }

    /// The prefill ranks `(tp, pp)` that send to decode rank `(tp_rank, pp_rank)`.
    #[pyo3(signature = (tp_rank, pp_rank=0))]
    fn senders(&self, tp_rank: u32, pp_rank: u32) -> Vec<(u32, u32)> {
        self.topo.senders(RankId::new(tp_rank, pp_rank)).into_iter().map(|r| (r.tp, r.pp)).collect()
    }

    /// The decode ranks `(tp, pp)` prefill rank `(tp_rank, pp_rank)` sends to.
    #[pyo3(signature = (tp_rank, pp_rank=0))]
    fn receivers(&self, tp_rank: u32, pp_rank: u32) -> Vec<(u32, u32)> {
        self.topo.receivers(RankId::new(tp_rank, pp_rank)).into_iter().map(|r| (r.tp, r.pp)).collect()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<Topology>().is_ok_and(|o| o.get().topo == self.topo)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.topo.hash(&mut h);
        h.finish()
    }

    fn __repr__(&self) -> String {
        let kv = self.topo.kv();
        let shape = match kv.attention {
            Attention::Gqa { kv_heads, head_dim_k, head_dim_v } => {
                format!("kv_heads={kv_heads}, head_dim={head_dim_k}, v_head_dim={head_dim_v}")
            }
            Attention::Mla { latent_dim } => format!("mla_latent_dim={latent_dim}"),
        };
        let (p, d) = (self.topo.parallel(Side::Prefill), self.topo.parallel(Side::Decode));
        format!(
            "Topology({shape}, layers={}, page_size={}, dtype_bytes={}, prefill_tp={}, decode_tp={}, prefill_pp={}, decode_pp={}, layout={:?})",
            kv.layers,
            kv.page_size,
            kv.dtype_bytes,
            p.tp,
            d.tp,
            p.pp,
            d.pp,
            self.layout()
        )
    }
}

// ----------------------------------------------------------------------------------- BootstrapServer

/// The embedded bootstrap service (where ranks meet), on its own small runtime.
#[pyclass(module = "kvxfer._native", name = "BootstrapServer", frozen)]
struct BootstrapServer {
    address: String,
    state: Mutex<Option<(Arc<tokio::runtime::Runtime>, RsBootstrap)>>,
}

#[pymethods]
impl BootstrapServer {
    #[new]
    #[pyo3(signature = (host="127.0.0.1", port=0))]
    fn new(py: Python<'_>, host: &str, port: u16) -> PyResult<Self> {
        guarded("BootstrapServer()", || {
            let bind = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
            let rt = runtime(1, "kvxfer-bootstrap")?;
            let server = py.detach(|| rt.block_on(RsBootstrap::start(&bind))).map_err(err)?;
            Ok(Self { address: server.addr().to_string(), state: Mutex::new(Some((rt, server))) })
        })
    }

    /// `"HOST:PORT"` to pass to `Agent(bootstrap=...)`.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// Stops serving (idempotent).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        guarded("BootstrapServer.close()", || {
            let taken = self.state.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some((rt, server)) = taken {
                py.detach(move || {
                    drop(server);
                    if let Ok(rt) = Arc::try_unwrap(rt) {
                        rt.shutdown_timeout(Duration::from_secs(2));
                    }
                });
            }
            Ok(())
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("BootstrapServer({})", self.address)
    }
}

// ----------------------------------------------------------------------------------------- Aux rows

/// The aux buffers of a rank (SGLang's metadata buffers): one row per request slot in each buffer.
struct Aux {
    bufs: Vec<(MemDesc, u64)>,
    rows: u64,
}

impl Aux {
    fn row_bytes(&self) -> u64 {
        self.bufs.iter().map(|(_, l)| *l).sum()
    }

    fn check(&self, index: u32) -> Result<(), String> {
        if u64::from(index) >= self.rows {
            return Err(format!("aux_index {index} is outside the {} rows of the registered aux buffers", self.rows));
        }
        Ok(())
    }

    /// Row `index` of every aux buffer, concatenated.
    fn read(&self, index: u32) -> Result<Vec<u8>, String> {
        self.check(index)?;
        let mut out = Vec::with_capacity(self.row_bytes() as usize);
        for (i, (m, l)) in self.bufs.iter().enumerate() {
            let g = m.read_guard(u64::from(index) * l, *l).map_err(|e| format!("reading aux buffer {i}: {e}"))?;
            out.extend_from_slice(g.as_slice());
        }
        Ok(out)
    }

    /// Writes a payload made by [`Aux::read`] into row `index`.
    fn write(&self, index: u32, data: &[u8]) -> Result<(), String> {
        self.check(index)?;
        if data.len() as u64 != self.row_bytes() {
            return Err(format!(
                "the aux payload has {} bytes but this rank's aux row has {} (aux buffers with item lengths {:?}); \
                 register the same aux buffers on both sides, and give the prefill an aux_index",
                data.len(),
                self.row_bytes(),
                self.bufs.iter().map(|(_, l)| *l).collect::<Vec<_>>()
            ));
        }
        let mut at = 0usize;
        for (i, (m, l)) in self.bufs.iter().enumerate() {
            let mut g = m.write_guard(u64::from(index) * l, *l).map_err(|e| format!("writing aux buffer {i}: {e}"))?;
            g.as_mut_slice().copy_from_slice(&data[at..at + *l as usize]);
            at += *l as usize;
        }
        Ok(())
    }
}

// --------------------------------------------------------------------------------------------- Agent

enum Pending {
    Receiver(RsReceiver),
    Sender(RsSender),
}

/// Requests `clear()`ed while writes could still land: released by the agent's runtime once allowed.
type PendingList = Arc<Mutex<Vec<Pending>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Running {
    rt: Arc<tokio::runtime::Runtime>,
    /// Shared with calls in progress (they never hold a lock while the GIL is released).
    agent: Option<Arc<RsAgent>>,
}

struct Setup {
    cfg: AgentConfig,
    kv: Option<(u32, Vec<(BufferRef, MemDesc)>)>,
    aux: Option<Arc<Aux>>,
}

/// One rank's transfer agent (see the package docs for the call sequence).
#[pyclass(module = "kvxfer._native", name = "Agent", frozen)]
struct Agent {
    role: Side,
    rank: RankId,
    topo: RsTopology,
    setup: Mutex<Option<Setup>>,
    running: Mutex<Option<Running>>,
    aux: Mutex<Option<Arc<Aux>>>,
    /// Buffer exports and tensors kept alive while registered (dropped after the runtime stopped).
    keep: Mutex<Vec<cuda::Kept>>,
    pending: PendingList,
}

impl Agent {
    fn not_started(&self, call: &str) -> PyErr {
        err(format!("{} rank {}: {call}: call start() first", self.role, self.rank))
    }

    fn setup_mut<T>(&self, call: &str, f: impl FnOnce(&mut Setup) -> PyResult<T>) -> PyResult<T> {
        let mut g = lock(&self.setup);
        match g.as_mut() {
            Some(s) => f(s),
            None => Err(err(format!("{} rank {}: {call}: the agent was already started", self.role, self.rank))),
        }
    }

    /// Maps SGLang's buffer order onto buffer refs and checks each item length.
    fn kv_layout(&self, lens: &[usize], item_lens: &[u64]) -> PyResult<(u32, Vec<BufferRef>)> {
        let stage_layers = self.topo.stage_layers(self.role, self.rank.pp);
        let kinds = self.topo.kv().kinds();
        let want = kinds.len() * stage_layers as usize;
        let what = if kinds.len() == 1 {
            format!("{stage_layers} latent buffers (one per layer of this stage)")
        } else {
            format!("{want} buffers (the {stage_layers} K buffers of this stage's layers, then the {stage_layers} V buffers)")
        };
        if lens.len() != want || item_lens.len() != want {
            return Err(err(format!(
                "{} rank {}: expected {what}, got {} buffers and {} item lengths",
                self.role,
                self.rank,
                lens.len(),
                item_lens.len()
            )));
        }
        let mut refs = Vec::with_capacity(want);
        let mut pages = u64::MAX;
        for (i, (len, item)) in lens.iter().zip(item_lens).enumerate() {
            let kind = kinds[i / stage_layers as usize];
            let layer = (i % stage_layers as usize) as u32;
            let expect = self.topo.buffer_bytes(self.role, kind, 1);
            if *item != expect {
                return Err(err(format!(
                    "{} rank {}: buffer {i} (layer {layer} {}): item length {item} bytes, but one page of the topology is \
                     {expect} bytes ({} local heads x {} tokens x {} bytes per head)",
                    self.role,
                    self.rank,
                    kind_name(kind),
                    self.topo.local_heads(self.role),
                    self.topo.kv().page_size,
                    self.topo.kv().head_bytes(kind)
                )));
            }
            pages = pages.min(*len as u64 / item);
            refs.push(BufferRef { layer, kind });
        }
        if pages == 0 {
            return Err(err(format!("{} rank {}: a KV buffer holds no whole page", self.role, self.rank)));
        }
        Ok((pages.min(u64::from(u32::MAX)) as u32, refs))
    }

    fn running<T>(&self, call: &str, f: impl FnOnce(&Running) -> PyResult<T>) -> PyResult<T> {
        let g = lock(&self.running);
        match g.as_ref() {
            Some(r) if r.agent.is_some() => f(r),
            _ => Err(self.not_started(call)),
        }
    }

    /// The agent and its runtime, for a call that releases the GIL (no lock is held meanwhile).
    fn shared(&self, call: &str) -> PyResult<(Arc<RsAgent>, Arc<tokio::runtime::Runtime>)> {
        self.running(call, |r| Ok((Arc::clone(r.agent.as_ref().expect("checked")), Arc::clone(&r.rt))))
    }

    fn stop(&self, py: Python<'_>, deadline: Instant) -> PyResult<()> {
        let taken = lock(&self.running).take();
        let mut result = Ok(());
        let mut stopped = true;
        if let Some(Running { rt, agent }) = taken {
            (result, stopped) = py.detach(|| {
                // A call in progress (wait_connected) may still hold the agent for a moment.
                let r = match agent.and_then(|a| unwrap_until(a, deadline)) {
                    Some(a) => rt.block_on(a.shutdown(deadline)).map_err(|e| e.to_string()),
                    None => Ok(()),
                };
                (r, stop_runtime(rt, deadline))
            });
        }
        lock(&self.pending).clear();
        let kept = std::mem::take(&mut *lock(&self.keep));
        if stopped {
            for b in kept {
                b.release(py);
            }
        } else {
            // The runtime could not be stopped: a transfer may still touch the memory. Keep the buffers
            // alive for the life of the process rather than let them go under it.
            std::mem::forget(kept);
        }
        result.map_err(err)
    }
}

/// The sole owner of `a`, waiting (bounded) for calls in progress to let go of their clones.
fn unwrap_until<T>(mut a: Arc<T>, deadline: Instant) -> Option<T> {
    loop {
        match Arc::try_unwrap(a) {
            Ok(t) => return Some(t),
            Err(back) if Instant::now() < deadline => {
                a = back;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => return None,
        }
    }
}

/// Shuts the runtime down: once it returns true, no task of it runs (and so no backend transfer touches
/// the registered memory any more).
fn stop_runtime(rt: Arc<tokio::runtime::Runtime>, deadline: Instant) -> bool {
    match unwrap_until(rt, deadline.max(Instant::now() + Duration::from_secs(2))) {
        Some(rt) => {
            rt.shutdown_timeout(Duration::from_secs(5));
            true
        }
        None => false,
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Not closed: stop the runtime before the kept buffer exports are released.
        if let Some(Running { rt, agent }) = lock(&self.running).take() {
            drop(agent);
            if !stop_runtime(rt, Instant::now() + Duration::from_secs(5)) {
                std::mem::forget(std::mem::take(&mut *lock(&self.keep)));
            }
        }
    }
}

#[pymethods]
impl Agent {
    #[new]
    #[pyo3(signature = (role, topology, tp_rank=0, pp_rank=0, bootstrap=None, backend="tcp", notify="attached",
                        backend_options=None, timeout_s=60.0, connect_timeout_s=None, lease_ttl_s=10.0, label=None,
                        digest=false, model=None, protocol=None))]
    fn new(
        role: &str,
        topology: &Topology,
        tp_rank: u32,
        pp_rank: u32,
        bootstrap: Option<&str>,
        backend: &str,
        notify: &str,
        backend_options: Option<BTreeMap<String, String>>,
        timeout_s: f64,
        connect_timeout_s: Option<f64>,
        lease_ttl_s: f64,
        label: Option<String>,
        digest: bool,
        model: Option<BTreeMap<String, String>>,
        protocol: Option<u16>,
    ) -> PyResult<Self> {
        guarded("Agent()", || {
            let role = parse_side(role)?;
            let rank = RankId::new(tp_rank, pp_rank);
            let topo = topology.topo;
            topo.check_rank(role, rank).map_err(err)?;
            let bootstrap = bootstrap.ok_or_else(|| {
                PyValueError::new_err("bootstrap is required: \"HOST:PORT\" of a BootstrapServer (or etcd://...)")
            })?;
            let metadata = MetadataAddr::parse(bootstrap).map_err(err)?;
            let mut cfg = AgentConfig::new(role, rank, topo, metadata);
            cfg.backend = backend.to_owned();
            cfg.backend_options = backend_options.unwrap_or_default();
            cfg.notify = match notify {
                "attached" => NotifyStyle::Attached,
                "out-of-band" | "out_of_band" => NotifyStyle::OutOfBand,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "notify must be \"attached\" or \"out-of-band\", not {notify:?}"
                    )))
                }
            };
            cfg.request_timeout = secs("timeout_s", timeout_s)?;
            cfg.connect_timeout = secs("connect_timeout_s", connect_timeout_s.unwrap_or(timeout_s))?;
            cfg.lease_ttl = secs("lease_ttl_s", lease_ttl_s)?;
            cfg.label = label.unwrap_or_else(|| format!("python pid {}", std::process::id()));
            if digest && role != Side::Decode {
                return Err(PyValueError::new_err(
                    "digest=True is a decode setting (the decode rank asks its prefill ranks for digests)",
                ));
            }
            cfg.digest = digest;
            cfg.model = match model {
                None => None,
                Some(mut m) => {
                    let name = m.remove("name").filter(|n| !n.is_empty()).ok_or_else(|| {
                        PyValueError::new_err(
                            "model needs a non-empty \"name\" (and optionally \"revision\", \"dtype\")",
                        )
                    })?;
                    let id = kvxfer::bootstrap::ModelIdentity {
                        name,
                        revision: m.remove("revision").unwrap_or_default(),
                        dtype: m.remove("dtype").unwrap_or_default(),
                    };
                    if let Some(k) = m.keys().next() {
                        return Err(PyValueError::new_err(format!("model: unknown key {k:?} (name, revision, dtype)")));
                    }
                    Some(id)
                }
            };
            if let Some(v) = protocol {
                if kvxfer::ProtocolRange::pinned(v).is_none() {
                    return Err(PyValueError::new_err(format!(
                        "protocol={v}: this build speaks kvxfer protocol {} (pin one of those, or leave it None)",
                        kvxfer::ProtocolRange::THIS_BUILD
                    )));
                }
            }
            cfg.protocol = protocol;
            Ok(Self {
                role,
                rank,
                topo,
                setup: Mutex::new(Some(Setup { cfg, kv: None, aux: None })),
                running: Mutex::new(None),
                aux: Mutex::new(None),
                keep: Mutex::new(Vec::new()),
                pending: Arc::new(Mutex::new(Vec::new())),
            })
        })
    }

    /// `"prefill"` or `"decode"`.
    #[getter]
    fn role(&self) -> &'static str {
        match self.role {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }
    /// This rank's TP rank.
    #[getter]
    fn tp_rank(&self) -> u32 {
        self.rank.tp
    }
    /// This rank's PP stage.
    #[getter]
    fn pp_rank(&self) -> u32 {
        self.rank.pp
    }
    /// The topology.
    #[getter]
    fn topology(&self) -> Topology {
        Topology { topo: self.topo }
    }

    /// Registers the KV pool from raw addresses (host or device), in SGLang's `KVArgs` order: every layer's
    /// K buffer, then every layer's V buffer (MLA: one buffer per layer); `item_lens` = bytes of one page.
    /// `kind`: "host"/"cpu"/"DRAM", "cuda"/"gpu"/"VRAM" (on `device`, else the device the driver names for
    /// the first address), "cuda:N", or "auto" (from the first address). The memory must stay valid until
    /// `close()` returned.
    #[pyo3(signature = (ptrs, lens, item_lens, kind="host", device=None))]
    fn register_kv(
        &self,
        ptrs: Vec<usize>,
        lens: Vec<usize>,
        item_lens: Vec<u64>,
        kind: &str,
        device: Option<u32>,
    ) -> PyResult<()> {
        guarded("register_kv", || {
            let kind = cuda::mem_kind(kind, device, ptrs.first().copied())?;
            if ptrs.len() != lens.len() {
                return Err(PyValueError::new_err(format!("{} addresses but {} lengths", ptrs.len(), lens.len())));
            }
            let (pages, refs) = self.kv_layout(&lens, &item_lens)?;
            self.setup_mut("register_kv", |s| {
                if s.kv.is_some() {
                    return Err(err("register_kv: KV memory was already registered"));
                }
                let raw: Vec<(usize, usize)> = ptrs.iter().copied().zip(lens.iter().copied()).collect();
                let descs = describe(&raw, kind)?;
                s.kv = Some((pages, refs.into_iter().zip(descs).collect()));
                Ok(())
            })
        })
    }

    /// Registers the KV pool from buffer-protocol objects (numpy arrays), torch tensors (on the host or on
    /// `cuda:N`) or objects with `__cuda_array_interface__`, in SGLang's order; keeps them alive (and
    /// unresizable) until `close()`. Item lengths come from the topology; the memory kind and CUDA device
    /// from the buffers (all of one kind).
    fn register_kv_buffers(&self, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        guarded("register_kv_buffers", || {
            let mut exports = Vec::new();
            let mut raw = Vec::new();
            let mut kind = None;
            for (i, b) in buffers.iter().enumerate() {
                let (e, addr, len, k) = cuda::export_any(b, i, self.role == Side::Decode)?;
                if *kind.get_or_insert(k) != k {
                    return Err(PyValueError::new_err(format!(
                        "buffer {i} is {k} but buffer 0 is {}: register one memory kind per pool",
                        kind.expect("set")
                    )));
                }
                exports.push(e);
                raw.push((addr, len));
            }
            let kind = kind.unwrap_or(MemKind::Host);
            let lens: Vec<usize> = raw.iter().map(|r| r.1).collect();
            let stage_layers = self.topo.stage_layers(self.role, self.rank.pp) as usize;
            let item_lens: Vec<u64> = (0..lens.len())
                .map(|i| {
                    let kinds = self.topo.kv().kinds();
                    let kind = kinds[(i / stage_layers.max(1)).min(kinds.len() - 1)];
                    self.topo.buffer_bytes(self.role, kind, 1)
                })
                .collect();
            let (pages, refs) = self.kv_layout(&lens, &item_lens)?;
            self.setup_mut("register_kv_buffers", |s| {
                if s.kv.is_some() {
                    return Err(err("register_kv_buffers: KV memory was already registered"));
                }
                let descs = describe(&raw, kind)?;
                s.kv = Some((pages, refs.into_iter().zip(descs).collect()));
                lock(&self.keep).extend(exports);
                Ok(())
            })
        })
    }

    /// Registers aux rows (SGLang's metadata buffers, host memory): row `i` of buffer `b` is
    /// `[i * item_lens[b], (i + 1) * item_lens[b])`.
    fn register_aux(&self, ptrs: Vec<usize>, lens: Vec<usize>, item_lens: Vec<u64>) -> PyResult<()> {
        guarded("register_aux", || {
            if ptrs.len() != lens.len() || ptrs.len() != item_lens.len() {
                return Err(PyValueError::new_err(format!(
                    "{} addresses, {} lengths, {} item lengths: give one of each per aux buffer",
                    ptrs.len(),
                    lens.len(),
                    item_lens.len()
                )));
            }
            let raw: Vec<(usize, usize)> = ptrs.iter().copied().zip(lens.iter().copied()).collect();
            self.set_aux(raw, item_lens, Vec::new())
        })
    }

    /// Registers aux rows from buffer-protocol objects (2-D numpy arrays: one row per request slot); keeps
    /// them alive until `close()`.
    fn register_aux_buffers(&self, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        guarded("register_aux_buffers", || {
            let mut exports = Vec::new();
            let mut raw = Vec::new();
            let mut items = Vec::new();
            for (i, b) in buffers.iter().enumerate() {
                let (e, addr, len) = export(b, i, self.role == Side::Decode)?;
                let rows = e.shape().first().copied().unwrap_or(1).max(1);
                items.push((len / rows) as u64);
                exports.push(e);
                raw.push((addr, len));
            }
            self.set_aux(raw, items, exports)
        })
    }

    /// Creates the backend endpoint, registers the memory, joins the bootstrap and connects to the peer
    /// ranks in the background (requests are `Bootstrapping` until then). Blocks (GIL released) until
    /// this rank is registered; `wait_connected()` waits for the peers.
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        guarded("start", || {
            let setup = lock(&self.setup)
                .take()
                .ok_or_else(|| err(format!("{} rank {}: start: already started", self.role, self.rank)))?;
            let Some((pages, buffers)) = setup.kv else {
                *lock(&self.setup) = Some(setup);
                return Err(err(format!(
                    "{} rank {}: start: register the KV pool first (register_kv or register_kv_buffers)",
                    self.role, self.rank
                )));
            };
            // A start that fails keeps its setup: the engine may retry (a bootstrap service not up yet) and
            // then sees the real cause again, never "already started".
            let restore = |setup: Setup| *lock(&self.setup) = Some(setup);
            let rt = match runtime(2, &format!("kvxfer-{}{}", self.role, self.rank.tp)) {
                Ok(rt) => rt,
                Err(e) => {
                    restore(Setup { kv: Some((pages, buffers)), ..setup });
                    return Err(e);
                }
            };
            let cfg = setup.cfg.clone();
            // A backend that refuses the pool's memory kind: the error says which backends take it.
            let kinds: Vec<MemKind> = buffers.iter().map(|(_, d)| d.kind()).fold(Vec::new(), |mut v, k| {
                if !v.contains(&k) {
                    v.push(k);
                }
                v
            });
            let memory = KvMemory::Buffers { pages, buffers: buffers.clone() };
            let agent = py.detach(|| rt.block_on(RsAgent::start(cfg, memory)));
            let agent = match agent {
                Ok(a) => a,
                Err(e) => {
                    py.detach(|| {
                        if let Ok(rt) = Arc::try_unwrap(rt) {
                            rt.shutdown_timeout(Duration::from_secs(2));
                        }
                    });
                    restore(Setup { kv: Some((pages, buffers)), ..setup });
                    let msg = e.to_string();
                    if msg.contains("registering") && msg.contains("not supported") {
                        let hints: Vec<String> = kinds.into_iter().map(cuda::capable_backends).collect();
                        return Err(err(format!("{msg}; {}", hints.join("; "))));
                    }
                    if matches!(e, kvxfer::engine::EngineError::StoreUnreachable { .. }) {
                        return Err(StoreUnreachable::new_err(e.to_string()));
                    }
                    return Err(err(e));
                }
            };
            *lock(&self.aux) = setup.aux;
            // Deferred releases (requests clear()ed while writes could still land).
            let pending = Arc::clone(&self.pending);
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let mut p = lock(&pending);
                    p.retain(|x| match x {
                        Pending::Receiver(r) => r.clone().release().is_err(),
                        Pending::Sender(s) => s.clone().release().is_err(),
                    });
                }
            });
            *lock(&self.running) = Some(Running { rt, agent: Some(Arc::new(agent)) });
            Ok(())
        })
    }

    /// Whether every peer rank this rank exchanges with is connected.
    fn is_connected(&self) -> PyResult<bool> {
        guarded("is_connected", || {
            self.running("is_connected", |r| Ok(r.agent.as_ref().is_some_and(|a| a.is_connected())))
        })
    }

    /// Blocks (GIL released) until every peer rank is connected; raises after `timeout_s`.
    #[pyo3(signature = (timeout_s=60.0))]
    fn wait_connected(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        guarded("wait_connected", || {
            let deadline = Instant::now() + secs("timeout_s", timeout_s)?;
            let (agent, rt) = self.shared("wait_connected")?;
            py.detach(|| rt.block_on(agent.wait_connected(deadline))).map_err(err)
        })
    }

    /// A decode-side request for `room` (SGLang's `KVReceiver`).
    fn receiver(&self, room: u64) -> PyResult<Receiver> {
        guarded("receiver", || {
            self.running("receiver", |r| {
                let rx = r.agent.as_ref().expect("checked").receiver(RequestId(room)).map_err(err)?;
                Ok(Receiver {
                    rx,
                    handle: r.rt.handle().clone(),
                    aux: lock(&self.aux).clone(),
                    pending: Arc::clone(&self.pending),
                    state: Mutex::new(RecvState::default()),
                })
            })
        })
    }

    /// A prefill-side request for `room` (SGLang's `KVSender`).
    fn sender(&self, room: u64) -> PyResult<Sender> {
        guarded("sender", || {
            self.running("sender", |r| {
                let agent = r.agent.as_ref().expect("checked");
                let tx = agent.sender(RequestId(room)).map_err(err)?;
                Ok(Sender {
                    tx,
                    handle: r.rt.handle().clone(),
                    aux: lock(&self.aux).clone(),
                    pending: Arc::clone(&self.pending),
                    stage_layers: self.topo.stage_layers(self.role, self.rank.pp),
                    state: Mutex::new(SendState::default()),
                })
            })
        })
    }

    /// Requests created and not yet released on this rank.
    fn active_requests(&self) -> PyResult<usize> {
        guarded("active_requests", || {
            self.running("active_requests", |r| Ok(r.agent.as_ref().expect("checked").active_requests()))
        })
    }

    /// Counters, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded("stats", || {
            let s = self.running("stats", |r| Ok(r.agent.as_ref().expect("checked").stats()))?;
            let d = PyDict::new(py);
            d.set_item("succeeded", s.succeeded)?;
            d.set_item("failed", s.failed)?;
            d.set_item("aborted", s.aborted)?;
            d.set_item("early_handoffs_kept", s.early_handoffs_kept)?;
            d.set_item("early_handoffs_expired", s.early_handoffs_expired)?;
            d.set_item("aborts_received", s.aborts_received)?;
            d.set_item("fences", s.fences)?;
            d.set_item("fence_reasks", s.fence_reasks)?;
            d.set_item("warm_ups", s.warm_ups)?;
            d.set_item("warm_up_failures", s.warm_up_failures)?;
            d.set_item("peers_lost", s.peers_lost)?;
            d.set_item("protocol_errors", s.protocol_errors)?;
            d.set_item("digest_bytes", s.digest_bytes)?;
            d.set_item("digest_mismatches", s.digest_mismatches)?;
            d.set_item("pending_releases", lock(&self.pending).len())?;
            Ok(d)
        })
    }

    /// Every metric of this agent now, in the OpenMetrics text format (what Prometheus scrapes; names
    /// and meanings in docs/operations.md): serve it from the engine's own metrics endpoint.
    fn metrics(&self) -> PyResult<String> {
        guarded("metrics", || self.running("metrics", |r| Ok(r.agent.as_ref().expect("checked").metrics())))
    }

    /// Stops (GIL released): fails the requests still active (telling the peers), leaves the cluster, closes
    /// the registrations and stops the runtime; then lets go of the buffers it kept alive. Idempotent.
    #[pyo3(signature = (timeout_s=10.0))]
    fn close(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        guarded("close", || {
            let deadline = Instant::now() + secs("timeout_s", timeout_s)?;
            lock(&self.setup).take();
            self.stop(py, deadline)
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py, 10.0)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let state = if lock(&self.running).is_some() {
            "started"
        } else if lock(&self.setup).is_some() {
            "not started"
        } else {
            "closed"
        };
        format!("Agent({} rank {}, {state})", self.role, self.rank)
    }
}

impl Agent {
    fn set_aux(&self, raw: Vec<(usize, usize)>, item_lens: Vec<u64>, exports: Vec<PyUntypedBuffer>) -> PyResult<()> {
        if raw.is_empty() {
            return Err(PyValueError::new_err("no aux buffers given"));
        }
        let mut rows = u64::MAX;
        for (i, ((_, len), item)) in raw.iter().zip(&item_lens).enumerate() {
            if *item == 0 || (*len as u64) < *item {
                return Err(PyValueError::new_err(format!(
                    "aux buffer {i}: item length {item} bytes does not fit its {len} bytes"
                )));
            }
            rows = rows.min(*len as u64 / item);
        }
        self.setup_mut("register_aux", |s| {
            if s.aux.is_some() {
                return Err(err("register_aux: aux buffers were already registered"));
            }
            let descs = describe(&raw, MemKind::Host)?;
            s.aux = Some(Arc::new(Aux { bufs: descs.into_iter().zip(item_lens).collect(), rows }));
            lock(&self.keep).extend(exports.into_iter().map(cuda::Kept::Buffer));
            Ok(())
        })
    }
}

// ------------------------------------------------------------------------------------------ Requests

#[derive(Default)]
struct RecvState {
    aux_index: Option<u32>,
    aux_done: bool,
    /// A local failure (the aux payload could not be placed).
    local_failure: Option<String>,
    cleared: bool,
}

/// A decode-side request.
#[pyclass(module = "kvxfer._native", name = "Receiver", frozen)]
struct Receiver {
    rx: RsReceiver,
    handle: tokio::runtime::Handle,
    aux: Option<Arc<Aux>>,
    pending: PendingList,
    state: Mutex<RecvState>,
}

impl Receiver {
    /// The status, with the aux row placed before `Success` is reported.
    fn status_now(&self) -> (RequestStatus, Option<String>) {
        let s = self.rx.status();
        let mut st = lock(&self.state);
        if let Some(f) = &st.local_failure {
            return (
                RequestStatus { phase: Phase::Failed, reason: Some(f.clone()), pages_reusable: true },
                Some(f.clone()),
            );
        }
        if s.phase == Phase::Success && !st.aux_done {
            if let (Some(i), Some(aux)) = (st.aux_index, &self.aux) {
                let placed = match self.rx.aux() {
                    Some(data) => aux.write(i, &data),
                    None => Err("the request completed without its aux payload".into()),
                };
                if let Err(e) = placed {
                    let why = format!("decode request {}: aux row {i}: {e}", self.rx.room().0);
                    st.local_failure = Some(why.clone());
                    return (
                        RequestStatus { phase: Phase::Failed, reason: Some(why.clone()), pages_reusable: true },
                        Some(why),
                    );
                }
            }
            st.aux_done = true;
        }
        let reason = s.reason.clone();
        (s, reason)
    }
}

#[pymethods]
impl Receiver {
    /// The room (the engine's request id).
    #[getter]
    fn room(&self) -> u64 {
        self.rx.room().0
    }

    /// The generation of this use of the room, once `send_metadata` was called.
    #[getter]
    fn generation(&self) -> Option<u64> {
        self.rx.generation()
    }

    /// The trace id of this use of the room (32 hex digits; every request event kvxfer logs for it,
    /// here and on its prefill ranks, carries it as `trace_id`), once `send_metadata` was called.
    #[getter]
    fn trace_id(&self) -> Option<String> {
        self.rx.trace_id().map(|t| t.to_string())
    }

    /// Hands the request off: this rank's destination page indices (int32 array or ints, token order) and
    /// optionally the aux row to fill. Returns at once.
    #[pyo3(signature = (kv_indices, aux_index=None))]
    fn send_metadata(&self, py: Python<'_>, kv_indices: &Bound<'_, PyAny>, aux_index: Option<u32>) -> PyResult<()> {
        guarded("send_metadata", || {
            let pages = pages_of(kv_indices)?;
            if let Some(i) = aux_index {
                match &self.aux {
                    None => {
                        return Err(err(format!(
                            "decode request {}: aux_index {i} given but no aux buffers were registered (register_aux)",
                            self.rx.room().0
                        )))
                    }
                    Some(a) => a.check(i).map_err(err)?,
                }
            }
            lock(&self.state).aux_index = aux_index;
            py.detach(|| {
                let _rt = self.handle.enter();
                self.rx.send_metadata(&pages, aux_index)
            })
            .map_err(err)
        })
    }

    /// A `KVPoll` value; never blocks. `Aborting` (failed, writes not fenced yet) reports `Transferring`.
    fn poll(&self) -> PyResult<i32> {
        guarded("poll", || Ok(kvpoll_of(self.status_now().0.phase)))
    }

    /// Waits (GIL released) until the request is final or `timeout_s` passed; returns `poll()`.
    #[pyo3(signature = (timeout_s=60.0))]
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<i32> {
        guarded("wait", || {
            let deadline = Instant::now() + secs("timeout_s", timeout_s)?;
            let _ = py.detach(|| self.handle.block_on(self.rx.wait(deadline)));
            Ok(kvpoll_of(self.status_now().0.phase))
        })
    }

    /// The phase by name: bootstrapping, waiting_for_input, transferring, success, aborting, failed.
    fn phase(&self) -> PyResult<&'static str> {
        guarded("phase", || Ok(phase_name(self.status_now().0.phase)))
    }

    /// Whether this request's destination pages may be reused now.
    fn pages_reusable(&self) -> PyResult<bool> {
        guarded("pages_reusable", || Ok(self.status_now().0.pages_reusable))
    }

    /// `{"phase", "reason", "pages_reusable"}`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded("status", || status_dict(py, &self.status_now().0))
    }

    /// A `KvxferError` naming the cause once the request failed (also while it is still aborting), else None.
    fn failure_exception(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        guarded("failure_exception", || {
            Ok(self.status_now().1.map(|r| KvxferError::new_err(r).into_value(py).into_any()))
        })
    }

    /// Aborts: every prefill rank that could still write is told and asked to fence. Never blocks.
    #[pyo3(signature = (reason="aborted by the decode engine"))]
    fn abort(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        guarded("abort", || {
            py.detach(|| {
                let _rt = self.handle.enter();
                self.rx.abort(reason)
            });
            Ok(())
        })
    }

    /// Forgets the request. A request that may still be written into is aborted and released by the agent
    /// as soon as its fence closed (its room is in use until then). Never blocks.
    fn clear(&self) -> PyResult<()> {
        guarded("clear", || {
            let mut st = lock(&self.state);
            if st.cleared {
                return Ok(());
            }
            st.cleared = true;
            drop(st);
            let _rt = self.handle.enter();
            if self.rx.clone().release().is_err() {
                self.rx.abort("cleared by the decode engine before it finished");
                lock(&self.pending).push(Pending::Receiver(self.rx.clone()));
            }
            Ok(())
        })
    }

    fn __repr__(&self) -> String {
        format!("Receiver(room={}, {})", self.rx.room().0, phase_name(self.rx.status().phase))
    }
}

#[derive(Default)]
struct SendState {
    total: Option<u32>,
    sent: u32,
    aux_index: Option<u32>,
    aux_sent: bool,
    /// Layer-wise: the chunk in progress (its pages and layers sent).
    layerwise: Option<(Vec<u32>, u32)>,
    local_failure: Option<String>,
    cleared: bool,
}

/// A prefill-side request.
#[pyclass(module = "kvxfer._native", name = "Sender", frozen)]
struct Sender {
    tx: RsSender,
    handle: tokio::runtime::Handle,
    aux: Option<Arc<Aux>>,
    pending: PendingList,
    stage_layers: u32,
    state: Mutex<SendState>,
}

impl Sender {
    fn status_now(&self) -> (RequestStatus, Option<String>) {
        if let Some(f) = &lock(&self.state).local_failure {
            return (
                RequestStatus { phase: Phase::Failed, reason: Some(f.clone()), pages_reusable: true },
                Some(f.clone()),
            );
        }
        let s = self.tx.status();
        let reason = s.reason.clone();
        (s, reason)
    }

    /// After the last chunk: the aux row (empty when this rank has none), to every decode rank that asked.
    fn send_aux(&self, st: &mut SendState) -> PyResult<()> {
        if st.aux_sent {
            return Ok(());
        }
        let data = match (st.aux_index, &self.aux) {
            (Some(i), Some(aux)) => aux.read(i).map_err(|e| format!("prefill request {}: {e}", self.tx.room().0)),
            _ => Ok(Vec::new()),
        };
        st.aux_sent = true;
        // The chunks went out: a request whose aux cannot follow them would only wait for its deadline, so it
        // is aborted at once, with the reason (the decode side learns it too).
        let sent = data.and_then(|d| self.tx.send_aux(d).map_err(|e| e.to_string()));
        sent.map_err(|why| {
            self.tx.abort(&format!("the aux row could not be sent: {why}"));
            err(why)
        })
    }
}

#[pymethods]
impl Sender {
    /// The room (the engine's request id).
    #[getter]
    fn room(&self) -> u64 {
        self.tx.room().0
    }

    /// The trace ids of this request's transfers, by decode rank (`"tp/pp"` -> 32 hex digits), for
    /// the decode ranks that handed off so far.
    #[getter]
    fn trace_ids(&self) -> BTreeMap<String, String> {
        self.tx.trace_ids().into_iter().map(|(d, t)| (d.to_string(), t.to_string())).collect()
    }

    /// Sets the request's total page count; `aux_index` is this rank's aux row to send after the last chunk.
    #[pyo3(signature = (num_kv_indices, aux_index=None))]
    fn init(&self, num_kv_indices: u32, aux_index: Option<u32>) -> PyResult<()> {
        guarded("init", || {
            if let (Some(i), Some(a)) = (aux_index, &self.aux) {
                a.check(i).map_err(err)?;
            }
            self.tx.init(num_kv_indices).map_err(err)?;
            let mut st = lock(&self.state);
            st.total = Some(num_kv_indices);
            st.aux_index = aux_index;
            Ok(())
        })
    }

    /// Sends the next chunk of source page indices; the chunk that reaches the total is the last, and the aux
    /// row follows it. Returns at once (the writes run on the agent's threads).
    fn send(&self, py: Python<'_>, kv_indices: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded("send", || {
            let pages = pages_of(kv_indices)?;
            py.detach(|| {
                let _rt = self.handle.enter();
                let mut st = lock(&self.state);
                self.tx.send(&pages).map_err(err)?;
                st.sent += pages.len() as u32;
                if st.total == Some(st.sent) {
                    self.send_aux(&mut st)?;
                }
                Ok(())
            })
        })
    }

    /// Layer-wise sending (vLLM's `save_kv_layer`): layers `[layer_start, layer_end)` (stage-local) of the chunk
    /// made of `kv_indices`; every call of one chunk gives the same pages. Returns at once.
    fn send_layers(
        &self,
        py: Python<'_>,
        kv_indices: &Bound<'_, PyAny>,
        layer_start: u32,
        layer_end: u32,
    ) -> PyResult<()> {
        guarded("send_layers", || {
            let pages = pages_of(kv_indices)?;
            let stage_layers = self.stage_layers;
            py.detach(|| {
                let _rt = self.handle.enter();
                let mut st = lock(&self.state);
                self.tx.send_layers(&pages, layer_start..layer_end).map_err(err)?;
                let (first, done) = match &mut st.layerwise {
                    Some((_, done)) => {
                        *done += layer_end - layer_start;
                        (false, *done)
                    }
                    None => {
                        st.layerwise = Some((pages.clone(), layer_end - layer_start));
                        (true, layer_end - layer_start)
                    }
                };
                if first {
                    st.sent += pages.len() as u32;
                }
                if done >= stage_layers {
                    st.layerwise = None;
                    if st.total == Some(st.sent) {
                        self.send_aux(&mut st)?;
                    }
                }
                Ok(())
            })
        })
    }

    /// A `KVPoll` value; never blocks. `Aborting` reports `Transferring` (source pages still read).
    fn poll(&self) -> PyResult<i32> {
        guarded("poll", || Ok(kvpoll_of(self.status_now().0.phase)))
    }

    /// Waits (GIL released) until the request is final or `timeout_s` passed; returns `poll()`.
    #[pyo3(signature = (timeout_s=60.0))]
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<i32> {
        guarded("wait", || {
            let deadline = Instant::now() + secs("timeout_s", timeout_s)?;
            let _ = py.detach(|| self.handle.block_on(self.tx.wait(deadline)));
            Ok(kvpoll_of(self.status_now().0.phase))
        })
    }

    /// Waits (GIL released) until every decode rank handed off (`poll()` is `WaitingForInput`:
    /// `send` may go), the request has an outcome, or `timeout_s` passed; returns `poll()`. For an
    /// engine with a thread per request; a scheduler loop polls instead.
    #[pyo3(signature = (timeout_s=60.0))]
    fn wait_ready(&self, py: Python<'_>, timeout_s: f64) -> PyResult<i32> {
        guarded("wait_ready", || {
            let deadline = Instant::now() + secs("timeout_s", timeout_s)?;
            let _ = py.detach(|| self.handle.block_on(self.tx.wait_ready(deadline)));
            Ok(kvpoll_of(self.status_now().0.phase))
        })
    }

    /// The phase by name.
    fn phase(&self) -> PyResult<&'static str> {
        guarded("phase", || Ok(phase_name(self.status_now().0.phase)))
    }

    /// Whether this request's source pages may be reused now.
    fn pages_reusable(&self) -> PyResult<bool> {
        guarded("pages_reusable", || {
            let s = self.status_now().0;
            Ok(s.phase.is_final() || s.pages_reusable)
        })
    }

    /// `{"phase", "reason", "pages_reusable"}`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded("status", || status_dict(py, &self.status_now().0))
    }

    /// A `KvxferError` naming the cause once the request failed, else None.
    fn failure_exception(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        guarded("failure_exception", || {
            Ok(self.status_now().1.map(|r| KvxferError::new_err(r).into_value(py).into_any()))
        })
    }

    /// Aborts: stops posting, aborts what is in flight, tells every decode rank. Never blocks.
    #[pyo3(signature = (reason="aborted by the prefill engine"))]
    fn abort(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        guarded("abort", || {
            py.detach(|| {
                let _rt = self.handle.enter();
                self.tx.abort(reason)
            });
            Ok(())
        })
    }

    /// Forgets the request; one with transfers in flight is aborted and released once they settled.
    fn clear(&self) -> PyResult<()> {
        guarded("clear", || {
            let mut st = lock(&self.state);
            if st.cleared {
                return Ok(());
            }
            st.cleared = true;
            drop(st);
            let _rt = self.handle.enter();
            if self.tx.clone().release().is_err() {
                self.tx.abort("cleared by the prefill engine before it finished");
                lock(&self.pending).push(Pending::Sender(self.tx.clone()));
            }
            Ok(())
        })
    }

    fn __repr__(&self) -> String {
        format!("Sender(room={}, {})", self.tx.room().0, phase_name(self.tx.status().phase))
    }
}

fn status_dict<'py>(py: Python<'py>, s: &RequestStatus) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("phase", phase_name(s.phase))?;
    d.set_item("kvpoll", kvpoll_of(s.phase))?;
    d.set_item("reason", s.reason.clone())?;
    d.set_item("pages_reusable", s.pages_reusable)?;
    Ok(d)
}

// --------------------------------------------------------------------------------------- measurement

/// The Rust side of the overhead measurement: `n` cycles of `send(src)` + `status()` on fresh senders of
/// the given (ready) rooms, timed in Rust. Returns the seconds spent in those calls.
#[pyfunction]
fn _rust_send_poll_seconds(py: Python<'_>, senders: Vec<PyRef<'_, Sender>>, src: Vec<u32>) -> PyResult<f64> {
    guarded("_rust_send_poll_seconds", || {
        let txs: Vec<(RsSender, tokio::runtime::Handle)> =
            senders.iter().map(|s| (s.tx.clone(), s.handle.clone())).collect();
        py.detach(|| {
            let mut total = Duration::ZERO;
            for (tx, handle) in &txs {
                let _rt = handle.enter();
                let t = Instant::now();
                tx.send(&src).map_err(err)?;
                let phase = tx.status().phase;
                total += t.elapsed();
                std::hint::black_box(phase);
            }
            Ok(total.as_secs_f64())
        })
    })
}

/// One request through the engine API driven from Rust, as `python -m kvxfer.bench` drives it
/// from Python: decode hands off `dst`, prefill `init`s, waits until ready and sends `src`; the
/// time from the handoff until decode's `Success`, in seconds (both ends then released). Test
/// support for the request-level comparison; not part of the API.
#[pyfunction]
fn _rust_request_seconds(
    py: Python<'_>,
    prefill: PyRef<'_, Agent>,
    decode: PyRef<'_, Agent>,
    room: u64,
    src: Vec<u32>,
    dst: Vec<u32>,
) -> PyResult<f64> {
    guarded("_rust_request_seconds", || {
        let (pre, pre_rt) = prefill.shared("_rust_request_seconds")?;
        let (dec, dec_rt) = decode.shared("_rust_request_seconds")?;
        py.detach(|| {
            let deadline = Instant::now() + Duration::from_secs(30);
            let room = RequestId(room);
            let t = Instant::now();
            let rx = {
                let _rt = dec_rt.enter();
                let rx = dec.receiver(room).map_err(err)?;
                rx.send_metadata(&dst, None).map_err(err)?;
                rx
            };
            let tx = {
                let _rt = pre_rt.enter();
                let tx = pre.sender(room).map_err(err)?;
                tx.init(src.len() as u32).map_err(err)?;
                tx
            };
            let ready = pre_rt.block_on(tx.wait_ready(deadline)).map_err(err)?;
            if ready.phase != Phase::WaitingForInput {
                return Err(KvxferError::new_err(format!("request {room}: prefill {:?}", ready.phase)));
            }
            {
                let _rt = pre_rt.enter();
                tx.send(&src).map_err(err)?;
            }
            let done = dec_rt.block_on(rx.wait(deadline)).map_err(err)?;
            let elapsed = t.elapsed();
            if done.phase != Phase::Success {
                return Err(KvxferError::new_err(format!(
                    "request {room}: decode {:?}: {:?}",
                    done.phase, done.reason
                )));
            }
            pre_rt.block_on(tx.wait(deadline)).map_err(err)?;
            tx.release().map_err(err)?;
            rx.release().map_err(err)?;
            Ok(elapsed.as_secs_f64())
        })
    })
}

/// The backends compiled into this build.
#[pyfunction]
fn backends() -> Vec<&'static str> {
    kvxfer::backends::linked().into_iter().map(|(n, _)| n).collect()
}

/// `kvxfer._native`: the Rust core of the `kvxfer` package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KvxferError", m.py().get_type::<KvxferError>())?;
    m.add("StoreUnreachable", m.py().get_type::<StoreUnreachable>())?;
    m.add_class::<Topology>()?;
    m.add_class::<BootstrapServer>()?;
    m.add_class::<Agent>()?;
    m.add_class::<Receiver>()?;
    m.add_class::<Sender>()?;
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    m.add_function(wrap_pyfunction!(_rust_send_poll_seconds, m)?)?;
    m.add_function(wrap_pyfunction!(_rust_request_seconds, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FAILED", kvpoll::FAILED)?;
    m.add("BOOTSTRAPPING", kvpoll::BOOTSTRAPPING)?;
    m.add("WAITING_FOR_INPUT", kvpoll::WAITING_FOR_INPUT)?;
    m.add("TRANSFERRING", kvpoll::TRANSFERRING)?;
    m.add("SUCCESS", kvpoll::SUCCESS)?;
    Ok(())
}

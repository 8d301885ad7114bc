//! The safe wrapper over libfabric: one RDM endpoint with its fabric, domain, completion queue,
//! address vector and memory registrations, all owned by [`RdmEndpoint`] and closed by its Drop in
//! the order libfabric requires (registrations, endpoint, address vector, completion queue, domain,
//! fabric, info).
//!
//! This is the only module of the crate with `unsafe` code (`unsafe_code` is denied elsewhere): it
//! calls the C library through `kvxfer-fabric-sys`. Every public function here is safe to call: the
//! posting functions ([`Endpoint::write`], [`Endpoint::send`], the receives) hand the provider
//! pointers it keeps past the call, and they are sound because the endpoint itself keeps what those
//! pointers point to alive until the operation's completion is read or the endpoint is closed: the
//! [`MemDesc`] of every registration and of every write's source, the owned message of every send
//! (copied into an owned, registered [`HostBuffer`] under `FI_MR_LOCAL`), the receive slab, and the
//! boxed per-operation context. A caller cannot free that memory early from safe code.
//!
//! Threading: the domain is opened with `FI_THREAD_DOMAIN` (or better), which makes the application
//! serialise every call on the domain's objects. `RdmEndpoint` methods take `&mut self`, so Rust's
//! borrow rules do exactly that; the backend keeps the endpoint in a mutex.
#![allow(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::ptr;
use std::sync::Mutex;
use std::time::Duration;

use kvxfer_core::{BackendError, HostBuffer, MemDesc};
use kvxfer_fabric_sys as sys;

use crate::NAME;

/// `FI_ADDR_UNSPEC` (`(uint64_t)-1`, a cast bindgen does not translate).
pub const FI_ADDR_UNSPEC: u64 = u64::MAX;

/// `-FI_EAGAIN` as a return code.
const EAGAIN: isize = -(sys::FI_EAGAIN as isize);
/// `-FI_EAVAIL` as a return code.
const EAVAIL: isize = -(sys::FI_EAVAIL as isize);

/// libfabric's error string for a (positive) error number.
pub fn strerror(code: i64) -> String {
    // SAFETY: fi_strerror returns a pointer to a static, NUL-terminated string for any input.
    unsafe {
        let p = sys::fi_strerror(code.unsigned_abs() as i32);
        if p.is_null() {
            format!("error {code}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// Turns a libfabric return code into a typed error naming the call.
fn check(call: &'static str, ret: isize, context: impl FnOnce() -> String) -> Result<(), BackendError> {
    if ret >= 0 {
        Ok(())
    } else {
        Err(BackendError::Ffi {
            backend: NAME,
            call,
            code: ret as i64,
            detail: format!("{}; {}", strerror(ret as i64), context()),
        })
    }
}

/// What the application asks of the provider.
#[derive(Debug, Clone)]
pub struct Hints {
    /// Provider name as libfabric spells it (`tcp;ofi_rxm`, `shm`, `efa`, ...); `None` lets libfabric
    /// choose (it honours `FI_PROVIDER` itself).
    pub provider: Option<String>,
    /// Local address (node) to bind to, e.g. `127.0.0.1`; `None` takes the provider's first.
    pub node: Option<String>,
    /// Open the completion queue with an fd wait object (`FI_WAIT_FD`) if the provider offers one, so
    /// an idle progress thread can block on it (see [`Endpoint::try_wait`]).
    pub wait_fd: bool,
}

/// The memory-registration mode bits of the chosen provider (`fi_domain_attr::mr_mode`), decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrMode {
    /// `FI_MR_LOCAL`: local buffers (write sources, send and receive buffers) must be registered and
    /// their descriptors passed.
    pub local: bool,
    /// `FI_MR_VIRT_ADDR`: remote addresses are virtual addresses (else offsets into the region).
    pub virt_addr: bool,
    /// `FI_MR_ALLOCATED`: registered memory must be allocated and backed (ours always is).
    pub allocated: bool,
    /// `FI_MR_PROV_KEY`: the provider picks keys (else we request unique ones).
    pub prov_key: bool,
    /// `FI_MR_ENDPOINT`: registrations are bound to the endpoint and enabled before use.
    pub endpoint: bool,
}

impl MrMode {
    fn from_bits(bits: u64) -> Self {
        let has = |b: u32| bits & u64::from(b) != 0;
        Self {
            local: has(sys::FI_MR_LOCAL),
            virt_addr: has(sys::FI_MR_VIRT_ADDR),
            allocated: has(sys::FI_MR_ALLOCATED),
            prov_key: has(sys::FI_MR_PROV_KEY),
            endpoint: has(sys::FI_MR_ENDPOINT),
        }
    }
}

impl fmt::Display for MrMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut v = Vec::new();
        for (on, name) in [
            (self.local, "FI_MR_LOCAL"),
            (self.virt_addr, "FI_MR_VIRT_ADDR"),
            (self.allocated, "FI_MR_ALLOCATED"),
            (self.prov_key, "FI_MR_PROV_KEY"),
            (self.endpoint, "FI_MR_ENDPOINT"),
        ] {
            if on {
                v.push(name);
            }
        }
        if v.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&v.join("|"))
        }
    }
}

/// What the chosen provider offers, read from its `fi_info`.
#[derive(Debug, Clone)]
pub struct ProviderInfo {
    /// `fabric_attr->prov_name`, e.g. `tcp;ofi_rxm`.
    pub provider: String,
    /// `fabric_attr->name`.
    pub fabric: String,
    /// `domain_attr->name`.
    pub domain: String,
    /// Memory-registration mode bits.
    pub mr_mode: MrMode,
    /// `domain_attr->mr_key_size`.
    pub mr_key_size: usize,
    /// `domain_attr->cq_data_size` (bytes of remote CQ data a write can carry).
    pub cq_data_size: usize,
    /// Whether `FI_RMA_EVENT` is among the capabilities.
    pub rma_event: bool,
    /// Whether `FI_DELIVERY_COMPLETE` is the default completion semantic of transmits.
    pub delivery_complete: bool,
    /// Whether sends are ordered after earlier writes (`FI_ORDER_SAW` in `tx_attr->msg_order`).
    pub order_saw: bool,
    /// Whether writes are ordered after earlier writes (`FI_ORDER_WAW` in `tx_attr->msg_order`).
    pub order_waw: bool,
    /// Whether the provider needs a posted receive for each write with remote CQ data (`FI_RX_CQ_DATA`).
    pub rx_cq_data: bool,
    /// `min(tx_attr->iov_limit, tx_attr->rma_iov_limit)`, at least 1.
    pub iov_limit: usize,
    /// `ep_attr->max_msg_size`.
    pub max_msg_size: u64,
    /// `tx_attr->size`.
    pub tx_size: usize,
    /// `rx_attr->size`.
    pub rx_size: usize,
}

/// An owned `fi_info` list (only its first entry is used).
struct Info(*mut sys::fi_info);

impl Drop for Info {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: allocated by fi_getinfo/fi_allocinfo, freed once here.
            unsafe { sys::fi_freeinfo(self.0) }
        }
    }
}

fn cstr_field(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: libfabric strings in fi_info are NUL-terminated and live as long as the info.
        unsafe { CStr::from_ptr(p).to_string_lossy().into_owned() }
    }
}

/// Queries libfabric for an RDM endpoint with messages and RMA writes.
fn getinfo(hints: &Hints, delivery_complete: bool) -> Result<Info, BackendError> {
    // SAFETY: fi_allocinfo returns a zeroed fi_info with allocated attribute structs, or NULL.
    let h = Info(unsafe { sys::kvx_fi_allocinfo() });
    if h.0.is_null() {
        return Err(BackendError::Ffi {
            backend: NAME,
            call: "fi_allocinfo",
            code: -12,
            detail: "out of memory".into(),
        });
    }
    let prov = hints
        .provider
        .as_deref()
        .map(CString::new)
        .transpose()
        .map_err(|_| BackendError::Config { backend: NAME, detail: "provider name contains a NUL byte".into() })?;
    let node = hints
        .node
        .as_deref()
        .map(CString::new)
        .transpose()
        .map_err(|_| BackendError::Config { backend: NAME, detail: "address contains a NUL byte".into() })?;
    // SAFETY: h.0 and its attribute pointers were allocated by fi_allocinfo and are exclusively ours;
    // the provider name is duplicated with the C allocator because fi_freeinfo frees it.
    unsafe {
        let i = &mut *h.0;
        i.caps = u64::from(sys::FI_MSG | sys::FI_RMA);
        i.mode = sys::FI_CONTEXT | sys::FI_CONTEXT2 | sys::FI_RX_CQ_DATA;
        (*i.ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
        let d = &mut *i.domain_attr;
        d.mr_mode = (sys::FI_MR_LOCAL
            | sys::FI_MR_VIRT_ADDR
            | sys::FI_MR_ALLOCATED
            | sys::FI_MR_PROV_KEY
            | sys::FI_MR_ENDPOINT) as i32;
        d.threading = sys::fi_threading_FI_THREAD_DOMAIN;
        if delivery_complete {
            (*i.tx_attr).op_flags = u64::from(sys::FI_DELIVERY_COMPLETE);
        }
        if let Some(p) = &prov {
            (*i.fabric_attr).prov_name = sys::kvx_strdup(p.as_ptr());
        }
    }
    let mut out: *mut sys::fi_info = ptr::null_mut();
    let (node_ptr, flags) = match &node {
        Some(n) => (n.as_ptr(), sys::FI_SOURCE),
        None => (ptr::null(), 0),
    };
    // SAFETY: all pointers are valid for the call; `out` receives a list we own (wrapped below).
    let ret = unsafe { sys::fi_getinfo(sys::KVX_FI_API_VERSION, node_ptr, ptr::null(), flags, h.0, &mut out) };
    let info = Info(out);
    check("fi_getinfo", ret as isize, || {
        format!(
            "no RDM endpoint with FI_MSG|FI_RMA from provider {}{}{}",
            hints.provider.as_deref().unwrap_or("(any; FI_PROVIDER unset)"),
            hints.node.as_deref().map(|n| format!(" at {n}")).unwrap_or_default(),
            if delivery_complete { " with FI_DELIVERY_COMPLETE" } else { "" }
        )
    })?;
    if info.0.is_null() {
        return Err(BackendError::NoDevice { backend: NAME, detail: "fi_getinfo returned no entries".into() });
    }
    Ok(info)
}

fn provider_info(info: &Info) -> ProviderInfo {
    // SAFETY: info.0 is a non-null fi_info returned by fi_getinfo, with its attribute structs set.
    unsafe {
        let i = &*info.0;
        let tx = &*i.tx_attr;
        let rx = &*i.rx_attr;
        let d = &*i.domain_attr;
        let ep = &*i.ep_attr;
        let fab = &*i.fabric_attr;
        ProviderInfo {
            provider: cstr_field(fab.prov_name),
            fabric: cstr_field(fab.name),
            domain: cstr_field(d.name),
            mr_mode: MrMode::from_bits(d.mr_mode as u32 as u64),
            mr_key_size: d.mr_key_size,
            cq_data_size: d.cq_data_size,
            rma_event: i.caps & sys::FI_RMA_EVENT != 0,
            delivery_complete: tx.op_flags & u64::from(sys::FI_DELIVERY_COMPLETE) != 0,
            order_saw: tx.msg_order & u64::from(sys::FI_ORDER_SAW) != 0,
            order_waw: tx.msg_order & u64::from(sys::FI_ORDER_WAW) != 0,
            rx_cq_data: i.mode & sys::FI_RX_CQ_DATA != 0,
            iov_limit: tx.iov_limit.min(tx.rma_iov_limit).max(1),
            max_msg_size: ep.max_msg_size as u64,
            tx_size: tx.size,
            rx_size: rx.size,
        }
    }
}

/// Whether this process may use cross-memory attach (`process_vm_writev`) on process `pid`: what
/// libfabric 1.17's shm provider tests when it maps a peer (`smr_cma_check`, a one-value
/// `process_vm_writev` into the peer's region) to choose between copying by CMA and its
/// segmentation-and-reassembly protocol. The probe writes one byte to address 0 of `pid`: the
/// kernel checks the permission first (`EPERM`, `ESRCH`), then fails the copy (`EFAULT`) without
/// writing anything.
pub fn cma_permitted(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    let mut byte = 0u8;
    let local = libc::iovec { iov_base: (&mut byte as *mut u8).cast(), iov_len: 1 };
    let remote = libc::iovec { iov_base: ptr::null_mut(), iov_len: 1 };
    // SAFETY: `local` describes one readable byte of ours for the call; `remote` names address 0 of
    // the target, which no process maps, so the kernel writes nothing (EFAULT after its permission
    // check); both iovec arrays hold one element as the counts say.
    let n = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
    n >= 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EFAULT)
}

/// A libfabric boolean parameter from the environment, parsed as libfabric parses it (`fi_param_get`:
/// 0/false/no/off, 1/true/yes/on, case-insensitive); unset or unparsable is `false`.
pub fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| {
        let v = v.trim();
        v == "1" || ["true", "yes", "on"].iter().any(|t| v.eq_ignore_ascii_case(t))
    })
}

/// A handle to one memory registration of an [`RdmEndpoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrHandle(u64);

/// What a peer needs to write into a registration.
#[derive(Debug, Clone, Copy)]
pub struct MrInfo {
    /// The remote key.
    pub key: u64,
    /// The base address remote writes use: the buffer's virtual address under `FI_MR_VIRT_ADDR`, else 0.
    pub base: u64,
}

struct Mr {
    fid: *mut sys::fid_mr,
    desc: *mut c_void,
    /// Registered through [`Endpoint::reg`] (a user region), closed when the endpoint is recycled.
    user: bool,
    /// The registered memory, kept alive as long as the registration.
    mem: MemDesc,
}

/// Storage the provider may use per operation (`struct fi_context2`, for the `FI_CONTEXT2` mode). Its
/// address is the operation's context.
#[derive(Default)]
struct OpContext(#[allow(dead_code)] sys::fi_context2);

/// What an in-flight operation keeps alive until its completion.
enum Keep {
    /// A write: the source memory.
    Regions(#[allow(dead_code)] Vec<MemDesc>),
    /// A send: the message (`None` under `FI_MR_LOCAL`, where it was copied into an owned buffer that
    /// its registration keeps alive) and that registration.
    Send(#[allow(dead_code)] Option<Vec<u8>>, Option<MrHandle>),
    /// A posted receive: its slot in the receive slab.
    Recv(usize),
}

struct Op {
    /// Boxed so its address (the context) is stable while the map moves entries around.
    #[allow(dead_code)]
    ctx: Box<OpContext>,
    user: u64,
    keep: Keep,
    /// The endpoint generation that posted it (see [`RdmEndpoint`]): completions of an earlier
    /// owner's operations are swallowed.
    generation: u64,
    /// Bytes it carries.
    bytes: u64,
}

/// A failed operation, as `fi_cq_readerr` described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FiError {
    /// The (positive) libfabric error number.
    pub code: i32,
    /// `fi_strerror` and `fi_cq_strerror` text.
    pub detail: String,
    /// The provider's own error number (`prov_errno`; the tcp provider's is the socket's errno).
    pub prov_errno: i32,
}

/// libfabric's connection errors (their numbers are the Linux errno values).
const CONNECTION_ERRORS: [u32; 7] = [
    sys::FI_ECONNRESET,
    sys::FI_ECONNREFUSED,
    sys::FI_ECONNABORTED,
    sys::FI_ENOTCONN,
    sys::FI_ETIMEDOUT,
    sys::FI_EHOSTUNREACH,
    sys::FI_EIO,
];

impl FiError {
    /// Whether the error says the connection to the peer is gone: a connection error, or an
    /// operation the provider cancelled because its socket failed with one (the tcp provider
    /// completes the writes queued to a dead peer with `FI_ECANCELED` and `prov_errno` ENOTCONN or
    /// ECONNRESET; without this a killed decode rank was reported only as a failed write, never as
    /// a lost peer).
    pub fn is_connection_loss(&self) -> bool {
        const EPIPE: i32 = 32;
        let conn = |c: i32| CONNECTION_ERRORS.iter().any(|e| *e as i32 == c) || c == EPIPE;
        conn(self.code) || (self.code == sys::FI_ECANCELED as i32 && self.prov_errno != 0 && conn(self.prov_errno))
    }
}

/// What [`Endpoint::poll`](crate::ffi::Endpoint::poll) reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A write or send posted with `user` completed (with an error, if `error` is set).
    Done {
        /// The value given when posting.
        user: u64,
        /// The failure, if any.
        error: Option<FiError>,
        /// Bytes the operation carried.
        bytes: u64,
    },
    /// A message arrived in a posted receive buffer (its bytes, copied out; the buffer is reposted).
    Message(Vec<u8>),
    /// A remote write carrying CQ data completed here.
    RemoteData(u64),
    /// A receive failed (e.g. a message longer than the posted buffers).
    RecvError(FiError),
}

/// A local source range: a registration and a byte range inside it.
#[derive(Debug, Clone, Copy)]
pub struct LocalRange {
    /// The registration.
    pub mr: MrHandle,
    /// Offset in the registered memory.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

/// A remote range: address (virtual or offset, as the peer's mode says), length and key.
#[derive(Debug, Clone, Copy)]
pub struct RemoteIov {
    /// Address.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Key.
    pub key: u64,
}

/// What [`Endpoint::av_remove`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AvRemoved {
    /// The address was removed (and on `tcp;ofi_rxm` with `FI_AV_REMOVE_CLEANUP`, its connection
    /// closed).
    Removed,
    /// The provider holds no connection to it (a post to it fails at once), so there was nothing to
    /// close; the address stays in the address vector (libfabric 1.17 crashes removing it).
    NoConnection,
}

/// Why a post did not go out.
#[derive(Debug)]
pub enum PostError {
    /// The provider's queue is full (`-FI_EAGAIN`): progress the completion queue and retry.
    Again,
    /// Any other failure.
    Failed(BackendError),
}

/// An RDM endpoint and everything it needs, owned together: the fabric, domain, completion queue,
/// address vector, memory registrations, in-flight operations (and what they keep alive), and a slab
/// of receive buffers it keeps posted. Used through [`RdmEndpoint`].
pub struct Endpoint {
    mrs: HashMap<u64, Mr>,
    ep: *mut sys::fid_ep,
    av: *mut sys::fid_av,
    cq: *mut sys::fid_cq,
    domain: *mut sys::fid_domain,
    fabric: *mut sys::fid_fabric,
    _info: Info,
    pinfo: ProviderInfo,
    next_mr: u64,
    next_key: u64,
    name: Vec<u8>,
    /// Every address inserted into `av`, with its `fi_addr_t`. Kept for the endpoint's whole life
    /// (across recycling): an address is inserted once. libfabric 1.17's shm counts every insertion,
    /// duplicates included, against its 256-peer limit, so re-inserting the addresses of recycled
    /// peers once per use made `fi_av_insert` fail after 256 uses of a recycled endpoint.
    av_known: HashMap<Vec<u8>, u64>,
    /// Destinations whose last post failed at once with an error other than `-FI_EAGAIN`. On
    /// `tcp;ofi_rxm` such a failure (a connect the kernel refused in the call, e.g. `ENETUNREACH` while
    /// the link is down) leaves libfabric 1.17's connection object for that peer idle, without an
    /// endpoint, and `fi_av_remove` under `FI_AV_REMOVE_CLEANUP` then closes that missing endpoint and
    /// crashes the process (`rxm_av_remove_handler` -> `rxm_close_conn` -> `fi_close(NULL)`; later
    /// releases check for it). [`Endpoint::av_remove`] reads this set.
    unconnected: HashSet<u64>,
    /// In-flight operations by context address. Dropped after the handles are closed (Drop below).
    ops: HashMap<usize, Op>,
    recv_slab: Option<(MemDesc, MrHandle, usize)>,
    unposted: Vec<usize>,
    tx_in_flight: usize,
    generation: u64,
    pool_key: (Option<String>, Option<String>, bool),
    wait_fd: Option<i32>,
    /// Whether [`Endpoint::write`] asks for `FI_DELIVERY_COMPLETE` (what the provider granted, unless
    /// changed with [`Endpoint::set_delivery_complete`]).
    delivery_complete: bool,
}

// SAFETY: libfabric objects opened with FI_THREAD_DOMAIN may be used from any thread as long as calls
// are serialised; every method that calls libfabric takes `&mut self`, and the backend keeps the
// endpoint in a Mutex (the recycling pool in another). The raw pointers in `ops` point into memory
// this struct owns or keeps alive.
unsafe impl Send for Endpoint {}

/// Endpoints of providers that must not be closed while the process runs (see [`RdmEndpoint`]).
/// Boxed because [`RdmEndpoint`] holds them boxed; moving between the two is then a pointer move.
#[allow(clippy::vec_box)]
static RECYCLED: Mutex<Vec<Box<Endpoint>>> = Mutex::new(Vec::new());

#[allow(clippy::vec_box)]
fn recycled() -> std::sync::MutexGuard<'static, Vec<Box<Endpoint>>> {
    RECYCLED.lock().unwrap_or_else(|p| p.into_inner())
}

/// An open [`Endpoint`], closed on drop, except for the `shm` provider, whose endpoints are recycled.
///
/// Why: libfabric 1.17's shm provider shares the shared-memory region of an endpoint with the other
/// endpoints of the same process by pointer, and `fi_close` unmaps it, so any later access by a peer
/// endpoint of the same process (a send, the progress of an earlier command, closing its address
/// vector) crashes the process. Recycling keeps every shm region mapped for the life of the process
/// and bounds their number by the peak of endpoints open at once. A recycled endpoint gets a new
/// generation: its user registrations are closed (their keys are never reused), completions of the
/// previous owner's operations are swallowed, and the backend tags messages with the receiver's
/// nonce so stale ones are dropped.
pub struct RdmEndpoint(Option<Box<Endpoint>>);

impl std::ops::Deref for RdmEndpoint {
    type Target = Endpoint;
    fn deref(&self) -> &Endpoint {
        self.0.as_deref().expect("present until drop")
    }
}

impl std::ops::DerefMut for RdmEndpoint {
    fn deref_mut(&mut self) -> &mut Endpoint {
        self.0.as_deref_mut().expect("present until drop")
    }
}

impl Drop for RdmEndpoint {
    fn drop(&mut self) {
        if let Some(mut e) = self.0.take() {
            if e.pinfo.provider == "shm" {
                let user: Vec<u64> = e.mrs.iter().filter(|(_, m)| m.user).map(|(k, _)| *k).collect();
                for k in user {
                    e.dereg(MrHandle(k));
                }
                e.generation += 1;
                e.delivery_complete = e.pinfo.delivery_complete;
                recycled().push(e);
                AT_EXIT.call_once(|| {
                    // SAFETY: registers a plain `extern "C" fn` that takes no arguments.
                    unsafe { sys::kvx_atexit(Some(close_recycled_at_exit)) };
                    let spawned =
                        std::thread::Builder::new().name("kvxfer-fabric-pool".into()).spawn(progress_recycled);
                    if let Err(e) = spawned {
                        tracing::warn!(target: "kvxfer_fabric", "no progress thread for recycled endpoints: {e}");
                    }
                });
            }
        }
    }
}

static AT_EXIT: std::sync::Once = std::sync::Once::new();

/// Keeps polling the recycled (idle) endpoints, discarding what they report.
///
/// An endpoint dropped while the provider still had work of it under way (a write in its
/// segmentation-and-reassembly protocol, a peer's message half received) would otherwise hold the
/// peer's shared buffers forever: shm then answers `-FI_EAGAIN` to every later post from or to that
/// peer, which the conformance suite saw as a hello that never went out. Polls every 1-20 ms (backing
/// off while nothing happens) for the life of the process.
fn progress_recycled() {
    let mut events = Vec::new();
    let mut sleep = Duration::from_millis(1);
    loop {
        std::thread::sleep(sleep);
        let mut worked = 0;
        for e in recycled().iter_mut() {
            worked += e.poll(&mut events, 64).unwrap_or(0);
            events.clear();
        }
        sleep = if worked > 0 { Duration::from_millis(1) } else { (sleep * 2).min(Duration::from_millis(20)) };
    }
}

/// Closes the recycled endpoints when the process exits, so the provider removes their shared-memory
/// files (`/dev/shm`). Registered with `atexit` on first recycling.
extern "C" fn close_recycled_at_exit() {
    // A panic must not unwind into C.
    let _ = std::panic::catch_unwind(|| {
        let pool = std::mem::take(&mut *recycled());
        drop(pool);
    });
}

impl RdmEndpoint {
    /// Opens an endpoint (or takes a recycled one opened with the same hints).
    pub fn open(hints: &Hints) -> Result<Self, BackendError> {
        let key = (hints.provider.clone(), hints.node.clone(), hints.wait_fd);
        let reuse = {
            let mut pool = recycled();
            pool.iter().position(|e| e.pool_key == key).map(|i| pool.swap_remove(i))
        };
        match reuse {
            Some(e) => Ok(Self(Some(e))),
            None => Ok(Self(Some(Box::new(Endpoint::open(hints)?)))),
        }
    }
}

fn close_fid(what: &str, fid: *mut sys::fid) {
    if fid.is_null() {
        return;
    }
    // SAFETY: fid is an open libfabric object owned by the caller, closed exactly once.
    let ret = unsafe { sys::kvx_fi_close(fid) };
    if ret != 0 {
        tracing::warn!(target: "kvxfer_fabric", "fi_close({what}) failed: {} ({ret})", strerror(ret as i64));
    }
}

macro_rules! fid_of {
    ($p:expr) => {
        if $p.is_null() {
            ptr::null_mut()
        } else {
            // SAFETY: the handle is non-null and open; every fid_* struct starts with its `struct fid`.
            #[allow(unused_unsafe)]
            unsafe {
                ptr::addr_of_mut!((*$p).fid)
            }
        }
    };
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Close order: endpoint first (it stops using posted buffers and registrations), then the
        // registrations, address vector, completion queue, domain and fabric. The memory that in-flight
        // operations reference (`ops`, `recv_slab`) is freed only after this, when the fields drop.
        close_fid("ep", fid_of!(self.ep));
        for (_, mr) in self.mrs.drain() {
            close_fid("mr", fid_of!(mr.fid));
        }
        close_fid("av", fid_of!(self.av));
        close_fid("cq", fid_of!(self.cq));
        close_fid("domain", fid_of!(self.domain));
        close_fid("fabric", fid_of!(self.fabric));
    }
}

impl Endpoint {
    /// Opens fabric, domain, completion queue, address vector and an enabled RDM endpoint. Asks for
    /// `FI_DELIVERY_COMPLETE` first and falls back to the provider's default completion semantic.
    fn open(hints: &Hints) -> Result<Self, BackendError> {
        let info = match getinfo(hints, true) {
            Ok(i) => i,
            Err(first) => getinfo(hints, false).inspect_err(|_| {
                tracing::debug!(target: "kvxfer_fabric", "with FI_DELIVERY_COMPLETE: {first}");
            })?,
        };
        let pinfo = provider_info(&info);
        if pinfo.mr_key_size > 8 {
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!("provider {} with {}-byte MR keys (FI_MR_RAW)", pinfo.provider, pinfo.mr_key_size),
            });
        }
        let mut me = Self {
            mrs: HashMap::new(),
            ep: ptr::null_mut(),
            av: ptr::null_mut(),
            cq: ptr::null_mut(),
            domain: ptr::null_mut(),
            fabric: ptr::null_mut(),
            _info: info,
            pinfo,
            next_mr: 1,
            next_key: 1,
            name: Vec::new(),
            av_known: HashMap::new(),
            unconnected: HashSet::new(),
            ops: HashMap::new(),
            recv_slab: None,
            unposted: Vec::new(),
            tx_in_flight: 0,
            generation: 0,
            pool_key: (hints.provider.clone(), hints.node.clone(), hints.wait_fd),
            wait_fd: None,
            delivery_complete: false,
        };
        me.delivery_complete = me.pinfo.delivery_complete;
        let prov = me.pinfo.provider.clone();
        let ctx = || format!("provider {prov}");
        let i = me._info.0;
        // SAFETY: `i` is the fi_info we own; each out-pointer is a field of `me`, whose Drop closes
        // whatever was opened if a later step fails.
        unsafe {
            check("fi_fabric", sys::fi_fabric((*i).fabric_attr, &mut me.fabric, ptr::null_mut()) as isize, ctx)?;
            check("fi_domain", sys::kvx_fi_domain(me.fabric, i, &mut me.domain, ptr::null_mut()) as isize, ctx)?;
            let mut cq_attr = sys::fi_cq_attr {
                format: sys::fi_cq_format_FI_CQ_FORMAT_DATA,
                wait_obj: sys::fi_wait_obj_FI_WAIT_FD,
                ..Default::default()
            };
            if hints.wait_fd && sys::kvx_fi_cq_open(me.domain, &mut cq_attr, &mut me.cq, ptr::null_mut()) == 0 {
                let fd = sys::kvx_cq_wait_fd(me.cq);
                if fd >= 0 {
                    me.wait_fd = Some(fd);
                }
            } else {
                me.cq = ptr::null_mut();
                cq_attr.wait_obj = sys::fi_wait_obj_FI_WAIT_NONE;
                let ret = sys::kvx_fi_cq_open(me.domain, &mut cq_attr, &mut me.cq, ptr::null_mut());
                check("fi_cq_open", ret as isize, ctx)?;
            }
            let mut av_attr = sys::fi_av_attr { type_: sys::fi_av_type_FI_AV_TABLE, ..Default::default() };
            check(
                "fi_av_open",
                sys::kvx_fi_av_open(me.domain, &mut av_attr, &mut me.av, ptr::null_mut()) as isize,
                ctx,
            )?;
            check("fi_endpoint", sys::kvx_fi_endpoint(me.domain, i, &mut me.ep, ptr::null_mut()) as isize, ctx)?;
            let flags = u64::from(sys::FI_TRANSMIT | sys::FI_RECV);
            check("fi_ep_bind(cq)", sys::kvx_fi_ep_bind(me.ep, fid_of!(me.cq), flags) as isize, ctx)?;
            check("fi_ep_bind(av)", sys::kvx_fi_ep_bind(me.ep, fid_of!(me.av), 0) as isize, ctx)?;
            check("fi_enable", sys::kvx_fi_enable(me.ep) as isize, ctx)?;
            let mut buf = vec![0u8; 256];
            let mut len = buf.len();
            let ret = sys::kvx_fi_getname(fid_of!(me.ep), buf.as_mut_ptr().cast(), &mut len);
            if ret == -(sys::FI_ETOOSMALL as i32) && len > buf.len() {
                buf.resize(len, 0);
                let ret = sys::kvx_fi_getname(fid_of!(me.ep), buf.as_mut_ptr().cast(), &mut len);
                check("fi_getname", ret as isize, ctx)?;
            } else {
                check("fi_getname", ret as isize, ctx)?;
            }
            buf.truncate(len);
            me.name = buf;
        }
        Ok(me)
    }

    /// Whether [`Self::write`] asks for `FI_DELIVERY_COMPLETE` (default: when the provider granted
    /// it). Only the completion probe (`tests/completion.rs`) turns it off.
    pub fn set_delivery_complete(&mut self, on: bool) {
        self.delivery_complete = on && self.pinfo.delivery_complete;
    }

    /// Whether [`Self::write`] asks for `FI_DELIVERY_COMPLETE`.
    pub fn delivery_complete_requested(&self) -> bool {
        self.delivery_complete
    }

    /// What the provider offers.
    pub fn info(&self) -> &ProviderInfo {
        &self.pinfo
    }

    /// This endpoint's address (`fi_getname`), for peers' `fi_av_insert`.
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// Whether the completion queue has an fd wait object.
    pub fn has_wait_fd(&self) -> bool {
        self.wait_fd.is_some()
    }

    /// `fi_trywait` on the completion queue: `Some(fd)` when it is safe to block on the fd until the
    /// provider has something to do (then poll again); `None` when there is no wait fd or events are
    /// pending.
    pub fn try_wait(&mut self) -> Option<i32> {
        let fd = self.wait_fd?;
        // SAFETY: fabric and cq are open; fi_trywait only inspects them.
        let ret = unsafe { sys::kvx_fi_trywait(self.fabric, self.cq) };
        (ret == 0).then_some(fd)
    }

    /// Size of each posted receive buffer (0 before [`Self::post_receives`]).
    pub fn recv_buf_size(&self) -> usize {
        self.recv_slab.as_ref().map_or(0, |(_, _, s)| *s)
    }

    /// Writes and sends posted and not yet completed.
    pub fn tx_in_flight(&self) -> usize {
        self.tx_in_flight
    }

    /// Inserts a peer's address into the address vector, once: inserting a known address again
    /// returns its `fi_addr_t` without calling the provider.
    pub fn av_insert(&mut self, addr: &[u8]) -> Result<u64, BackendError> {
        if let Some(&known) = self.av_known.get(addr) {
            return Ok(known);
        }
        let mut fi_addr: u64 = FI_ADDR_UNSPEC;
        // SAFETY: `addr` is a readable buffer; the provider reads one address of its own format from it
        // (the caller checked the peer uses the same provider, whose fi_getname produced it);
        // `fi_addr` is a valid out-pointer.
        let n = unsafe { sys::kvx_fi_av_insert(self.av, addr.as_ptr().cast(), 1, &mut fi_addr, 0, ptr::null_mut()) };
        if n != 1 {
            // A synchronous AV without an event queue reports a refused address only by inserting
            // none: there is no error code to give.
            let (code, detail) = if n < 0 {
                (n as i64, format!("{}; {} bytes of address", strerror(n as i64), addr.len()))
            } else {
                (
                    -(sys::FI_EINVAL as i64),
                    format!(
                        "the provider inserted {n} of 1 addresses ({} bytes) and gives no reason; this \
                         address vector holds {} addresses (libfabric 1.17's shm refuses more than 256)",
                        addr.len(),
                        self.av_known.len()
                    ),
                )
            };
            return Err(BackendError::Ffi { backend: NAME, call: "fi_av_insert", code, detail });
        }
        self.av_known.insert(addr.to_vec(), fi_addr);
        Ok(fi_addr)
    }

    fn reg_access(&mut self, mem: &MemDesc, access: u64, user: bool) -> Result<(MrHandle, MrInfo), BackendError> {
        let requested_key = if self.pinfo.mr_mode.prov_key { 0 } else { self.next_key };
        let mut mr: *mut sys::fid_mr = ptr::null_mut();
        let (p, len) = (mem.addr(), mem.len());
        let ctx = || format!("registering {len} bytes at {p:p} (mr_mode {})", self.pinfo.mr_mode);
        // SAFETY: MemDesc's contract (its unsafe constructor, or HostBuffer ownership) keeps
        // `p..p+len` valid while a clone lives; we keep one in the map with the registration until it
        // is closed. `mr` is a valid out-pointer.
        let ret = unsafe {
            sys::kvx_fi_mr_reg(self.domain, p.cast(), len, access, 0, requested_key, 0, &mut mr, ptr::null_mut())
        };
        check("fi_mr_reg", ret as isize, ctx)?;
        if self.pinfo.mr_mode.endpoint {
            // SAFETY: mr and ep are open; FI_MR_ENDPOINT requires binding the MR to the endpoint and
            // enabling it before use.
            let r = unsafe { sys::kvx_fi_mr_bind(mr, fid_of!(self.ep), 0) };
            // SAFETY: as above.
            let r = check("fi_mr_bind", r as isize, ctx)
                .and_then(|_| check("fi_mr_enable", unsafe { sys::kvx_fi_mr_enable(mr) } as isize, ctx));
            if let Err(e) = r {
                close_fid("mr", fid_of!(mr));
                return Err(e);
            }
        }
        // SAFETY: mr is open (and enabled).
        let (key, desc) = unsafe { (sys::kvx_fi_mr_key(mr), sys::kvx_fi_mr_desc(mr)) };
        if key == u64::MAX {
            close_fid("mr", fid_of!(mr));
            return Err(BackendError::Ffi {
                backend: NAME,
                call: "fi_mr_key",
                code: -(sys::FI_EINVAL as i64),
                detail: "the provider returned FI_KEY_NOTAVAIL (raw keys are not supported)".into(),
            });
        }
        if !self.pinfo.mr_mode.prov_key {
            self.next_key += 1;
        }
        let h = MrHandle(self.next_mr);
        self.next_mr += 1;
        self.mrs.insert(h.0, Mr { fid: mr, desc, user, mem: mem.clone() });
        let base = if self.pinfo.mr_mode.virt_addr { p as u64 } else { 0 };
        Ok((h, MrInfo { key, base }))
    }

    /// Registers `mem` for local use only (sources of writes, no remote access): its key lets no
    /// peer write. Otherwise as [`Self::reg`].
    pub fn reg_local(&mut self, mem: &MemDesc) -> Result<(MrHandle, MrInfo), BackendError> {
        let access = u64::from(sys::FI_SEND | sys::FI_RECV | sys::FI_READ | sys::FI_WRITE);
        self.reg_access(mem, access, true)
    }

    /// Registers the memory of registration `of` once more, for remote writes only, under a key of
    /// its own: what one peer may write with, revoked by closing it ([`Self::dereg`]) without
    /// touching the other registrations of the memory.
    pub fn reg_remote(&mut self, of: MrHandle) -> Result<(MrHandle, MrInfo), BackendError> {
        let mem = self.mrs.get(&of.0).map(|m| m.mem.clone()).ok_or_else(|| BackendError::Config {
            backend: NAME,
            detail: format!("memory registration {} is closed", of.0),
        })?;
        self.reg_access(&mem, u64::from(sys::FI_REMOTE_WRITE), true)
    }

    /// Removes `fi_addr` from the address vector (`fi_av_remove`). On `tcp;ofi_rxm` with
    /// `FI_AV_REMOVE_CLEANUP` in effect (read by libfabric once, at its initialisation) this closes
    /// the connection to that peer in the call: a write whose header was accepted and whose payload
    /// is still arriving is abandoned. The address is inserted anew when it is used again.
    ///
    /// When the last post to `fi_addr` failed at once (see `unconnected`), `probe` (a message the
    /// peer may receive harmlessly) is posted first, with `user`: if that fails at once too, the
    /// provider holds no connection to the peer, nothing is removed (removing would crash libfabric
    /// 1.17) and [`AvRemoved::NoConnection`] says so; otherwise the connection now being made or
    /// used is closed by the removal as usual.
    pub fn av_remove(&mut self, fi_addr: u64, probe: Vec<u8>, user: u64) -> Result<AvRemoved, BackendError> {
        if self.unconnected.contains(&fi_addr) && matches!(self.send(fi_addr, probe, user), Err(PostError::Failed(_))) {
            self.av_known.retain(|_, v| *v != fi_addr);
            return Ok(AvRemoved::NoConnection);
        }
        self.unconnected.remove(&fi_addr);
        let mut a = fi_addr;
        // SAFETY: `av` is open; `a` is one fi_addr_t this address vector returned, readable for the
        // call; no flags.
        let ret = unsafe { sys::kvx_fi_av_remove(self.av, &mut a, 1, 0) };
        check("fi_av_remove", ret as isize, || format!("address {fi_addr}"))?;
        self.av_known.retain(|_, v| *v != fi_addr);
        Ok(AvRemoved::Removed)
    }

    /// Whether the last post to `dest` failed at once with an error other than `-FI_EAGAIN` (on
    /// `tcp;ofi_rxm`: the provider then holds no connection to it).
    pub fn post_failed_at_once(&self, dest: u64) -> bool {
        self.unconnected.contains(&dest)
    }

    /// Registers `mem` for local use and remote writes, honouring the provider's `mr_mode` (requested
    /// key unless `FI_MR_PROV_KEY`, bind + enable under `FI_MR_ENDPOINT`). The registration keeps a
    /// clone of `mem` (and so the memory) until [`Self::dereg`] or drop.
    pub fn reg(&mut self, mem: &MemDesc) -> Result<(MrHandle, MrInfo), BackendError> {
        let access = u64::from(
            sys::FI_SEND | sys::FI_RECV | sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE,
        );
        self.reg_access(mem, access, true)
    }

    /// Closes a registration. Unknown handles are ignored. Operations in flight keep their memory alive
    /// but may complete with an error.
    pub fn dereg(&mut self, h: MrHandle) {
        if let Some(mr) = self.mrs.remove(&h.0) {
            close_fid("mr", fid_of!(mr.fid));
        }
    }

    fn track(&mut self, ctx: Box<OpContext>, user: u64, keep: Keep, bytes: u64) {
        let addr = (&*ctx as *const OpContext) as usize;
        if !matches!(keep, Keep::Recv(_)) {
            self.tx_in_flight += 1;
        }
        let generation = self.generation;
        self.ops.insert(addr, Op { ctx, user, keep, generation, bytes });
    }

    /// A post's return value as a result, noting for `dest` whether it failed at once.
    fn post_ret(
        &mut self,
        dest: u64,
        call: &'static str,
        ret: isize,
        ctx: impl FnOnce() -> String,
    ) -> Result<(), PostError> {
        if ret == EAGAIN || ret == 0 {
            self.unconnected.remove(&dest);
        } else {
            self.unconnected.insert(dest);
        }
        Self::post_result(call, ret, ctx)
    }

    fn post_result(call: &'static str, ret: isize, ctx: impl FnOnce() -> String) -> Result<(), PostError> {
        if ret == EAGAIN {
            return Err(PostError::Again);
        }
        check(call, ret, ctx).map_err(PostError::Failed)
    }

    fn local_ptr(&self, r: &LocalRange) -> Result<(*mut u8, *mut c_void, MemDesc), BackendError> {
        let mr = self.mrs.get(&r.mr.0).ok_or_else(|| BackendError::Config {
            backend: NAME,
            detail: format!("memory registration {} is closed", r.mr.0),
        })?;
        mr.mem.check(r.offset, r.len).map_err(|e| BackendError::Config {
            backend: NAME,
            detail: format!("local range outside its registration: {e}"),
        })?;
        Ok((mr.mem.addr().wrapping_add(r.offset as usize), mr.desc, mr.mem.clone()))
    }

    /// Posts one RMA write of `local` (gathered) to `remote` (scattered) at `dest` with `fi_writemsg`,
    /// requesting a completion (with `FI_DELIVERY_COMPLETE` when the provider offers it) and carrying
    /// remote CQ data when `data` is given. Its [`Event::Done`] carries `user`. The source memory stays
    /// alive until then.
    pub fn write(
        &mut self,
        dest: u64,
        local: &[LocalRange],
        remote: &[RemoteIov],
        data: Option<u64>,
        user: u64,
    ) -> Result<(), PostError> {
        let mut iov = Vec::with_capacity(local.len());
        let mut desc = Vec::with_capacity(local.len());
        let mut keep = Vec::with_capacity(local.len());
        for l in local {
            let (p, d, m) = self.local_ptr(l).map_err(PostError::Failed)?;
            iov.push(sys::iovec { iov_base: p.cast(), iov_len: l.len as usize });
            desc.push(d);
            keep.push(m);
        }
        let rma: Vec<sys::fi_rma_iov> =
            remote.iter().map(|r| sys::fi_rma_iov { addr: r.addr, len: r.len as usize, key: r.key }).collect();
        let mut ctx = Box::<OpContext>::default();
        let msg = sys::fi_msg_rma {
            msg_iov: iov.as_ptr(),
            desc: desc.as_mut_ptr(),
            iov_count: iov.len(),
            addr: dest,
            rma_iov: rma.as_ptr(),
            rma_iov_count: rma.len(),
            context: (&mut *ctx as *mut OpContext).cast(),
            data: data.unwrap_or(0),
        };
        let mut flags = u64::from(sys::FI_COMPLETION);
        if self.delivery_complete {
            flags |= u64::from(sys::FI_DELIVERY_COMPLETE);
        }
        if data.is_some() {
            flags |= u64::from(sys::FI_REMOTE_CQ_DATA);
        }
        // SAFETY: the iov/desc/rma arrays live across the call (the provider copies them); the source
        // memory is kept alive by `keep` and the context by the boxed `ctx`, both stored in `ops` until
        // the completion is read (or the endpoint is closed).
        let ret = unsafe { sys::kvx_fi_writemsg(self.ep, &msg, flags) };
        let total: u64 = local.iter().map(|l| l.len).sum();
        self.post_ret(dest, "fi_writemsg", ret, || format!("{} iovs, {total} bytes", local.len()))?;
        self.track(ctx, user, Keep::Regions(keep), total);
        Ok(())
    }

    /// Posts a plain `fi_write` of one range (the baseline's path; no flags beyond the provider's defaults).
    pub fn write_plain(&mut self, dest: u64, local: LocalRange, remote: RemoteIov, user: u64) -> Result<(), PostError> {
        let (p, d, m) = self.local_ptr(&local).map_err(PostError::Failed)?;
        let mut ctx = Box::<OpContext>::default();
        // SAFETY: the source memory (`m`) and the context are stored in `ops` until completion.
        let ret = unsafe {
            sys::kvx_fi_write(
                self.ep,
                p.cast(),
                local.len as usize,
                d,
                dest,
                remote.addr,
                remote.key,
                (&mut *ctx as *mut OpContext).cast(),
            )
        };
        self.post_ret(dest, "fi_write", ret, || format!("{} bytes", local.len))?;
        self.track(ctx, user, Keep::Regions(vec![m]), local.len);
        Ok(())
    }

    /// Posts a message, owned by the endpoint until its completion. Under `FI_MR_LOCAL` it is copied
    /// into an owned [`HostBuffer`] first and registered; the registration keeps that buffer's
    /// descriptor (and so the memory) alive and is closed at the completion.
    pub fn send(&mut self, dest: u64, msg: Vec<u8>, user: u64) -> Result<(), PostError> {
        let len = msg.len();
        let (ptr_, desc, mr, keep) = if self.pinfo.mr_mode.local && !msg.is_empty() {
            let mem = HostBuffer::from_slice(&msg).desc();
            let (h, _) = self.reg_access(&mem, u64::from(sys::FI_SEND), false).map_err(PostError::Failed)?;
            (mem.addr().cast_const(), self.mrs.get(&h.0).map_or(ptr::null_mut(), |m| m.desc), Some(h), None)
        } else {
            (msg.as_ptr(), ptr::null_mut(), None, Some(msg))
        };
        let mut ctx = Box::<OpContext>::default();
        // SAFETY: the message (the Vec's heap buffer, or the registered copy that the registration
        // keeps alive) and the context are stored in `ops` until the completion is read.
        let ret =
            unsafe { sys::kvx_fi_send(self.ep, ptr_.cast(), len, desc, dest, (&mut *ctx as *mut OpContext).cast()) };
        if let Err(e) = self.post_ret(dest, "fi_send", ret, || format!("{len} bytes")) {
            if let Some(h) = mr {
                self.dereg(h);
            }
            return Err(e);
        }
        self.track(ctx, user, Keep::Send(keep, mr), len as u64);
        Ok(())
    }

    /// Allocates, registers (for `FI_RECV`) and posts `count` receive buffers of `size` bytes, which
    /// [`Self::poll`] reposts after each message.
    pub fn post_receives(&mut self, count: usize, size: usize) -> Result<(), BackendError> {
        if self.recv_slab.is_some() {
            // A recycled endpoint keeps the buffers its first owner posted.
            return Ok(());
        }
        let slab = HostBuffer::zeroed(count * size).desc();
        let (h, _) = self.reg_access(&slab, u64::from(sys::FI_RECV), false)?;
        self.recv_slab = Some((slab, h, size));
        for slot in 0..count {
            match self.post_slot(slot) {
                Ok(()) => {}
                Err(PostError::Again) => self.unposted.push(slot),
                Err(PostError::Failed(e)) => return Err(e),
            }
        }
        Ok(())
    }

    fn post_slot(&mut self, slot: usize) -> Result<(), PostError> {
        let Some((slab, h, size)) = &self.recv_slab else { return Ok(()) };
        let (size, h) = (*size, *h);
        let desc = self.mrs.get(&h.0).map_or(ptr::null_mut(), |m| m.desc);
        let p = slab.addr().wrapping_add(slot * size);
        let mut ctx = Box::<OpContext>::default();
        // SAFETY: the slot lies inside the slab (slot < count), which lives until after the endpoint is
        // closed; the context is stored in `ops` until completion or close.
        let ret = unsafe {
            sys::kvx_fi_recv(self.ep, p.cast(), size, desc, FI_ADDR_UNSPEC, (&mut *ctx as *mut OpContext).cast())
        };
        Self::post_result("fi_recv", ret, || format!("{size} bytes"))?;
        self.track(ctx, 0, Keep::Recv(slot), 0);
        Ok(())
    }

    fn repost(&mut self, slot: usize) {
        match self.post_slot(slot) {
            Ok(()) => {}
            Err(PostError::Again) => self.unposted.push(slot),
            Err(PostError::Failed(e)) => {
                tracing::warn!(target: "kvxfer_fabric", "reposting receive buffer {slot}: {e}");
                self.unposted.push(slot);
            }
        }
    }

    /// Reads up to `max` completions (errors included, via `fi_cq_readerr`), which also drives the
    /// provider's progress, and turns them into events. Returns how many completions were read.
    pub fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> Result<usize, BackendError> {
        if !self.unposted.is_empty() {
            for slot in std::mem::take(&mut self.unposted) {
                self.repost(slot);
            }
        }
        let mut entries: Vec<sys::fi_cq_data_entry> =
            vec![
                sys::fi_cq_data_entry { op_context: ptr::null_mut(), flags: 0, len: 0, buf: ptr::null_mut(), data: 0 };
                max.max(1)
            ];
        // SAFETY: `entries` has room for `entries.len()` entries of the CQ's format (FI_CQ_FORMAT_DATA).
        let n = unsafe { sys::kvx_fi_cq_read(self.cq, entries.as_mut_ptr().cast(), entries.len()) };
        if n > 0 {
            for e in &entries[..n as usize] {
                self.complete(e.op_context as usize, e.flags, e.len, e.data, None, out);
            }
            return Ok(n as usize);
        }
        if n == EAGAIN || n == 0 {
            return Ok(0);
        }
        if n != EAVAIL {
            check("fi_cq_read", n, || "polling the completion queue".into())?;
            return Ok(0);
        }
        let mut err = sys::fi_cq_err_entry::default();
        // SAFETY: `err` is a valid, zeroed error entry (err_data_size 0: the provider may point err_data
        // at its own buffer, valid until the next call on the CQ; we use it right below).
        let r = unsafe { sys::kvx_fi_cq_readerr(self.cq, &mut err, 0) };
        check("fi_cq_readerr", r, || "reading an error completion".into())?;
        let mut buf = vec![0 as std::os::raw::c_char; 256];
        // SAFETY: cq is open; err_data (if any) is the provider's and still valid; `buf` holds 256 bytes.
        let msg = unsafe {
            cstr_field(sys::kvx_fi_cq_strerror(self.cq, err.prov_errno, err.err_data, buf.as_mut_ptr(), buf.len()))
        };
        let fe = FiError {
            code: err.err,
            detail: format!("{} (provider errno {}: {msg})", strerror(i64::from(err.err)), err.prov_errno),
            prov_errno: err.prov_errno,
        };
        self.complete(err.op_context as usize, err.flags, err.len, err.data, Some(fe), out);
        Ok(1)
    }

    fn complete(
        &mut self,
        ctx: usize,
        flags: u64,
        len: usize,
        data: u64,
        error: Option<FiError>,
        out: &mut Vec<Event>,
    ) {
        let op = self.ops.remove(&ctx);
        let remote_data = flags & u64::from(sys::FI_REMOTE_CQ_DATA) != 0 && error.is_none();
        match op {
            None => {
                if remote_data {
                    out.push(Event::RemoteData(data));
                } else if let Some(e) = error {
                    out.push(Event::RecvError(e));
                } else {
                    tracing::debug!(target: "kvxfer_fabric", "completion for an unknown context {ctx:#x} (flags {flags:#x})");
                }
            }
            Some(Op { user, keep: Keep::Regions(_), generation, bytes, .. }) => {
                self.tx_in_flight -= 1;
                if generation == self.generation {
                    out.push(Event::Done { user, error, bytes });
                }
            }
            Some(Op { user, keep: Keep::Send(_, mr), generation, bytes, .. }) => {
                self.tx_in_flight -= 1;
                if let Some(h) = mr {
                    self.dereg(h);
                }
                if generation == self.generation {
                    out.push(Event::Done { user, error, bytes });
                }
            }
            Some(Op { keep: Keep::Recv(slot), .. }) => {
                if remote_data {
                    // FI_RX_CQ_DATA: the write's CQ data consumed this buffer; no message in it.
                    out.push(Event::RemoteData(data));
                } else if let Some(e) = error {
                    if e.code != sys::FI_ECANCELED as i32 {
                        out.push(Event::RecvError(e));
                    }
                } else if let Some((slab, _, size)) = &self.recv_slab {
                    // The provider filled the slot and reports it done; it is not reposted until
                    // after this copy, so no one writes it meanwhile.
                    if let Ok(g) = slab.read_guard((slot * size) as u64, len.min(*size) as u64) {
                        out.push(Event::Message(g.as_slice().to_vec()));
                    }
                }
                self.repost(slot);
            }
        }
    }
}

/// A self-pipe that wakes a progress thread blocked in [`Waker::wait`].
#[derive(Debug)]
pub struct Waker {
    read: i32,
    write: i32,
}

impl Waker {
    /// A new pipe.
    pub fn new() -> Result<Self, BackendError> {
        let mut fds = [-1i32; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        let ret = unsafe { sys::kvx_pipe(fds.as_mut_ptr()) };
        if ret != 0 {
            return Err(BackendError::Io {
                backend: NAME,
                context: "creating the wake pipe".into(),
                detail: format!("errno {}", -ret),
            });
        }
        Ok(Self { read: fds[0], write: fds[1] })
    }

    /// Wakes a thread blocked in [`Self::wait`] (or makes its next wait return at once).
    pub fn poke(&self) {
        // SAFETY: writes one byte from a local to our own non-blocking pipe.
        unsafe { sys::kvx_poke(self.write) }
    }

    /// Blocks until the pipe is poked, `fd` (a completion queue's wait fd) is readable, or `timeout`
    /// passes; then empties the pipe.
    pub fn wait(&self, fd: i32, timeout: Duration) {
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: poll on two descriptors: our pipe and the provider's wait fd, which stays open while
        // the endpoint does (the progress thread that calls this is joined before the endpoint closes).
        unsafe {
            sys::kvx_poll_in(self.read, fd, ms);
            sys::kvx_drain(self.read);
        }
    }
}

impl Drop for Waker {
    fn drop(&mut self) {
        // SAFETY: both descriptors were opened by pipe2 and are closed once.
        unsafe {
            sys::kvx_close_fd(self.read);
            sys::kvx_close_fd(self.write);
        }
    }
}

#[cfg(test)]
mod connection_loss_tests {
    use super::*;

    fn e(code: u32, prov_errno: i32) -> FiError {
        FiError { code: code as i32, detail: String::new(), prov_errno }
    }

    #[test]
    fn a_cancelled_write_to_a_dead_socket_is_a_connection_loss() {
        assert!(e(sys::FI_ENOTCONN, 0).is_connection_loss());
        assert!(e(sys::FI_ECANCELED, sys::FI_ENOTCONN as i32).is_connection_loss(), "tcp provider, peer killed");
        assert!(e(sys::FI_ECANCELED, sys::FI_ECONNRESET as i32).is_connection_loss());
        assert!(e(sys::FI_ECANCELED, 32).is_connection_loss(), "EPIPE");
        assert!(!e(sys::FI_ECANCELED, 0).is_connection_loss(), "a cancel of our own");
        assert!(!e(sys::FI_ECANCELED, 22).is_connection_loss(), "EINVAL");
        assert!(!e(sys::FI_EINVAL, sys::FI_ENOTCONN as i32).is_connection_loss(), "only a cancel looks at prov_errno");
    }
}

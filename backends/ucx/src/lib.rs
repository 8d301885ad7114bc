//! kvxfer's UCX backend: one-sided puts with remote keys, active-message notifications.
//!
//! # How it works
//! - Each endpoint owns a UCP context and one worker, driven by a dedicated progress thread (the
//!   worker is `UCS_THREAD_MODE_SINGLE` and only that thread touches it). The async API sends the
//!   thread commands over a channel and awaits the answer on a oneshot channel; the thread enforces
//!   a deadline (`timeout_ms`) on every operation, so no call waits forever.
//! - [`KvTransferBackend::metadata`] publishes the worker address and, per registered region, its
//!   address, length and packed remote key. Peers create their endpoint from the worker address,
//!   so UCX picks the best lane it shares with the peer: shared memory (posix/sysv for active
//!   messages, cma for puts) between processes on one host, tcp or RDMA between hosts.
//! - `write` validates every op against the local registration and the peer's published regions,
//!   posts `ucp_put_nbx` for each range (a strided op becomes one put per range; a contiguous one a
//!   single put), then flushes the endpoint: `write` returns after the flush completed, which means
//!   the bytes are placed in the peer's memory (remote completion). An attached notification is an
//!   active message posted after that flush, so it can never arrive before the data it covers.
//!   Out-of-band notifications (`notify`) are active messages too, sent on the caller's request
//!   after its writes returned; both kinds are delivered in the order they were sent per peer.
//! - Over tcp, writes take the active-message data path instead (option `data`, see below): UCX
//!   1.13 has no native RMA over tcp and emulates puts with active messages whose acknowledgement
//!   path aborts the *receiving* process (`ucp_put_handler` -> `Fatal: unexpected error: Endpoint
//!   timeout`, in `ucp_request_try_send`) when the sender dies mid-transfer. So over tcp the sender
//!   packs the ranges into eager active messages (up to 1 MiB each) followed by a commit carrying
//!   the attached notification; the receiver checks every range against its registered region,
//!   copies it in, and acknowledges the commit; `write` returns on that acknowledgement (remote
//!   completion). Messages on one endpoint are ordered, so the notification still follows the data.
//! - Peer loss: endpoints use `UCP_ERR_HANDLING_MODE_PEER` with an error callback. A connecting
//!   endpoint introduces itself with a hello message carrying its worker address; the receiver
//!   opens an endpoint back to it just to watch it. When a peer dies, UCX fails these endpoints
//!   (tcp: at once; shared memory: through keepalive, `keepalive_ms`), the receiver reports
//!   [`BackendEvent::PeerLost`], and the sender's pending and later writes fail with
//!   [`BackendError::PeerLost`]. An endpoint that shuts down cleanly (drop) says goodbye first,
//!   which peers report the same way without waiting for a timeout.
//!
//! # Which memory a peer can write
//! A receiver only accepts writes into memory it registered. With puts, a peer can only address a
//! region through the remote key it was given in the metadata, and with RDMA transports the NIC
//! enforces the key's bounds. With cma (shared memory) UCX does not check bounds on the receiving
//! side (cma is `process_vm_writev`, limited by the kernel's ptrace rules to processes of the same
//! user), so kvxfer checks every range against the published region on the sending side before
//! posting it: a kvxfer sender never writes outside a region, and a receiver should only publish
//! its metadata to peers it trusts. A deregistered region must not be freed while connected peers
//! may still hold its remote key (reconnect them first). On the active-message data path (tcp)
//! the receiver itself checks every range against the region it has registered *now* and refuses
//! (the sender's `write` fails with a protocol error) anything else.
//!
//! # Options (`BackendConfig::options`, with environment fallbacks)
//! | option | env | meaning |
//! |---|---|---|
//! | `tls` | `KVXFER_UCX_TLS` | UCX transports (`UCX_TLS`), e.g. `tcp`, `shm,self`, `posix,sysv,cma,self`; default: UCX's |
//! | `net_devices` | `KVXFER_UCX_NET_DEVICES` | network devices (`UCX_NET_DEVICES`), e.g. `lo`; default: UCX's |
//! | `timeout_ms` | `KVXFER_UCX_TIMEOUT_MS` | deadline of every connect, write and notify (default 30000) |
//! | `keepalive_ms` | `KVXFER_UCX_KEEPALIVE_MS` | UCX keepalive interval, bounds dead-peer detection on shared memory (default 1000) |
//! | `data` | `KVXFER_UCX_DATA` | `auto` (default), `put` or `am`: one-sided `ucp_put_nbx`, or the active-message data path; `auto` = `am` when tcp may be used (tls unset, `all`, or naming tcp) or cma is not allowed (Yama `ptrace_scope` not 0), else `put` |
//! | `err_mode` | `KVXFER_UCX_ERR_MODE` | `auto` (default), `peer` or `none`: UCX error handling mode of endpoints (see below) |
//! | `ucx.NAME` | | any other UCX setting, e.g. `ucx.RNDV_THRESH=64k` |
//!
//! `UCX_*` environment variables still apply; options override them.
//!
//! UCX 1.13's shared-memory transports (posix, sysv, self) do not support
//! `UCP_ERR_HANDLING_MODE_PEER`: with it, UCX refuses them (and picks tcp when allowed). In `auto`
//! mode endpoints therefore use peer error handling unless the transports are shared memory only
//! (or no transport supports it); such endpoints use mode none, and the backend watches those
//! peers itself: clean shutdowns say goodbye, and a peer process that dies is detected through
//! `/proc` (boot id, pid and start time from its metadata) every `keepalive_ms`. Writes are never
//! posted to a peer process known to be gone. For shared memory between processes, set
//! `tls=posix,sysv,cma,self` (or `shm,self`); with UCX's default transports and peer error
//! handling, same-host peers talk over tcp.

use std::collections::BTreeMap;
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer_core::backend::BackendDescriptor;
use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, Capabilities, EndpointMetadata, KvTransferBackend, MemRegion,
    Notification, PeerId, RegionId, WriteOp,
};
use tokio::sync::{mpsc, oneshot};

mod engine;
mod liveness;
pub mod perftest;
mod ucp;
mod wire;

use engine::{Cmd, ErrMode, LocalMeta, Settings};

/// Registry name.
pub const NAME: &str = "ucx";

/// What the UCX backend supports.
pub const CAPABILITIES: Capabilities =
    Capabilities { attached: true, out_of_band: true, cross_process: true, cross_host: true };

kvxfer_core::inventory::submit! {
    BackendDescriptor {
        name: NAME,
        description: "UCX: ucp_put_nbx with remote keys, active-message notifications (tcp, shared memory, RDMA)",
        capabilities: CAPABILITIES,
        create,
    }
}

/// The version of the UCX library this process loaded.
pub fn ucx_version() -> String {
    ucp::version()
}

/// Creates an endpoint (see the crate docs for options).
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    Ok(Arc::new(UcxBackend::new(config)?))
}

const DEFAULT_TIMEOUT_MS: u64 = 30_000;
const DEFAULT_KEEPALIVE_MS: u64 = 1_000;

fn option(config: &BackendConfig, key: &str, env: &str) -> Option<String> {
    config.options.get(key).cloned().or_else(|| std::env::var(env).ok().filter(|v| !v.is_empty()))
}

fn parse_ms(config: &BackendConfig, key: &str, env: &str, default: u64) -> Result<u64, BackendError> {
    match option(config, key, env) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| BackendError::Config {
            backend: NAME,
            detail: format!("{key}={v:?} (or {env}) is not a whole number of milliseconds"),
        }),
    }
}

fn settings(config: &BackendConfig) -> Result<Settings, BackendError> {
    const KNOWN: [&str; 6] = ["tls", "net_devices", "timeout_ms", "keepalive_ms", "err_mode", "data"];
    for k in config.options.keys() {
        if !KNOWN.contains(&k.as_str()) && !k.starts_with("ucx.") {
            return Err(BackendError::Config {
                backend: NAME,
                detail: format!("unknown option {k:?}; known: {}, ucx.<UCX setting>", KNOWN.join(", ")),
            });
        }
    }
    let mut ucx = Vec::new();
    let tls = option(config, "tls", "KVXFER_UCX_TLS");
    if let Some(t) = &tls {
        ucx.push(("TLS".to_owned(), t.clone()));
    }
    if let Some(d) = option(config, "net_devices", "KVXFER_UCX_NET_DEVICES") {
        ucx.push(("NET_DEVICES".to_owned(), d));
    }
    let keepalive = parse_ms(config, "keepalive_ms", "KVXFER_UCX_KEEPALIVE_MS", DEFAULT_KEEPALIVE_MS)?;
    ucx.push(("KEEPALIVE_INTERVAL".to_owned(), format!("{keepalive}ms")));
    for (k, v) in &config.options {
        if let Some(name) = k.strip_prefix("ucx.") {
            ucx.push((name.to_owned(), v.clone()));
        }
    }
    let timeout = parse_ms(config, "timeout_ms", "KVXFER_UCX_TIMEOUT_MS", DEFAULT_TIMEOUT_MS)?;
    if timeout == 0 {
        return Err(BackendError::Config { backend: NAME, detail: "timeout_ms must be at least 1".into() });
    }
    let err_mode = match option(config, "err_mode", "KVXFER_UCX_ERR_MODE").as_deref() {
        None | Some("auto") => ErrMode::Auto,
        Some("peer") => ErrMode::Peer,
        Some("none") => ErrMode::None,
        Some(other) => {
            return Err(BackendError::Config {
                backend: NAME,
                detail: format!("err_mode={other:?} (or KVXFER_UCX_ERR_MODE): expected auto, peer or none"),
            })
        }
    };
    let effective_tls = tls.clone().or_else(|| std::env::var("UCX_TLS").ok().filter(|t| !t.is_empty()));
    let am_data = match option(config, "data", "KVXFER_UCX_DATA").as_deref() {
        None | Some("auto") => match effective_tls.as_deref() {
            None => true,
            Some(t) => {
                t.split(',').any(|x| matches!(x.trim().trim_start_matches('^'), "tcp" | "all"))
                    || t.starts_with('^')
                    || !cma_allowed()
            }
        },
        Some("put") => false,
        Some("am") => true,
        Some(other) => {
            return Err(BackendError::Config {
                backend: NAME,
                detail: format!("data={other:?} (or KVXFER_UCX_DATA): expected auto, put or am"),
            })
        }
    };
    if keepalive == 0 {
        return Err(BackendError::Config { backend: NAME, detail: "keepalive_ms must be at least 1".into() });
    }
    Ok(Settings {
        ucx,
        op_timeout: Duration::from_millis(timeout),
        identity: config.identity,
        instance: rand::random(),
        err_mode,
        keepalive: Duration::from_millis(keepalive),
        proc: liveness::ProcId::current(),
        shm_only: shm_only(effective_tls.as_deref()),
        am_data,
    })
}

/// Whether cma (`process_vm_writev` between sibling processes) is allowed: Yama's
/// `ptrace_scope` absent or 0. Otherwise UCX has no one-sided lane on shared memory and would
/// emulate puts with active messages, so `data=auto` takes the active-message data path.
fn cma_allowed() -> bool {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Err(_) => true,
        Ok(v) => v.trim() == "0",
    }
}

/// Whether a `UCX_TLS` value names only shared-memory transports.
fn shm_only(tls: Option<&str>) -> bool {
    const SHM: [&str; 9] = ["posix", "sysv", "cma", "self", "shm", "mm", "sm", "xpmem", "knem"];
    match tls {
        None => false,
        Some(t) if t.starts_with('^') => false,
        Some(t) => t.split(',').map(str::trim).filter(|s| !s.is_empty()).all(|s| SHM.contains(&s)),
    }
}

/// A UCX endpoint. Dropping it says goodbye to its peers and releases every UCX handle (on its
/// progress thread, bounded by a few seconds).
pub struct UcxBackend {
    identity: u64,
    instance: u64,
    proc: liveness::ProcId,
    timeout: Duration,
    cmds: Mutex<std::sync::mpsc::Sender<Cmd>>,
    events: tokio::sync::Mutex<mpsc::UnboundedReceiver<BackendEvent>>,
    meta: Arc<Mutex<LocalMeta>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for UcxBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxBackend").field("identity", &self.identity).field("instance", &self.instance).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl UcxBackend {
    /// Creates an endpoint: a UCX context and worker with the configured transports, and the
    /// progress thread that owns them.
    pub fn new(config: &BackendConfig) -> Result<Self, BackendError> {
        let s = settings(config)?;
        let (identity, instance, timeout, proc) = (s.identity, s.instance, s.op_timeout, s.proc.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let (etx, erx) = mpsc::unbounded_channel();
        let meta = Arc::new(Mutex::new(LocalMeta { worker: Vec::new(), regions: BTreeMap::new() }));
        let thread = engine::start(s, rx, etx, meta.clone())?;
        Ok(Self {
            identity,
            instance,
            proc,
            timeout,
            cmds: Mutex::new(tx),
            events: tokio::sync::Mutex::new(erx),
            meta,
            thread: Mutex::new(Some(thread)),
        })
    }

    fn send(&self, cmd: Cmd) -> Result<(), BackendError> {
        lock(&self.cmds).send(cmd).map_err(|_| BackendError::Closed { backend: NAME })
    }

    fn call_sync(&self, make: impl FnOnce(SyncSender<Result<(), BackendError>>) -> Cmd) -> Result<(), BackendError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.send(make(tx))?;
        rx.recv_timeout(self.timeout).map_err(|e| match e {
            std::sync::mpsc::RecvTimeoutError::Timeout => {
                BackendError::Timeout { backend: NAME, what: "the UCX progress thread".into(), after: self.timeout }
            }
            std::sync::mpsc::RecvTimeoutError::Disconnected => BackendError::Closed { backend: NAME },
        })?
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, BackendError>>) -> Cmd,
    ) -> Result<T, BackendError> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx))?;
        // The progress thread answers every command by its deadline (or drops the sender on exit).
        rx.await.map_err(|_| BackendError::Closed { backend: NAME })?
    }
}

impl Drop for UcxBackend {
    fn drop(&mut self) {
        let _ = lock(&self.cmds).send(Cmd::Shutdown);
        if let Some(t) = lock(&self.thread).take() {
            // Bounded: shutdown waits at most a few seconds for in-flight work and goodbyes.
            let _ = t.join();
        }
    }
}

#[async_trait::async_trait]
impl KvTransferBackend for UcxBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn register(&self, id: RegionId, mem: MemRegion) -> Result<(), BackendError> {
        self.call_sync(|reply| Cmd::Register { id, mem, reply })
    }

    fn deregister(&self, id: RegionId) -> Result<(), BackendError> {
        self.call_sync(|reply| Cmd::Deregister { id, reply })
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let payload = {
            let m = lock(&self.meta);
            wire::Payload {
                v: wire::PAYLOAD_VERSION,
                instance: self.instance,
                ucx: ucp::version(),
                worker: wire::hex(&m.worker),
                regions: m.regions.values().cloned().collect(),
                proc: self.proc.clone(),
            }
        };
        let payload = serde_json::to_vec(&payload)
            .map_err(|e| BackendError::BadMetadata { backend: NAME, detail: format!("encoding the payload: {e}") })?;
        Ok(EndpointMetadata::new(NAME, self.identity, payload))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        peer.check(NAME)?;
        let payload: wire::Payload = serde_json::from_slice(&peer.payload)
            .map_err(|e| BackendError::BadMetadata { backend: NAME, detail: format!("payload: {e}") })?;
        if payload.v != wire::PAYLOAD_VERSION {
            return Err(BackendError::BadMetadata {
                backend: NAME,
                detail: format!("payload version {}, this build speaks {}", payload.v, wire::PAYLOAD_VERSION),
            });
        }
        let identity = peer.identity;
        self.call(|reply| Cmd::Connect { identity, payload, reply }).await
    }

    async fn write(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<(), BackendError> {
        let notify = match notify {
            Some(n) => Some(n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?),
            None => None,
        };
        let ops = ops.to_vec();
        self.call(|reply| Cmd::Write { peer, ops, notify, reply }).await
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        let bytes = notification.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        self.call(|reply| Cmd::Notify { peer, bytes, reply }).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        let mut rx = self.events.lock().await;
        let mut out = Vec::new();
        match tokio::time::timeout(max_wait, rx.recv()).await {
            Err(_) => return Ok(out),
            Ok(None) => return Err(BackendError::Closed { backend: NAME }),
            Ok(Some(e)) => out.push(e),
        }
        while let Ok(e) = rx.try_recv() {
            out.push(e);
        }
        Ok(out)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        self.call(|reply| Cmd::Disconnect { peer, reply }).await
    }
}

//! kvxfer's ibverbs backend: one RC queue pair per peer, ops as RDMA WRITE work requests, attached
//! notifications as RDMA WRITE WITH IMMEDIATE into a per-connection notification ring, out-of-band
//! notifications as SENDs, and a small TCP side channel for the QP handshake, ring credits, region
//! revokes and peer-loss detection.
//!
//! Modules:
//! - `verbs` (private): the interface the endpoint is written against (the `Verbs` traits) and the
//!   plain types it exchanges;
//! - `ffi` (private): that interface over `ibverbs-sys` (device, PD, MR, CQ + completion channel,
//!   QP), the crate's only `unsafe` code, compiled in every build;
//! - `emu` (private, `emulator` feature only): an in-process software model of the same interface,
//!   used by endpoints created with `device=emulated` (or `create_emulated`);
//! - `endpoint` (private): the endpoint's shared state, opening the device, starting its threads;
//! - `peers` (private): connecting, the handshake listener and authentication, side channels, cut-off;
//! - `regions` (private): revoking and closing registrations;
//! - `progress` (private): posting and the poller that drives completions;
//! - `transfer` (private): transfers on one connection (jobs, the posting pump, send completions);
//! - [`attrs`]: QP attributes for INIT, RTR and RTS built from exchanged metadata;
//! - [`ring`]: the notification ring (slots, credits, immediates);
//! - [`wire`]: the metadata payload and the side-channel frames.
//!
//! The trait impls (`KvTransferBackend` for [`VerbsBackend`] and for the endpoint) are in this file.
//!
//! **The cluster secret** (`BackendConfig::secret`): every connection starts with the toolkit's
//! mutual challenge-response ([`kvxfer_core::secret::Exchange`]) on the side channel, before any
//! queue pair, ring or remote key is announced; a connect between endpoints whose secrets differ,
//! or where only one has one, fails naming authentication. With a secret, every notification must be
//! keyed with the identity its connection proved ([`kvxfer_core::Notification::is_from`]); one that
//! is not is dropped, counted ([`VerbsBackend::forged_notifications`]), its sender refused and
//! reported lost. RDMA writes themselves are not gated by the secret (see the README).
//!
//! Options (`BackendConfig::options`, falling back to the environment variable `KVXFER_VERBS_<NAME>`,
//! then the default; an unknown option is an error listing the known ones): see [`Settings`].

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::{Options, FRAGMENT_HEADER};
use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, Capabilities, Completion, CutOff, EndpointMetadata, KvTransferBackend,
    Limits, MemDesc, MemKinds, Notification, OptionDoc, PeerId, RegionId, Registration, Transfer, WriteOp,
};

use crate::endpoint::{io_err, Endpoint};
use crate::regions::Closer;
use crate::transfer::{lock, Peer};
use crate::verbs::{Access, MemoryRegion, Verbs};
use crate::wire::Address;

pub mod attrs;
#[cfg(feature = "emulator")]
mod emu;
mod endpoint;
mod ffi;
#[cfg(any(fuzzing, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod limits;
mod peers;
mod progress;
mod regions;
pub mod ring;
mod transfer;
mod verbs;
pub mod wire;

/// Registry name.
pub const NAME: &str = "verbs";

/// True when this build includes the test-only in-process model of the verbs layer (the `emulator`
/// feature): endpoints created with `device=emulated` run on it. Real devices work as in any build.
pub const EMULATED: bool = cfg!(feature = "emulator");

/// The `device` value that selects the in-process model (only in builds with the `emulator` feature).
pub const EMULATED_DEVICE: &str = "emulated";

/// Default most ops one post takes.
const DEFAULT_MAX_OPS: u64 = 1 << 16;
/// Default most regions registered at once.
const DEFAULT_MAX_REGIONS: u64 = 1024;
/// Default notification ring slot size and receive buffer size.
const DEFAULT_SLOT: u32 = 4096;

/// Largest encoded notification a connection whose fragments are at most `fragment` bytes carries:
/// the codec's largest encoding, and at most 65535 fragments of the toolkit's fragmenter.
pub const fn max_notification_bytes(fragment: u32) -> u64 {
    let codec = kvxfer_core::notify::MAX_PAYLOAD as u64 + 64;
    let frags = (fragment as u64 - FRAGMENT_HEADER as u64) * u16::MAX as u64;
    if codec < frags {
        codec
    } else {
        frags
    }
}

/// Capabilities of an endpoint on a real device with default options (instances report their own:
/// limits follow the options and the device, and a model endpoint cannot leave the process).
pub const CAPABILITIES: Capabilities = Capabilities::new(true, true, true, true)
    .with_memory(MemKinds::HOST)
    .with_limits(Limits::new(DEFAULT_MAX_OPS, max_notification_bytes(DEFAULT_SLOT), DEFAULT_MAX_REGIONS))
    .with_completion(Completion::Remote);

pub use limits::{HandshakeRefusals, LimitRefusal};

/// Default of `handshake_timeout_ms`: an incoming connection's time from its accept to its
/// authentication.
pub const DEFAULT_HANDSHAKE_TIMEOUT_MS: u64 = 5_000;

/// Settings of one endpoint, from options and environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Device name (`None`: the first device; [`EMULATED_DEVICE`]: the in-process model).
    pub device: Option<String>,
    /// Port number.
    pub port: u8,
    /// GID index (RoCE, or routed InfiniBand).
    pub gid_index: u8,
    /// Handshake listener address.
    pub listen: SocketAddr,
    /// Deadline of connect, notify, disconnect and the revoke acknowledgements of a closing region;
    /// also of an incoming connection's whole handshake.
    pub timeout: Duration,
    /// How long an incoming connection may take from its accept to its authentication (open,
    /// challenge, auth) before it is closed (`handshake_timeout_ms`; capped by `timeout_ms`).
    pub handshake_timeout: Duration,
    /// Most incoming connections before their authentication at once, in total (`max_handshakes`).
    pub max_handshakes: u32,
    /// Most incoming connections before their authentication at once from one source IP address
    /// (`max_handshakes_per_source`).
    pub max_handshakes_per_source: u32,
    /// Notification ring slots per connection.
    pub ring_slots: u32,
    /// Notification ring slot size.
    pub slot_size: u32,
    /// Receive buffer size (largest out-of-band SEND fragment).
    pub recv_buf: u32,
    /// Send queue depth requested.
    pub sq_depth: u32,
    /// Signal at least every this many work requests.
    pub signal_every: u32,
    /// Inline bytes requested per work request.
    pub max_inline: u32,
    /// SGEs requested per work request.
    pub max_sge: u32,
    /// Most ops one post takes.
    pub max_ops_per_post: u64,
    /// Most regions registered at once (the device's own limit may be lower).
    pub max_regions: u64,
}

/// Every option, with its default and what it does: the list [`Settings::from_config`] checks keys
/// against and `kvxfer backends` prints.
pub const OPTIONS: &[OptionDoc] = &[
    OptionDoc::new(
        "device",
        "the first device",
        "RDMA device name (ibv_devices); emulated: the in-process test model (builds with the emulator feature only)",
    ),
    OptionDoc::new("port", "1", "port number (1..=255)"),
    OptionDoc::new("gid_index", "0", "source GID index (RoCE: the RoCEv2 entry of show_gids; 0..=255)"),
    OptionDoc::new("listen", "127.0.0.1:0", "handshake listener; a routable ip:0 across hosts"),
    OptionDoc::new(
        "timeout_ms",
        "30000",
        "deadline of connect, notify, disconnect, revoke acknowledgements and a whole handshake (1..=3600000)",
    ),
    OptionDoc::new(
        "handshake_timeout_ms",
        "5000",
        "an incoming connection's time from its accept to its authentication, capped by timeout_ms (1..=3600000)",
    ),
    OptionDoc::new(
        "max_handshakes",
        "256",
        "incoming connections not yet authenticated at once, in total (1..=1048576); one beyond is refused at once",
    ),
    OptionDoc::new("max_handshakes_per_source", "64", "the same per source IP address (1..=1048576)"),
    OptionDoc::new("ring_slots", "64", "notification ring slots per connection (1..=32768)"),
    OptionDoc::new("slot_size", "4096", "bytes of a notification ring slot (64..=32768)"),
    OptionDoc::new("recv_buf", "4096", "receive buffer size: the largest out-of-band SEND fragment (64..=1048576)"),
    OptionDoc::new("sq_depth", "512", "send queue depth requested (4..=65536)"),
    OptionDoc::new("signal_every", "64", "signal at least every this many work requests (1..=65536)"),
    OptionDoc::new("max_inline", "64", "inline bytes requested per work request (0..=4096; the device may grant less)"),
    OptionDoc::new("max_sge", "16", "SGEs requested per work request (1..=256; the device may grant less)"),
    OptionDoc::new("max_ops_per_post", "65536", "ops one post takes (1..=16777216)"),
    OptionDoc::new("max_regions", "1024", "regions registered at once (1..=1048576; at most half the device's max_mr)"),
];

impl Settings {
    /// Reads `config`'s options, then `KVXFER_VERBS_<NAME>` environment variables, then defaults.
    pub fn from_config(config: &BackendConfig) -> Result<Self, BackendError> {
        let o = Options::new(NAME, config, OPTIONS)?;
        let s = Settings {
            device: o.get("device").filter(|d| !d.is_empty()),
            port: o.int_in("port", 1, 1..=u8::MAX)?,
            gid_index: o.int_in("gid_index", 0, 0..=u8::MAX)?,
            listen: o.parse("listen", SocketAddr::from(([127, 0, 0, 1], 0)), "an ip:port address")?,
            timeout: Duration::from_millis(o.int_in("timeout_ms", 30_000, 1..=3_600_000)?),
            handshake_timeout: Duration::from_millis(o.int_in(
                "handshake_timeout_ms",
                DEFAULT_HANDSHAKE_TIMEOUT_MS,
                1..=3_600_000,
            )?),
            max_handshakes: o.int_in("max_handshakes", limits::DEFAULT_MAX_HANDSHAKES, 1..=1 << 20)?,
            max_handshakes_per_source: o.int_in(
                "max_handshakes_per_source",
                limits::DEFAULT_MAX_HANDSHAKES_PER_SOURCE,
                1..=1 << 20,
            )?,
            ring_slots: o.int_in("ring_slots", 64, 1..=ring::MAX_SLOTS)?,
            slot_size: o.int_in("slot_size", DEFAULT_SLOT, 64..=ring::MAX_SLOT_SIZE)?,
            recv_buf: o.int_in("recv_buf", DEFAULT_SLOT, 64..=1 << 20)?,
            sq_depth: o.int_in("sq_depth", 512, 4..=1 << 16)?,
            signal_every: o.int_in("signal_every", 64, 1..=1 << 16)?,
            max_inline: o.int_in("max_inline", 64, 0..=1 << 12)?,
            max_sge: o.int_in("max_sge", 16, 1..=256)?,
            max_ops_per_post: o.int_in("max_ops_per_post", DEFAULT_MAX_OPS, 1..=1 << 24)?,
            max_regions: o.int_in("max_regions", DEFAULT_MAX_REGIONS, 1..=1 << 20)?,
        };
        if s.emulated() && !EMULATED {
            return Err(BackendError::Config {
                backend: NAME,
                detail: format!(
                    "device={EMULATED_DEVICE} is the in-process test model, which this build does not include \
                     (enable the `emulator` feature of kvxfer-verbs)"
                ),
            });
        }
        Ok(s)
    }

    /// Whether the in-process model is selected.
    pub fn emulated(&self) -> bool {
        self.device.as_deref() == Some(EMULATED_DEVICE)
    }
}

/// A verbs endpoint (on a device, or on the in-process model), with its counters.
pub struct VerbsBackend {
    ep: Arc<dyn KvTransferBackend>,
    counters: Arc<endpoint::Counters>,
}

impl VerbsBackend {
    /// Builds an endpoint. Without a usable RDMA device this is [`BackendError::NoDevice`] with
    /// what `ibv_get_device_list` reported. With `device=emulated` (builds with the `emulator`
    /// feature only) the endpoint runs on the in-process model.
    pub fn new(config: &BackendConfig) -> Result<Self, BackendError> {
        let settings = Settings::from_config(config)?;
        let secret = config.secret.clone();
        #[cfg(feature = "emulator")]
        if settings.emulated() {
            let (ep, counters) = endpoint::create::<emu::Emulated>(config.identity, secret, settings)?;
            return Ok(Self { ep, counters });
        }
        let (ep, counters) = endpoint::create::<ffi::Ibv>(config.identity, secret, settings)?;
        Ok(Self { ep, counters })
    }

    /// Notifications dropped because their key was not the identity their connection proved (with
    /// a cluster secret); each also refused its sender.
    pub fn forged_notifications(&self) -> u64 {
        self.counters.forged.load(Ordering::Relaxed)
    }

    /// Incoming connections refused before their authentication, by reason: beyond
    /// `max_handshakes` or `max_handshakes_per_source` (answered at once), not authenticated
    /// within `handshake_timeout_ms`, or refused in the exchange (version, authentication).
    pub fn handshake_refusals(&self) -> HandshakeRefusals {
        self.counters.refusals.snapshot()
    }
}

impl fmt::Debug for VerbsBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsBackend").field("forged_notifications", &self.forged_notifications()).finish()
    }
}

#[async_trait::async_trait]
impl KvTransferBackend for VerbsBackend {
    fn name(&self) -> &'static str {
        self.ep.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.ep.capabilities()
    }
    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        if let kvxfer_core::MemKind::Cuda { device } = mem.kind() {
            // GPUDirect RDMA registration is not implemented: say what the host offers and what to use.
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "registering {} (GPUDirect RDMA registration, ibv_reg_dmabuf_mr of a dma-buf from \
                     cuMemGetHandleForAddressRange or ibv_reg_mr of the device address under nvidia-peermem, is not \
                     implemented in this build; on this host: {}; use the tcp backend, which stages CUDA memory \
                     through pinned buffers, or cuda-ipc between processes of one node)",
                    mem.kind(),
                    kvxfer_cuda::dmabuf::gpudirect_status(device)
                ),
            });
        }
        self.ep.register(id, mem).await
    }
    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        self.ep.metadata()
    }
    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        self.ep.connect(peer).await
    }
    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.ep.post(peer, ops, notify)
    }
    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        self.ep.notify(peer, notification).await
    }
    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        self.ep.recv(max_wait).await
    }
    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        self.ep.disconnect(peer).await
    }
    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        self.ep.cut_off(peer, reason).await
    }
}

#[async_trait::async_trait]
impl<V: Verbs> KvTransferBackend for Endpoint<V> {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities
    }

    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        let inner = &self.inner;
        inner.closed()?;
        inner.capabilities.check_memory(NAME, &mem.kind())?;
        let rt = tokio::runtime::Handle::try_current().map_err(|e| BackendError::Unsupported {
            backend: NAME,
            what: format!("registering outside a tokio runtime ({e})"),
        })?;
        if lock(&inner.mrs).contains_key(&id) {
            return Err(BackendError::RegionInUse { backend: NAME, region: id });
        }
        let limit = inner.capabilities.limits.max_regions;
        if inner.regions.len() as u64 >= limit {
            let asked = inner.regions.len() as u64 + 1;
            return Err(BackendError::Limit { backend: NAME, what: "registered regions", asked, limit });
        }
        // Some providers refuse to register zero bytes; an empty region needs no registration.
        let mr = if mem.is_empty() {
            None
        } else {
            // Pinning pages can take long: not on the runtime's threads.
            let (pd, m) = (inner.pd.clone(), mem.clone());
            let mr = rt
                .spawn_blocking(move || V::Mr::register(&pd, m, Access::RemoteWrite))
                .await
                .map_err(|e| io_err("the registration task", e))??;
            Some(Arc::new(mr))
        };
        {
            let mut mrs = lock(&inner.mrs);
            inner.regions.insert(id, mem.clone())?;
            mrs.insert(id, mr.clone());
        }
        let closer = Closer { inner: inner.clone(), id, mr, rt };
        Ok(Registration::new(NAME, id, &mem, Box::new(closer)))
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        self.inner.closed()?;
        Ok(EndpointMetadata::new(NAME, self.inner.identity, self.inner.address().to_payload()))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        self.inner.closed()?;
        peer.check(NAME)?;
        let addr = Address::from_payload(&peer.payload)
            .map_err(|detail| BackendError::BadMetadata { backend: NAME, detail })?;
        if addr.link_layer != self.inner.port.link_layer {
            return Err(BackendError::BadMetadata {
                backend: NAME,
                detail: format!(
                    "peer's link layer is {} and ours is {} (1 InfiniBand, 2 Ethernet)",
                    addr.link_layer, self.inner.port.link_layer
                ),
            });
        }
        let inner = self.inner.clone();
        let identity = peer.identity;
        tokio::task::spawn_blocking(move || inner.dial(addr, identity))
            .await
            .map_err(|e| io_err("the handshake task", e))?
    }

    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.inner.post(peer, ops, notify)
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        self.inner.notify(peer, notification).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        Ok(self.inner.events.recv(max_wait).await)
    }

    /// Cuts the peer's instance off (see the crate README, "Cutting a peer off"): every queue pair
    /// of that instance, in both directions, goes to ERR (the NIC drops every write that arrives on
    /// it afterwards, and its remote keys reach our memory through no other queue pair), its side
    /// channels are shut and its handshakes refused for this endpoint's life; the call resolves once
    /// every transfer to it is final (their posted requests flushed: the NIC reads no more of our
    /// memory for them), bounded by `timeout_ms`.
    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        let inner = &self.inner;
        let p = match inner.peers.get(peer) {
            Ok(p) => p,
            // Cut off already (this id, or another connection of the same instance): still confirmed.
            Err(_) if lock(&inner.cut_ids).contains(&peer) => {
                return Ok(CutOff { closed: 0, failed_transfers: 0, how: "already cut off" });
            }
            Err(e) => return Err(e),
        };
        let who = (p.identity, p.instance);
        let victims: Vec<Arc<Peer<V>>> = {
            let mut cut = lock(&inner.cut);
            cut.insert(who);
            inner.peers.all().into_iter().filter(|(_, q)| (q.identity, q.instance) == who).map(|(_, q)| q).collect()
        };
        tracing::info!(peer = %p.label, instance = who.1, %reason, connections = victims.len(), "cutting off");
        let mut failed = 0;
        let mut error = None;
        lock(&inner.cut_ids).extend(victims.iter().map(|q| q.id));
        for q in &victims {
            let _ = inner.peers.remove(q.id);
            match inner.cut_peer(q, reason) {
                Ok(n) => failed += n,
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = error {
            // A queue pair that did not reach ERR may still take writes: not confirmed.
            return Err(e);
        }
        let deadline = Instant::now() + inner.opts.timeout;
        for q in &victims {
            if !q.wait_idle(deadline).await {
                return Err(inner.timeout_error(format!(
                    "the flush completions of the transfers to the cut-off {} (the device may still read their \
                     source memory)",
                    q.label
                )));
            }
            inner.forget_key(q);
        }
        Ok(CutOff {
            closed: victims.len(),
            failed_transfers: failed,
            how: "queue pairs moved to the error state, side channels shut, instance refused at the handshake",
        })
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        let p = self.inner.peers.remove(peer)?;
        self.inner.close_peer(&p, "disconnect requested");
        // Posted requests end with their flush completions (the QP is in the error state).
        let settled = p.wait_idle(Instant::now() + self.inner.opts.timeout).await;
        self.inner.forget_key(&p);
        if !settled {
            let n = p.abandon("their flush did not arrive before the disconnect deadline");
            return Err(self.inner.timeout_error(format!("the flush of {n} transfers to {}", p.label)));
        }
        Ok(())
    }
}

/// Builds an endpoint ([`VerbsBackend::new`]).
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    Ok(Arc::new(VerbsBackend::new(config)?))
}

/// Builds an endpoint on the in-process model of the verbs layer (test-only; same as `create` with
/// `device=emulated`). Such an endpoint talks only to model endpoints of this process.
#[cfg(feature = "emulator")]
pub fn create_emulated(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    create(&config.clone().with("device", EMULATED_DEVICE))
}

#[cfg(feature = "emulator")]
#[doc(hidden)]
pub use emu::invalidate_keys_at as emulated_invalidate_keys_at;

#[cfg(feature = "emulator")]
#[doc(hidden)]
pub use emu::{heal as emulated_heal, partition as emulated_partition};

/// Why this host cannot run the verbs backend with `config`'s device selection, or `None` when a
/// device opens and its port is active (always `None` for the model). Used by the conformance
/// target to skip with the reason.
pub fn no_device_reason(config: &BackendConfig) -> Option<String> {
    let settings = match Settings::from_config(config) {
        Ok(s) => s,
        Err(e) => return Some(e.to_string()),
    };
    if settings.emulated() {
        return None;
    }
    endpoint::probe::<ffi::Ibv>(&settings).err().map(|e| e.to_string())
}

kvxfer_core::register_backend!(
    NAME,
    if EMULATED {
        "ibverbs: RC queue pairs, RDMA WRITE, WRITE WITH IMMEDIATE (InfiniBand, RoCE); this build also includes \
         the test-only in-process verbs model (device=emulated, not RDMA)"
    } else {
        "ibverbs: RC queue pairs, RDMA WRITE, WRITE WITH IMMEDIATE notifications (InfiniBand, RoCE)"
    },
    CAPABILITIES,
    OPTIONS,
    create
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_come_from_config_then_env_then_defaults() {
        // Only this test touches these variables in this binary.
        std::env::set_var("KVXFER_VERBS_RING_SLOTS", "32");
        std::env::set_var("KVXFER_VERBS_SIGNAL_EVERY", "8");
        let o = Settings::from_config(&BackendConfig::new(1)).unwrap();
        assert_eq!(o.ring_slots, 32);
        assert_eq!(o.signal_every, 8);
        assert_eq!(o.slot_size, 4096);
        assert_eq!(o.device, None);
        let cfg = BackendConfig::new(1).with("ring_slots", "16").with("gid_index", "3").with("timeout_ms", "500");
        let o = Settings::from_config(&cfg).unwrap();
        assert_eq!(o.ring_slots, 16, "an option beats the environment");
        assert_eq!(o.gid_index, 3);
        assert_eq!(o.timeout, Duration::from_millis(500));
        assert_eq!(o.handshake_timeout, Duration::from_secs(5));
        assert_eq!((o.max_handshakes, o.max_handshakes_per_source), (256, 64));
        let cfg = BackendConfig::new(1)
            .with("handshake_timeout_ms", "250")
            .with("max_handshakes", "8")
            .with("max_handshakes_per_source", "2");
        let o = Settings::from_config(&cfg).unwrap();
        assert_eq!(o.handshake_timeout, Duration::from_millis(250));
        assert_eq!((o.max_handshakes, o.max_handshakes_per_source), (8, 2));
        std::env::remove_var("KVXFER_VERBS_RING_SLOTS");
        std::env::remove_var("KVXFER_VERBS_SIGNAL_EVERY");
        // Every documented default that is a value parses, set to it, to what leaving it unset gives
        // (here, where the variables above are gone again; `device`'s default is a phrase).
        kvxfer_core::check_documented_defaults(OPTIONS, &["device"], Settings::from_config);
    }

    #[test]
    fn bad_options_name_themselves() {
        let bad = |k: &str, v: &str| Settings::from_config(&BackendConfig::new(1).with(k, v)).unwrap_err().to_string();
        assert!(bad("port", "x").contains("option port=x"));
        let e = bad("colour", "red");
        assert!(e.contains("colour") && e.contains("known options") && e.contains("max_sge"), "{e}");
        assert!(bad("listen", "nope").contains("listen"));
        assert!(bad("slot_size", "100000").contains("slot_size"));
        assert!(bad("port", "0").contains("port"));
        assert!(bad("sq_depth", "2").contains("sq_depth"));
        assert!(bad("max_handshakes", "0").contains("max_handshakes=0"));
        assert!(bad("max_handshakes_per_source", "x").contains("max_handshakes_per_source"));
        assert!(bad("handshake_timeout_ms", "0").contains("handshake_timeout_ms"));
        assert!(bad("colour", "red").contains("handshake_timeout_ms"));
        if !EMULATED {
            assert!(bad("device", EMULATED_DEVICE).contains("emulator"));
        }
    }

    #[test]
    fn capabilities_state_the_limits() {
        assert_eq!(CAPABILITIES.memory, MemKinds::HOST);
        assert_eq!(CAPABILITIES.completion, Completion::Remote);
        const { assert!(CAPABILITIES.out_of_band && CAPABILITIES.attached) };
        assert_eq!(CAPABILITIES.limits.max_notification_bytes, kvxfer_core::notify::MAX_PAYLOAD as u64 + 64);
        assert_eq!(max_notification_bytes(64), CAPABILITIES.limits.max_notification_bytes, "the codec bounds it");
    }
}

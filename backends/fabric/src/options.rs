//! The option table: every construction option with its default ([`OPTIONS`]), their parsing into
//! [`Options`] (with the `KVXFER_FABRIC_<OPTION>` environment fallbacks), the backend's size limits,
//! and what an endpoint with a given provider can promise ([`capabilities_for`]).

use std::time::Duration;

use kvxfer_core::toolkit::{self, Fragmenter};
use kvxfer_core::{BackendConfig, BackendError, Capabilities, Completion, Limits, OptionDoc};

use crate::ffi::ProviderInfo;
use crate::wire;
use crate::NAME;

/// How attached notifications travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachedMode {
    /// Remote CQ data where the provider has it (cq_data_size >= 8), else a message.
    Auto,
    /// Always remote CQ data (an error at construction if the provider has none).
    CqData,
    /// Always a message sent after the writes completed.
    Message,
}

/// Every option the backend knows, with its default and what it does; any other is refused, naming
/// these. The list `kvxfer backends` prints.
pub const OPTIONS: &[OptionDoc] = &[
    OptionDoc::new(
        "provider",
        "tcp",
        "tcp (tcp;ofi_rxm), shm (same host) or any name fi_getinfo knows; unset: FI_PROVIDER, else tcp",
    ),
    OptionDoc::new("addr", "the provider's first interface", "local address (tcp), e.g. 127.0.0.1; ignored for shm"),
    OptionDoc::new(
        "timeout_ms",
        "30000",
        "deadline of each transfer, notify, connect, disconnect and a registration close (1..=86400000)",
    ),
    OptionDoc::new(
        "peer_timeout_ms",
        "5000",
        "silence after which a peer that connected here is reported lost (100..=86400000)",
    ),
    OptionDoc::new(
        "recv_buffers",
        "64",
        "receive buffers kept posted (1..=65536; larger notifications are fragmented)",
    ),
    OptionDoc::new("recv_buf_size", "65536", "bytes of each receive buffer (136..=16777216)"),
    OptionDoc::new(
        "attached",
        "auto",
        "attached notifications: cq-data, message, auto (remote CQ data where the provider has it, except tcp;ofi_rxm)",
    ),
    OptionDoc::new("wait", "fd (tcp), poll (shm)", "how the idle progress thread waits: fd (the CQ's wait fd) or poll"),
    OptionDoc::new("idle_poll_us", "200", "longest idle sleep of the progress thread in poll mode (1..=1000000)"),
];

/// Largest encoded notification (post and notify): the codec's largest payload plus its header;
/// larger is [`BackendError::Limit`] (the codec refuses larger payloads first).
pub const MAX_NOTIFICATION: usize = kvxfer_core::notify::MAX_PAYLOAD + 64;

/// Most write bytes posted and not completed at once, over all transfers of an endpoint: what an
/// abort waits for at most, and what the provider is asked to buffer.
pub const MAX_IN_FLIGHT: u64 = 16 << 20;

/// Largest single `fi_writemsg`: coalesced pieces stop here, so an abort has pieces to drop and
/// transfers to one peer interleave. 1 MiB, because that is where `tcp;ofi_rxm` over loopback is
/// fastest (2026-12-03, 1 GiB in shuffled 1 MiB blocks, two rounds: 4.2-4.3 GB/s with 8 MiB
/// posts, 5.1-5.2 with 2 MiB, 5.9-6.0 with 1 MiB, 4.7-5.2 with 512 KiB; 16 MiB blocks 3.5-3.6,
/// 5.0-5.2, 5.8-5.9 and 5.2-5.3), as a plain loopback socket is with 1 MiB sends (see
/// `benches/socket/loopback_poll.py`); shm measured the same at every size.
pub const MAX_PIECE: u64 = 1 << 20;

/// Parsed construction options (see the crate docs for the list).
#[derive(Debug, Clone)]
pub struct Options {
    /// libfabric provider name (`tcp` is expanded to `tcp;ofi_rxm`).
    pub provider: String,
    /// Local address to bind (`addr`), e.g. `127.0.0.1`.
    pub addr: Option<String>,
    /// Deadline of each transfer, `notify`, `connect`, `disconnect` and registration close.
    pub timeout: Duration,
    /// Receive buffers kept posted.
    pub recv_buffers: usize,
    /// Size of each receive buffer (the largest message a peer sends in one piece).
    pub recv_buf_size: usize,
    /// How attached notifications travel.
    pub attached: AttachedMode,
    /// Longest sleep of the idle progress thread.
    pub idle_poll: Duration,
    /// Silence after which a peer that connected to this endpoint is reported lost.
    pub peer_timeout: Duration,
    /// Let the idle progress thread block on the completion queue's wait fd (`wait=fd`) instead of
    /// polling with backoff (`wait=poll`).
    pub wait_fd: bool,
}

impl Options {
    /// How often an endpoint tells the peers it connected to that it is alive.
    pub fn heartbeat_interval(&self) -> Duration {
        (self.peer_timeout / 8).clamp(Duration::from_millis(20), Duration::from_secs(1))
    }

    /// Reads options from a config, with `KVXFER_FABRIC_<OPTION>` environment fallbacks (and
    /// `FI_PROVIDER` for the provider); unknown options are refused.
    pub fn from_config(config: &BackendConfig) -> Result<Self, BackendError> {
        let o = toolkit::Options::new(NAME, config, OPTIONS)?;
        let provider = o
            .get("provider")
            .or_else(|| std::env::var("FI_PROVIDER").ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "tcp".to_owned());
        let provider = match provider.as_str() {
            "tcp" => "tcp;ofi_rxm".to_owned(),
            "verbs" => "verbs;ofi_rxm".to_owned(),
            _ => provider,
        };
        let shm = provider.starts_with("shm");
        // shm takes the node as the endpoint's name, not as an interface: one name for every endpoint
        // would collide (fi_enable: EBUSY), so an address is only used by network providers.
        let addr = o.get("addr").filter(|s| !s.is_empty() && !shm);
        let ms = Duration::from_millis;
        let timeout = ms(o.int_in("timeout_ms", 30_000u64, 1..=86_400_000)?);
        let peer_timeout = ms(o.int_in("peer_timeout_ms", 5_000u64, 100..=86_400_000)?);
        let recv_buffers = o.int_in("recv_buffers", 64usize, 1..=65_536)?;
        let min_buf = 4 * (wire::HEADER + toolkit::FRAGMENT_HEADER);
        let recv_buf_size = o.int_in("recv_buf_size", 64 * 1024usize, min_buf..=16 << 20)?;
        let attached = match o.choice("attached", "auto", &["auto", "cq-data", "message"])? {
            "cq-data" => AttachedMode::CqData,
            "message" => AttachedMode::Message,
            _ => AttachedMode::Auto,
        };
        let wait_fd = o.choice("wait", if shm { "poll" } else { "fd" }, &["fd", "poll"])? == "fd";
        let idle_poll = Duration::from_micros(o.int_in("idle_poll_us", 200u64, 1..=1_000_000)?);
        Ok(Self { provider, addr, timeout, recv_buffers, recv_buf_size, attached, idle_poll, peer_timeout, wait_fd })
    }
}

pub(crate) fn config_err(detail: String) -> BackendError {
    BackendError::Config { backend: NAME, detail }
}

/// What an endpoint with this provider can promise (see the README's provider table).
pub fn capabilities_for(info: &ProviderInfo, cq_data: bool, recv_buf_size: usize) -> Capabilities {
    let completion = if info.delivery_complete { Completion::Remote } else { Completion::Local };
    // An attached notification after local completions is only ordered after the bytes when it
    // rides on the last write and writes are ordered.
    let attached = completion == Completion::Remote || (cq_data && info.order_waw);
    let max_notification = MAX_NOTIFICATION.min(Fragmenter::new(recv_buf_size - wire::HEADER).max_message());
    Capabilities::new(attached, true, true, !info.provider.starts_with("shm"))
        .with_limits(Limits::new(u64::MAX, max_notification as u64, u64::MAX))
        .with_completion(completion)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every option whose documented default is a value parses, set to it, to what leaving it unset
    /// gives (`addr` and `wait` have computed defaults; `provider` falls back to `FI_PROVIDER`).
    #[test]
    fn documented_defaults_are_the_defaults() {
        let mut phrases = vec!["addr", "wait"];
        if std::env::var_os("FI_PROVIDER").is_some() {
            phrases.push("provider");
        }
        kvxfer_core::check_documented_defaults(OPTIONS, &phrases, |c| {
            Options::from_config(c).map(|o| format!("{o:?}"))
        });
        let e = Options::from_config(&BackendConfig::new(1).with("bogus", "1")).unwrap_err().to_string();
        assert!(e.contains("known options: provider, addr, timeout_ms, peer_timeout_ms, recv_buffers"), "{e}");
    }
}

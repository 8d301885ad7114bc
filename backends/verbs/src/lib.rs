//! kvxfer's ibverbs backend: one RC queue pair per peer, ops as RDMA WRITE work requests, attached
//! notifications as RDMA WRITE WITH IMMEDIATE into a per-connection notification ring, out-of-band
//! notifications as SENDs, and a small TCP side channel for the QP handshake, ring credits and peer-loss
//! detection.
//!
//! Modules:
//! - `ffi` (private): the safe layer over `ibverbs-sys` (device, PD, MR, CQ + completion channel, QP),
//!   the crate's only `unsafe` code (with the test-only `emulator` feature, `emu.rs`, a safe in-process
//!   model of the same API, takes its place);
//! - [`attrs`]: QP attributes for INIT, RTR and RTS built from exchanged metadata;
//! - [`split`]: strided ops into work requests within SGE, message-size and inline limits;
//! - [`ring`]: immediate encoding, the notification ring, fragmenting and reassembly;
//! - [`proto`]: the metadata payload and the side-channel frames.
//!
//! Options (`BackendConfig::options`, falling back to the environment variable `KVXFER_VERBS_<NAME>`,
//! then the default): `device` (first device), `port` (1), `gid_index` (0), `listen` (`127.0.0.1:0`,
//! the handshake listener; set a routable address for cross-host use), `timeout_ms` (30000),
//! `ring_slots` (64), `slot_size` (4096), `recv_buf` (4096), `sq_depth` (512), `signal_every` (64),
//! `max_inline` (64), `max_sge` (16).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvxfer_core::{BackendConfig, BackendError, Capabilities, KvTransferBackend};

pub mod attrs;
mod backend;
// With the test-only `emulator` feature, the FFI layer is replaced by an in-process software model
// of the same API (see src/emu.rs); without it, the real libibverbs layer is used.
#[cfg_attr(feature = "emulator", path = "emu.rs")]
mod ffi;
pub mod proto;
pub mod ring;
pub mod split;
mod vtypes;

pub use backend::VerbsBackend;

/// Registry name.
pub const NAME: &str = "verbs";

/// True when built with the test-only `emulator` feature: the verbs layer is an in-process software
/// model (device `emu0`), not libibverbs. Such a build cannot talk to real hardware.
pub const EMULATED: bool = cfg!(feature = "emulator");

/// What this backend supports.
pub const CAPABILITIES: Capabilities =
    Capabilities { attached: true, out_of_band: true, cross_process: true, cross_host: true };

/// Settings of one endpoint, from options and environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Device name (`None`: the first device).
    pub device: Option<String>,
    /// Port number.
    pub port: u8,
    /// GID index (RoCE, or routed InfiniBand).
    pub gid_index: u8,
    /// Handshake listener address.
    pub listen: SocketAddr,
    /// Deadline of connect, write and notify.
    pub timeout: Duration,
    /// Notification ring slots per connection.
    pub ring_slots: u32,
    /// Notification ring slot size.
    pub slot_size: u32,
    /// Receive buffer size (largest out-of-band SEND fragment + 1).
    pub recv_buf: u32,
    /// Send queue depth requested.
    pub sq_depth: u32,
    /// Signal at least every this many work requests.
    pub signal_every: u32,
    /// Inline bytes requested per work request.
    pub max_inline: u32,
    /// SGEs requested per work request.
    pub max_sge: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            device: None,
            port: 1,
            gid_index: 0,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            timeout: Duration::from_secs(30),
            ring_slots: 64,
            slot_size: 4096,
            recv_buf: 4096,
            sq_depth: 512,
            signal_every: 64,
            max_inline: 64,
            max_sge: 16,
        }
    }
}

impl Options {
    /// Reads options, then `KVXFER_VERBS_<NAME>` environment variables, then defaults.
    pub fn from_config(config: &BackendConfig) -> Result<Self, BackendError> {
        Self::from_sources(config, |k| std::env::var(k).ok())
    }

    /// As [`Options::from_config`] with an injectable environment.
    pub fn from_sources(config: &BackendConfig, env: impl Fn(&str) -> Option<String>) -> Result<Self, BackendError> {
        const KNOWN: [&str; 12] = [
            "device",
            "port",
            "gid_index",
            "listen",
            "timeout_ms",
            "ring_slots",
            "slot_size",
            "recv_buf",
            "sq_depth",
            "signal_every",
            "max_inline",
            "max_sge",
        ];
        if let Some(k) = config.options.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(BackendError::Config {
                backend: NAME,
                detail: format!("unknown option {k:?}; known: {}", KNOWN.join(", ")),
            });
        }
        let get = |key: &str| -> Option<(String, String)> {
            if let Some(v) = config.options.get(key) {
                return Some((format!("option {key}"), v.clone()));
            }
            let var = format!("KVXFER_VERBS_{}", key.to_ascii_uppercase());
            env(&var).filter(|v| !v.is_empty()).map(|v| (var, v))
        };
        fn parse<T: std::str::FromStr>(
            get: &impl Fn(&str) -> Option<(String, String)>,
            key: &str,
            default: T,
        ) -> Result<T, BackendError> {
            match get(key) {
                None => Ok(default),
                Some((source, v)) => v.parse().map_err(|_| BackendError::Config {
                    backend: NAME,
                    detail: format!("{source}={v:?} does not parse as the expected number or address"),
                }),
            }
        }
        let d = Options::default();
        let o = Options {
            device: get("device").map(|(_, v)| v),
            port: parse(&get, "port", d.port)?,
            gid_index: parse(&get, "gid_index", d.gid_index)?,
            listen: parse(&get, "listen", d.listen)?,
            timeout: Duration::from_millis(parse(&get, "timeout_ms", d.timeout.as_millis() as u64)?),
            ring_slots: parse(&get, "ring_slots", d.ring_slots)?,
            slot_size: parse(&get, "slot_size", d.slot_size)?,
            recv_buf: parse(&get, "recv_buf", d.recv_buf)?,
            sq_depth: parse(&get, "sq_depth", d.sq_depth)?,
            signal_every: parse(&get, "signal_every", d.signal_every)?,
            max_inline: parse(&get, "max_inline", d.max_inline)?,
            max_sge: parse(&get, "max_sge", d.max_sge)?,
        };
        ring::check_geometry(o.ring_slots, o.slot_size)
            .map_err(|e| BackendError::Config { backend: NAME, detail: e.0 })?;
        let bad = |what: String| Err(BackendError::Config { backend: NAME, detail: what });
        if o.port == 0 {
            return bad("port must be at least 1".into());
        }
        if !(64..=1 << 20).contains(&o.recv_buf) {
            return bad(format!("recv_buf={} must be 64..=1048576 bytes", o.recv_buf));
        }
        if o.sq_depth < 4 || o.signal_every == 0 || o.max_sge == 0 || o.timeout.is_zero() {
            return bad(format!(
                "sq_depth={} must be at least 4, signal_every={}, max_sge={} and timeout_ms={} at least 1",
                o.sq_depth,
                o.signal_every,
                o.max_sge,
                o.timeout.as_millis()
            ));
        }
        Ok(o)
    }
}

/// Builds an endpoint. Without a usable RDMA device this is [`BackendError::NoDevice`] with what
/// `ibv_get_device_list` reported.
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    Ok(Arc::new(VerbsBackend::new(config)?))
}

/// Why this host cannot run the verbs backend with `config`'s device selection, or `None` when a
/// device opens and its port is active. Used by the conformance target to skip with the reason.
pub fn no_device_reason(config: &BackendConfig) -> Option<String> {
    let opts = match Options::from_config(config) {
        Ok(o) => o,
        Err(e) => return Some(e.to_string()),
    };
    match backend::probe(&opts) {
        Ok(()) => None,
        Err(e) => Some(e.to_string()),
    }
}

kvxfer_core::inventory::submit! {
    kvxfer_core::BackendDescriptor {
        name: NAME,
        description: if EMULATED {
            "ibverbs EMULATED in-process (test-only `emulator` feature; not RDMA)"
        } else {
            "ibverbs: RC queue pairs, RDMA WRITE, WRITE WITH IMMEDIATE notifications (InfiniBand, RoCE)"
        },
        capabilities: CAPABILITIES,
        create,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_come_from_config_then_env_then_defaults() {
        let env = |k: &str| match k {
            "KVXFER_VERBS_DEVICE" => Some("mlx5_1".to_string()),
            "KVXFER_VERBS_PORT" => Some("2".to_string()),
            _ => None,
        };
        let o = Options::from_sources(&BackendConfig::new(1), env).unwrap();
        assert_eq!(o.device.as_deref(), Some("mlx5_1"));
        assert_eq!(o.port, 2);
        assert_eq!(o.ring_slots, 64);
        let cfg = BackendConfig::new(1).with("device", "rxe0").with("gid_index", "3").with("timeout_ms", "500");
        let o = Options::from_sources(&cfg, env).unwrap();
        assert_eq!(o.device.as_deref(), Some("rxe0"), "an option beats the environment");
        assert_eq!(o.gid_index, 3);
        assert_eq!(o.timeout, Duration::from_millis(500));
    }

    #[test]
    fn bad_options_name_themselves() {
        let none = |_: &str| None;
        let e = Options::from_sources(&BackendConfig::new(1).with("port", "x"), none).unwrap_err();
        assert!(e.to_string().contains("option port"), "{e}");
        let e = Options::from_sources(&BackendConfig::new(1).with("colour", "red"), none).unwrap_err();
        assert!(e.to_string().contains("colour"), "{e}");
        let e = Options::from_sources(&BackendConfig::new(1), |k: &str| {
            (k == "KVXFER_VERBS_LISTEN").then(|| "nope".into())
        })
        .unwrap_err();
        assert!(e.to_string().contains("KVXFER_VERBS_LISTEN"), "{e}");
        assert!(Options::from_sources(&BackendConfig::new(1).with("slot_size", "100000"), none).is_err());
        assert!(Options::from_sources(&BackendConfig::new(1).with("port", "0"), none).is_err());
        assert!(Options::from_sources(&BackendConfig::new(1).with("sq_depth", "2"), none).is_err());
    }
}

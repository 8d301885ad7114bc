//! The shared-memory segment size (UCX's `MM_SEG_SIZE`): how many bytes one FIFO message of the
//! posix and sysv transports carries.
//!
//! Why the backend sets it: on UCX 1.13 every `ucp_put_nbx` into an engine's memory over shared
//! memory is emulated with active messages of at most one segment, and each segment costs a FIFO
//! element, a receive descriptor and an acknowledgement. UCX's default (8 KiB + 64) splits a
//! 64 KiB put into 8 messages; [`DEFAULT`] (32 KiB + 64) into 2. Measured on the 2-core
//! development VM (2026-12-04), six interleaved rounds of `kvxfer bench --backend ucx
//! --backend-opt tls=posix,sysv,cma,self --block 4K,64K,1M --total 1G --shuffle --runs 5`, this
//! default against `UCX_MM_SEG_SIZE=8256` on both sides, ucx / memcpy, median (range): 4 KiB 0.73
//! (0.64-0.80) against 0.70 (0.42-0.79); 64 KiB 0.74 (0.40-0.78) against 0.62 (0.27-0.70); 1 MiB
//! 0.87 (0.76-1.06) against 0.68 (0.55-0.73). Single runs swing 2-3x on that VM with its
//! core-to-core round trip (see `kvxfer bench`).
//!
//! Why it must match: UCX's sender writes up to its own segment size into a receive descriptor
//! the peer allocated with the peer's size, so a sender with the larger size overruns the peer's
//! descriptors. Endpoints publish their size (metadata and hello) and refuse a peer on the same
//! host whose size differs.
//!
//! Why below 64 KiB: UCX 1.13's FIFO element stores a message length in 16 bits; with
//! `UCX_MM_SEG_SIZE=65600` the bench's verification failed (bytes lost without an error).

use kvxfer_core::BackendError;

use crate::NAME;

/// The size this backend sets when nobody chose one: 32 KiB of payload plus UCX's 64-byte header
/// room (UCX's own default is 8 KiB + 64).
pub const DEFAULT: u64 = 32 * 1024 + 64;

/// UCX 1.13's own default (8 KiB + 64).
pub const UCX_DEFAULT: u64 = 8 * 1024 + 64;

/// The largest size UCX 1.13 handles (its FIFO element's 16-bit length).
pub const MAX: u64 = 65_535;

/// The smallest size accepted (UCX's headers must fit with room for data).
pub const MIN: u64 = 1024;

/// UCX settings (without the `UCX_` prefix) that set the segment size.
const KEYS: [&str; 3] = ["MM_SEG_SIZE", "POSIX_SEG_SIZE", "SYSV_SEG_SIZE"];

/// Parses a UCX memory-units value: a number with an optional `b`, `k`/`kb`, `m`/`mb`, `g`/`gb`
/// suffix (any case), as `ucs_str_to_memunits` does; `None` for anything else (`auto`, `inf`).
pub fn parse_units(v: &str) -> Option<u64> {
    let v = v.trim().to_ascii_lowercase();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mul: u64 = match unit {
        "" | "b" => 1,
        "k" | "kb" => 1 << 10,
        "m" | "mb" => 1 << 20,
        "g" | "gb" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mul)
}

/// The segment size to use and whether the backend must set it (`ucp_config_modify`), from the
/// backend's `ucx.NAME` options and the `UCX_*` environment (`env` looks a name up).
///
/// Every value the operator gave (options and environment, for the generic and the posix and
/// sysv names) must be one size in `MIN..=MAX`; `ucx.POSIX_SEG_SIZE` and `ucx.SYSV_SEG_SIZE` are
/// refused because `ucp_config_modify` does not apply them on UCX 1.13 (measured: a corrupting
/// size given that way changed nothing), so the published size would be wrong.
pub fn resolve(
    options: &[(String, String)],
    env: impl Fn(&str) -> Option<String>,
) -> Result<(u64, bool), BackendError> {
    let bad = |detail: String| BackendError::Config { backend: NAME, detail };
    let mut given: Vec<(String, String)> = Vec::new();
    for (k, v) in options {
        if k == "POSIX_SEG_SIZE" || k == "SYSV_SEG_SIZE" {
            return Err(bad(format!(
                "ucx.{k} is not applied by UCX 1.13 through ucp_config_modify; set ucx.MM_SEG_SIZE \
                 (or UCX_{k} in the environment) instead"
            )));
        }
        if k == "MM_SEG_SIZE" {
            given.push((format!("option ucx.{k}"), v.clone()));
        }
    }
    for k in KEYS {
        if let Some(v) = env(&format!("UCX_{k}")).filter(|v| !v.trim().is_empty()) {
            given.push((format!("UCX_{k}"), v));
        }
    }
    let mut size = None;
    for (what, v) in &given {
        let n =
            parse_units(v).ok_or_else(|| bad(format!("{what}={v:?} is not a size (a number with b, k, m or g)")))?;
        if !(MIN..=MAX).contains(&n) {
            return Err(bad(format!(
                "{what}={v} is outside {MIN}..={MAX} bytes: UCX 1.13 keeps a shared-memory message's \
                 length in 16 bits and loses bytes beyond it; use at most {MAX} (the backend's default is {DEFAULT})"
            )));
        }
        match size {
            None => size = Some((what.clone(), n)),
            Some((ref first, m)) if m != n => {
                return Err(bad(format!(
                    "{first} and {what} give different shared-memory segment sizes ({m} and {n}); \
                     set one size (peers on this host must all use it)"
                )))
            }
            Some(_) => {}
        }
    }
    let has = |name: &str| given.iter().any(|(w, _)| w.ends_with(name));
    if let Some((what, n)) = &size {
        // Only one transport's own name given: the other keeps UCX's default size.
        let both = has("MM_SEG_SIZE") || (has("POSIX_SEG_SIZE") && has("SYSV_SEG_SIZE"));
        if !both && *n != UCX_DEFAULT {
            return Err(bad(format!(
                "{what} sets one shared-memory transport's segment size; the other (posix or sysv) \
                 keeps UCX's default {UCX_DEFAULT}: set UCX_MM_SEG_SIZE (or both) instead"
            )));
        }
    }
    Ok(match size {
        Some((_, n)) => (n, false),
        None => (DEFAULT, true),
    })
}

/// Whether a `UCX_TLS` value (`None`: unset, every transport) opens UCX's posix or sysv
/// transport.
pub fn uses_mm(tls: Option<&str>) -> bool {
    match tls {
        None => true,
        Some(t) if t.trim_start().starts_with('^') => {
            // An exclusion list: mm opens unless it is excluded.
            let off: Vec<&str> = t.trim_start()[1..].split(',').map(str::trim).collect();
            !(off.iter().any(|x| matches!(*x, "mm" | "sm" | "shm"))
                || (off.contains(&"posix") && off.contains(&"sysv")))
        }
        Some(t) => t.split(',').map(str::trim).any(|x| matches!(x, "posix" | "sysv" | "mm" | "sm" | "shm" | "all")),
    }
}

/// Whether two endpoints on one host can talk: equal sizes, or one without shared memory (0).
pub fn compatible(ours: u64, theirs: u64) -> bool {
    ours == 0 || theirs == 0 || ours == theirs
}

/// The refusal for a same-host peer whose segment size differs from ours.
pub fn mismatch(ours: u64, theirs: u64) -> String {
    format!(
        "shared-memory segment sizes differ (this endpoint {ours} bytes, the peer {theirs}): UCX would \
         write past the smaller side's receive buffers; give every rank on a host the same \
         ucx.MM_SEG_SIZE / UCX_MM_SEG_SIZE, or none (default {DEFAULT})"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_owned())
    }

    fn opts(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn units() {
        for (s, n) in [
            ("8256", Some(8256)),
            ("8k", Some(8192)),
            ("8KB", Some(8192)),
            ("1m", Some(1 << 20)),
            (" 2g ", Some(2 << 30)),
            ("64b", Some(64)),
            ("auto", None),
            ("inf", None),
            ("", None),
            ("8x", None),
            ("k", None),
            ("99999999999999999999g", None),
        ] {
            assert_eq!(parse_units(s), n, "{s:?}");
        }
    }

    #[test]
    fn default_when_nothing_is_given() {
        assert_eq!(resolve(&[], env(&[])).unwrap(), (DEFAULT, true));
        // Other UCX options and variables do not count.
        assert_eq!(resolve(&opts(&[("RNDV_THRESH", "64k")]), env(&[("UCX_TLS", "tcp")])).unwrap(), (DEFAULT, true));
        const { assert!(DEFAULT <= MAX && DEFAULT >= MIN) };
    }

    #[test]
    fn operator_values_are_used_as_given() {
        assert_eq!(resolve(&opts(&[("MM_SEG_SIZE", "16k")]), env(&[])).unwrap(), (16384, false));
        assert_eq!(resolve(&[], env(&[("UCX_MM_SEG_SIZE", "8256")])).unwrap(), (8256, false));
        assert_eq!(
            resolve(&[], env(&[("UCX_SYSV_SEG_SIZE", "8256"), ("UCX_POSIX_SEG_SIZE", "8256")])).unwrap(),
            (8256, false)
        );
        assert_eq!(
            resolve(&[], env(&[("UCX_SYSV_SEG_SIZE", "16k"), ("UCX_POSIX_SEG_SIZE", "16k")])).unwrap(),
            (16384, false)
        );
        // One transport's name alone at UCX's default: both are at the default.
        assert_eq!(resolve(&[], env(&[("UCX_SYSV_SEG_SIZE", "8256")])).unwrap(), (8256, false));
        // The same size spelled two ways agrees.
        assert_eq!(
            resolve(&opts(&[("MM_SEG_SIZE", "16k")]), env(&[("UCX_MM_SEG_SIZE", "16384")])).unwrap(),
            (16384, false)
        );
    }

    #[test]
    fn bad_values_are_refused_with_the_reason() {
        let e = |o: &[(&str, &str)], v: &'static [(&'static str, &'static str)]| {
            resolve(&opts(o), env(v)).unwrap_err().to_string()
        };
        assert!(e(&[("MM_SEG_SIZE", "65600")], &[]).contains("16 bits"));
        assert!(e(&[], &[("UCX_SYSV_SEG_SIZE", "64k")]).contains("16 bits"));
        assert!(e(&[("MM_SEG_SIZE", "100")], &[]).contains("outside"));
        assert!(e(&[("MM_SEG_SIZE", "auto")], &[]).contains("not a size"));
        assert!(e(&[("MM_SEG_SIZE", "16k")], &[("UCX_POSIX_SEG_SIZE", "8256")]).contains("different"));
        assert!(e(&[], &[("UCX_POSIX_SEG_SIZE", "16k"), ("UCX_SYSV_SEG_SIZE", "8256")]).contains("different"));
        assert!(e(&[("SYSV_SEG_SIZE", "16k")], &[]).contains("ucx.MM_SEG_SIZE"));
        assert!(e(&[], &[("UCX_SYSV_SEG_SIZE", "16k")]).contains("keeps UCX's default"));
        assert!(e(&[("POSIX_SEG_SIZE", "16k")], &[]).contains("ucx.MM_SEG_SIZE"));
    }

    #[test]
    fn mismatch_names_both_sizes_and_the_fix() {
        let m = mismatch(DEFAULT, 8256);
        assert!(m.contains(&DEFAULT.to_string()) && m.contains("8256") && m.contains("MM_SEG_SIZE"));
    }

    #[test]
    fn which_transport_lists_open_shared_memory() {
        for (tls, mm) in [
            (None, true),
            (Some("tcp"), false),
            (Some("tcp,cma"), false),
            (Some("posix,sysv,cma,self"), true),
            (Some("sysv"), true),
            (Some("shm"), true),
            (Some("sm,tcp"), true),
            (Some("all"), true),
            (Some("^tcp"), true),
            (Some("^posix,sysv"), false),
            (Some("^shm"), false),
            (Some("^posix"), true),
        ] {
            assert_eq!(uses_mm(tls), mm, "{tls:?}");
        }
        assert!(compatible(DEFAULT, DEFAULT) && compatible(0, 8256) && compatible(8256, 0));
        assert!(!compatible(DEFAULT, UCX_DEFAULT));
    }
}

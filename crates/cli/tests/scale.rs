//! `kvxfer scale`: simulated ranks join a real bootstrap service (its own process) at once and each
//! sees the whole membership; the JSON report has its documented keys and consistent figures. Small
//! here (the 1,024-rank figures are in docs/performance/); what this guards is that the command
//! works end to end and that every rank completes.

use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kvxfer");

#[test]
fn every_simulated_rank_sees_the_whole_membership() {
    let out = Command::new(BIN)
        .args(["scale", "--ranks", "64", "--tp", "8", "--model", "llama3-8b", "--format", "json", "--timeout-s", "90"])
        .output()
        .expect("run kvxfer scale");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvxfer scale failed: {stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON document");
    assert_eq!(r["ranks"], 64);
    assert_eq!(r["parallel"], "tp 8 x pp 4");
    assert_eq!(r["store"], "bootstrap (own process)");
    // A real tcp endpoint's metadata and a pool of 32 / 4 layers: far from an empty record.
    assert!(r["record_bytes"].as_u64().unwrap() > 1000, "{r}");
    let s = |k: &str, q: &str| r[k][q].as_f64().unwrap_or_else(|| panic!("{k}.{q} missing: {r}"));
    for k in ["join", "handshake", "full"] {
        assert!(s(k, "p50_s") <= s(k, "p99_s") && s(k, "p99_s") <= s(k, "max_s"), "{k}: {r}");
    }
    // A rank joins before it sees the others, and the run ends when the last rank saw everyone.
    assert!(s("join", "max_s") <= s("full", "max_s"), "{r}");
    let full = r["full_membership_s"].as_f64().unwrap();
    assert!(full >= s("full", "max_s") && full < 90.0, "{r}");
    assert!(r["store_kib_per_rank"].as_f64().is_some(), "{r}");
    assert!(r["client_kib_per_rank"].as_f64().is_some(), "{r}");
}

#[test]
fn a_rank_count_that_does_not_split_is_refused() {
    let out = Command::new(BIN).args(["scale", "--ranks", "50", "--tp", "8"]).output().expect("run kvxfer scale");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--ranks 50 with --tp 8"), "{stderr}");
}

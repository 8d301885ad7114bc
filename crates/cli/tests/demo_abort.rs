//! `kvxfer demo --abort-rate` and `--layerwise`: decode ranks abort a fraction of the requests mid
//! transfer and reuse their pages at once after the fence; every completed request still verifies
//! byte for byte and the final whole-pool check finds no stray write. On tcp always; on ucx and
//! libfabric with the cargo features `ucx` / `fabric`.

use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_kvxfer");
const REQUESTS: u64 = 8;

/// Runs a small demo (4 layers, 5 pages per request) and checks the abort accounting.
fn abort_demo(extra: &[&str]) -> serde_json::Value {
    let out = Command::new(EXE)
        .args(["demo", "--format", "json", "--timeout-s", "120", "--requests", &REQUESTS.to_string()])
        .args(["--tokens", "80", "--layers", "4", "--abort-rate", "0.3"])
        .args(extra)
        .output()
        .expect("run kvxfer demo");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "demo {extra:?} printed no JSON ({e}); stdout {:?}, stderr {:?}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo {extra:?} failed: {v:#}\nstderr: {stderr}");
    assert_eq!(v["ok"], true, "{v:#}");
    assert_eq!(v["abort_rate"], 0.3);
    let (completed, aborted, verified) =
        (v["completed"].as_u64().unwrap(), v["aborted"].as_u64().unwrap(), v["verified"].as_u64().unwrap());
    assert!(aborted > 0, "nothing was aborted: {v:#}");
    assert_eq!(completed, verified, "{v:#}");
    let decode_ranks = v["ranks"].as_array().unwrap().iter().filter(|r| r["role"] == "decode").count() as u64;
    assert_eq!(completed + aborted, REQUESTS * decode_ranks, "{v:#}");
    // Each decode rank verified exactly its completed requests; with equal shares the bytes add up.
    let per = v["bytes_per_request"].as_u64().unwrap() / decode_ranks;
    assert_eq!(v["verified_bytes"].as_u64().unwrap(), completed * per, "{v:#}");
    eprintln!(
        "demo {extra:?}: {completed} completed = {verified} verified, {aborted} aborted, wall {:.2} s",
        v["wall_seconds"].as_f64().unwrap()
    );
    v
}

#[test]
fn aborted_requests_are_fenced_and_their_pages_reused_on_tcp() {
    let v = abort_demo(&["--prefill-tp", "2", "--decode-tp", "1"]);
    assert_eq!(v["layerwise"], false);
    // P < D, out of band, several chunks: every decode rank aborts the same requests.
    abort_demo(&["--prefill-tp", "1", "--decode-tp", "2", "--notify", "out-of-band", "--chunk-pages", "2"]);
}

#[test]
fn layerwise_sending_with_aborts_on_tcp() {
    let v = abort_demo(&["--layerwise", "--chunk-pages", "2"]);
    assert_eq!(v["layerwise"], true);
}

#[test]
fn the_abort_rate_is_validated() {
    for bad in ["1.5", "-0.1", "nan"] {
        let out = Command::new(EXE).args(["demo", &format!("--abort-rate={bad}")]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains("[0, 1]") && !e.contains("panicked"), "{bad}: {e}");
    }
}

#[cfg(feature = "ucx")]
#[test]
fn aborts_and_layerwise_on_ucx() {
    abort_demo(&["--backend", "ucx", "--backend-opt", "net_devices=lo"]);
    abort_demo(&["--backend", "ucx", "--backend-opt", "net_devices=lo", "--layerwise"]);
}

#[cfg(feature = "fabric")]
#[test]
fn aborts_and_layerwise_on_fabric() {
    abort_demo(&["--backend", "fabric"]);
    abort_demo(&["--backend", "fabric", "--layerwise", "--notify", "out-of-band"]);
}

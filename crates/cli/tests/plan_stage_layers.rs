//! `--prefill-layers` / `--decode-layers`: explicit per-stage layer counts (uneven pipeline stages) on
//! `kvxfer plan`, and the errors an invalid partition gets (the core's, naming the numbers; a malformed
//! list is a usage error).

use std::process::Command;

use serde_json::Value;

fn kvxfer(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer")).args(args).output().expect("run kvxfer");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// DeepSeek-V3's shape: MLA, 61 layers; prefill TP 2, decode TP 1; two pages.
fn deepseek(extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "plan",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
        "--mla",
        "--latent-dim",
        "576",
        "--layers",
        "61",
        "--page-size",
        "64",
        "--dtype-bytes",
        "2",
        "--src-pages",
        "0,1",
        "--dst-pages",
        "5,6",
    ]
    .map(String::from)
    .to_vec();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn run(args: &[String]) -> (Option<i32>, String, String) {
    kvxfer(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn expect_error(args: &[String], code: i32, want: &str) {
    let (got, _, err) = run(args);
    assert_eq!(got, Some(code), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: stderr lacks `{want}`: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

#[test]
fn deepseek_v3_61_layers_on_prefill_pp2_into_decode_pp1() {
    let (code, out, err) = run(&deepseek(&["--prefill-pp", "2", "--prefill-layers", "31,30", "--format", "json"]));
    assert_eq!(code, Some(0), "{err}");
    let doc: Value = serde_json::from_str(&out).unwrap();
    let mut dst_layers = std::collections::BTreeSet::new();
    for t in doc["transfers"].as_array().unwrap() {
        let stage = t["src"]["pp"].as_u64().unwrap();
        assert_eq!(t["dst"]["pp"], 0);
        let ops = t["ops"].as_array().unwrap();
        let src_layers: std::collections::BTreeSet<u64> =
            ops.iter().map(|o| o["src_region"]["layer"].as_u64().unwrap()).collect();
        // MLA: one sender (prefill TP 0) per stage writes; its stage's own layers, rank-local.
        if !ops.is_empty() {
            assert_eq!(src_layers, (0..if stage == 0 { 31 } else { 30 }).collect(), "stage {stage}");
        }
        for o in ops {
            let (sl, dl) = (o["src_region"]["layer"].as_u64().unwrap(), o["dst_region"]["layer"].as_u64().unwrap());
            assert_eq!(dl, sl + if stage == 0 { 0 } else { 31 }, "stage {stage}: {o}");
            assert!(dst_layers.insert((dl, o["src_region"]["kind"].as_str().unwrap().to_owned())), "layer {dl} twice");
        }
    }
    assert_eq!(dst_layers.len(), 61, "every decode layer written once");
    assert_eq!(doc["expected_senders"]["0/0"], serde_json::json!(["tp0.pp0", "tp0.pp1"]));

    // The table names the stages' layer counts.
    let (code, out, err) = run(&deepseek(&["--prefill-pp", "2", "--prefill-layers", "31,30"]));
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("prefill TP 2 x PP 2 (layers 31+30) -> decode TP 1 x PP 1;"), "{out}");
    assert!(out.contains("31/30 layer(s) per prefill stage"), "{out}");
}

#[test]
fn equal_pp_takes_the_prefill_partition_or_refuses_a_different_one() {
    let five = |extra: &[&str]| {
        let mut a: Vec<String> = [
            "plan",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "2",
            "--kv-heads",
            "2",
            "--head-dim",
            "8",
            "--layers",
            "5",
            "--page-size",
            "4",
            "--dtype-bytes",
            "2",
            "--src-pages",
            "0",
            "--dst-pages",
            "1",
            "--prefill-pp",
            "2",
            "--decode-pp",
            "2",
            "--format",
            "json",
        ]
        .map(String::from)
        .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    // --decode-layers defaults to --prefill-layers with equal PP; stating it again is the same.
    for extra in [&["--prefill-layers", "2,3"][..], &["--prefill-layers", "2,3", "--decode-layers", "2,3"]] {
        let (code, out, err) = run(&five(extra));
        assert_eq!(code, Some(0), "{extra:?}: {err}");
        let doc: Value = serde_json::from_str(&out).unwrap();
        for t in doc["transfers"].as_array().unwrap() {
            let stage = t["src"]["pp"].as_u64().unwrap();
            assert_eq!(t["dst"]["pp"].as_u64().unwrap(), stage);
            let layers: std::collections::BTreeSet<u64> =
                t["ops"].as_array().unwrap().iter().map(|o| o["dst_region"]["layer"].as_u64().unwrap()).collect();
            assert_eq!(layers, (0..if stage == 0 { 2 } else { 3 }).collect());
        }
    }
    expect_error(
        &five(&["--prefill-layers", "2,3", "--decode-layers", "3,2"]),
        1,
        "prefill layer partition [2, 3] and decode layer partition [3, 2] differ",
    );
    // Only the decode side explicit: the prefill side's even split cannot hold 5 layers.
    expect_error(&five(&["--decode-layers", "3,2"]), 1, "prefill: 5 layers cannot be split evenly over PP 2");
}

#[test]
fn invalid_partitions_are_refused_with_the_numbers() {
    expect_error(
        &deepseek(&["--prefill-pp", "2"]),
        1,
        "prefill: 61 layers cannot be split evenly over PP 2; give an explicit layer partition",
    );
    expect_error(
        &deepseek(&["--prefill-pp", "2", "--prefill-layers", "31,31"]),
        1,
        "prefill: layer partition [31, 31] sums to 62 layers but the model has 61",
    );
    expect_error(
        &deepseek(&["--prefill-pp", "2", "--prefill-layers", "61"]),
        1,
        "prefill: layer partition [61] names 1 stage(s) but PP is 2",
    );
    expect_error(
        &deepseek(&["--prefill-pp", "3", "--prefill-layers", "31,0,30"]),
        1,
        "prefill: stage 1 of layer partition [31, 0, 30] has 0 layers",
    );
    expect_error(
        &deepseek(&["--prefill-pp", "2", "--prefill-layers", "31,30", "--decode-layers", "30,31"]),
        1,
        "decode: layer partition [30, 31] names 2 stage(s) but PP is 1",
    );
    // Malformed lists are usage errors (exit 2) that quote the bad count.
    expect_error(&deepseek(&["--prefill-pp", "2", "--prefill-layers", "31,x"]), 2, "layer count `x` in `31,x`");
    expect_error(&deepseek(&["--prefill-pp", "2", "--prefill-layers", "31,,30"]), 2, "layer count ``");
    expect_error(&deepseek(&["--prefill-pp", "2", "--prefill-layers=-1,62"]), 2, "layer count `-1`");
    let many = vec!["1"; 65].join(",");
    expect_error(
        &deepseek(&["--prefill-pp", "65", "--prefill-layers", &many]),
        2,
        "65 exceeds the supported maximum 64",
    );
}

#[test]
fn help_documents_the_flags() {
    for cmd in ["plan", "demo"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvxfer")).args([cmd, "--help"]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("--prefill-layers <L0,L1,..>") && text.contains("--decode-layers <L0,L1,..>"),
            "{cmd}: {text}"
        );
        assert!(text.contains("31,30"), "{cmd}: {text}");
    }
}

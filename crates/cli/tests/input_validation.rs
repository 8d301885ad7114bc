//! Durations the command line takes are validated: NaN, infinities, zero, negative and absurd values
//! are a usage error naming the range, never a panic (they used to panic converting to a `Duration`,
//! or end a run at once).

use std::process::Command;

fn kvxfer(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer")).args(args).output().expect("run kvxfer");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_durations_are_refused_with_the_range() {
    // `--flag=value`, so that `-1` is taken as the value, as a user would write it.
    let mut cases: Vec<Vec<String>> = Vec::new();
    for v in ["nan", "-1", "1e300", "0", "inf"] {
        for (cmd, flag) in [
            ("demo", "timeout-s"),
            ("demo", "lease-ttl-s"),
            ("demo", "request-timeout-s"),
            ("bootstrap", "for-s"),
            ("worker", "timeout-s"),
            ("worker", "lease-ttl-s"),
        ] {
            let mut a = vec![cmd.to_owned(), format!("--{flag}={v}")];
            if cmd == "worker" {
                a.extend(["--bootstrap", "127.0.0.1:1", "--role", "decode"].map(String::from));
            }
            cases.push(a);
        }
    }
    for args in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, err) = kvxfer(&args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains("(0, 86400]"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

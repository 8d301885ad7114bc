//! `kvxfer backends`: every backend of the binary with its memory kinds and every option with its
//! default and docs, as a table and as JSON. The options printed are the backend's own list
//! (`kvxfer_tcp::OPTIONS`, the one its option parser checks keys against).

use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kvxfer");

fn run(args: &[&str]) -> String {
    let out = Command::new(BIN).arg("backends").args(args).output().expect("runs kvxfer");
    assert!(out.status.success(), "kvxfer backends {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// The lines of one backend's block of the table.
fn block<'a>(table: &'a str, name: &str) -> Vec<&'a str> {
    let head = format!("{name}: ");
    let mut lines = table.lines().skip_while(|l| !l.starts_with(&head));
    let first = lines.next().unwrap_or_else(|| panic!("no {name} block in:\n{table}"));
    std::iter::once(first).chain(lines.take_while(|l| !l.is_empty())).collect()
}

#[test]
fn table_lists_memory_kinds_and_options_with_defaults_and_docs() {
    let table = run(&[]);
    let tcp = block(&table, "tcp");
    assert!(tcp.contains(&"  memory kinds: host"), "{tcp:#?}");
    assert!(tcp.contains(&"  notifications: attached, out-of-band"), "{tcp:#?}");
    assert!(tcp
        .iter()
        .any(|l| l.starts_with("  options (--backend-opt NAME=VALUE, else the variable KVXFER_TCP_<NAME>)")));
    // Each option: its name and default on one line, its docs on the next.
    for o in kvxfer_tcp::OPTIONS {
        let at = tcp
            .iter()
            .position(|l| {
                l.trim_start().starts_with(o.name) && l.trim_end().ends_with(&format!("default: {}", o.default))
            })
            .unwrap_or_else(|| panic!("{} with its default {} not listed: {tcp:#?}", o.name, o.default));
        assert_eq!(tcp[at + 1].trim(), o.doc, "{}", o.name);
    }
    let poll = tcp.iter().find(|l| l.trim_start().starts_with("poll_us ")).expect("poll_us listed");
    assert!(poll.ends_with("default: 200"), "{poll}");
    let local = block(&table, "local");
    assert!(local.contains(&"  memory kinds: host") && local.contains(&"  options: none"), "{local:#?}");
}

#[test]
fn json_lists_the_same() {
    let doc: Value = serde_json::from_str(&run(&["--format", "json"])).expect("one JSON document");
    let all = doc["backends"].as_array().expect("backends array");
    let names: Vec<&str> = all.iter().map(|b| b["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"tcp") && names.contains(&"local"), "{names:?}");
    let tcp = all.iter().find(|b| b["name"] == "tcp").unwrap();
    assert_eq!(tcp["memory"], serde_json::json!(kvxfer_tcp::CAPABILITIES.memory.names()));
    assert_eq!(tcp["memory"], serde_json::json!(["host"]));
    assert_eq!(tcp["completion"], "remote");
    assert_eq!(tcp["indexed"], "native");
    assert_eq!(tcp["cross_host"], true);
    let options = tcp["options"].as_array().unwrap();
    assert_eq!(options.len(), kvxfer_tcp::OPTIONS.len());
    for (j, o) in options.iter().zip(kvxfer_tcp::OPTIONS) {
        assert_eq!(
            (j["name"].as_str(), j["default"].as_str(), j["doc"].as_str()),
            (Some(o.name), Some(o.default), Some(o.doc))
        );
        assert_eq!(j["env"], format!("KVXFER_TCP_{}", o.name.to_uppercase()));
    }
    let poll = options.iter().find(|o| o["name"] == "poll_us").expect("poll_us listed");
    assert_eq!(poll["default"], "200");
    let local = all.iter().find(|b| b["name"] == "local").unwrap();
    assert_eq!(local["options"], serde_json::json!([]));
}

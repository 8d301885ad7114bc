//! `kvxfer backends`: every backend compiled into this binary, with what an endpoint of it takes
//! (memory kinds, notification styles, reach, completion: the capabilities of an endpoint with
//! default options) and every option it accepts, with its default and one line of docs, from the
//! backend's registry entry ([`kvxfer_core::BackendDescriptor`]). `--format json` prints the same
//! as one JSON document (documented in docs/cli.md).

use std::io::{self, Write};
use std::process::ExitCode;

use kvxfer_core::{BackendDescriptor, Completion};
use serde_json::{json, Value};

use crate::plan::Format;

/// Arguments of `kvxfer backends`.
#[derive(Debug, Clone, clap::Args)]
pub struct BackendsArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// The backends of this binary, sorted by name.
fn backends() -> Vec<&'static BackendDescriptor> {
    // References every backend the cargo features enabled, so the linker keeps its registration.
    let _ = kvxfer::backends::linked();
    kvxfer_core::backend::registered()
}

fn completion(c: Completion) -> &'static str {
    match c {
        Completion::Remote => "remote",
        Completion::Local => "local",
    }
}

fn styles(d: &BackendDescriptor) -> Vec<&'static str> {
    let c = &d.capabilities;
    [(c.attached, "attached"), (c.out_of_band, "out-of-band")]
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, s)| s)
        .collect()
}

/// The environment variable an option falls back to (`None` for a pattern such as `ucx.<NAME>`).
fn env_name(backend: &str, option: &str) -> Option<String> {
    (!option.contains('<')).then(|| kvxfer_core::toolkit::option_env_name(backend, option))
}

fn or_none(v: Vec<&str>) -> String {
    if v.is_empty() {
        "none".to_owned()
    } else {
        v.join(", ")
    }
}

fn write_table(out: &mut impl Write, all: &[&BackendDescriptor]) -> io::Result<()> {
    writeln!(out, "{} backends compiled in (capabilities of an endpoint with default options):", all.len())?;
    for d in all {
        let c = &d.capabilities;
        let yes = |b: bool| if b { "yes" } else { "no" };
        writeln!(out)?;
        writeln!(out, "{}: {}", d.name, d.description)?;
        writeln!(out, "  memory kinds: {}", or_none(c.memory.names()))?;
        writeln!(out, "  notifications: {}", or_none(styles(d)))?;
        writeln!(
            out,
            "  cross-process: {}, cross-host: {}, completion: {}, page lists (indexed ops): {}",
            yes(c.cross_process),
            yes(c.cross_host),
            completion(c.completion),
            if c.indexed { "native" } else { "expanded" }
        )?;
        if d.options.is_empty() {
            writeln!(out, "  options: none")?;
            continue;
        }
        writeln!(
            out,
            "  options (--backend-opt NAME=VALUE, else the variable KVXFER_{}_<NAME>):",
            d.name.to_uppercase()
        )?;
        let width = d.options.iter().map(|o| o.name.len()).max().unwrap_or(0);
        for o in d.options {
            writeln!(out, "    {:width$}  default: {}", o.name, o.default)?;
            writeln!(out, "    {:width$}  {}", "", o.doc)?;
        }
    }
    Ok(())
}

fn to_json(all: &[&BackendDescriptor]) -> Value {
    let backends: Vec<Value> = all
        .iter()
        .map(|d| {
            let c = &d.capabilities;
            let options: Vec<Value> = d
                .options
                .iter()
                .map(|o| json!({"name": o.name, "default": o.default, "doc": o.doc, "env": env_name(d.name, o.name)}))
                .collect();
            json!({
                "name": d.name,
                "description": d.description,
                "memory": c.memory.names(),
                "notifications": styles(d),
                "cross_process": c.cross_process,
                "cross_host": c.cross_host,
                "completion": completion(c.completion),
                "indexed": if c.indexed { "native" } else { "expanded" },
                "options": options,
            })
        })
        .collect();
    json!({ "backends": backends })
}

/// Prints the backends of this binary.
pub fn run(args: &BackendsArgs) -> ExitCode {
    let all = backends();
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let res = match args.format {
        Format::Table => write_table(&mut out, &all),
        Format::Json => writeln!(out, "{:#}", to_json(&all)),
    }
    .and_then(|()| out.flush());
    match res {
        Ok(()) => ExitCode::SUCCESS,
        // `kvxfer backends | head`: the reader had enough.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvxfer backends: writing the listing: {e}");
            ExitCode::FAILURE
        }
    }
}

//! `kvxfer`: the kvxfer command-line tool.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod backends;
mod bench;
mod bench_engine;
mod bootstrap;
mod demo;
mod metrics_http;
mod model;
#[cfg(feature = "otel")]
mod otel;
#[cfg(feature = "ucx")]
mod perftest;
mod plan;
mod scale;
mod soak;
mod svg;
mod worker;

/// Moves KV cache between prefill and decode workers of disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "kvxfer", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print what every prefill rank writes into every decode rank for one request chunk.
    Plan(plan::PlanArgs),
    /// The main job: prefill and decode worker processes move a stream of requests for a model shape
    /// through a bootstrap service, and every decode byte is verified.
    Demo(demo::DemoArgs),
    /// One prefill or decode rank (started by `demo`, or by hand on several hosts).
    Worker(Box<worker::WorkerArgs>),
    /// Run the bootstrap service alone, for workers started by hand.
    Bootstrap(bootstrap::BootstrapArgs),
    /// Bandwidth of a backend between two processes, next to memcpy and a plain socket.
    Bench(Box<bench::BenchArgs>),
    /// The control plane at scale: many simulated ranks join one metadata store at once; reports the
    /// time until every rank sees the full membership, and memory per rank.
    Scale(scale::ScaleArgs),
    /// List the backends compiled into this binary: memory kinds, notification styles, reach,
    /// completion, and every option with its default and what it does.
    Backends(backends::BackendsArgs),
    /// Sustained load: a bootstrap, a decode and prefill workers stream requests for a long time
    /// while a prefill rank is killed and restarted; RSS and open fds sampled (scripts/soak.sh).
    #[command(hide = true)]
    Soak(soak::SoakArgs),
    /// The receiving process of `bench` (started by it).
    #[command(hide = true)]
    BenchPeer(bench::PeerArgs),
    /// The target process of the two-process fabric baseline (started by `bench`).
    #[cfg(feature = "fabric")]
    #[command(hide = true)]
    FabricBaselineTarget(bench::FabricTargetArgs),
}

/// Log filter: `KVXFER_LOG`, else `RUST_LOG`, else `warn` (the library's warnings: refused
/// handshakes, forged notifications, lost peers, failed reconnects). Logs go to stderr, so the
/// JSON and text reports on stdout stay clean. With the `otel` feature and
/// `OTEL_EXPORTER_OTLP_ENDPOINT` set, request traces are also exported (see `otel.rs`); the
/// returned guard flushes them at exit.
fn init_logging(command: &str) -> Option<Box<dyn std::any::Any>> {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{EnvFilter, Layer as _};
    let filter = std::env::var("KVXFER_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new("warn"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi).with_filter(filter);
    #[cfg(feature = "otel")]
    {
        let (spans, guard) = match otel::from_env(command) {
            Ok(Some((l, g))) => (Some(l), Some(g)),
            Ok(None) => (None, None),
            Err(e) => {
                eprintln!("kvxfer: {e}; request traces are not exported");
                (None, None)
            }
        };
        let only_requests = tracing_subscriber::filter::Targets::new()
            .with_target("kvxfer::request", tracing_subscriber::filter::LevelFilter::DEBUG);
        let _ = tracing_subscriber::registry().with(fmt).with(spans.with_filter(only_requests)).try_init();
        guard.map(|g| Box::new(g) as Box<dyn std::any::Any>)
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = command;
        if ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
            .iter()
            .any(|v| std::env::var_os(v).is_some())
        {
            eprintln!(
                "kvxfer: OTEL_EXPORTER_OTLP_ENDPOINT is set, but this kvxfer was built without the `otel` feature: no \
                 request traces are exported (cargo build --release -p kvxfer-cli --features otel)"
            );
        }
        let _ = tracing_subscriber::registry().with(fmt).try_init();
        None
    }
}

fn main() -> ExitCode {
    // libfabric reads FI_AV_REMOVE_CLEANUP once, when it starts: with it, removing a peer that this
    // rank cut off closes its tcp connection, which is what makes the fabric backend's cut-off
    // confirmable on `tcp;ofi_rxm` (SEMANTICS §6). Set here, before any thread exists; an
    // operator's own value is kept, and child processes (the demo's workers) inherit it.
    #[cfg(feature = "fabric")]
    if std::env::var_os("FI_AV_REMOVE_CLEANUP").is_none() {
        std::env::set_var("FI_AV_REMOVE_CLEANUP", "1");
    }
    let cli = Cli::parse();
    let command = match &cli.command {
        Command::Plan(_) => "plan",
        Command::Demo(_) => "demo",
        Command::Worker(_) => "worker",
        Command::Bootstrap(_) => "bootstrap",
        Command::Bench(_) => "bench",
        Command::Scale(_) => "scale",
        Command::Backends(_) => "backends",
        Command::Soak(_) => "soak",
        Command::BenchPeer(_) => "bench-peer",
        #[cfg(feature = "fabric")]
        Command::FabricBaselineTarget(_) => "fabric-baseline-target",
    };
    // Dropped after the command returned: flushes exported traces (bounded).
    let _traces = init_logging(command);
    match cli.command {
        Command::Plan(args) => plan::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::Worker(args) => worker::run(&args),
        Command::Bootstrap(args) => bootstrap::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Scale(args) => scale::run(&args),
        Command::Backends(args) => backends::run(&args),
        Command::Soak(args) => soak::run(&args),
        Command::BenchPeer(args) => bench::peer(&args),
        #[cfg(feature = "fabric")]
        Command::FabricBaselineTarget(args) => bench::fabric_target(&args),
    }
}

//! `kvxfer`: the kvxfer command-line tool.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod plan;

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
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Plan(args) => plan::run(&args),
    }
}

//! The conformance suite over loopback TCP with polling on (`poll_us`, one data stream per peer):
//! the polling reads and writes go through plain system calls on the borrowed socket instead of
//! tokio's, so they get the whole suite of their own, failure and abort cases included.

mod common;

fn main() -> std::process::ExitCode {
    common::run(common::Tcp {
        name: "tcp(loopback, poll_us=100)",
        options: &[("connections", "1"), ("poll_us", "100")],
    })
}

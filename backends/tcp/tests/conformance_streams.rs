//! The conformance suite over loopback TCP with several sleeping streams per peer
//! (`connections=3 poll_us=0`): frames dealt over streams, attached notifications that wait for
//! every stream's part, and reads and writes that sleep on tokio's readiness instead of polling
//! with plain system calls (the default, one polling stream, is `tests/conformance.rs`). Three
//! streams, so that a post's frames are split unevenly.

mod common;

fn main() -> std::process::ExitCode {
    common::run(common::Tcp {
        name: "tcp(loopback, connections=3, poll_us=0)",
        options: &[("connections", "3"), ("poll_us", "0")],
    })
}

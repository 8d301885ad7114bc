//! The conformance suite over real loopback TCP sockets (both notification styles are cases of the
//! suite), two data streams per peer.

mod common;

fn main() -> std::process::ExitCode {
    common::run(common::Tcp { name: "tcp(loopback)", options: &[("connections", "2")] })
}

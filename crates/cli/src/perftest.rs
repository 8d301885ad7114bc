//! The baseline kvxfer's UCX numbers are compared with: UCX's own `ucx_perftest -t ucp_put_bw`
//! (server and client on loopback), run as child processes with a deadline and killed afterwards.
//! Used by `kvxfer bench` (feature `ucx`) and included by the UCX backend's `examples/ucx_bench.rs`;
//! it uses nothing of kvxfer, so it is not part of the backend library.

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why a perftest run produced no number.
#[derive(Debug, thiserror::Error)]
pub enum PerftestError {
    /// `ucx_perftest` is not installed.
    #[error("ucx_perftest not found on PATH (Debian: apt-get install ucx-utils): {0}")]
    NotFound(String),
    /// Spawning or talking to a child failed.
    #[error("running ucx_perftest: {0}")]
    Io(String),
    /// The run did not finish in time (both processes were killed).
    #[error("ucx_perftest did not finish within {0:?} (killed)")]
    Timeout(Duration),
    /// The client exited unsuccessfully.
    #[error("ucx_perftest client failed ({status}): {output}")]
    Failed {
        /// Exit status.
        status: String,
        /// The end of its output.
        output: String,
    },
    /// The output had no `Final:` line that parses.
    #[error("could not find the result in ucx_perftest's output: {0}")]
    Parse(String),
}

/// Kills and reaps a child when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn binary() -> Result<PathBuf, PerftestError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("ucx_perftest"))
        .find(|p| p.is_file())
        .ok_or_else(|| PerftestError::NotFound(format!("PATH={}", path.to_string_lossy())))
}

fn free_port() -> Result<u16, PerftestError> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| PerftestError::Io(format!("finding a free port: {e}")))?;
    l.local_addr().map(|a| a.port()).map_err(|e| PerftestError::Io(e.to_string()))
}

/// Parses the bandwidth of the `Final:` line (column 6, "overall" MB/s, where UCX's MB is 2^20
/// bytes) into bytes per second.
pub fn parse_final(output: &str) -> Result<f64, PerftestError> {
    let line = output
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with("Final:"))
        .ok_or_else(|| PerftestError::Parse(tail(output)))?;
    let cols: Vec<&str> = line.split_whitespace().collect();
    // Final: iters lat50 lat_avg lat_overall bw_avg bw_overall rate_avg rate_overall
    let bw = cols
        .get(6)
        .and_then(|c| c.parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v > 0.0)
        .ok_or_else(|| PerftestError::Parse(line.to_owned()))?;
    Ok(bw * 1024.0 * 1024.0)
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

fn command(tls: &str, port: u16) -> Result<Command, PerftestError> {
    let mut c = Command::new(binary()?);
    c.env("UCX_TLS", tls).arg("-p").arg(port.to_string());
    if tls.contains("tcp") || tls == "all" {
        c.env("UCX_NET_DEVICES", "lo");
    }
    c.stdin(Stdio::null());
    Ok(c)
}

/// Runs `ucx_perftest -t ucp_put_bw` with `UCX_TLS=tls` on loopback (`UCX_NET_DEVICES=lo` for
/// network transports; the out-of-band connection goes to 127.0.0.1), `iters` messages of `size`
/// bytes, and returns its overall bandwidth in bytes per second. Bounded by `limit`; both processes
/// are killed afterwards.
pub fn run(tls: &str, size: usize, iters: usize, limit: Duration) -> Result<f64, PerftestError> {
    let deadline = Instant::now() + limit;
    let iters = iters.max(1);
    let warmup = (iters / 10).max(1);
    // The server exits after one test; a client that found it not listening yet is retried.
    for attempt in 0..5 {
        let port = free_port()?;
        let server = command(tls, port)?
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| PerftestError::Io(format!("spawning the server: {e}")))?;
        let _server = Reaped(server);
        std::thread::sleep(Duration::from_millis(300 + 200 * attempt));
        let mut client = command(tls, port)?;
        client
            .arg("127.0.0.1")
            .args(["-t", "ucp_put_bw", "-s", &size.to_string(), "-n", &iters.to_string(), "-w", &warmup.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = Reaped(client.spawn().map_err(|e| PerftestError::Io(format!("spawning the client: {e}")))?);
        let mut out = String::new();
        let mut stdout = child.0.stdout.take().expect("piped");
        let mut stderr = child.0.stderr.take().expect("piped");
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stdout.read_to_string(&mut s);
            let mut e = String::new();
            let _ = stderr.read_to_string(&mut e);
            s + &e
        });
        let status = loop {
            match child.0.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if Instant::now() >= deadline => {
                    drop(child);
                    let _ = reader.join();
                    return Err(PerftestError::Timeout(limit));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(PerftestError::Io(e.to_string())),
            }
        };
        out.push_str(&reader.join().unwrap_or_default());
        if status.success() {
            return parse_final(&out);
        }
        let refused = out.contains("refused") || out.contains("connect");
        if !refused || attempt == 4 || Instant::now() >= deadline {
            return Err(PerftestError::Failed { status: status.to_string(), output: tail(&out) });
        }
    }
    unreachable!("the loop returns on its last attempt")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_final_line() {
        let out = "| Stage | ...\nFinal:                   200      0.175 17388.785 17388.785       57.51      57.51          58          58\n";
        let bw = parse_final(out).unwrap();
        assert!((bw - 57.51 * 1048576.0).abs() < 1.0);
        assert!(parse_final("no result here").is_err());
        assert!(parse_final("Final: 1 2 3").is_err());
    }
}

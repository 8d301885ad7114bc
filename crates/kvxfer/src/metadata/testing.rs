//! A throwaway etcd server for tests and local trials: Debian's `etcd` binary (package
//! `etcd-server`) on free loopback ports with a temporary data directory, stopped and removed on
//! drop. Needs no cargo feature (it only starts a process).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    host: String,
    netns: Option<String>,
}

/// The etcd binary: `$KVXFER_ETCD_BIN`, else `etcd` on `PATH` (or `/usr/bin/etcd`).
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVXFER_ETCD_BIN") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdServer {
    /// Starts etcd on `127.0.0.1` with free ports and waits (at most 30 s) until it answers.
    /// `Err` says why (no binary, did not start).
    pub fn start() -> Result<Self, String> {
        Self::start_on("127.0.0.1", free_port().map_err(|e| e.to_string())?, None)
    }

    /// Starts etcd listening on `host:port` (peer port `port + 1`), inside network namespace
    /// `netns` when given (via `ip netns exec`).
    pub fn start_on(host: &str, client_port: u16, netns: Option<&str>) -> Result<Self, String> {
        let bin = etcd_binary().ok_or("no etcd binary (install Debian's etcd-server, or set KVXFER_ETCD_BIN)")?;
        let peer_port = if netns.is_some() { client_port + 1 } else { free_port().map_err(|e| e.to_string())? };
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvxfer-etcd-{}-{client_port}-{seq}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let client = format!("http://{host}:{client_port}");
        let peer = format!("http://{host}:{peer_port}");
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        cmd.args(["--name", "kvxfer-test", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kvxfer-test={peer}"), "--initial-cluster-state", "new"])
            .args(["--listen-metrics-urls", ""])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("etcd.log")).map(Stdio::from).unwrap_or_else(|_| Stdio::null()));
        let child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let mut s = Self {
            child: Some(child),
            dir,
            client_port,
            peer_port,
            host: host.to_owned(),
            netns: netns.map(String::from),
        };
        s.wait_ready(Duration::from_secs(30))?;
        Ok(s)
    }

    fn wait_ready(&mut self, within: Duration) -> Result<(), String> {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    return Err(format!("etcd exited with {st} at start-up; log: {}", self.log_tail()));
                }
            }
            if self.healthy() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!("etcd did not answer within {within:?}; log: {}", self.log_tail()))
    }

    /// Whether `/health` answers `"health":"true"` (a plain HTTP GET, bounded).
    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let probe = || -> std::io::Result<String> {
            let addr = format!("{}:{}", self.host, self.client_port);
            let sa: std::net::SocketAddr = addr.parse().map_err(std::io::Error::other)?;
            let mut s = std::net::TcpStream::connect_timeout(&sa, Duration::from_millis(300))?;
            s.set_read_timeout(Some(Duration::from_millis(500)))?;
            s.write_all(format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out)
        };
        if self.netns.is_some() {
            // Not reachable from here: ask from inside the namespace.
            let out = Command::new("ip")
                .args(["netns", "exec", self.netns.as_deref().unwrap_or_default(), "bash", "-c"])
                .arg(format!(
                    "exec 3<>/dev/tcp/{}/{} && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && timeout 1 cat <&3",
                    self.host, self.client_port
                ))
                .output();
            return out.map(|o| String::from_utf8_lossy(&o.stdout).contains("\"health\":\"true\"")).unwrap_or(false);
        }
        probe().map(|o| o.contains("\"health\":\"true\"")).unwrap_or(false)
    }

    /// `host:port` of the client URL.
    pub fn endpoint(&self) -> String {
        format!("{}:{}", self.host, self.client_port)
    }

    /// `etcd://host:port/<prefix>`.
    pub fn address(&self, prefix: &str) -> String {
        format!("etcd://{}/{}", self.endpoint(), prefix.trim_matches('/'))
    }

    /// The peer port.
    pub fn peer_port(&self) -> u16 {
        self.peer_port
    }

    /// The last lines of etcd's log.
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }

    /// Stops etcd (SIGKILL) now and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

//! The bootstrap service of a long-running cluster, facing hostile clients: the real `kvxfer
//! bootstrap` binary in its own process, driven over loopback.
//!
//! - a client that sends 100 MB without a newline: the service's VmRSS (`/proc/<pid>/status`) stays
//!   under its idle RSS + 64 MiB, and a well-formed client is served meanwhile;
//! - 1,000 idle connections: well-formed clients are still served, and the idle connections are
//!   closed at the idle deadline (a short one here);
//! - a rank that registers, crashes and registers again is accepted under a higher epoch once its
//!   lease expired, and the peers see the new one (membership through the service's store);
//! - with a shared secret: unauthenticated and wrongly authenticated clients are refused and get no
//!   value, an authenticated one works, a captured request line replayed on another connection is
//!   refused, and the secret is never printed;
//! - at the open-file limit, the accept loop backs off instead of spinning and recovers;
//! - the limits given on the command line hold, and the store's key and lease counts return to 0
//!   (nothing leaks).
//!
//! Every loop is bounded in count and time; every process started is killed on drop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::bootstrap::{BootstrapClient, RankRegistration, Secret, ServerStats};
use kvxfer::metadata::bootstrap::BootstrapStore;
use kvxfer::metadata::{Membership, MetadataError, MetadataStore};
use kvxfer::session::KvPool;
use kvxfer::{Attention, EndpointMetadata, KvSpec, Layout, Parallel, RankId, Side, SideSpec};
use serde_json::{json, Value};

const EXE: &str = env!("CARGO_BIN_EXE_kvxfer");
const MIB: u64 = 1 << 20;

/// A `kvxfer bootstrap` process, killed on drop, with its output collected.
struct Service {
    child: Child,
    addr: SocketAddr,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl Service {
    /// Starts the service on a free loopback port with `args`; `env` is added to its environment;
    /// `nofile` runs it under that open-file limit (soft and hard).
    fn start(args: &[&str], env: &[(&str, &str)], nofile: Option<u32>) -> Self {
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = Command::new("bash");
                c.args(["-c", &format!("ulimit -n {n} && exec \"$0\" \"$@\""), EXE]);
                c
            }
            None => Command::new(EXE),
        };
        cmd.args(["bootstrap", "--listen", "127.0.0.1:0", "--for-s", "300"])
            .args(args)
            .env_remove("KVXFER_SECRET")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start kvxfer bootstrap");
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let so = Arc::clone(&stdout);
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l.clone());
                so.lock().unwrap().push_str(&(l + "\n"));
            }
        });
        let err = child.stderr.take().unwrap();
        let se = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut r = BufReader::new(err);
            let mut buf = [0u8; 4096];
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                se.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let mut svc = Service { child, addr: "127.0.0.1:1".parse().unwrap(), stdout, stderr };
        let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| {
            panic!("kvxfer bootstrap did not start within 30 s; stderr: {}", svc.stderr.lock().unwrap())
        });
        svc.addr = line.rsplit(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("no address in {line:?}"));
        svc
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn client(&self) -> BootstrapClient {
        BootstrapClient::new(self.addr.to_string()).with_timeout(Duration::from_secs(10))
    }

    /// The service's metadata store as ranks reach it (keys under `/longrun`).
    fn store(&self) -> BootstrapStore {
        BootstrapStore::new(&self.addr.to_string(), "/longrun").with_timeout(Duration::from_secs(10))
    }

    /// A field of the service's /proc/<pid>/status, in bytes.
    fn status_bytes(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("/proc/<pid>/status");
        let line = s.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field}"));
        line.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).expect("kB") * 1024
    }

    /// User + system CPU time of the service so far, in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).expect("/proc/<pid>/stat");
        // After the command name in parentheses: state is field 3; utime and stime are 14 and 15.
        let rest = &s[s.rfind(')').expect("stat") + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }

    fn output(&self) -> String {
        format!("{}{}", self.stdout.lock().unwrap(), self.stderr.lock().unwrap())
    }

    /// Its output once it contains `pat` (read by other threads: waits at most 10 s for it).
    fn output_with(&self, pat: &str) -> String {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let out = self.output();
            if out.contains(pat) || Instant::now() >= end {
                return out;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn stats(rt: &tokio::runtime::Runtime, c: &BootstrapClient) -> ServerStats {
    rt.block_on(c.stats()).expect("stats")
}

/// Puts `value` under `key` (no lease).
fn put(rt: &tokio::runtime::Runtime, s: &BootstrapStore, key: &str, value: Value) -> Result<u64, String> {
    rt.block_on(s.put(key, &value, None)).map_err(|e| e.to_string())
}

/// The value under `key`, if any.
fn get(rt: &tokio::runtime::Runtime, s: &BootstrapStore, key: &str) -> Result<Option<Value>, String> {
    rt.block_on(s.get(key)).map(|(e, _)| e.map(|e| e.json())).map_err(|e| e.to_string())
}

/// A rank joins as ranks do (its record under a lease, checked against the ranks there), and the
/// ranks of its role are listed; returns how many there are.
fn join_and_list(rt: &tokio::runtime::Runtime, s: &BootstrapStore, r: RankRegistration) -> (Membership, usize) {
    let store: Arc<dyn MetadataStore> = Arc::new(s.clone());
    let role = r.role;
    let m = rt.block_on(Membership::join(Arc::clone(&store), r, Duration::from_secs(30))).unwrap();
    let peers = rt.block_on(kvxfer::metadata::peers(&*store, role, 1, Duration::from_secs(10))).unwrap();
    (m, peers.len())
}

/// Polls the service's stats (at most `within`) until `pred` holds; returns the last. A refused
/// stats call (the service at its connection limit) is retried.
fn until(
    rt: &tokio::runtime::Runtime,
    c: &BootstrapClient,
    within: Duration,
    pred: impl Fn(&ServerStats) -> bool,
) -> ServerStats {
    let end = Instant::now() + within;
    loop {
        match rt.block_on(c.stats()) {
            Ok(s) if pred(&s) || Instant::now() >= end => return s,
            Err(e) if Instant::now() >= end => panic!("stats: {e}"),
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn spec(tp: u32) -> SideSpec {
    SideSpec {
        kv: KvSpec {
            attention: Attention::Gqa { kv_heads: 8, head_dim_k: 128, head_dim_v: 128 },
            layers: 4,
            dtype_bytes: 2,
            page_size: 16,
            layout: Layout::Nhd,
        },
        parallel: Parallel::new(tp, 1),
    }
}

fn reg(role: Side, tp: u32, label: &str) -> RankRegistration {
    RankRegistration {
        role,
        rank: RankId::new(tp, 0),
        backend: "tcp".into(),
        endpoint: EndpointMetadata { version: 1, backend: "tcp".into(), identity: u64::from(tp), payload: vec![7; 64] },
        pool: KvPool { pages: 1, buffers: vec![] },
        spec: spec(2),
        label: label.into(),
        model: None,
        protocol: kvxfer_core::ProtocolRange::THIS_BUILD,
        warmup: None,
    }
}

/// Reads one line from a raw connection (read timeout 10 s).
fn raw_line(r: &mut BufReader<TcpStream>) -> String {
    r.get_ref().set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut l = String::new();
    let _ = r.read_line(&mut l);
    l
}

#[test]
fn a_client_sending_100_mb_without_newline_leaves_the_service_small_while_others_are_served() {
    let svc = Service::start(&[], &[], None);
    let rt = rt();
    let c = svc.client();
    let kv = svc.store();
    // Warm up: the runtime, the service and its first allocations.
    for i in 0..20 {
        put(&rt, &kv, &format!("warm/{i}"), json!(i)).unwrap();
        get(&rt, &kv, &format!("warm/{i}")).unwrap().unwrap();
    }
    // Start the peak count here (Linux >= 4.0: "5" resets VmHWM to VmRSS).
    let _ = std::fs::write(format!("/proc/{}/clear_refs", svc.pid()), "5");
    let idle = svc.status_bytes("VmRSS:");

    // The hostile client: 100 MB of 'x' without a newline, from one reused 1 MiB buffer; a second
    // thread reads what the service answers.
    let mut s = TcpStream::connect(svc.addr).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut reader = s.try_clone().unwrap();
    reader.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let (sent_tx, sent_rx) = mpsc::channel::<()>();
    let writer = std::thread::spawn(move || {
        let chunk = vec![b'x'; MIB as usize];
        let mut sent = 0u64;
        while sent < 100 * MIB {
            if s.write_all(&chunk).is_err() {
                break;
            }
            sent += MIB;
            if sent == 4 * MIB {
                let _ = sent_tx.send(());
            }
        }
        sent
    });
    let answer = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 || got.len() > 64 << 10 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    });

    // Meanwhile a well-formed client joins as a rank, lists the ranks, puts and gets.
    let _ = sent_rx.recv_timeout(Duration::from_secs(30));
    let t = Instant::now();
    let (member, ranks) = join_and_list(&rt, &kv, reg(Side::Prefill, 0, "well-formed"));
    assert_eq!(ranks, 1);
    put(&rt, &kv, "during", json!("yes")).unwrap();
    assert_eq!(get(&rt, &kv, "during").unwrap(), Some(json!("yes")));
    let served_in = t.elapsed();
    rt.block_on(member.leave()).unwrap();

    let sent = writer.join().unwrap();
    let answer = answer.join().unwrap();
    let peak = svc.status_bytes("VmHWM:").max(svc.status_bytes("VmRSS:"));
    let after = svc.status_bytes("VmRSS:");
    let growth = peak.saturating_sub(idle);
    eprintln!(
        "bootstrap process: idle RSS {:.1} MiB, peak {:.1} MiB (growth {:.1} MiB), after {:.1} MiB; the hostile \
         client sent {} MiB and got {:?}; a well-formed client was served (join, list, put, get) in {served_in:?}",
        idle as f64 / MIB as f64,
        peak as f64 / MIB as f64,
        growth as f64 / MIB as f64,
        after as f64 / MIB as f64,
        sent / MIB,
        answer.trim()
    );
    assert!(
        growth < 64 * MIB,
        "the service's RSS grew by {} MiB (limit 64) for one line without newline",
        growth / MIB
    );
    assert!(answer.contains("\"ok\":false") && answer.contains("longer than"), "no error answer: {answer:?}");
    let st = stats(&rt, &c);
    assert_eq!(st.malformed, 1, "{st:?}");
}

#[test]
fn a_thousand_idle_connections_neither_stop_service_nor_outlive_the_idle_deadline() {
    const IDLE: usize = 1000;
    const IDLE_S: u64 = 5;
    // This process holds 1,000 connections; the service raises its own limit at start-up.
    let have = kvxfer::bootstrap::raise_open_file_limit(4096).expect("raise the open-file limit");
    assert!(have >= IDLE as u64 + 100, "this test needs about {} open files; the hard limit allows {have}", IDLE + 100);
    let svc = Service::start(&["--idle-timeout-s", &IDLE_S.to_string()], &[], None);
    let rt = rt();
    let c = svc.client();
    let kv = svc.store();
    let t0 = Instant::now();
    let mut held = Vec::with_capacity(IDLE);
    for _ in 0..IDLE {
        held.push(TcpStream::connect(svc.addr).expect("connect an idle client"));
    }
    let opened = t0.elapsed();
    let s = until(&rt, &c, Duration::from_secs(10), |s| s.connections > IDLE as u64);
    assert!(s.connections > IDLE as u64, "the service holds {} connections, not all {IDLE}: {s:?}", s.connections);
    // Well-formed clients are served while they are held.
    let mut times = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        put(&rt, &kv, &format!("k{i}"), json!(i)).unwrap();
        assert_eq!(get(&rt, &kv, &format!("k{i}")).unwrap(), Some(json!(i)));
        times.push(t.elapsed());
    }
    let t = Instant::now();
    let (member, _) = join_and_list(&rt, &kv, reg(Side::Prefill, 0, "under load"));
    let register = t.elapsed();
    rt.block_on(member.leave()).unwrap();
    let during = t0.elapsed();
    assert!(
        during < Duration::from_secs(IDLE_S),
        "the checks took {during:?}, past the idle deadline: the idle connections may already be gone"
    );
    times.sort();
    eprintln!(
        "{IDLE} idle connections opened in {opened:?}; a well-formed put + get took {:?} (median of 5, max {:?}), \
         a join and list {register:?}",
        times[2], times[4]
    );
    // Each idle connection is answered an error and closed at the deadline.
    let mut closed = 0;
    let end = t0 + Duration::from_secs(IDLE_S + 10);
    for s in &mut held {
        let left = end.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        s.set_read_timeout(Some(left)).unwrap();
        let mut got = Vec::new();
        if s.read_to_end(&mut got).is_ok() && String::from_utf8_lossy(&got).contains("no complete request line") {
            closed += 1;
        }
    }
    let took = t0.elapsed();
    assert_eq!(closed, IDLE, "only {closed} of {IDLE} idle connections were closed with an error by {took:?}");
    assert!(took >= Duration::from_secs(IDLE_S) - Duration::from_millis(100), "closed before the deadline: {took:?}");
    drop(held);
    let s = until(&rt, &c, Duration::from_secs(5), |s| s.connections == 1);
    eprintln!("all {IDLE} closed {took:?} after opening (idle deadline {IDLE_S} s); stats {s:?}");
    assert_eq!((s.connections, s.waits), (1, 0), "{s:?}");
    assert!(s.idle_closed >= IDLE as u64, "{s:?}");
}

#[test]
fn a_rank_that_crashes_registers_again_under_a_higher_epoch() {
    let svc = Service::start(&[], &[], None);
    let rt = rt();
    // Membership through the store: the lease of the crashed rank must expire first.
    let ttl = Duration::from_millis(800);
    let store: Arc<dyn MetadataStore> = Arc::new(BootstrapStore::new(&svc.addr.to_string(), "/crash"));
    let m = rt.block_on(Membership::join(Arc::clone(&store), reg(Side::Decode, 0, "pid 300"), ttl)).unwrap();
    let before = m.epoch();
    drop(m); // the crash: its keep-alive stops
    let e = rt.block_on(Membership::join(Arc::clone(&store), reg(Side::Decode, 0, "pid 400"), ttl)).unwrap_err();
    assert!(matches!(e, MetadataError::Duplicate { .. }), "{e}");
    let end = Instant::now() + ttl + Duration::from_secs(5);
    let m = loop {
        match rt.block_on(Membership::join(Arc::clone(&store), reg(Side::Decode, 0, "pid 400"), ttl)) {
            Ok(m) => break m,
            Err(MetadataError::Duplicate { .. }) if Instant::now() < end => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => panic!("the rank did not come back: {e}"),
        }
    };
    assert!(m.epoch() > before, "{} after {before}", m.epoch());
    let peers = rt.block_on(kvxfer::metadata::peers(&*store, Side::Decode, 1, Duration::from_secs(5))).unwrap();
    assert_eq!(peers.len(), 1);
    assert_eq!((peers[0].epoch, peers[0].registration.label.as_str()), (m.epoch(), "pid 400"));
    eprintln!("membership: epoch {before} before the crash, {} after", m.epoch());
    rt.block_on(m.leave()).unwrap();
}

/// A proxy for one connection that records what the client sends.
fn recording_proxy(target: SocketAddr) -> (SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (client, _) = l.accept().unwrap();
        let server = TcpStream::connect(target).unwrap();
        for s in [&client, &server] {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        }
        let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut s2, &mut c2);
            let _ = c2.shutdown(std::net::Shutdown::Write);
        });
        let (mut client, mut server) = (client, server);
        let mut recorded = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = client.read(&mut buf) {
            if n == 0 {
                break;
            }
            recorded.extend_from_slice(&buf[..n]);
            if server.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = server.shutdown(std::net::Shutdown::Write);
        let _ = back.join();
        recorded
    });
    (addr, h)
}

#[test]
fn with_a_secret_only_proven_requests_are_served_and_a_replayed_line_is_refused() {
    const SECRET: &str = "kvxfer-test-secret-3f9a1c";
    let dir = std::env::temp_dir().join(format!("kvxfer-longrun-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let svc = Service::start(&["--secret-file", file.to_str().unwrap()], &[], None);
    let _ = std::fs::remove_dir_all(&dir);
    let rt = rt();
    let secret = Secret::new(SECRET.as_bytes().to_vec()).unwrap();
    let good = svc.store().with_secret(secret.clone());
    put(&rt, &good, "k", json!("the value")).unwrap();
    assert_eq!(get(&rt, &good, "k").unwrap(), Some(json!("the value")));

    // Without a proof: refused, no value.
    let e = get(&rt, &svc.store(), "k").unwrap_err();
    assert!(e.contains("authentication required") && !e.contains("the value"), "{e}");
    let mut raw = BufReader::new(TcpStream::connect(svc.addr).unwrap());
    let challenge = raw_line(&mut raw);
    assert!(challenge.starts_with("{\"challenge\":\""), "{challenge}");
    raw.get_mut().write_all(b"{\"op\":\"store\",\"call\":{\"op\":\"get\",\"key\":\"/longrun/k\"}}\n").unwrap();
    let l = raw_line(&mut raw);
    assert!(l.contains("authentication required") && !l.contains("the value"), "{l}");
    // A wrong secret: refused, no value.
    let wrong = svc.store().with_secret(Secret::new(b"guessed".to_vec()).unwrap());
    let e = get(&rt, &wrong, "k").unwrap_err();
    assert!(e.contains("authentication failed") && !e.contains("the value"), "{e}");

    // Capture an authenticated get and an authenticated put on the wire, then replay each line on a
    // fresh connection: both refused; the put changed nothing.
    let through = |proxy: SocketAddr| {
        BootstrapStore::new(&proxy.to_string(), "/longrun")
            .with_secret(secret.clone())
            .with_timeout(Duration::from_secs(10))
    };
    let (proxy, rec) = recording_proxy(svc.addr);
    assert_eq!(get(&rt, &through(proxy), "k").unwrap(), Some(json!("the value")));
    let get_line = rec.join().unwrap();
    let (proxy, rec) = recording_proxy(svc.addr);
    put(&rt, &through(proxy), "k", json!("overwritten")).unwrap();
    let put_line = rec.join().unwrap();
    put(&rt, &good, "k", json!("the value")).unwrap();
    assert!(String::from_utf8_lossy(&put_line).starts_with("{\"auth\":\""), "{}", String::from_utf8_lossy(&put_line));
    for line in [&get_line, &put_line] {
        let mut raw = BufReader::new(TcpStream::connect(svc.addr).unwrap());
        raw_line(&mut raw);
        raw.get_mut().write_all(line).unwrap();
        let l = raw_line(&mut raw);
        assert!(l.contains("authentication failed") && !l.contains("the value"), "replay answered {l}");
    }
    assert_eq!(get(&rt, &good, "k").unwrap(), Some(json!("the value")));
    let s = stats(&rt, &svc.client().with_secret(secret.clone()));
    assert_eq!(s.auth_failures, 5, "{s:?}");

    // The secret from the environment instead of a file.
    let env = Service::start(&[], &[("KVXFER_SECRET", SECRET)], None);
    let c = env.store().with_secret(secret.clone());
    put(&rt, &c, "e", json!(1)).unwrap();
    let e = put(&rt, &env.store(), "e", json!(2)).unwrap_err();
    assert!(e.contains("authentication required"), "{e}");
    assert_eq!(get(&rt, &c, "e").unwrap(), Some(json!(1)));
    // Never printed.
    for (what, s) in [("file", &svc), ("environment", &env)] {
        let out = s.output_with("must prove the shared secret");
        assert!(out.contains("must prove the shared secret") && !out.contains(SECRET), "secret from the {what}: {out}");
    }
    assert!(!format!("{secret:?} {good:?}").contains(SECRET));
}

#[test]
fn with_tls_flags_only_clients_of_the_cluster_are_served() {
    let dir = std::env::temp_dir().join(format!("kvxfer-longrun-tls-{}", std::process::id()));
    let (tls, generated) = kvxfer_tls::Tls::generate().unwrap();
    let files = generated.write_to(&dir).unwrap();
    let p = |f: &std::path::Path| f.to_str().unwrap().to_owned();
    let args = ["--tls-cert", &p(&files.cert), "--tls-key", &p(&files.key), "--tls-ca", &p(&files.ca)];
    let svc = Service::start(&args, &[], None);
    let rt = rt();
    let c = svc.client().with_tls(Some(tls.clone()));
    let kv = svc.store().with_tls(Some(tls.clone()));
    put(&rt, &kv, "k", json!("over tls")).unwrap();
    assert_eq!(get(&rt, &kv, "k").unwrap(), Some(json!("over tls")));
    // A plaintext client gets nothing; the service counts the failed handshake.
    let e = get(&rt, &svc.store().with_timeout(Duration::from_secs(1)), "k").unwrap_err();
    assert!(!e.contains("over tls"), "{e}");
    let s = stats(&rt, &c);
    assert!(s.tls_failures >= 1, "{s:?}");
    assert!(svc.output_with("TLS on every connection").contains("TLS on every connection"));
    // The same from the environment; an incomplete set of flags is refused by the parser.
    let env = Service::start(
        &[],
        &[("KVXFER_TLS_CERT", &p(&files.cert)), ("KVXFER_TLS_KEY", &p(&files.key)), ("KVXFER_TLS_CA", &p(&files.ca))],
        None,
    );
    put(&rt, &env.store().with_tls(Some(tls)), "e", json!(1)).unwrap();
    let out = Command::new(EXE)
        .args(["bootstrap", "--listen", "127.0.0.1:0", "--for-s", "1", "--tls-cert", &p(&files.cert)])
        .output()
        .unwrap();
    assert!(!out.status.success(), "an incomplete TLS setup must be refused");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tls-key") && err.contains("--tls-ca"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn at_the_open_file_limit_the_service_backs_off_instead_of_spinning_and_recovers() {
    // 48 descriptors for the whole process: the connections beyond about 38 meet EMFILE in accept.
    let svc = Service::start(&["--max-connections", "1000", "--idle-timeout-s", "60"], &[], Some(48));
    let rt = rt();
    let mut held = Vec::new();
    for _ in 0..80 {
        match TcpStream::connect(svc.addr) {
            Ok(s) => held.push(s),
            Err(e) => panic!("connect: {e}"),
        }
    }
    // Let the accept loop meet the limit, then measure its CPU time over 2 s.
    std::thread::sleep(Duration::from_millis(500));
    let (t, before) = (Instant::now(), svc.cpu_ticks());
    std::thread::sleep(Duration::from_secs(2));
    let ticks = svc.cpu_ticks() - before;
    let window = t.elapsed();
    // Clock ticks are 1/100 s on Linux: a spinning loop would use about 200 here.
    eprintln!("at the open-file limit with {} connections pending: {ticks} CPU ticks in {window:?}", held.len());
    assert!(ticks <= 40, "the service used {ticks} ticks of CPU in {window:?} at the open-file limit: it spins");
    // Descriptors come back: the service serves again, and counted the failures.
    held.clear();
    let c = svc.client();
    let kv = svc.store();
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        match put(&rt, &kv, "after", json!(true)) {
            Ok(_) => break,
            Err(e) if Instant::now() < end => {
                eprintln!("not yet: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("the service did not recover: {e}"),
        }
    }
    let s = until(&rt, &c, Duration::from_secs(10), |s| s.connections == 1);
    assert!(s.accept_errors > 0 && s.connections == 1, "{s:?}");
    eprintln!("recovered: {s:?}");
    let out = svc.output_with("open-file limit is 48");
    assert!(out.contains("open-file limit is 48") && out.contains("--max-connections 1000"), "no warning: {out}");
}

#[test]
fn limits_given_on_the_command_line_hold_and_nothing_leaks() {
    let svc = Service::start(&["--max-connections", "8", "--max-value-bytes", "4096", "--max-waits", "2"], &[], None);
    let rt = rt();
    let c = svc.client();
    let kv = svc.store();
    // A value over the limit, named with its size and the limit.
    let e = put(&rt, &kv, "big", json!("x".repeat(5000))).unwrap_err();
    assert!(e.contains("5002 bytes") && e.contains("limit of 4096"), "{e}");
    // Waits over the limit: two watches wait for their keys, a third is refused.
    let (_, rev) = rt.block_on(kv.get("w0")).unwrap();
    let waiting: Vec<_> = (0..2)
        .map(|i| {
            let kv = kv.clone();
            rt.spawn(async move { kv.watch(&format!("w{i}"), rev).await?.next(Duration::from_secs(20)).await })
        })
        .collect();
    until(&rt, &c, Duration::from_secs(5), |s| s.waits == 2);
    let e = rt.block_on(async { kv.watch("w9", rev).await?.next(Duration::from_secs(5)).await }).unwrap_err();
    assert!(e.to_string().contains("2 waits") && e.to_string().contains("--max-waits"), "{e}");
    for i in 0..2 {
        put(&rt, &kv, &format!("w{i}"), json!(i)).unwrap();
    }
    for w in waiting {
        assert!(!rt.block_on(w).unwrap().unwrap().is_empty(), "a watch saw no change");
    }
    // Connections over the limit: one error line each, then the service goes on.
    let held: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(svc.addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut extra = BufReader::new(TcpStream::connect(svc.addr).unwrap());
    let l = raw_line(&mut extra);
    assert!(l.contains("8 connections open") && l.contains("--max-connections"), "{l}");
    drop(held);
    // Many keys come and go (deleted, or expired with their lease): none stay.
    let end = Instant::now() + Duration::from_secs(30);
    let s = until(&rt, &c, Duration::from_secs(5), |s| s.connections == 1);
    assert_eq!(s.connections, 1, "{s:?}");
    for i in 0..200 {
        assert!(Instant::now() < end, "too slow");
        put(&rt, &kv, &format!("req/{i}"), json!({"pages": [i, i + 1]})).unwrap();
        if i % 2 == 1 {
            let lease = rt.block_on(kv.grant(Duration::from_millis(300))).unwrap();
            rt.block_on(kv.put(&format!("ready/{i}"), &json!(true), Some(lease))).unwrap();
        }
        assert!(rt.block_on(kv.delete(&format!("req/{i}"))).unwrap());
    }
    for i in 0..2 {
        rt.block_on(kv.delete(&format!("w{i}"))).unwrap();
    }
    std::thread::sleep(Duration::from_millis(400));
    let s = until(&rt, &c, Duration::from_secs(5), |s| s.store_keys == 0 && s.store_leases == 0 && s.connections == 1);
    eprintln!("after 200 requests' keys: {s:?}");
    assert_eq!((s.store_keys, s.store_leases, s.connections, s.waits), (0, 0, 1, 0), "{s:?}");
    assert!(s.refused_values == 1 && s.refused_waits == 1 && s.refused_connections >= 1, "{s:?}");
}

//! Write bandwidth of the UCX backend next to UCX's own `ucx_perftest -t ucp_put_bw`, same sizes,
//! same transports, one run.
//!
//! ```text
//! cargo run --release -p kvxfer-ucx --example ucx_bench -- [--sizes 65536,1048576] [--tls tcp,posix,sysv,cma,self] [--window 8]
//! ```
//! `--tls` takes `;`-separated transport lists (default `tcp;posix,sysv,cma,self`). For each size
//! it measures the backend between this process and a receiver process (this binary with
//! `--serve`, which verifies the bytes it received): one transfer at a time (each done after a
//! flush, i.e. remote completion) and `--window` writes in flight from concurrent tasks;
//! then it runs `ucx_perftest` (server and client processes on loopback) and prints the ratios.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{BackendConfig, HostBuffer, KvTransferBackend, RegionId, WriteOp};

// The `ucx_perftest` runner lives with its main user, `kvxfer bench` (it uses nothing of kvxfer).
#[path = "../../../crates/cli/src/perftest.rs"]
mod perftest;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn iters_for(size: usize) -> usize {
    ((256usize << 20) / size).clamp(20, 2000)
}

fn endpoint(tls: &str, identity: u64) -> Arc<dyn KvTransferBackend> {
    let mut c = BackendConfig::new(identity).with("tls", tls).with("timeout_ms", "60000");
    if tls.contains("tcp") {
        c = c.with("net_devices", "lo");
    }
    kvxfer_ucx::create(&c).expect("creating a UCX endpoint")
}

/// The receiving side, in a child process: registers `bytes`, prints its metadata as one JSON
/// line, and serves until its stdin closes (bounded by ten minutes).
fn serve(tls: &str, bytes: usize) {
    let rx = endpoint(tls, 2);
    let mut dst = HostBuffer::zeroed(bytes);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let reg = rt.block_on(rx.register(RegionId(2), dst.desc())).unwrap();
    println!("{}", serde_json::to_string(&rx.metadata().unwrap()).unwrap());
    let (tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        let _ = tx.send(());
    });
    let _ = done.recv_timeout(Duration::from_secs(600));
    rt.block_on(reg.close(Instant::now() + Duration::from_secs(30))).unwrap();
    let ok = dst.to_vec().unwrap().iter().all(|&b| b == 7);
    eprintln!("receiver: destination {}", if ok { "verified" } else { "NOT all source bytes" });
    drop(rx);
    std::process::exit(if ok { 0 } else { 3 });
}

/// Kills and reaps the receiver process when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Bytes per second of `iters` writes of `size` bytes with `window` writes in flight, to a receiver
/// in another process.
async fn backend_bw(tls: &str, size: usize, iters: usize, window: usize) -> f64 {
    let slots = window.max(1);
    let mut child = Child(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--serve", tls, &(size * slots).to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawning the receiver process"),
    );
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.0.stdout.take().unwrap()), &mut line).unwrap();
    let meta: kvxfer_core::EndpointMetadata = serde_json::from_str(&line).expect("receiver metadata");
    let tx = endpoint(tls, 1);
    let mut src = HostBuffer::filled(size * slots, 7);
    let _reg = tx.register(RegionId(1), src.desc()).await.unwrap();
    let peer = tx.connect(&meta).await.unwrap();
    let run = |n: usize| {
        let tx = tx.clone();
        async move {
            let per = n.div_ceil(slots);
            let mut tasks = Vec::new();
            for s in 0..slots {
                let tx = tx.clone();
                tasks.push(tokio::spawn(async move {
                    let off = (s * size) as u64;
                    let op = WriteOp::contiguous(RegionId(1), off, RegionId(2), off, size as u64);
                    let deadline = || Instant::now() + Duration::from_secs(60);
                    for _ in 0..per {
                        tx.post(peer, &[op], None).unwrap().wait(deadline()).await.unwrap();
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            per * slots
        }
    };
    run((iters / 10).max(slots)).await; // warm-up
    let t0 = Instant::now();
    let done = run(iters).await;
    let secs = t0.elapsed().as_secs_f64();
    drop(tx);
    drop(child.0.stdin.take());
    let status = child.0.wait().expect("waiting for the receiver");
    assert!(status.success(), "the receiver did not verify its bytes ({status})");
    (done * size) as f64 / secs
}

fn gib(bps: f64) -> String {
    format!("{:8.3}", bps / f64::from(1u32 << 30))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if let Some(i) = std::env::args().position(|a| a == "--serve") {
        let a: Vec<String> = std::env::args().collect();
        return serve(&a[i + 1], a[i + 2].parse().expect("--serve TLS BYTES"));
    }
    let sizes: Vec<usize> = arg("--sizes")
        .unwrap_or_else(|| "65536,262144,1048576,4194304".into())
        .split(',')
        .map(|s| s.trim().parse().expect("--sizes takes byte counts"))
        .collect();
    let tls_list: Vec<String> =
        arg("--tls").unwrap_or_else(|| "tcp;posix,sysv,cma,self".into()).split(';').map(str::to_owned).collect();
    let window: usize = arg("--window").map(|w| w.parse().expect("--window takes a count")).unwrap_or(8);
    let repeat: usize = arg("--repeat").map(|w| w.parse().expect("--repeat takes a count")).unwrap_or(3).max(1);
    println!(
        "UCX {} | write = one write in flight, window = {window} in flight | GiB/s, best of {repeat} runs each",
        kvxfer_ucx::ucx_version()
    );
    println!(
        "{:<22} {:>9} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "tls", "size", "iters", "write", "window", "perftest", "ratio1", "ratioW"
    );
    for tls in &tls_list {
        for &size in &sizes {
            let iters = iters_for(size);
            let (mut one, mut win, mut base) = (0f64, 0f64, Err(None));
            for _ in 0..repeat {
                one = one.max(backend_bw(tls, size, iters, 1).await);
                win = win.max(backend_bw(tls, size, iters, window).await);
                let b = tokio::task::spawn_blocking({
                    let tls = tls.clone();
                    move || perftest::run(&tls, size, iters, Duration::from_secs(300))
                })
                .await
                .unwrap();
                base = match (base, b) {
                    (Ok(x), Ok(y)) => Ok(x.max(y)),
                    (Ok(x), Err(_)) | (Err(_), Ok(x)) => Ok(x),
                    (Err(_), Err(e)) => Err(Some(e)),
                };
            }
            match base {
                Ok(b) => println!(
                    "{tls:<22} {size:>9} {iters:>6} {} {} {} {:8.2} {:8.2}",
                    gib(one),
                    gib(win),
                    gib(b),
                    one / b,
                    win / b
                ),
                Err(e) => println!("{tls:<22} {size:>9} {iters:>6} {} {} perftest failed: {e:?}", gib(one), gib(win)),
            }
        }
    }
}

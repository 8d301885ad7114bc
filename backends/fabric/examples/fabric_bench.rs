//! Write bandwidth of the fabric backend next to a plain `fi_write` loop (the baseline) at the same
//! sizes and providers, in one run, with the ratio.
//!
//! ```text
//! cargo run --release -p kvxfer-fabric --features baseline --example fabric_bench -- [--providers tcp,shm] [--sizes 65536,1048576,16777216]
//!     [--windows 1,8] [--bytes 268435456] [--reps 3]
//! ```
//! Both sides run in this process over loopback (`tcp` binds 127.0.0.1). The backend column is
//! `post(peer, [one contiguous op], None)` with `window` transfers in flight (each slot posts its next
//! transfer when its previous one completed); the baseline keeps `window` `fi_write`s in flight from one polling thread. Each cell is
//! the median of `reps` runs; every run checks the destination bytes.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{BackendConfig, BackendError, HostBuffer, KvTransferBackend, PeerId, RegionId, WriteOp};
use kvxfer_fabric::{baseline, FabricBackend};

struct Args {
    providers: Vec<String>,
    sizes: Vec<usize>,
    windows: Vec<usize>,
    bytes: usize,
    reps: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        providers: vec!["tcp".into(), "shm".into()],
        sizes: vec![64 << 10, 1 << 20, 16 << 20],
        windows: vec![1, 8],
        bytes: 256 << 20,
        reps: 3,
    };
    let mut it = std::env::args().skip(1);
    let list = |v: Option<String>, what: &str| -> Result<Vec<usize>, String> {
        v.ok_or(format!("{what} needs a value"))?
            .split(',')
            .map(|s| s.trim().parse::<usize>().map_err(|e| format!("{what} {s}: {e}")))
            .collect()
    };
    while let Some(k) = it.next() {
        match k.as_str() {
            "--providers" => {
                a.providers = it.next().ok_or("--providers needs a value")?.split(',').map(str::to_owned).collect()
            }
            "--sizes" => a.sizes = list(it.next(), "--sizes")?,
            "--windows" => a.windows = list(it.next(), "--windows")?,
            "--bytes" => a.bytes = list(it.next(), "--bytes")?.first().copied().ok_or("--bytes needs a value")?,
            "--reps" => a.reps = list(it.next(), "--reps")?.first().copied().ok_or("--reps needs a value")?.max(1),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn config(provider: &str, identity: u64) -> BackendConfig {
    let c = BackendConfig::new(identity).with("provider", provider).with("timeout_ms", "60000");
    if provider == "tcp" {
        c.with("addr", "127.0.0.1")
    } else {
        c
    }
}

/// Bytes per second of the backend: `writes` writes of `size` bytes, `window` at a time.
async fn backend_run(provider: &str, size: usize, writes: usize, window: usize) -> Result<f64, BackendError> {
    let a = Arc::new(FabricBackend::new(&config(provider, 1))?);
    let b = FabricBackend::new(&config(provider, 2))?;
    let pattern: Vec<u8> = (0..size).map(|i| (i % 251) as u8 + 1).collect();
    let dst = HostBuffer::zeroed(size * window).desc();
    let src_reg = a.register(RegionId(1), HostBuffer::from_slice(&pattern).desc()).await?;
    let dst_reg = b.register(RegionId(2), dst.clone()).await?;
    let peer = a.connect(&b.metadata()?).await?;
    let op = |slot: usize| WriteOp::contiguous(RegionId(1), 0, RegionId(2), (slot * size) as u64, size as u64);
    for slot in 0..window {
        write(&a, peer, op(slot)).await?;
    }
    let per_task = writes.div_ceil(window);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for slot in 0..window {
        let a = a.clone();
        let o = op(slot);
        tasks.push(tokio::spawn(async move {
            for _ in 0..per_task {
                write(&a, peer, o).await?;
            }
            Ok::<(), BackendError>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| BackendError::Io {
            backend: "fabric",
            context: "bench task".into(),
            detail: e.to_string(),
        })??;
    }
    let elapsed = start.elapsed();
    let d = dst.read_guard(0, dst.len() as u64).map_err(|e| BackendError::Protocol {
        backend: "fabric",
        peer: "bench".into(),
        detail: e.to_string(),
    })?;
    let d = d.as_slice();
    for slot in 0..window {
        if d[slot * size..(slot + 1) * size] != pattern[..] {
            return Err(BackendError::Protocol {
                backend: "fabric",
                peer: "bench".into(),
                detail: format!("destination slot {slot} does not hold the written bytes"),
            });
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    src_reg.close(deadline).await?;
    dst_reg.close(deadline).await?;
    Ok((per_task * window * size) as f64 / elapsed.as_secs_f64())
}

/// One transfer, awaited.
async fn write(a: &FabricBackend, peer: PeerId, op: WriteOp) -> Result<(), BackendError> {
    a.post(peer, &[op], None)?.wait(Instant::now() + Duration::from_secs(60)).await
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    v[v.len() / 2]
}

fn gbs(x: f64) -> String {
    format!("{:.2}", x / 1e9)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    println!("provider  size       window  backend GB/s  fi_write GB/s  ratio");
    let mut failed = false;
    for p in &args.providers {
        for &size in &args.sizes {
            let writes = (args.bytes / size).max(8);
            for &window in &args.windows {
                let mut be = Vec::new();
                let mut bl = Vec::new();
                for _ in 0..args.reps {
                    match rt.block_on(backend_run(p, size, writes, window)) {
                        Ok(x) => be.push(x),
                        Err(e) => {
                            eprintln!("bench: backend {p} {size} x{window}: {e}");
                            failed = true;
                        }
                    }
                    let addr = (p == "tcp").then_some("127.0.0.1");
                    match baseline::write_bandwidth(p, addr, size, writes, window, Duration::from_secs(120)) {
                        Ok(m) => bl.push(m.bytes_per_sec()),
                        Err(e) => {
                            eprintln!("bench: baseline {p} {size} x{window}: {e}");
                            failed = true;
                        }
                    }
                }
                if be.is_empty() || bl.is_empty() {
                    continue;
                }
                let (x, y) = (median(be), median(bl));
                println!("{p:<9} {size:<10} {window:<7} {:<13} {:<14} {:.2}", gbs(x), gbs(y), x / y);
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

//! Cutting a peer off (`KvTransferBackend::cut_off`, SEMANTICS §6 "known dead") on the libfabric
//! backend, with `tcp;ofi_rxm` and `shm`.
//!
//! Its own harness (`harness = false`): `FI_AV_REMOVE_CLEANUP=1` must be in the environment before
//! libfabric starts (it reads it once), so `main` sets it before anything else runs, then runs:
//!
//! - `in_process(provider)`: A and B connected both ways, A writing a large multi-piece transfer into
//!   B; B cuts A off mid-transfer and the call is confirmed; from its return on nothing A sends lands
//!   in B's region (A's late transfers, new posts), A's reconnect with the same instance is refused
//!   and so is B's connect to it, B's transfers to A are final; a new endpoint with A's identity is
//!   admitted both ways and its write lands; a second cut-off is confirmed at once.
//! - `stopped_writer(provider)`: A in another process writes 1 MiB pieces into B back to back, two
//!   patterns in turn; it is stopped (`SIGSTOP`) mid-stream, B cuts it off, it is continued
//!   (`SIGCONT`) and keeps writing: B's region must not change after the cut-off returned. Over tcp
//!   a piece A was in the middle of sending when it stopped has passed the key check at B and is
//!   placed as its payload arrives, unless the connection is closed.
//! - `stopped_writer_notified_tcp`: the same with an attached notification on every write (B on
//!   `attached=auto`, which takes no remote CQ data over tcp: see `cq_data_tcp`).
//! - `cq_data_tcp`: over `tcp;ofi_rxm`, `attached=auto` takes no remote CQ data and confirms
//!   cut-offs; `attached=cq-data` reports them unconfirmed (libfabric 1.17 crashes closing a
//!   connection on which a CQ-data write is half received: 3 of 3 rounds of the notified writer
//!   with B on `cq-data` died of SIGSEGV in `fi_av_remove`, 2026-12-05).
//! - `tcp_without_cleanup`: this binary again without `FI_AV_REMOVE_CLEANUP`: the cut-off is carried
//!   out but not confirmed (`Unsupported`).
//! - `unreachable_tcp` (in a child, so a crash is reported as one): removing an address whose
//!   connect failed in the call. A send to an address the kernel will not route a TCP connection to
//!   (a multicast address: `connect` fails at once with `ENETUNREACH`, as it does for a peer behind
//!   a link that is down) leaves libfabric 1.17's `ofi_rxm` with an idle connection object and no
//!   endpoint, and a plain `fi_av_remove` under `FI_AV_REMOVE_CLEANUP` then dies of SIGSEGV (the
//!   chaos case `presumed_dead_link_healed` met it: the decode cut off the partitioned prefill).
//!   `Endpoint::av_remove` must see that no connection exists and remove nothing; an address whose
//!   connection is being made is removed as usual.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, EndpointMetadata, HostBuffer, KvTransferBackend, MemDesc, Notification, RankId,
    RegionId, RequestId, SenderKey, WriteOp,
};
use kvxfer_fabric::FabricBackend;

const LEN: u64 = 16 << 20;
const PIECE: u64 = 4096;
const ROLE: &str = "KVXFER_FABRIC_CUT_ROLE";

fn config(provider: &str, identity: u64) -> BackendConfig {
    let c = BackendConfig::new(identity).with("provider", provider).with("timeout_ms", "3000");
    if provider == "tcp" {
        c.with("addr", "127.0.0.1")
    } else {
        c
    }
}

fn endpoint(provider: &str, identity: u64) -> Arc<FabricBackend> {
    Arc::new(FabricBackend::new(&config(provider, identity)).expect("opening an endpoint"))
}

/// The region's bytes (read once nothing may write it any more).
fn bytes(view: &MemDesc) -> Vec<u8> {
    view.read_guard(0, view.len() as u64).expect("no local writer").as_slice().to_vec()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn strided(dst_offset: u64) -> WriteOp {
    WriteOp {
        src: RegionId(1),
        src_offset: 0,
        dst: RegionId(2),
        dst_offset,
        len: PIECE,
        count: LEN / (2 * PIECE) - 1,
        src_stride: 2 * PIECE,
        dst_stride: 2 * PIECE,
    }
}

async fn in_process(provider: &str) -> Result<(), String> {
    let a = endpoint(provider, 1);
    let b = endpoint(provider, 2);
    let mut a_src = HostBuffer::filled(LEN as usize, 0xa1);
    let mut a_dst = HostBuffer::zeroed(LEN as usize);
    let mut b_dst = HostBuffer::zeroed(LEN as usize);
    let mut b_src = HostBuffer::filled(LEN as usize, 0xb2);
    let _as = a.register(RegionId(1), a_src.desc()).await.unwrap();
    let _ad = a.register(RegionId(2), a_dst.desc()).await.unwrap();
    let view = b_dst.desc();
    let _bd = b.register(RegionId(2), view.clone()).await.unwrap();
    let _bs = b.register(RegionId(1), b_src.desc()).await.unwrap();
    let ab = a.connect(&b.metadata().unwrap()).await.map_err(|e| format!("A connects: {e}"))?;
    let ba = b.connect(&a.metadata().unwrap()).await.map_err(|e| format!("B connects: {e}"))?;
    // A first write completes, then the large one starts and is cut off a few milliseconds in
    // (B's region is not read before the cut-off: the provider writes it without a guard).
    let first = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, PIECE);
    a.post(ab, &[first], None).unwrap().wait(soon()).await.map_err(|e| format!("first write: {e}"))?;
    let big = a.post(ab, &[strided(2 * PIECE)], None).unwrap();
    let back = b.post(ba, &[strided(0)], None).unwrap();
    tokio::time::sleep(Duration::from_millis(3)).await;

    let t = Instant::now();
    let cut = b.cut_off(ba, "test: lease expired").await.map_err(|e| format!("cut-off not confirmed: {e}"))?;
    eprintln!("fabric({provider}): cut_off took {:?}: {cut:?}", t.elapsed());
    if cut.closed < 2 {
        return Err(format!("both connections of the instance: {cut:?}"));
    }
    let snapshot = bytes(&view);
    if !back.status().is_final() {
        return Err(format!("B's transfer to A is not final after the cut-off: {:?}", back.status()));
    }

    // A goes on: its transfer, late transfers into the gaps, new posts.
    let mut late = vec![a.post(ab, &[strided(PIECE)], None)];
    for i in 0..8u64 {
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(2), (2 * i + 1) * PIECE, PIECE);
        late.push(a.post(ab, &[op], None));
    }
    let _ = big.wait(soon()).await;
    for t in late.into_iter().flatten() {
        if t.wait(soon()).await.is_ok() {
            return Err("a write of A after the cut-off completed".into());
        }
    }
    // Refused over tcp; over shm A cannot even send to B any more (shm keeps waiting for the answer
    // to the write commands B dropped, and refuses new posts to that peer), so it times out.
    match a.connect(&b.metadata().unwrap()).await {
        Ok(_) => return Err("the cut-off instance reconnected".into()),
        Err(e) if provider == "tcp" && !e.to_string().contains("cut off") => {
            return Err(format!("refused, but not for the cut-off: {e}"))
        }
        Err(_) => {}
    }
    if b.connect(&a.metadata().unwrap()).await.is_ok() {
        return Err("B connected to the cut-off instance".into());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    if bytes(&view) != snapshot {
        return Err("bytes landed in B's region after the cut-off returned".into());
    }
    if provider == "tcp" && b.cut_off_messages() == 0 {
        return Err("B saw no message of A after the cut-off (its reconnect at least)".into());
    }
    match b.cut_off(ba, "again").await {
        Ok(c) if c.how == "already cut off" => {}
        other => return Err(format!("a second cut-off: {other:?}")),
    }

    // A restarted process: same identity, a new instance.
    let a2 = endpoint(provider, 1);
    let mut a2_src = HostBuffer::filled(LEN as usize, 0x5a);
    let _a2s = a2.register(RegionId(1), a2_src.desc()).await.unwrap();
    let a2b = a2.connect(&b.metadata().unwrap()).await.map_err(|e| format!("a new instance is refused: {e}"))?;
    b.connect(&a2.metadata().unwrap()).await.map_err(|e| format!("B cannot connect to the new instance: {e}"))?;
    a2.post(a2b, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 2 * PIECE)], None)
        .unwrap()
        .wait(soon())
        .await
        .map_err(|e| format!("the new instance's write: {e}"))?;
    if !bytes(&view)[..2 * PIECE as usize].iter().all(|&x| x == 0x5a) {
        return Err("the new instance's write did not land".into());
    }
    Ok(())
}

/// Kills and reaps the child when dropped.
struct Child2(Child);

impl Drop for Child2 {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill").args([sig, &pid.to_string()]).status().is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

fn read_line_with(out: &mut BufReader<std::process::ChildStdout>, tag: &str) -> Result<String, String> {
    let mut line = String::new();
    for _ in 0..100 {
        line.clear();
        if out.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            return Err(format!("the writer process exited before {tag}"));
        }
        if let Some(at) = line.find(tag) {
            return Ok(line[at + tag.len()..].trim().to_owned());
        }
    }
    Err(format!("no {tag} from the writer process"))
}

/// The writer process: registers two 1 MiB sources (0x11, 0x22), prints its metadata, reads B's,
/// connects, then writes them in turn into three 1 MiB slots of B's region until 30 s passed
/// (errors and all); with `notify`, each write carries an attached notification (a write carrying
/// remote CQ data where B takes those).
async fn writer(provider: &str, notify: bool) {
    let a = endpoint(provider, 1);
    let mut one = HostBuffer::filled(1 << 20, 0x11);
    let mut two = HostBuffer::filled(1 << 20, 0x22);
    let _r1 = a.register(RegionId(1), one.desc()).await.unwrap();
    let _r2 = a.register(RegionId(3), two.desc()).await.unwrap();
    println!("META {}", serde_json::to_string(&a.metadata().unwrap()).unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let meta: EndpointMetadata = serde_json::from_str(&line).unwrap();
    let peer = a.connect(&meta).await.unwrap();
    println!("CONNECTED");
    std::io::stdout().flush().unwrap();
    let end = Instant::now() + Duration::from_secs(30);
    let mut i = 0u64;
    // Eight writes in flight: more than the sockets buffer, so a receiver that falls behind leaves
    // a write half sent in this process.
    let mut window = std::collections::VecDeque::new();
    while Instant::now() < end {
        let src = if i % 2 == 0 { RegionId(1) } else { RegionId(3) };
        // Three slots, two patterns: each slot gets the other pattern on its next visit.
        let op = WriteOp::contiguous(src, 0, RegionId(2), (i % 3) << 20, 1 << 20);
        let n = Notification::chunk(RequestId(i), SenderKey::of(RankId::new(0, 0)), 0, false);
        match a.post(peer, &[op], notify.then_some(&n)) {
            Ok(t) => window.push_back(t),
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
        if window.len() >= 16 {
            if let Some(t) = window.pop_front() {
                let _ = t.wait(Instant::now() + Duration::from_secs(2)).await;
            }
        }
        i += 1;
    }
}

/// One round; `Ok(true)` when a piece was half placed at the cut-off.
async fn stopped_writer_round(provider: &str, notify: bool) -> Result<bool, String> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, format!("{}:{provider}", if notify { "writer+notify" } else { "writer" }))
        .env("FI_AV_REMOVE_CLEANUP", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawning the writer: {e}"))?;
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut input = child.stdin.take().unwrap();
    let pid = child.id();
    let _child = Child2(child);
    let meta: EndpointMetadata =
        serde_json::from_str(&read_line_with(&mut out, "META ")?).map_err(|e| format!("writer metadata: {e}"))?;
    let b = endpoint(provider, 2);
    let mut dst = HostBuffer::zeroed(4 << 20);
    let view = dst.desc();
    let _d = b.register(RegionId(2), view.clone()).await.unwrap();
    writeln!(input, "{}", serde_json::to_string(&b.metadata().unwrap()).unwrap()).map_err(|e| e.to_string())?;
    input.flush().map_err(|e| e.to_string())?;
    read_line_with(&mut out, "CONNECTED")?;
    let ba = b.connect(&meta).await.map_err(|e| format!("B connects to the writer: {e}"))?;
    // Writing for a while; B falls behind (its progress held), so A's socket fills and a piece
    // stays half sent; A is stopped there; B catches up (reading the first part of that piece,
    // whose header passed the key check), then cuts A off.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stall = b.clone();
    let held = std::thread::spawn(move || stall.stall_progress(Duration::from_millis(800)));
    tokio::time::sleep(Duration::from_millis(700)).await;
    signal(pid, "-STOP");
    held.join().map_err(|_| "the stall thread panicked".to_string())?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    let cut = b.cut_off(ba, "test: the writer stopped");
    let cut = cut.await;
    let took = t.elapsed();
    signal(pid, "-CONT");
    let cut = cut.map_err(|e| format!("cut-off of a stopped writer not confirmed: {e}"))?;
    eprintln!("fabric({provider}): cut_off of a stopped writer took {took:?}: {cut:?}");
    // Nothing may be placed from the cut-off's return on; the region is read only after a pause
    // (reading while a broken cut-off still lets writes in would race with them).
    let snapshot = bytes(&view);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    if bytes(&view) != snapshot {
        return Err("the continued writer's bytes landed after the cut-off returned".into());
    }
    if !snapshot.iter().any(|&x| x == 0x11 || x == 0x22) {
        return Err("the writer wrote nothing before it was stopped (the test proves nothing)".into());
    }
    // A slot with both patterns: a piece was half placed when B cut A off.
    Ok(snapshot.chunks(1 << 20).any(|s| s.contains(&0x11) && s.contains(&0x22)))
}

/// Rounds of [`stopped_writer_round`] until one cut a writer off in the middle of a piece (at most
/// four): that is the round in which only closing the connection keeps the rest of the piece out.
/// shm places a piece whole within one progress call (cross-memory attach), so one round there (and
/// its endpoints are recycled in-process: a later round's B would inherit the killed writer).
async fn stopped_writer(provider: &str, notify: bool) -> Result<(), String> {
    let rounds = if provider == "shm" { 1 } else { 4 };
    for round in 1..=rounds {
        if stopped_writer_round(provider, notify).await? {
            eprintln!("fabric({provider}): round {round} cut the writer off in the middle of a piece; nothing landed");
            return Ok(());
        }
    }
    eprintln!("fabric({provider}): no round caught a piece half placed (nothing landed in any)");
    Ok(())
}

/// Run in a child without `FI_AV_REMOVE_CLEANUP`: over tcp the cut-off is not confirmed.
async fn without_cleanup() -> Result<(), String> {
    let a = endpoint("tcp", 1);
    let b = endpoint("tcp", 2);
    let mut src = HostBuffer::filled(1 << 20, 1);
    let mut dst = HostBuffer::zeroed(1 << 20);
    let _s = a.register(RegionId(1), src.desc()).await.unwrap();
    let _d = b.register(RegionId(2), dst.desc()).await.unwrap();
    let ab = a.connect(&b.metadata().unwrap()).await.map_err(|e| e.to_string())?;
    let ba = b.connect(&a.metadata().unwrap()).await.map_err(|e| e.to_string())?;
    a.post(ab, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 4096)], None)
        .unwrap()
        .wait(soon())
        .await
        .map_err(|e| e.to_string())?;
    match b.cut_off(ba, "test").await {
        Err(BackendError::Unsupported { what, .. }) if what.contains("FI_AV_REMOVE_CLEANUP") => {}
        other => return Err(format!("expected Unsupported naming FI_AV_REMOVE_CLEANUP, got {other:?}")),
    }
    if a.connect(&b.metadata().unwrap()).await.is_ok() {
        return Err("the cut-off (unconfirmed) instance reconnected".into());
    }
    Ok(())
}

/// `attached=auto` over `tcp;ofi_rxm` takes no remote CQ data (a cut-off that closes a connection
/// with a CQ-data write half received crashes libfabric 1.17: 3 of 3 rounds of
/// `stopped_writer_notified_tcp` with B on `attached=cq-data` died of SIGSEGV before this), so its
/// cut-offs are confirmable; with `attached=cq-data` they are carried out, not confirmed, and
/// nothing crashes.
async fn cq_data_tcp() -> Result<(), String> {
    let auto = endpoint("tcp", 7);
    if auto.attached_uses_cq_data() || !auto.capabilities().cut_off_live {
        return Err(format!(
            "tcp;ofi_rxm attached=auto: uses CQ data {}, cut_off_live {}",
            auto.attached_uses_cq_data(),
            auto.capabilities().cut_off_live
        ));
    }
    let c = |id| config("tcp", id).with("attached", "cq-data");
    let a = Arc::new(FabricBackend::new(&c(1)).map_err(|e| e.to_string())?);
    let b = Arc::new(FabricBackend::new(&c(2)).map_err(|e| e.to_string())?);
    if !b.attached_uses_cq_data() || b.capabilities().cut_off_live {
        return Err("tcp;ofi_rxm attached=cq-data: expected CQ data and no live cut-off".into());
    }
    let mut src = HostBuffer::filled(1 << 20, 1);
    let mut dst = HostBuffer::zeroed(1 << 20);
    let _s = a.register(RegionId(1), src.desc()).await.unwrap();
    let _d = b.register(RegionId(2), dst.desc()).await.unwrap();
    let ab = a.connect(&b.metadata().unwrap()).await.map_err(|e| e.to_string())?;
    let ba = b.connect(&a.metadata().unwrap()).await.map_err(|e| e.to_string())?;
    let n = Notification::chunk(RequestId(1), SenderKey::of(RankId::new(0, 0)), 0, true);
    let op = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 1 << 20);
    a.post(ab, &[op], Some(&n)).unwrap().wait(soon()).await.map_err(|e| format!("the CQ-data write: {e}"))?;
    match b.cut_off(ba, "test").await {
        Err(BackendError::Unsupported { what, .. }) if what.contains("attached=cq-data") => Ok(()),
        other => Err(format!("expected Unsupported naming attached=cq-data, got {other:?}")),
    }
}

/// In a child: see `unreachable_tcp`.
fn unreachable() -> Result<(), String> {
    use kvxfer_fabric::ffi::{AvRemoved, Hints, PostError, RdmEndpoint};
    let hints = Hints { provider: Some("tcp;ofi_rxm".into()), node: Some("127.0.0.1".into()), wait_fd: false };
    let mut a = RdmEndpoint::open(&hints).map_err(|e| format!("opening A: {e}"))?;
    let b = RdmEndpoint::open(&hints).map_err(|e| format!("opening B: {e}"))?;
    // B's address (a sockaddr_in: family, port, IPv4 address) with a multicast address instead.
    let mut name = b.name().to_vec();
    if name.len() < 8 || name[4..8] != [127, 0, 0, 1] {
        return Err(format!("B's address is not an IPv4 sockaddr on 127.0.0.1: {name:?}"));
    }
    name[4..8].copy_from_slice(&[224, 0, 0, 1]);
    let lost = a.av_insert(&name).map_err(|e| format!("inserting the unreachable address: {e}"))?;
    for i in 0..3 {
        match a.send(lost, vec![0; 8], 0) {
            Err(PostError::Failed(_)) => {}
            Err(PostError::Again) => return Err(format!("send {i} to 224.0.0.1: -FI_EAGAIN, expected a failure")),
            Ok(()) => return Err(format!("send {i} to 224.0.0.1 was accepted, expected a failure")),
        }
    }
    if !a.post_failed_at_once(lost) {
        return Err("the failed sends are not noted".into());
    }
    match a.av_remove(lost, vec![0; 8], 0) {
        Ok(AvRemoved::NoConnection) => {}
        other => return Err(format!("removing the unreachable address: expected NoConnection, got {other:?}")),
    }
    // A reachable address, its connection being made: removed as usual.
    let live = a.av_insert(b.name()).map_err(|e| format!("inserting B: {e}"))?;
    match a.send(live, vec![0; 8], 0) {
        Ok(()) | Err(PostError::Again) => {}
        Err(PostError::Failed(e)) => return Err(format!("send to B: {e}")),
    }
    match a.av_remove(live, vec![0; 8], 0) {
        Ok(AvRemoved::Removed) => Ok(()),
        other => Err(format!("removing B: expected Removed, got {other:?}")),
    }
}

fn unreachable_tcp() -> Result<(), String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, "unreachable")
        .env("FI_AV_REMOVE_CLEANUP", "1")
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "the child ended with {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn tcp_without_cleanup() -> Result<(), String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, "no-cleanup")
        .env_remove("FI_AV_REMOVE_CLEANUP")
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    }
}

fn main() -> ExitCode {
    let role = std::env::var(ROLE).ok();
    if role.as_deref() != Some("no-cleanup") {
        // Before libfabric starts: nothing else runs yet in this process.
        std::env::set_var("FI_AV_REMOVE_CLEANUP", "1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    match role.as_deref() {
        Some(r) if r.starts_with("writer:") || r.starts_with("writer+notify:") => {
            let (kind, provider) = r.split_once(':').unwrap_or_default();
            rt.block_on(writer(provider, kind == "writer+notify"));
            return ExitCode::SUCCESS;
        }
        Some("unreachable") => {
            return match unreachable() {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            };
        }
        Some("no-cleanup") => {
            return match rt.block_on(without_cleanup()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    type Case<'a> = (&'static str, Box<dyn Fn() -> Result<(), String> + 'a>);
    let cases: Vec<Case<'_>> = vec![
        ("in_process_tcp", Box::new(|| rt.block_on(in_process("tcp")))),
        ("in_process_shm", Box::new(|| rt.block_on(in_process("shm")))),
        ("stopped_writer_tcp", Box::new(|| rt.block_on(stopped_writer("tcp", false)))),
        ("stopped_writer_shm", Box::new(|| rt.block_on(stopped_writer("shm", false)))),
        ("stopped_writer_notified_tcp", Box::new(|| rt.block_on(stopped_writer("tcp", true)))),
        ("cq_data_tcp", Box::new(|| rt.block_on(cq_data_tcp()))),
        ("tcp_without_cleanup", Box::new(tcp_without_cleanup)),
        ("unreachable_tcp", Box::new(unreachable_tcp)),
    ];
    let mut failed = 0;
    let mut ran = 0;
    for (name, case) in &cases {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        let t = Instant::now();
        match case() {
            Ok(()) => println!("test {name} ... ok ({:?})", t.elapsed()),
            Err(e) => {
                failed += 1;
                println!("test {name} ... FAILED ({:?}): {e}", t.elapsed());
            }
        }
    }
    println!("cut_off: {} passed, {failed} failed", ran - failed);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

//! The receiving side: accepts streams, runs the handshake (challenge, token and, with a cluster
//! secret, the client's proof), validates every WRITE frame against the region table and places its
//! payload through memory guards, and delivers notifications, each bound to the identity its stream
//! proved when there is a secret.
//!
//! The handshake runs on the endpoint's runtime, bounded by the handshake deadline as a whole; a
//! stream gets its own thread only once it was accepted, so connections that never authenticate
//! cost a task for at most that long, not a thread.
//!
//! A frame holds a [`kvxfer_core::toolkit::RegionRef`] of every region it writes, and a write guard
//! of every destination piece, from before its first payload byte until its last one is placed. So
//! closing a registration (remove from the table, then wait until it is drained) waits for frames
//! in progress, a frame that names a removed region is refused, and two frames (on two streams, of
//! one peer or two) can never write one byte at the same time: the second one's guard is refused and
//! it is answered as a protocol error, nothing written.
//!
//! Cutting a peer off ([`Shared::cut_off`], SEMANTICS §6 "known dead"): the peer instance (identity
//! and the instance its HELLO carries) is banned under the same lock that admits streams into their
//! link's books, every stream of its links is told to stop, and the call resolves once each of them
//! left its frame loop. A stream checks the signal before it admits each WRITE or NOTE, so at most
//! the frame it was already placing completes; after that nothing it reads is placed or delivered,
//! and no later stream of that instance passes its handshake.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::{EventQueue, RegionRef, RegionTable};
use kvxfer_core::{BackendEvent, Notification, Secret};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::conn::{Conn, Rx, Sock, Tx};
use crate::limits::{
    HandshakeLimits, LimitRefusal, RefusalCounters, Slot, DEFAULT_MAX_HANDSHAKES, DEFAULT_MAX_HANDSHAKES_PER_SOURCE,
};
use crate::wire::{self, AuthFailure, Challenge, FrameType, Header, Hello, OpDesc, WireError};
use crate::{io, sock};

/// The attached notification of one batch and the data-stream parts it waits for.
#[derive(Default)]
struct Batch {
    /// Parts accounted for: placed (LAST | NOTE_FOLLOWS frames) or dropped (DROP PART frames).
    parts: u32,
    /// Whether a part was dropped (the batch was aborted: its notification is not delivered).
    dropped: bool,
    /// The NOTE's part count, and the notification (`None` when the NOTE itself was dropped).
    note: Option<(u32, Option<Notification>)>,
}

/// Per incoming link: batches whose notification waits for data parts on other streams.
struct InLink {
    identity: u64,
    /// The client endpoint's instance (its HELLO's).
    instance: u64,
    batches: HashMap<u64, Batch>,
    lost: bool,
    open: u32,
    /// Set when the link is lost: every stream of it closes (not only the one that failed).
    kill: watch::Sender<bool>,
}

/// Default of [`Shared::poll`] (the `poll_us` option): 200 us. With the default of one stream per
/// peer and 1 MiB frames, on the 2-core development machine (2026-12-03, 1 GiB shuffled, two
/// rounds) one polling stream moved 3.1-3.3 / 5.4-6.0 / 6.3-6.4 / 6.5-6.6 GB/s at 4 KiB / 64 KiB
/// / 1 MiB / 16 MiB blocks, against 2.5 / 4.6-5.0 / 4.7-5.1 / 4.3-4.5 for two sleeping streams.
/// A stream polls only for this long after its last byte, so an idle endpoint burns no CPU; between
/// frames a receiver polls only while more frames of a batch are due (see `serve_frames`).
pub(crate) const DEFAULT_POLL: Duration = Duration::from_micros(200);

/// Default of [`Shared::handshake_timeout`] (the `handshake_timeout_s` option): how long an incoming
/// stream may take from its accept to a complete HELLO (and the client to get the reply).
pub(crate) const DEFAULT_HANDSHAKE: Duration = Duration::from_secs(5);

/// Most batches an incoming link may keep half-announced.
const MAX_PENDING_BATCHES: usize = 1 << 16;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// State the listener's tasks share with the endpoint.
pub(crate) struct Shared {
    pub identity: u64,
    pub token: [u8; wire::TOKEN_LEN],
    pub regions: RegionTable,
    pub events: Arc<EventQueue>,
    pub timeout: Duration,
    /// How long a stream polls its empty socket before sleeping (see [`io::read_vectored_polling`]).
    pub poll: Duration,
    /// The cluster secret: with one, every stream must prove it and every notification must be keyed
    /// with the identity its stream proved.
    pub secret: Option<Secret>,
    /// Deadline of an incoming stream's whole handshake, and of the client's wait for the answers.
    pub handshake_timeout: Duration,
    /// Notifications refused because their key is not the identity their stream proved.
    pub forged: AtomicU64,
    /// Incoming handshakes refused, by reason.
    pub refusals: RefusalCounters,
    /// Connections in their handshake, bounded in total and per source.
    pub limits: HandshakeLimits,
    /// TLS (`tls=on`): every stream, incoming and outgoing, runs TLS with this setup before the
    /// handshake.
    pub tls: Option<kvxfer_tls::Tls>,
    /// This endpoint's instance (random per endpoint; carried in its metadata and HELLOs).
    pub instance: u64,
    links: Mutex<Books>,
    /// Notified whenever an incoming stream leaves its link's books.
    closed: tokio::sync::Notify,
    tasks: Mutex<Vec<AbortHandle>>,
}

/// Incoming links, the peer instances cut off (identity, instance), which no stream may join, and
/// the instances whose bytes may still land from a device copy that outlived its stream's wait.
#[derive(Default)]
struct Books {
    links: HashMap<u64, InLink>,
    banned: std::collections::HashSet<(u64, u64)>,
    unlanded: std::collections::HashSet<(u64, u64)>,
}

impl Shared {
    pub fn new(
        identity: u64,
        token: [u8; wire::TOKEN_LEN],
        instance: u64,
        regions: RegionTable,
        events: Arc<EventQueue>,
        timeout: Duration,
    ) -> Self {
        Self {
            instance,
            identity,
            token,
            regions,
            events,
            timeout,
            poll: DEFAULT_POLL,
            secret: None,
            handshake_timeout: DEFAULT_HANDSHAKE,
            forged: AtomicU64::new(0),
            refusals: RefusalCounters::default(),
            limits: HandshakeLimits::new(
                DEFAULT_MAX_HANDSHAKES,
                DEFAULT_MAX_HANDSHAKES_PER_SOURCE,
                "handshake_timeout_s",
            ),
            tls: None,
            links: Mutex::new(Books::default()),
            closed: tokio::sync::Notify::new(),
            tasks: Mutex::new(Vec::new()),
        }
    }

    /// The same state with another polling time.
    pub fn with_poll(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// The same state with a cluster secret and a handshake deadline.
    pub fn with_auth(mut self, secret: Option<Secret>, handshake_timeout: Duration) -> Self {
        self.secret = secret;
        self.handshake_timeout = handshake_timeout;
        self
    }

    /// The same state with other limits on connections in their handshake (in total, per source).
    pub fn with_limits(mut self, max: u32, per_source: u32) -> Self {
        self.limits = HandshakeLimits::new(max, per_source, "handshake_timeout_s");
        self
    }

    /// The same state with TLS on every stream (`None`: plaintext).
    pub fn with_tls(mut self, tls: Option<kvxfer_tls::Tls>) -> Self {
        self.tls = tls;
        self
    }

    /// The link is lost: reported once, and every stream of it closes.
    fn lost(&self, link: u64, reason: String) {
        if let Some(l) = lock(&self.links).links.get_mut(&link) {
            if !l.lost {
                l.lost = true;
                // Reported to the caller as an event (the engine names it in every request it fails).
                tracing::info!(identity = l.identity, %reason, "tcp: lost incoming peer");
                self.events.push(BackendEvent::PeerLost { identity: l.identity, reason });
                l.kill.send_replace(true);
            }
        }
    }

    /// Why a stream with this HELLO may not join its link: its instance was cut off, a link id
    /// another identity uses, or a link that was already lost.
    fn join_refusal(&self, hello: &Hello) -> Option<String> {
        let books = lock(&self.links);
        if books.banned.contains(&(hello.identity, hello.instance)) {
            return Some(cut_off_refusal(hello));
        }
        let l = books.links.get(&hello.link)?;
        if l.identity != hello.identity {
            return Some(format!(
                "link {:#x} belongs to identity {:#x}, not {:#x}; each connect draws its own link id",
                hello.link, l.identity, hello.identity
            ));
        }
        l.lost.then(|| format!("link {:#x} was already failed; connect again", hello.link))
    }

    /// Adds an accepted stream to its link's books (refused as [`Self::join_refusal`] says).
    /// Returns the link's kill signal.
    fn join(&self, hello: &Hello) -> Result<watch::Receiver<bool>, String> {
        let mut books = lock(&self.links);
        if books.banned.contains(&(hello.identity, hello.instance)) {
            return Err(cut_off_refusal(hello));
        }
        let l = books.links.entry(hello.link).or_insert_with(|| InLink {
            identity: hello.identity,
            instance: hello.instance,
            batches: HashMap::new(),
            lost: false,
            open: 0,
            kill: watch::Sender::new(false),
        });
        if l.identity != hello.identity || l.instance != hello.instance {
            return Err(format!(
                "link {:#x} belongs to identity {:#x}, not {:#x}; each connect draws its own link id",
                hello.link, l.identity, hello.identity
            ));
        }
        if l.lost {
            return Err(format!("link {:#x} was already failed; connect again", hello.link));
        }
        l.open += 1;
        Ok(l.kill.subscribe())
    }

    fn stream_closed(&self, link: u64) {
        {
            let mut books = lock(&self.links);
            if let Some(l) = books.links.get_mut(&link) {
                l.open = l.open.saturating_sub(1);
                if l.open == 0 {
                    books.links.remove(&link);
                }
            }
        }
        self.closed.notify_waiters();
    }

    /// Cuts the peer instance (`identity`, `instance`) off: banned (no stream of it passes its
    /// handshake any more), every stream of its links told to stop (no loss is reported: the
    /// caller gave up on it already). Resolves with the number of streams stopped once every one
    /// of them left its frame loop (nothing it reads is placed any more), or `Err` with the number
    /// still running at `deadline`, or `Err(0)` when a device copy of the instance's bytes outlived
    /// its stream's wait (see [`Shared::copies_outstanding`]): those bytes may still land.
    pub async fn cut_off(&self, identity: u64, instance: u64, deadline: Instant) -> Result<usize, usize> {
        let stopped = {
            let mut books = lock(&self.links);
            books.banned.insert((identity, instance));
            let mut n = 0;
            for l in books.links.values_mut().filter(|l| l.identity == identity && l.instance == instance) {
                l.lost = true;
                l.kill.send_replace(true);
                n += l.open as usize;
            }
            n
        };
        loop {
            let closed = self.closed.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            let open: usize = lock(&self.links)
                .links
                .values()
                .filter(|l| l.identity == identity && l.instance == instance)
                .map(|l| l.open as usize)
                .sum();
            if open == 0 {
                if lock(&self.links).unlanded.contains(&(identity, instance)) {
                    return Err(0);
                }
                return Ok(stopped);
            }
            if tokio::time::timeout_at(deadline.into(), closed).await.is_err() {
                return Err(open);
            }
        }
    }

    /// Records that a stream of the peer instance ended while a copy of its bytes into device memory
    /// was still queued past its wait: no cut-off of that instance can be confirmed any more.
    fn copies_outstanding(&self, identity: u64, instance: u64) {
        lock(&self.links).unlanded.insert((identity, instance));
    }

    /// Whether the peer instance was cut off.
    pub fn is_cut_off(&self, identity: u64, instance: u64) -> bool {
        lock(&self.links).banned.contains(&(identity, instance))
    }

    /// Updates a batch's books with `f` and delivers its notification once complete.
    fn batch(
        &self,
        link: u64,
        batch: u64,
        f: impl FnOnce(&mut Batch) -> Result<(), WireError>,
    ) -> Result<(), WireError> {
        let mut books = lock(&self.links);
        let l = books.links.get_mut(&link).ok_or_else(|| WireError("link state missing".into()))?;
        if !l.batches.contains_key(&batch) && l.batches.len() >= MAX_PENDING_BATCHES {
            return Err(WireError(format!("more than {MAX_PENDING_BATCHES} batches wait for their notification")));
        }
        let b = l.batches.entry(batch).or_default();
        f(b)?;
        if matches!(b.note, Some((k, _)) if b.parts >= k) {
            let b = l.batches.remove(&batch).expect("present");
            if let (false, Some((_, Some(n)))) = (b.dropped, b.note) {
                self.events.push(BackendEvent::Notification(n));
            }
        }
        Ok(())
    }

    /// A batch's part on one stream was placed (or dropped, for an aborted batch).
    pub(crate) fn part(&self, link: u64, batch: u64, dropped: bool) -> Result<(), WireError> {
        self.batch(link, batch, |b| {
            b.parts += 1;
            b.dropped |= dropped;
            Ok(())
        })
    }

    /// An attached (parts > 0) or immediate (parts == 0) notification arrived, or was dropped.
    fn note(&self, link: u64, batch: u64, parts: u32, note: Option<Notification>) -> Result<(), WireError> {
        if parts == 0 {
            if let Some(n) = note {
                self.events.push(BackendEvent::Notification(n));
            }
            return Ok(());
        }
        self.batch(link, batch, |b| match b.note {
            Some(_) => Err(WireError(format!("two notifications for batch {batch}"))),
            None => {
                b.note = Some((parts, note));
                Ok(())
            }
        })
    }

    fn track(&self, h: AbortHandle) {
        let mut t = lock(&self.tasks);
        t.retain(|h| !h.is_finished());
        t.push(h);
    }

    /// Stops every task serving incoming streams.
    pub fn abort_tasks(&self) {
        for t in lock(&self.tasks).iter() {
            t.abort();
        }
    }
}

pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, addr)) => match shared.limits.admit(addr.ip()) {
                Ok(slot) => {
                    // The handshake runs here (bounded); only an accepted stream gets a thread.
                    let task = tokio::spawn(handshake_then_serve(Arc::clone(&shared), stream, addr, slot));
                    shared.track(task.abort_handle());
                }
                Err(why) => refuse_at_limit(&shared, stream, addr, why),
            },
            Err(e) => {
                tracing::warn!(error = %e, "tcp: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Answers a connection beyond a limit at once and closes it. Plaintext: a CHALLENGE followed by a
/// rejected HELLO reply naming the limit, written without waiting (a fresh socket's send buffer
/// takes it whole), so a kvxfer client reads the challenge, sends its HELLO and reads the refusal:
/// its `connect` fails naming the limit. With TLS the refusal cannot be read before a TLS handshake
/// this endpoint does not spend on it: the connection is closed at once (the client's TLS fails).
fn refuse_at_limit(shared: &Shared, stream: TcpStream, addr: SocketAddr, why: LimitRefusal) {
    shared.refusals.limit(&why);
    tracing::warn!(%addr, reason = %why, "tcp: refused a connection at a handshake limit");
    if shared.tls.is_some() {
        return;
    }
    let challenge =
        Challenge { identity: shared.identity, secret: shared.secret.is_some(), nonce: [0; wire::NONCE_BYTES] }
            .encode();
    let mut answer = challenge.to_vec();
    answer.extend_from_slice(&wire::encode_hello_reply(shared.identity, Some(&why.to_string())));
    // Off the reactor: a plain non-blocking write, then the socket closes when dropped.
    if let Ok(mut s) = stream.into_std() {
        let _ = std::io::Write::write(&mut s, &answer);
    }
}

fn cut_off_refusal(hello: &Hello) -> String {
    format!(
        "this endpoint cut off identity {:#x} instance {:#x} (it gave up on that peer); a restarted process is \
         a new instance and may connect",
        hello.identity, hello.instance
    )
}

fn tokens_equal(a: &[u8; wire::TOKEN_LEN], b: &[u8; wire::TOKEN_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The server's verdict on a HELLO: accepted, or the reason it is refused (sent to the client).
fn judge(shared: &Shared, hello: &Result<Hello, WireError>, challenge: &[u8; wire::CHALLENGE_LEN]) -> Option<String> {
    let h = match hello {
        Ok(h) => h,
        Err(e) => return Some(e.0.clone()),
    };
    // The token and the proof are both checked, each in constant time, before answering.
    let token_ok = tokens_equal(&h.token, &shared.token);
    let auth = match (&shared.secret, &h.proof) {
        (Some(s), Some(_)) if h.verify(s, challenge) => None,
        (Some(_), Some(_)) => Some(AuthFailure::ProofInvalid),
        (Some(_), None) => Some(AuthFailure::ProofMissing),
        (None, Some(_)) => Some(AuthFailure::NoSecretHere),
        (None, None) => None,
    };
    match (auth, token_ok) {
        (Some(a), _) => Some(a.to_string()),
        (None, false) => {
            Some("access token rejected: the handshake does not carry this endpoint's token (stale metadata?)".into())
        }
        (None, true) => None,
    }
}

/// Why the handshake of an incoming stream ended without a stream to serve.
enum Refused {
    /// Logged at debug level (the client closed, or never spoke).
    Quiet(String),
    /// Logged as a warning and counted.
    Loud(String),
}

/// Handshake of one incoming stream (bounded by the handshake deadline as a whole), then its frames
/// on a thread of its own.
/// `slot` is the stream's place among those in their handshake, given back once it ends.
async fn handshake_then_serve(shared: Arc<Shared>, stream: TcpStream, addr: SocketAddr, slot: Slot) {
    let _ = stream.set_nodelay(true);
    let hs = shared.handshake_timeout;
    let outcome = tokio::time::timeout(hs, secure_then_handshake(&shared, stream, addr)).await;
    drop(slot);
    let accepted = match outcome {
        Ok(Ok(v)) => v,
        Ok(Err(Refused::Quiet(why))) => {
            tracing::debug!(%addr, %why, "tcp: incoming stream closed during the handshake");
            return;
        }
        Ok(Err(Refused::Loud(why))) => {
            shared.refusals.rejected.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%addr, reason = %why, "tcp: rejected a handshake");
            return;
        }
        Err(_) => {
            shared.refusals.timed_out.fetch_add(1, Ordering::Relaxed);
            let tls = if shared.tls.is_some() {
                " (this endpoint has tls=on: a plaintext peer never speaks TLS)"
            } else {
                ""
            };
            tracing::warn!(%addr, "tcp: no complete handshake within {hs:?}{tls}; closing");
            return;
        }
    };
    let (stream, hello, kill) = accepted;
    let link = hello.link;
    let sh = Arc::clone(&shared);
    // The stream is served on a thread of its own (see `sock::on_own_thread`).
    match sock::on_own_thread(stream, "kvxfer-tcp-rx", move |s| vec![tokio::spawn(serve(sh, s, addr, hello, kill))]) {
        Ok(tasks) => tasks.into_iter().for_each(|t| shared.track(t)),
        Err(e) => {
            tracing::warn!(%addr, error = %e, "tcp: cannot start a thread for an incoming stream");
            shared.lost(link, format!("{addr}: cannot start a thread for an incoming stream: {e}"));
            shared.stream_closed(link);
        }
    }
}

/// TLS first when this endpoint has it (a peer that fails it is refused, naming TLS), then the
/// handshake, inside TLS.
async fn secure_then_handshake(
    shared: &Shared,
    tcp: TcpStream,
    addr: SocketAddr,
) -> Result<(Conn, Hello, watch::Receiver<bool>), Refused> {
    let mut s = match &shared.tls {
        None => Conn::Plain(tcp),
        Some(tls) => {
            let t = tls
                .accept_over(Sock::new(tcp), &addr.to_string(), shared.handshake_timeout)
                .await
                .map_err(|e| Refused::Loud(e.to_string()))?;
            Conn::Tls(Box::new(t.into()))
        }
    };
    let (hello, kill) = handshake(shared, &mut s).await?;
    Ok((s, hello, kill))
}

/// CHALLENGE, HELLO, verdict, reply. On success the stream is in its link's books.
async fn handshake(shared: &Shared, s: &mut Conn) -> Result<(Hello, watch::Receiver<bool>), Refused> {
    let nonce = kvxfer_core::secret::nonce().map_err(|e| Refused::Loud(format!("drawing a nonce: {e}")))?;
    let challenge = Challenge { identity: shared.identity, secret: shared.secret.is_some(), nonce }.encode();
    s.send(&challenge).await.map_err(|e| Refused::Quiet(format!("sending the challenge: {e}")))?;
    let mut hb = [0u8; wire::HELLO_LEN];
    s.read_exact(&mut hb).await.map_err(|e| Refused::Quiet(format!("reading the HELLO: {e}")))?;
    let hello = Hello::decode(&hb);
    let verdict = judge(shared, &hello, &challenge);
    let admitted = match (verdict, hello) {
        (None, Ok(h)) => shared.join_refusal(&h).map_or(Ok(h), Err),
        (Some(reason), _) => Err(reason),
        (None, Err(e)) => Err(e.0),
    };
    let hello = match admitted {
        Ok(h) => h,
        Err(reason) => {
            let _ = s.send(&wire::encode_hello_reply(shared.identity, Some(&reason))).await;
            return Err(Refused::Loud(reason));
        }
    };
    let reply = match &shared.secret {
        Some(secret) => wire::encode_proved_reply(shared.identity, secret, &challenge, &hb).to_vec(),
        None => wire::encode_hello_reply(shared.identity, None),
    };
    s.send(&reply).await.map_err(|e| Refused::Quiet(format!("sending the reply: {e}")))?;
    // Joined only now, with nothing left to await: a handshake cut off by its deadline leaves no
    // books behind. (A stream that lost a race for its link id is closed after the acceptance.)
    let kill = shared.join(&hello).map_err(Refused::Loud)?;
    Ok((hello, kill))
}

/// Frames of one accepted stream, until BYE, loss, a protocol error, or the loss of another stream
/// of its link.
async fn serve(shared: Arc<Shared>, stream: Conn, addr: SocketAddr, hello: Hello, mut kill: watch::Receiver<bool>) {
    let (mut r, mut w) = stream.into_split();
    let peer = format!("{addr} (identity {:#x}, stream {})", hello.identity, hello.index);
    let stop = kill.clone();
    let killed = async {
        if kill.wait_for(|k| *k).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    // Frames into CUDA memory, staged through pinned slots (crate::staging); it outlives the frame
    // loop so that the copies it queued are waited for below, whichever way the loop ended.
    let mut staged = crate::staging::Receiving::default();
    let ending = tokio::select! {
        r = serve_frames(&shared, &hello, &mut r, &mut w, &stop, &mut staged) => r,
        () = killed => Err(Ending::Killed),
    };
    if !staged.finish() {
        // A copy into device memory outlived its wait: bytes of this instance may still land, so no
        // cut-off of it may be confirmed (its pages stay quarantined).
        shared.copies_outstanding(hello.identity, hello.instance);
    }
    match ending {
        Ok(()) | Err(Ending::Killed) => {}
        Err(Ending::Lost(reason)) => shared.lost(hello.link, format!("{peer}: {reason}")),
        Err(Ending::Protocol(e)) => {
            tracing::warn!(%peer, error = %e, "tcp: protocol violation; closing the stream");
            // The loss is reported (with this cause) before the peer is told: the peer closes its
            // streams on the ERROR, and their ends must not be what names the loss.
            shared.lost(hello.link, format!("{peer}: protocol error: {e}"));
            let msg = wire::truncate(&e.0, wire::MAX_MESSAGE as usize);
            let mut h = Header::new(FrameType::Error, 0);
            h.n = msg.len() as u32;
            let mut buf = h.encode().to_vec();
            buf.extend_from_slice(msg.as_bytes());
            let _ = tokio::time::timeout(Duration::from_secs(1), w.send(&buf)).await;
        }
    }
    // Out of the books first: nothing of this stream is placed any more (a cut-off waits for it).
    shared.stream_closed(hello.link);
    let _ = tokio::time::timeout(Duration::from_secs(1), w.shutdown()).await;
}

pub(crate) enum Ending {
    Lost(String),
    Protocol(WireError),
    /// Another stream of the link was lost (already reported).
    Killed,
}

impl From<WireError> for Ending {
    fn from(e: WireError) -> Self {
        Ending::Protocol(e)
    }
}

pub(crate) async fn within<T>(
    t: Duration,
    what: &str,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, Ending> {
    match tokio::time::timeout(t, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Ending::Lost(format!("{what}: {e}"))),
        Err(_) => Err(Ending::Lost(format!("{what}: stalled for {t:?}"))),
    }
}

/// Resolves a frame's regions (held until the frame is placed), validates it, and takes a write
/// guard of every destination op: nothing is written unless all of this succeeds.
pub(crate) fn admit_write(
    shared: &Shared,
    ops: &[OpDesc],
    payload: u64,
) -> Result<(Vec<RegionRef>, Vec<kvxfer_core::StridedWriteGuard>), WireError> {
    let mut refs: Vec<RegionRef> = Vec::new();
    let mut slots = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        let slot = match refs.iter().position(|r| r.id() == op.region) {
            Some(s) => s,
            None => {
                let r = shared
                    .regions
                    .get(op.region, None)
                    .map_err(|_| WireError(format!("op {i} names {}, which is not registered", op.region)))?;
                refs.push(r);
                refs.len() - 1
            }
        };
        slots.push(slot);
    }
    let lens: Vec<u64> = slots.iter().map(|s| refs[*s].len()).collect();
    wire::validate_write(ops, payload, &lens)?;
    // One guard per op: a strided op's per-token pieces are held as one entry, which leaves the
    // bytes between them to other writers (another sender's heads of the same tokens).
    let mut guards = Vec::with_capacity(ops.len());
    for (i, (op, slot)) in ops.iter().zip(&slots).enumerate() {
        let (len, count, stride) = if wire::contiguous(op.stride, op.len, op.count) {
            (op.len * op.count, 1, op.len * op.count)
        } else {
            (op.len, op.count, op.stride)
        };
        let g = refs[*slot].desc().write_guard_strided(op.offset, len, count, stride).map_err(|e| {
            WireError(format!(
                "op {i} into {}: {e} (ranges overlap within this frame or with a frame in flight on another stream)",
                op.region
            ))
        })?;
        guards.push(g);
    }
    Ok((refs, guards))
}

async fn serve_frames(
    shared: &Shared,
    hello: &Hello,
    r: &mut Rx,
    w: &mut Tx,
    stop: &watch::Receiver<bool>,
    staged: &mut crate::staging::Receiving,
) -> Result<(), Ending> {
    let (t, poll) = (shared.timeout, shared.poll);
    // Whether the last frame said more is on its way (a WRITE that is not its batch's last on this
    // stream, or one whose NOTE follows): only then does the wait for the next header poll. After
    // a batch's last frame, a NOTE or a DROP the stream sleeps on its socket at once, so an idle
    // stream spins on no core that a request's next step needs.
    let mut more = false;
    // A WRITE frame's op descriptors, raw and decoded: kept across frames (cleared, not freed), so
    // a frame costs no allocation for them once the stream has seen its largest.
    let (mut descs, mut ops) = (Vec::new(), Vec::new());
    loop {
        let mut hb = [0u8; wire::HEADER_LEN];
        // Waiting for the next frame has no deadline: an idle peer is fine; a dead one closes the
        // socket. Once a header's first byte arrived, the rest must arrive within the deadline.
        let wait = if more { poll } else { Duration::ZERO };
        let got = match staged.read_header(shared, hello, r, w, &mut hb, wait).await? {
            Ok(0) => return Err(Ending::Lost("connection closed without BYE".into())),
            Ok(n) => n,
            Err(e) => return Err(Ending::Lost(format!("reading a frame header: {e}"))),
        };
        if got < hb.len() {
            within(t, "reading a frame header after its first bytes", io::read_exact_polling(r, &mut hb[got..], poll))
                .await?;
        }
        let h = Header::decode(&hb)?;
        more = h.ty == FrameType::Write && (h.flags & wire::FLAG_LAST == 0 || h.flags & wire::FLAG_NOTE_FOLLOWS != 0);
        // A frame read in one poll with the link's stop signal already set (the peer was cut off,
        // or another stream of its link failed) is neither placed nor delivered.
        if *stop.borrow() {
            return Err(Ending::Killed);
        }
        if h.ty != FrameType::Write {
            staged.drain(shared, hello, w).await?;
        }
        match h.ty {
            FrameType::Write => {
                descs.clear();
                descs.resize(h.n as usize * wire::OP_LEN, 0u8);
                within(t, "reading op descriptors", io::read_exact_polling(r, &mut descs, poll)).await?;
                ops.clear();
                for d in descs.chunks_exact(wire::OP_LEN) {
                    ops.push(OpDesc::decode(d)?);
                }
                if *stop.borrow() {
                    return Err(Ending::Killed);
                }
                if crate::staging::touches_device(shared, &ops) {
                    staged.write(shared, hello, r, w, &h, &ops, poll).await?;
                    continue;
                }
                staged.drain(shared, hello, w).await?;
                let (refs, mut guards) = admit_write(shared, &ops, h.payload)?;
                within(t, "reading a WRITE payload", io::read_payload(r, &mut guards, poll)).await?;
                drop((guards, refs));
                if h.flags & wire::FLAG_LAST != 0 && h.flags & wire::FLAG_NOTE_FOLLOWS != 0 {
                    shared.part(hello.link, h.batch, false)?;
                }
                within(t, "sending an ACK", w.send(&Header::new(FrameType::Ack, h.batch).encode())).await?;
            }
            FrameType::Note => {
                let mut body = vec![0u8; h.n as usize];
                within(t, "reading a NOTE", io::read_exact_polling(r, &mut body, poll)).await?;
                let n = Notification::decode(&body).map_err(|e| WireError(format!("bad notification: {e}")))?;
                if *stop.borrow() {
                    return Err(Ending::Killed);
                }
                // The binding rule: a stream that proved an identity carries only its notifications.
                if shared.secret.is_some() && !n.is_from(hello.identity) {
                    shared.forged.fetch_add(1, Ordering::Relaxed);
                    return Err(WireError(format!(
                        "forged notification: the stream proved identity {:#x} but a notification of request {} \
                         carries the notification key {} ({:#x}); not delivered, connection closed",
                        hello.identity,
                        n.request,
                        n.sender,
                        n.sender.to_u64()
                    ))
                    .into());
                }
                shared.note(hello.link, h.batch, h.parts, Some(n))?;
            }
            FrameType::Drop if h.flags == wire::DROP_PART => shared.part(hello.link, h.batch, true)?,
            FrameType::Drop => shared.note(hello.link, h.batch, h.parts, None)?,
            FrameType::Bye => return Ok(()),
            FrameType::Ack | FrameType::Error => {
                return Err(WireError(format!("{:?} frames only travel from receiver to sender", h.ty)).into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> Shared {
        let regions = RegionTable::new(crate::NAME, 4);
        Shared::new(1, [0; wire::TOKEN_LEN], 2, regions, Arc::new(EventQueue::new()), Duration::from_secs(1))
    }

    #[tokio::test]
    async fn a_cut_off_is_confirmed_only_while_no_device_copy_of_the_instance_outlived_its_wait() {
        let s = shared();
        let soon = Instant::now() + Duration::from_millis(50);
        // No stream of (7, 8) is open and no copy of it is outstanding: confirmed, nothing stopped.
        assert_eq!(s.cut_off(7, 8, soon).await, Ok(0));
        assert!(s.is_cut_off(7, 8));
        // A copy of (7, 9)'s bytes outlived its stream's wait: its cut-off is refused (quarantine),
        // now and later, while another instance of the same identity is unaffected.
        s.copies_outstanding(7, 9);
        assert_eq!(s.cut_off(7, 9, soon).await, Err(0));
        assert_eq!(s.cut_off(7, 9, Instant::now() + Duration::from_millis(50)).await, Err(0));
        assert_eq!(s.cut_off(7, 10, Instant::now() + Duration::from_millis(50)).await, Ok(0));
    }
}

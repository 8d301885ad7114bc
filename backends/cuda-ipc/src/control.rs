//! The control connections: the decode side's listener and each connection's tasks, the prefill
//! side's handshake and tasks (see [`crate::wire`] for the frames).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer_core::secret::{Exchange, NONCE_BYTES, PROOF_BYTES};
use kvxfer_core::toolkit::{EventQueue, RegionTable};
use kvxfer_core::{BackendError, BackendEvent, Notification, Secret};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use crate::wire::{self, Hello, Type, Welcome, WireError};
use crate::NAME;

/// The label of this backend's challenge-response ([`Exchange::protocol`]).
pub(crate) const PROTOCOL: &str = "kvxfer-cuda-ipc/1";

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One accepted control connection (a prefill endpoint that writes into this endpoint's memory).
struct Incoming {
    identity: u64,
    tx: mpsc::UnboundedSender<Vec<u8>>,
}

/// A revoke waiting for its REVOKED: the connection it was sent on, and who waits.
struct Waiting {
    conn: u64,
    done: oneshot::Sender<()>,
}

/// What the listener's tasks share with the endpoint.
pub(crate) struct Shared {
    pub identity: u64,
    pub token: [u8; wire::TOKEN_LEN],
    pub secret: Option<Secret>,
    pub regions: RegionTable,
    pub events: Arc<EventQueue>,
    pub timeout: Duration,
    pub handshake_timeout: Duration,
    /// Notifications refused because their key is not the identity their connection proved.
    pub forged: AtomicU64,
    incoming: Mutex<HashMap<u64, Incoming>>,
    revokes: Mutex<HashMap<u64, Waiting>>,
    next: AtomicU64,
    tasks: Mutex<Vec<AbortHandle>>,
}

impl Shared {
    pub fn new(
        identity: u64,
        token: [u8; wire::TOKEN_LEN],
        secret: Option<Secret>,
        regions: RegionTable,
        timeout: Duration,
        handshake_timeout: Duration,
    ) -> Self {
        Self {
            identity,
            token,
            secret,
            regions,
            events: Arc::new(EventQueue::new()),
            timeout,
            handshake_timeout,
            forged: AtomicU64::new(0),
            incoming: Mutex::new(HashMap::new()),
            revokes: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            tasks: Mutex::new(Vec::new()),
        }
    }

    fn track(&self, h: AbortHandle) {
        let mut t = lock(&self.tasks);
        t.retain(|h| !h.is_finished());
        t.push(h);
    }

    /// Stops every task of the listener and its connections.
    pub fn abort_tasks(&self) {
        for t in lock(&self.tasks).iter() {
            t.abort();
        }
    }

    /// Tells every connected writer to stop writing `region` and resolves once each said so, or its
    /// connection ended (a prefill endpoint closes its mappings when its connection ends), or
    /// `deadline` passed ([`BackendError::Timeout`]: a writer may still write).
    pub async fn revoke(&self, region: u32, deadline: std::time::Instant) -> Result<(), BackendError> {
        let mut waits = Vec::new();
        for (conn, inc) in lock(&self.incoming).iter() {
            let seq = self.next.fetch_add(1, Ordering::Relaxed);
            let (done, rx) = oneshot::channel();
            lock(&self.revokes).insert(seq, Waiting { conn: *conn, done });
            if inc.tx.send(wire::revoke(region, seq)).is_ok() {
                waits.push((inc.identity, rx));
            } else {
                lock(&self.revokes).remove(&seq);
            }
        }
        for (identity, rx) in waits {
            if tokio::time::timeout_at(deadline.into(), rx).await.is_err() {
                return Err(BackendError::Timeout {
                    backend: NAME,
                    what: format!("peer {identity:#x} to stop writing region {region}"),
                    after: deadline.saturating_duration_since(std::time::Instant::now()),
                });
            }
        }
        Ok(())
    }

    /// A connection ended: its pending revokes resolve (nothing of it writes any more).
    fn closed(&self, conn: u64) {
        lock(&self.incoming).remove(&conn);
        lock(&self.revokes).retain(|_, w| w.conn != conn);
    }
}

async fn read_frame(r: &mut OwnedReadHalf) -> std::io::Result<Result<(Type, Vec<u8>), WireError>> {
    let mut h = [0u8; wire::HEADER_LEN];
    r.read_exact(&mut h).await?;
    let (ty, len) = match wire::decode_header(&h) {
        Ok(x) => x,
        Err(e) => return Ok(Err(e)),
    };
    let mut p = vec![0u8; len as usize];
    r.read_exact(&mut p).await?;
    Ok(Ok((ty, p)))
}

fn tokens_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn nonce() -> Result<[u8; NONCE_BYTES], String> {
    kvxfer_core::secret::nonce().map_err(|e| format!("drawing a nonce: {e}"))
}

// -------------------------------------------------------------------------------- decode side

pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((s, addr)) => {
                let _ = s.set_nodelay(true);
                let sh = Arc::clone(&shared);
                let t = tokio::spawn(async move {
                    match tokio::time::timeout(sh.handshake_timeout, accept_one(&sh, s)).await {
                        Ok(Ok(conn)) => serve(sh, conn).await,
                        Ok(Err(why)) => tracing::warn!(%addr, reason = %why, "cuda-ipc: refused a control connection"),
                        Err(_) => tracing::warn!(%addr, "cuda-ipc: no complete handshake in time; closing"),
                    }
                });
                shared.track(t.abort_handle());
            }
            Err(e) => {
                tracing::warn!(error = %e, "cuda-ipc: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

struct Accepted {
    identity: u64,
    r: OwnedReadHalf,
    w: OwnedWriteHalf,
}

/// HELLO, WELCOME, PROOF, READY (or REJECT with the reason).
async fn accept_one(shared: &Shared, s: TcpStream) -> Result<Accepted, String> {
    let (mut r, mut w) = s.into_split();
    let (ty, p) =
        read_frame(&mut r).await.map_err(|e| format!("reading the HELLO: {e}"))?.map_err(|e| e.to_string())?;
    if ty != Type::Hello {
        return Err(format!("expected a HELLO, got {ty:?}"));
    }
    let hello = match Hello::decode(&p) {
        Ok(h) => h,
        Err(e) => {
            let _ = w.write_all(&wire::reject(&e.0)).await;
            return Err(e.0);
        }
    };
    if !tokens_equal(&hello.token, &shared.token) {
        let why = "access token rejected: the HELLO does not carry this endpoint's token (stale metadata?)".to_owned();
        let _ = w.write_all(&wire::reject(&why)).await;
        return Err(why);
    }
    let na = nonce()?;
    let ex = Exchange {
        protocol: PROTOCOL,
        connector_nonce: hello.nonce,
        acceptor_nonce: na,
        connector: (hello.identity, 0),
        acceptor: (shared.identity, 0),
    };
    let proof = shared.secret.as_ref().map_or([0; PROOF_BYTES], |s| ex.acceptor_proof(s));
    let welcome = Welcome { identity: shared.identity, secret: shared.secret.is_some(), nonce: na, proof };
    w.write_all(&welcome.encode()).await.map_err(|e| format!("sending the WELCOME: {e}"))?;
    let (ty, p) =
        read_frame(&mut r).await.map_err(|e| format!("reading the PROOF: {e}"))?.map_err(|e| e.to_string())?;
    if ty != Type::Proof {
        return Err(format!("expected a PROOF, got {ty:?} (the peer refused this endpoint)"));
    }
    let proof = wire::decode_proof(&p).map_err(|e| e.0)?;
    if let Some(s) = &shared.secret {
        if !ex.verify_connector(s, &proof) {
            let why = "authentication failed: the connecting endpoint does not prove this cluster's secret".to_owned();
            let _ = w.write_all(&wire::reject(&why)).await;
            return Err(why);
        }
    }
    w.write_all(&wire::frame(Type::Ready, &[])).await.map_err(|e| format!("sending READY: {e}"))?;
    Ok(Accepted { identity: hello.identity, r, w })
}

/// One admitted connection: NOTEs become events, REVOKEDs resolve revokes; its end is reported.
async fn serve(shared: Arc<Shared>, conn: Accepted) {
    let Accepted { identity, mut r, mut w } = conn;
    let id = shared.next.fetch_add(1, Ordering::Relaxed);
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    lock(&shared.incoming).insert(id, Incoming { identity, tx });
    let writer = tokio::spawn(async move {
        while let Some(f) = rx.recv().await {
            if w.write_all(&f).await.is_err() {
                return;
            }
        }
    });
    let ending: Result<(), String> = async {
        loop {
            let (ty, p) = match read_frame(&mut r).await {
                Ok(Ok(f)) => f,
                Ok(Err(e)) => return Err(e.0),
                Err(e) => return Err(format!("control connection lost: {e}")),
            };
            match ty {
                Type::Note => {
                    let n = Notification::decode(&p).map_err(|e| format!("bad notification: {e}"))?;
                    if shared.secret.is_some() && !n.is_from(identity) {
                        shared.forged.fetch_add(1, Ordering::Relaxed);
                        return Err(format!(
                            "forged notification: the connection proved identity {identity:#x} but a notification of \
                             request {} carries the notification key {} ({:#x}); not delivered, connection closed",
                            n.request,
                            n.sender,
                            n.sender.to_u64()
                        ));
                    }
                    shared.events.push(BackendEvent::Notification(n));
                }
                Type::Revoked => {
                    let seq = wire::decode_revoked(&p).map_err(|e| e.0)?;
                    if let Some(wt) = lock(&shared.revokes).remove(&seq) {
                        let _ = wt.done.send(());
                    }
                }
                Type::Bye => return Ok(()),
                other => return Err(format!("unexpected {other:?} frame from a writer")),
            }
        }
    }
    .await;
    shared.closed(id);
    writer.abort();
    if let Err(reason) = ending {
        tracing::info!(identity, %reason, "cuda-ipc: lost a writer");
        shared.events.push(BackendEvent::PeerLost { identity, reason });
    }
}

// -------------------------------------------------------------------------------- prefill side

/// Connects the control connection and runs the handshake; `Ok` is an admitted connection.
pub(crate) async fn connect(
    addr: &str,
    identity: u64,
    expect: u64,
    token: [u8; wire::TOKEN_LEN],
    secret: Option<&Secret>,
    t: Duration,
) -> Result<(OwnedReadHalf, OwnedWriteHalf), BackendError> {
    let conn = |detail: String| BackendError::Connect { backend: NAME, peer: addr.to_owned(), detail };
    let s = tokio::time::timeout(t, TcpStream::connect(addr))
        .await
        .map_err(|_| conn(format!("no connection within {t:?}")))?
        .map_err(|e| conn(e.to_string()))?;
    let _ = s.set_nodelay(true);
    let (mut r, mut w) = s.into_split();
    let exchange = async {
        let nc = nonce().map_err(conn)?;
        w.write_all(&Hello { token, identity, nonce: nc }.encode()).await.map_err(|e| conn(e.to_string()))?;
        let (ty, p) =
            read_frame(&mut r).await.map_err(|e| conn(format!("reading the WELCOME: {e}")))?.map_err(|e| conn(e.0))?;
        if ty == Type::Reject {
            return Err(conn(format!("refused by the peer: {}", String::from_utf8_lossy(&p))));
        }
        let welcome = Welcome::decode(&p).map_err(|e| conn(e.0))?;
        if welcome.identity != expect {
            return Err(conn(format!(
                "metadata names identity {expect:#x} but the endpoint at this address is {:#x} (stale metadata?)",
                welcome.identity
            )));
        }
        let ex = Exchange {
            protocol: PROTOCOL,
            connector_nonce: nc,
            acceptor_nonce: welcome.nonce,
            connector: (identity, 0),
            acceptor: (welcome.identity, 0),
        };
        let proof = match (secret, welcome.secret) {
            (Some(s), true) => {
                if !ex.verify_acceptor(s, &welcome.proof) {
                    return Err(conn("authentication failed: the peer does not prove this cluster's secret".into()));
                }
                ex.connector_proof(s)
            }
            (Some(_), false) => {
                return Err(conn(
                    "authentication failed: the peer has no cluster secret and cannot prove one; configure the same \
                     cluster secret (KVXFER_SECRET) on every rank"
                        .into(),
                ))
            }
            (None, true) => {
                return Err(conn(
                    "authentication required: the peer has a cluster secret and this endpoint none; configure the \
                     same cluster secret (KVXFER_SECRET) on every rank"
                        .into(),
                ))
            }
            (None, false) => [0; PROOF_BYTES],
        };
        w.write_all(&wire::frame(Type::Proof, &proof)).await.map_err(|e| conn(e.to_string()))?;
        let (ty, p) =
            read_frame(&mut r).await.map_err(|e| conn(format!("reading READY: {e}")))?.map_err(|e| conn(e.0))?;
        match ty {
            Type::Ready => Ok(()),
            Type::Reject => Err(conn(format!("refused by the peer: {}", String::from_utf8_lossy(&p)))),
            other => Err(conn(format!("expected READY, got {other:?}"))),
        }
    };
    tokio::time::timeout(t, exchange).await.map_err(|_| conn(format!("no complete handshake within {t:?}")))??;
    Ok((r, w))
}

/// Reads what a decode endpoint sends a writer: REVOKEs (handed to `on_revoke`) until the
/// connection ends; returns why it ended.
pub(crate) async fn read_revokes(mut r: OwnedReadHalf, mut on_revoke: impl FnMut(u32, u64)) -> String {
    loop {
        match read_frame(&mut r).await {
            Ok(Ok((Type::Revoke, p))) => match wire::decode_revoke(&p) {
                Ok((region, seq)) => on_revoke(region, seq),
                Err(e) => return e.0,
            },
            Ok(Ok((Type::Reject, p))) => {
                return format!("the peer closed the connection: {}", String::from_utf8_lossy(&p))
            }
            Ok(Ok((other, _))) => return format!("unexpected {other:?} frame from the peer"),
            Ok(Err(e)) => return e.0,
            Err(e) => return format!("control connection lost: {e}"),
        }
    }
}

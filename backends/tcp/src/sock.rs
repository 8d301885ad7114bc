//! Socket set-up and the thread each stream runs on.
//!
//! Socket buffers: by default the kernel's autotuning (which grows a stream's receive buffer up to
//! `net.ipv4.tcp_rmem[2]`, 6 MiB by default). An explicit size (`socket_buffer`, like `iperf3 -w`)
//! turns autotuning off and is capped at `net.core.wmem_max`/`rmem_max` (doubled by the kernel for
//! its bookkeeping): on a default kernel that is 416 KiB, too little for a fast link between hosts.
//! On loopback on the 2-core development machine 8 MiB and autotuning measured the same within the
//! noise (8 MiB slightly ahead at 1 MiB blocks, behind at 4 and 64 KiB). A listener's buffers are
//! inherited by the streams it accepts, so the receive window is known when the handshake picks its
//! scale.

use std::io;
use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

use crate::conn::Conn;

/// Default socket buffer request in bytes (SO_SNDBUF and SO_RCVBUF): 0, the kernel's autotuning.
pub(crate) const DEFAULT_BUFFER: u32 = 0;

fn socket(addr: &SocketAddr, buffer: u32) -> io::Result<TcpSocket> {
    let s = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    if buffer > 0 {
        // Best effort: a kernel that refuses keeps its own sizes, which still work.
        let _ = s.set_send_buffer_size(buffer);
        let _ = s.set_recv_buffer_size(buffer);
    }
    Ok(s)
}

/// Binds and listens on `addr` (inside a runtime context); `buffer` 0 leaves the kernel's autotuning.
pub(crate) fn listen(addr: SocketAddr, buffer: u32) -> io::Result<TcpListener> {
    let s = socket(&addr, buffer)?;
    // As std's `TcpListener::bind` does: a restarted endpoint can take its port again at once.
    s.set_reuseaddr(true)?;
    s.bind(addr)?;
    s.listen(1024)
}

/// Connects to `host:port` (every address it resolves to, in order) with tuned buffers.
pub(crate) async fn connect(addr: &str, buffer: u32) -> io::Result<TcpStream> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        match socket(&a, buffer)?.connect(a).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address"))))
}

/// Runs the tasks that `start` spawns for one stream on a thread of the stream's own (a
/// current-thread runtime whose IO driver watches only this socket), and returns their abort
/// handles. `start` gets the stream (plaintext or TLS) registered with that runtime.
///
/// Why: on the ambient multi-threaded runtime, an idle worker sleeping in the shared `epoll_wait` is
/// woken for every segment that lands on any socket and every time a full send buffer drains, and
/// the stream's task hops between workers (and cores). A thread per stream sleeps on its own socket
/// only, like a blocking socket, and keeps its task on one thread: on the 2-core development
/// machine 1 MiB blocks went from 2.7-2.8 to 3.3-4.0 GB/s over loopback, and the sender's CPU time
/// per GB fell by a quarter. A stream's tasks are aborted, and its thread
/// ends, exactly as before (through the handles, or when the tasks return).
///
/// If no thread or runtime can be had (resource limits), the tasks run on the ambient runtime.
pub(crate) fn on_own_thread(
    stream: Conn,
    name: &str,
    start: impl FnOnce(Conn) -> Vec<JoinHandle<()>>,
) -> io::Result<Vec<AbortHandle>> {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => Background(Some(rt)),
        Err(_) => return Ok(handles(&start(stream))),
    };
    let tasks = {
        let _guard = rt.0.as_ref().expect("runtime").enter();
        // The socket leaves the runtime it was accepted or connected on for this one (a TLS
        // stream keeps its session).
        start(stream.rebind()?)
    };
    let aborts = handles(&tasks);
    // The runtime moves into the thread, which drives it until every task ended (or was aborted).
    let spawned = std::thread::Builder::new().name(name.into()).spawn(move || {
        rt.0.as_ref().expect("runtime").block_on(async {
            for t in tasks {
                let _ = t.await;
            }
        });
    });
    match spawned {
        Ok(_) => Ok(aborts),
        Err(e) => {
            for a in &aborts {
                a.abort();
            }
            Err(e)
        }
    }
}

/// A runtime that may be dropped anywhere, an async context included (it shuts down in the
/// background instead of blocking).
struct Background(Option<tokio::runtime::Runtime>);

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

fn handles(tasks: &[JoinHandle<()>]) -> Vec<AbortHandle> {
    tasks.iter().map(JoinHandle::abort_handle).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tuned_streams_connect_and_carry_the_buffers() {
        let l = listen(SocketAddr::from(([127, 0, 0, 1], 0)), 1 << 20).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (c, a) = tokio::join!(connect(&addr, 1 << 20), l.accept());
        let (c, (a, _)) = (c.unwrap(), a.unwrap());
        // Linux doubles the request, capped at net.core.rmem_max (212,992 by default): at least
        // 256 KiB, where an untuned stream starts at tcp_rmem[1] (128 KiB by default).
        for s in [&c, &a] {
            let r = recv_buffer(s);
            assert!(r >= 256 << 10, "receive buffer {r}");
        }
        assert!(connect("127.0.0.1:1", 0).await.is_err());
    }

    /// The receive buffer of a stream, read through a duplicate of its descriptor.
    fn recv_buffer(s: &TcpStream) -> u32 {
        use std::os::fd::AsFd;
        let dup = std::net::TcpStream::from(s.as_fd().try_clone_to_owned().unwrap());
        TcpSocket::from_std_stream(dup).recv_buffer_size().unwrap()
    }
}

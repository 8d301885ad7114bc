//! A stream of a link, plaintext or TLS (`tls=on`), and its read and write halves.
//!
//! The plaintext arm of every type here is the tokio TCP type the data path always used
//! ([`TcpStream`], [`OwnedReadHalf`], [`OwnedWriteHalf`]): a `match` on the arm is the only thing
//! added to the plaintext path (no boxing, no dynamic dispatch, no copy). The TLS arm is
//! tokio-rustls over [`Sock`], a TCP stream that can move to the stream's own runtime after its
//! handshake (see [`crate::sock::on_own_thread`]); rustls copies every byte into and out of its
//! record buffers, which is the cost TLS has.

use std::io::{self, IoSlice, IoSliceMut};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf, ReadHalf, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// The TCP transport under a TLS stream. It can be re-registered with another runtime
/// ([`Sock::rebind`]) while rustls keeps its session state (tokio-rustls has no way to rebuild a
/// stream from its parts).
#[derive(Debug)]
pub(crate) struct Sock(Option<TcpStream>);

impl Sock {
    pub(crate) fn new(tcp: TcpStream) -> Self {
        Self(Some(tcp))
    }

    fn tcp(&mut self) -> io::Result<&mut TcpStream> {
        self.0.as_mut().ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "the socket failed to move"))
    }

    /// Registers the socket with the current runtime.
    fn rebind(&mut self) -> io::Result<()> {
        let tcp = self.0.take().ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no socket"))?;
        self.0 = Some(TcpStream::from_std(tcp.into_std()?)?);
        Ok(())
    }
}

impl AsyncRead for Sock {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().tcp() {
            Ok(t) => Pin::new(t).poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for Sock {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut().tcp() {
            Ok(t) => Pin::new(t).poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().tcp() {
            Ok(t) => Pin::new(t).poll_write_vectored(cx, bufs),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().tcp() {
            Ok(t) => Pin::new(t).poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().tcp() {
            Ok(t) => Pin::new(t).poll_shutdown(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

type TlsStream = kvxfer_tls::Stream<Sock>;

/// One stream of a link, before it is split.
pub(crate) enum Conn {
    /// Plaintext TCP.
    Plain(TcpStream),
    /// TLS 1.3 (mutual, under the cluster CA) over TCP.
    Tls(Box<TlsStream>),
}

impl Conn {
    /// Whether the stream runs TLS.
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self, Conn::Tls(_))
    }

    /// The same stream registered with the current runtime (call it inside the target runtime's
    /// context).
    pub(crate) fn rebind(self) -> io::Result<Self> {
        match self {
            Conn::Plain(t) => Ok(Conn::Plain(TcpStream::from_std(t.into_std()?)?)),
            Conn::Tls(mut t) => {
                t.get_mut().0.rebind()?;
                Ok(Conn::Tls(t))
            }
        }
    }

    /// The read and write halves (for TLS, of one session: reading may process records that the
    /// writer then answers).
    pub(crate) fn into_split(self) -> (Rx, Tx) {
        match self {
            Conn::Plain(t) => {
                let (r, w) = t.into_split();
                (Rx::Plain(r), Tx::Plain(w))
            }
            Conn::Tls(t) => {
                let (r, w) = tokio::io::split(*t);
                (Rx::Tls(r), Tx::Tls(w))
            }
        }
    }

    /// Writes all of `buf` and pushes it out of the TLS session's buffer.
    pub(crate) async fn send(&mut self, buf: &[u8]) -> io::Result<()> {
        self.write_all(buf).await?;
        self.flush().await
    }
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(t) => Pin::new(t).poll_read(cx, buf),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(t) => Pin::new(t).poll_write(cx, buf),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(t) => Pin::new(t).poll_flush(cx),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(t) => Pin::new(t).poll_shutdown(cx),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The read half of a stream.
pub(crate) enum Rx {
    Plain(OwnedReadHalf),
    Tls(ReadHalf<TlsStream>),
}

impl Rx {
    /// One read into `iov` (at least one byte, or 0 at the end of the stream). Plaintext: one
    /// vectored read straight from the socket, polling an empty socket for `poll` first (see
    /// [`crate::io::read_vectored_polling`]). TLS: decrypted bytes into the first non-empty slice.
    pub(crate) async fn read_vectored_polling(
        &mut self,
        iov: &mut [IoSliceMut<'_>],
        poll: Duration,
    ) -> io::Result<usize> {
        match self {
            Rx::Plain(r) => crate::io::read_vectored_polling(r, iov, poll).await,
            Rx::Tls(r) => match iov.iter_mut().find(|s| !s.is_empty()) {
                Some(s) => r.read(s).await,
                None => Ok(0),
            },
        }
    }
}

impl AsyncRead for Rx {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Rx::Plain(r) => Pin::new(r).poll_read(cx, buf),
            Rx::Tls(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

/// The write half of a stream.
pub(crate) enum Tx {
    Plain(OwnedWriteHalf),
    Tls(WriteHalf<TlsStream>),
}

impl Tx {
    /// One vectored write, retrying a full send buffer for `poll` first (plaintext; TLS writes
    /// through rustls, which buffers).
    pub(crate) async fn write_vectored_polling(&mut self, iov: &[IoSlice<'_>], poll: Duration) -> io::Result<usize> {
        match self {
            Tx::Plain(w) => crate::io::write_vectored_polling(w, iov, poll).await,
            Tx::Tls(w) => w.write_vectored(iov).await,
        }
    }

    /// Writes all of `buf` and, with TLS, pushes it out of the session's buffer (a no-op on
    /// plaintext, whose bytes are in the socket once written).
    pub(crate) async fn send(&mut self, buf: &[u8]) -> io::Result<()> {
        self.write_all(buf).await?;
        self.flush().await
    }
}

impl AsyncWrite for Tx {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Tx::Plain(w) => Pin::new(w).poll_write(cx, buf),
            Tx::Tls(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Tx::Plain(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            Tx::Tls(w) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Tx::Plain(w) => w.is_write_vectored(),
            Tx::Tls(w) => w.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Tx::Plain(w) => Pin::new(w).poll_flush(cx),
            Tx::Tls(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Tx::Plain(w) => Pin::new(w).poll_shutdown(cx),
            Tx::Tls(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}

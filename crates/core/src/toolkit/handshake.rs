//! Limits on incoming connections before they authenticate, for backends whose listener accepts
//! raw connections (tcp, verbs' handshake channel): at most `max_handshakes` at once in total and
//! `max_handshakes_per_source` from one source IP address. A connection beyond either is answered
//! at once with a refusal naming the limit ([`LimitRefusal`], in the backend's own refusal frame)
//! and closed, so a flood of connections that never authenticate holds at most that many file
//! descriptors (and tasks or threads), each for at most the backend's handshake deadline.
//! Established, authenticated connections do not count: a connection's [`Slot`] is given back
//! when it is dropped, at the end of its handshake whichever way it ended.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Default of the `max_handshakes` option.
pub const DEFAULT_MAX_HANDSHAKES: u32 = 256;
/// Default of the `max_handshakes_per_source` option.
pub const DEFAULT_MAX_HANDSHAKES_PER_SOURCE: u32 = 64;

/// Why an incoming connection was refused before its handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitRefusal {
    /// `max_handshakes` connections were already in their handshake.
    Total {
        /// The limit (`max_handshakes`).
        limit: u32,
        /// The backend option that bounds a handshake (named in the message).
        deadline_option: &'static str,
    },
    /// `max_handshakes_per_source` connections from this source were already in their handshake.
    PerSource {
        /// The connection's source address.
        source: IpAddr,
        /// The limit (`max_handshakes_per_source`).
        limit: u32,
        /// The backend option that bounds a handshake (named in the message).
        deadline_option: &'static str,
    },
}

impl fmt::Display for LimitRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Total { limit, deadline_option } => write!(
                f,
                "too many connections in their handshake: the listener's limit max_handshakes={limit} (in total) \
                 is reached; retry shortly (unauthenticated connections are dropped at {deadline_option}), or \
                 raise the listener's max_handshakes option"
            ),
            Self::PerSource { source, limit, deadline_option } => write!(
                f,
                "too many connections in their handshake from {source}: the listener's limit \
                 max_handshakes_per_source={limit} is reached; retry shortly (unauthenticated connections are \
                 dropped at {deadline_option}), or raise the listener's max_handshakes_per_source option"
            ),
        }
    }
}

impl std::error::Error for LimitRefusal {}

/// Incoming handshakes refused so far, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandshakeRefusals {
    /// Refused in the handshake: malformed, another version, failed authentication (or TLS), a
    /// peer refused earlier, a misused link id.
    pub rejected: u64,
    /// No complete handshake within the backend's handshake deadline.
    pub timed_out: u64,
    /// Refused at once because `max_handshakes` connections were in their handshake.
    pub max_handshakes: u64,
    /// Refused at once because `max_handshakes_per_source` connections from the same source IP
    /// address were in their handshake.
    pub max_handshakes_per_source: u64,
}

impl HandshakeRefusals {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.rejected + self.timed_out + self.max_handshakes + self.max_handshakes_per_source
    }
}

/// The refusal counters an endpoint keeps.
#[derive(Debug, Default)]
pub struct RefusalCounters {
    /// See [`HandshakeRefusals::rejected`].
    pub rejected: AtomicU64,
    /// See [`HandshakeRefusals::timed_out`].
    pub timed_out: AtomicU64,
    /// See [`HandshakeRefusals::max_handshakes`].
    pub max_handshakes: AtomicU64,
    /// See [`HandshakeRefusals::max_handshakes_per_source`].
    pub max_handshakes_per_source: AtomicU64,
}

impl RefusalCounters {
    /// The counts now.
    pub fn snapshot(&self) -> HandshakeRefusals {
        HandshakeRefusals {
            rejected: self.rejected.load(Ordering::Relaxed),
            timed_out: self.timed_out.load(Ordering::Relaxed),
            max_handshakes: self.max_handshakes.load(Ordering::Relaxed),
            max_handshakes_per_source: self.max_handshakes_per_source.load(Ordering::Relaxed),
        }
    }

    /// Counts a refusal at a limit.
    pub fn limit(&self, why: &LimitRefusal) {
        match why {
            LimitRefusal::Total { .. } => &self.max_handshakes,
            LimitRefusal::PerSource { .. } => &self.max_handshakes_per_source,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
struct Books {
    total: u32,
    by_source: HashMap<IpAddr, u32>,
}

/// Connections in their handshake, in total and by source.
#[derive(Debug)]
pub struct HandshakeLimits {
    max: u32,
    per_source: u32,
    deadline_option: &'static str,
    books: Arc<Mutex<Books>>,
}

/// A connection's place among those in their handshake; given back when dropped.
#[derive(Debug)]
pub struct Slot {
    source: IpAddr,
    books: Arc<Mutex<Books>>,
}

fn lock(m: &Mutex<Books>) -> std::sync::MutexGuard<'_, Books> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The address a source is counted under (an IPv4-mapped IPv6 address as its IPv4 address).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

impl HandshakeLimits {
    /// At most `max` connections in their handshake, `per_source` from one source address;
    /// `deadline_option` is the backend option that bounds a handshake (`handshake_timeout_s`), named
    /// in refusals.
    pub fn new(max: u32, per_source: u32, deadline_option: &'static str) -> Self {
        Self { max, per_source, deadline_option, books: Arc::default() }
    }

    /// A slot for a connection from `source`, or why there is none.
    pub fn admit(&self, source: IpAddr) -> Result<Slot, LimitRefusal> {
        let source = canonical(source);
        let mut b = lock(&self.books);
        let from_source = b.by_source.get(&source).copied().unwrap_or(0);
        if from_source >= self.per_source {
            return Err(LimitRefusal::PerSource {
                source,
                limit: self.per_source,
                deadline_option: self.deadline_option,
            });
        }
        if b.total >= self.max {
            return Err(LimitRefusal::Total { limit: self.max, deadline_option: self.deadline_option });
        }
        b.total += 1;
        *b.by_source.entry(source).or_insert(0) += 1;
        Ok(Slot { source, books: Arc::clone(&self.books) })
    }

    /// Connections in their handshake now.
    pub fn in_handshake(&self) -> u32 {
        lock(&self.books).total
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut b = lock(&self.books);
        b.total = b.total.saturating_sub(1);
        if let Some(n) = b.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                b.by_source.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_counted_in_total_and_by_source_and_given_back() {
        let l = HandshakeLimits::new(3, 2, "handshake_timeout_s");
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let a1 = l.admit(a).unwrap();
        let _a2 = l.admit(a).unwrap();
        let e = l.admit(a).unwrap_err();
        assert_eq!(e, LimitRefusal::PerSource { source: a, limit: 2, deadline_option: "handshake_timeout_s" });
        assert!(e.to_string().contains("max_handshakes_per_source=2") && e.to_string().contains("127.0.0.2"), "{e}");
        // IPv4-mapped IPv6 counts as its IPv4 address.
        assert!(l.admit("::ffff:127.0.0.2".parse().unwrap()).is_err());
        let _b1 = l.admit(b).unwrap();
        let e = l.admit(b).unwrap_err();
        assert_eq!(e, LimitRefusal::Total { limit: 3, deadline_option: "handshake_timeout_s" });
        assert!(e.to_string().contains("max_handshakes=3") && e.to_string().contains("handshake_timeout_s"), "{e}");
        drop(a1);
        assert_eq!(l.in_handshake(), 2);
        let _b2 = l.admit(b).unwrap();
        assert_eq!(l.in_handshake(), 3);
    }
}

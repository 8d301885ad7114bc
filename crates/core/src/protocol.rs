//! The kvxfer protocol version: what two ranks speak to each other, and what they negotiate.
//!
//! One number versions what ranks exchange about requests: the notification wire format (its
//! version byte is this number, see [`crate::notify`]) and the rank record each rank publishes in
//! the metadata store (its `protocol` field). Every other wire and metadata format carries its
//! own version beside it (the endpoint metadata envelope, each backend's payload and handshake,
//! fragments); those have not changed between the protocol versions this build speaks, and a peer
//! that sends another is refused by name in that handshake.
//!
//! | protocol | builds | what it added |
//! |---|---|---|
//! | 1 | before the engine API (2026-12-01) | notifications without generations; no handoff |
//! | 2 | the engine API up to the metrics (4022094, 2026-12-05); records carry no `protocol` | generations, handoff, abort, fence |
//! | 3 | this build | the end-to-end digest (handoff flag bit 1, notification kind 8); the `protocol` field |
//!
//! A rank publishes the range it speaks, [`ProtocolRange`]: this build speaks 2 and 3, so a rank
//! one version behind keeps working with it during a rolling upgrade, and one two versions behind
//! is refused by name. Two ranks [negotiate](ProtocolRange::negotiate) the highest version both
//! speak; a [`Feature`] is used between them only where that version has it. A record without
//! the field comes from a protocol-2 build and is read as speaking 2 only.
//!
//! Notifications are written in the lowest version that can express them: everything but the
//! digest is written as version 2, byte for byte what a protocol-2 build writes, so an older peer
//! reads it; a rank sends a digest request or a digest only to a peer that negotiated 3.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The newest protocol this build speaks.
pub const PROTOCOL: u16 = 3;

/// The oldest protocol this build speaks (one version back: rolling upgrades go one version at a
/// time).
pub const OLDEST_PROTOCOL: u16 = 2;

/// The protocol of a rank record that names none (written by a protocol-2 build).
pub const UNVERSIONED: u16 = 2;

/// The protocol versions a rank speaks, both ends included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProtocolRange {
    /// The oldest version it speaks.
    pub oldest: u16,
    /// The newest version it speaks (the one it prefers).
    pub newest: u16,
}

impl Default for ProtocolRange {
    /// What a record without a range speaks: [`UNVERSIONED`] only.
    fn default() -> Self {
        Self::exactly(UNVERSIONED)
    }
}

impl fmt::Display for ProtocolRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.oldest == self.newest {
            write!(f, "{}", self.newest)
        } else {
            write!(f, "{}..={}", self.oldest, self.newest)
        }
    }
}

/// A protocol feature used between two ranks only where their negotiated version has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    /// The end-to-end digest ([`crate::digest`]): the handoff's wants-digest flag and the digest
    /// notification.
    Digest,
}

impl Feature {
    /// Every feature.
    pub const ALL: [Feature; 1] = [Feature::Digest];

    /// The first protocol version that has it.
    pub const fn since(self) -> u16 {
        match self {
            Feature::Digest => 3,
        }
    }

    /// Its name in messages and logs.
    pub const fn name(self) -> &'static str {
        match self {
            Feature::Digest => "digest",
        }
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Two ranks share no protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no common kvxfer protocol: {who} speaks {theirs}, this rank speaks {ours}; {}", self.advice())]
pub struct ProtocolMismatch {
    /// What this rank speaks.
    pub ours: ProtocolRange,
    /// What the peer speaks.
    pub theirs: ProtocolRange,
    /// Which side the peer is, for the message ("the prefill rank", "the decode rank", "the peer").
    pub who: &'static str,
}

impl ProtocolMismatch {
    /// What to do: upgrade whichever side is behind.
    pub fn advice(&self) -> String {
        if self.theirs.newest < self.ours.oldest {
            format!(
                "upgrade it to a kvxfer that speaks protocol {} or later (a rolling upgrade goes one protocol \
                 version at a time)",
                self.ours.oldest
            )
        } else {
            format!(
                "upgrade this rank to a kvxfer that speaks protocol {} or later (a rolling upgrade goes one \
                 protocol version at a time)",
                self.theirs.oldest
            )
        }
    }
}

impl ProtocolRange {
    /// What this build speaks: [`OLDEST_PROTOCOL`]..=[`PROTOCOL`].
    pub const THIS_BUILD: Self = Self { oldest: OLDEST_PROTOCOL, newest: PROTOCOL };

    /// One version only.
    pub const fn exactly(v: u16) -> Self {
        Self { oldest: v, newest: v }
    }

    /// This build's range with its newest version pinned to `newest` (to keep new ranks on the
    /// older protocol until every rank is upgraded). `None` when this build does not speak it.
    pub fn pinned(newest: u16) -> Option<Self> {
        (OLDEST_PROTOCOL..=PROTOCOL).contains(&newest).then_some(Self { oldest: OLDEST_PROTOCOL, newest })
    }

    /// Whether it holds `v`.
    pub const fn contains(self, v: u16) -> bool {
        self.oldest <= v && v <= self.newest
    }

    /// The highest version both speak, or the mismatch (`who` names the peer in the message).
    pub fn negotiate(self, theirs: ProtocolRange, who: &'static str) -> Result<Negotiated, ProtocolMismatch> {
        let v = self.newest.min(theirs.newest);
        if v >= self.oldest.max(theirs.oldest) && self.oldest <= self.newest && theirs.oldest <= theirs.newest {
            Ok(Negotiated { version: v })
        } else {
            Err(ProtocolMismatch { ours: self, theirs, who })
        }
    }
}

/// The version two ranks agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Negotiated {
    /// The highest version both speak.
    pub version: u16,
}

impl Negotiated {
    /// Whether `f` may be used between them.
    pub const fn has(self, f: Feature) -> bool {
        self.version >= f.since()
    }

    /// The features they share.
    pub fn features(self) -> Vec<Feature> {
        Feature::ALL.into_iter().filter(|f| self.has(*f)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pair of well-formed ranges over versions 1..=6, against the definition.
    #[test]
    fn negotiation_table() {
        let ranges: Vec<ProtocolRange> =
            (1..=6).flat_map(|a| (a..=6).map(move |b| ProtocolRange { oldest: a, newest: b })).collect();
        for &a in &ranges {
            for &b in &ranges {
                let common: Vec<u16> = (1..=6).filter(|v| a.contains(*v) && b.contains(*v)).collect();
                match (a.negotiate(b, "the peer"), common.last()) {
                    (Ok(n), Some(&v)) => {
                        assert_eq!(n.version, v, "{a} with {b}");
                        assert_eq!(b.negotiate(a, "the peer").unwrap(), n, "symmetric: {a} with {b}");
                    }
                    (Err(e), None) => {
                        let m = e.to_string();
                        assert!(m.contains(&a.to_string()) && m.contains(&b.to_string()), "{m}");
                        // The advice names the side that is behind.
                        if b.newest < a.oldest {
                            assert!(m.contains("upgrade it to"), "{m}");
                        } else {
                            assert!(b.oldest > a.newest && m.contains("upgrade this rank"), "{m}");
                        }
                    }
                    (r, c) => panic!("{a} with {b}: {r:?}, common {c:?}"),
                }
            }
        }
        // A malformed range negotiates nothing.
        let bad = ProtocolRange { oldest: 3, newest: 2 };
        assert!(ProtocolRange::THIS_BUILD.negotiate(bad, "the peer").is_err());
    }

    #[test]
    fn one_version_back_works_two_are_refused() {
        let me = ProtocolRange::THIS_BUILD;
        let prev = ProtocolRange::default();
        let n = me.negotiate(prev, "the prefill rank").unwrap();
        assert_eq!(n.version, PROTOCOL - 1);
        assert!(!n.has(Feature::Digest));
        assert!(me.negotiate(me, "the peer").unwrap().has(Feature::Digest));
        let e = me.negotiate(ProtocolRange::exactly(PROTOCOL - 2), "the prefill rank").unwrap_err();
        assert_eq!(
            e.to_string(),
            "no common kvxfer protocol: the prefill rank speaks 1, this rank speaks 2..=3; upgrade it to a kvxfer \
             that speaks protocol 2 or later (a rolling upgrade goes one protocol version at a time)"
        );
        assert_eq!(ProtocolRange::pinned(2), Some(ProtocolRange::exactly(2)));
        assert_eq!(ProtocolRange::pinned(1), None);
        assert_eq!(ProtocolRange::pinned(4), None);
        // The notification wire version is the protocol version.
        assert_eq!(u16::from(crate::notify::VERSION), PROTOCOL);
    }
}

//! The cluster's shared secret, and the keyed proofs every authenticated channel is built on.
//!
//! One [`Secret`] authenticates a rank to the metadata service and every connection between ranks:
//! each side proves it knows the secret by a MAC over a fresh challenge (a nonce from the other side),
//! so no reusable token ever crosses the wire. The protocols themselves live where their bytes are
//! (the bootstrap's request lines, each backend's handshake); this module gives them the secret, the
//! nonces and the MAC, so there is one implementation of each.
//!
//! Without a secret nothing is authenticated: anyone who can reach a port can read the metadata and
//! write and notify where a rank could. That is the embedded default for local use; a cluster on a
//! shared network should set [`SECRET_ENV`] (`KVXFER_SECRET`) or give a secret file.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The environment variable a secret is read from ([`Secret::from_env`]).
pub const SECRET_ENV: &str = "KVXFER_SECRET";

/// Length of a challenge nonce, in bytes.
pub const NONCE_BYTES: usize = 32;

/// Length of a proof ([`Secret::proof`]), in bytes: an HMAC-SHA256.
pub const PROOF_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// A shared secret. Its bytes are never printed: `Debug` shows `Secret(..)`, and there is no
/// `Display` and no serialization. Clones share one copy. Two secrets compare equal when their bytes
/// are equal (compared in constant time).
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        // Equal iff each one's proof of the other's bytes matches: constant time in the content.
        self.0.len() == other.0.len() && other.verify(&[&self.0], &self.proof(&[&self.0]))
    }
}

impl Eq for Secret {}

/// A secret that cannot be used, saying why and what to do (never with the secret itself).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// The secret is empty.
    #[error("the shared secret from {source_name} is empty; put at least 16 random bytes there (e.g. `head -c 32 /dev/urandom | base64`)")]
    Empty {
        /// Where it came from (a file name or the environment variable).
        source_name: String,
    },
    /// The secret file cannot be read.
    #[error("cannot read the shared secret from {path}: {detail}")]
    Unreadable {
        /// The file.
        path: String,
        /// The cause.
        detail: String,
    },
}

impl Secret {
    /// A secret from bytes; refuses an empty one.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, SecretError> {
        Self::named(bytes.into(), "the caller")
    }

    fn named(bytes: Vec<u8>, source_name: &str) -> Result<Self, SecretError> {
        if bytes.is_empty() {
            return Err(SecretError::Empty { source_name: source_name.to_owned() });
        }
        Ok(Self(bytes.into()))
    }

    /// The secret in [`SECRET_ENV`] (`KVXFER_SECRET`): `None` when the variable is not set, an error
    /// when it is set but empty. Its bytes are used as they are (no trimming).
    pub fn from_env() -> Result<Option<Self>, SecretError> {
        match std::env::var_os(SECRET_ENV) {
            None => Ok(None),
            Some(v) => Self::named(os_bytes(v), SECRET_ENV).map(Some),
        }
    }

    /// The secret in a file: its bytes, without trailing line breaks and spaces (so `echo secret >
    /// file` works). Errors name the file, never its content.
    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        let mut bytes = std::fs::read(path)
            .map_err(|e| SecretError::Unreadable { path: path.display().to_string(), detail: e.to_string() })?;
        while bytes.last().is_some_and(|b| matches!(b, b'\n' | b'\r' | b' ' | b'\t')) {
            bytes.pop();
        }
        Self::named(bytes, &path.display().to_string())
    }

    fn mac(&self, chunks: &[&[u8]]) -> HmacSha256 {
        // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!("HMAC key"));
        for c in chunks {
            mac.update(c);
        }
        mac
    }

    /// `HMAC-SHA256(secret, chunks concatenated)`. The chunks are concatenated as they are: a protocol
    /// starts them with a context string of its own (domain separation) and uses fixed-length fields,
    /// or length prefixes, wherever two encodings could otherwise concatenate to the same bytes.
    pub fn proof(&self, chunks: &[&[u8]]) -> [u8; PROOF_BYTES] {
        self.mac(chunks).finalize().into_bytes().into()
    }

    /// Whether `proof` is [`Self::proof`] of `chunks`, compared in constant time.
    pub fn verify(&self, chunks: &[&[u8]], proof: &[u8]) -> bool {
        self.mac(chunks).verify_slice(proof).is_ok()
    }
}

#[cfg(unix)]
fn os_bytes(v: std::ffi::OsString) -> Vec<u8> {
    use std::os::unix::ffi::OsStringExt;
    v.into_vec()
}

#[cfg(not(unix))]
fn os_bytes(v: std::ffi::OsString) -> Vec<u8> {
    v.to_string_lossy().into_owned().into_bytes()
}

/// A fresh challenge nonce from the operating system's random source.
pub fn nonce() -> std::io::Result<[u8; NONCE_BYTES]> {
    random_bytes()
}

/// `N` bytes from the operating system's random source (`getrandom`): the one source of
/// unpredictable values in kvxfer (nonces, access tokens, instance and link ids).
pub fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut n = [0u8; N];
    getrandom::getrandom(&mut n).map_err(std::io::Error::other)?;
    Ok(n)
}

/// The connect-time mutual challenge-response every authenticated backend runs, written once.
///
/// The protocol around it belongs to the backend (which messages carry the nonces and proofs); the
/// proofs are computed here:
///
/// 1. the connector sends its fresh nonce ([`nonce`]) `nc` (with its hello);
/// 2. the acceptor answers with its own fresh nonce `na` and [`Exchange::acceptor_proof`]; the connector
///    checks it with [`Exchange::verify_acceptor`] (mutual: a peer without the secret cannot answer, so
///    a connector never sends its proof, or anything else, to an impostor that merely listens);
/// 3. the connector sends [`Exchange::connector_proof`]; the acceptor checks it with
///    [`Exchange::verify_connector`] and admits the peer (or refuses it).
///
/// Each proof is `HMAC-SHA256(secret, "kvxfer exchange proof v1\0", direction, len(protocol) as u32 LE,
/// protocol, nc, na, connector identity, connector instance, acceptor identity, acceptor instance)`,
/// every field of fixed length (little endian) or length-prefixed, so no two exchanges encode alike.
/// What that binds:
/// - the direction (`"acceptor\0"` or `"connector\0"`): one side's proof never verifies as the
///   other's, so a proof cannot be reflected back to its sender;
/// - the [`protocol`](Exchange::protocol) label (one per backend, e.g. `"kvxfer-ucx"`): a proof made for
///   one backend never verifies for another;
/// - both fresh nonces: a captured exchange proves nothing on another connection;
/// - both endpoints' (identity, instance): a proof made for one pair of endpoints is useless to
///   any other, and the identity the acceptor admits is the one the connector proved.
///
/// The `instance` is whatever distinguishes one incarnation of an endpoint from a restarted one
/// (an instance id, an endpoint nonce widened to u64); both sides must put the same values in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    /// The protocol label: a constant per backend (and per version of its exchange).
    pub protocol: &'static str,
    /// The connecting side's fresh nonce (step 1).
    pub connector_nonce: [u8; NONCE_BYTES],
    /// The accepting side's fresh nonce (step 2).
    pub acceptor_nonce: [u8; NONCE_BYTES],
    /// The connecting endpoint: (identity, instance).
    pub connector: (u64, u64),
    /// The accepting endpoint: (identity, instance).
    pub acceptor: (u64, u64),
}

const EXCHANGE_CONTEXT: &[u8] = b"kvxfer exchange proof v1\0";
const ACCEPTOR_DIRECTION: &[u8] = b"acceptor\0";
const CONNECTOR_DIRECTION: &[u8] = b"connector\0";

impl Exchange {
    fn fields(&self) -> [u8; 32] {
        let mut f = [0u8; 32];
        for (i, v) in [self.connector.0, self.connector.1, self.acceptor.0, self.acceptor.1].iter().enumerate() {
            f[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        f
    }

    fn with_chunks<R>(&self, direction: &[u8], f: impl FnOnce(&[&[u8]]) -> R) -> R {
        // A label longer than u32::MAX bytes cannot be a `&'static str` constant in practice; saturate
        // rather than wrap so the length prefix never lies silently.
        let len = u32::try_from(self.protocol.len()).unwrap_or(u32::MAX).to_le_bytes();
        let fields = self.fields();
        f(&[
            EXCHANGE_CONTEXT,
            direction,
            &len,
            self.protocol.as_bytes(),
            &self.connector_nonce,
            &self.acceptor_nonce,
            &fields,
        ])
    }

    /// What the accepting side proves (step 2).
    pub fn acceptor_proof(&self, s: &Secret) -> [u8; PROOF_BYTES] {
        self.with_chunks(ACCEPTOR_DIRECTION, |c| s.proof(c))
    }

    /// What the connecting side proves (step 3).
    pub fn connector_proof(&self, s: &Secret) -> [u8; PROOF_BYTES] {
        self.with_chunks(CONNECTOR_DIRECTION, |c| s.proof(c))
    }

    /// Whether `proof` is the accepting side's proof of this exchange (constant time).
    pub fn verify_acceptor(&self, s: &Secret, proof: &[u8]) -> bool {
        self.with_chunks(ACCEPTOR_DIRECTION, |c| s.verify(c, proof))
    }

    /// Whether `proof` is the connecting side's proof of this exchange (constant time).
    pub fn verify_connector(&self, s: &Secret, proof: &[u8]) -> bool {
        self.with_chunks(CONNECTOR_DIRECTION, |c| s.verify(c, proof))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_every_byte_and_on_the_secret() {
        let s = Secret::new(b"s3cret".to_vec()).unwrap();
        let n = nonce().unwrap();
        assert_ne!(n, nonce().unwrap(), "two nonces");
        let p = s.proof(&[b"ctx\0", &n, b"body"]);
        assert!(s.verify(&[b"ctx\0", &n, b"body"], &p));
        assert!(s.verify(&[b"ctx\0", &n, b"bo", b"dy"], &p), "chunks concatenate");
        assert!(!s.verify(&[b"ctx\0", &n, b"bodY"], &p));
        assert!(!s.verify(&[b"ctx\0", &n, b"body"], &p[..31]));
        assert!(!Secret::new(b"other".to_vec()).unwrap().verify(&[b"ctx\0", &n, b"body"], &p));
        assert_eq!(format!("{s:?}"), "Secret(..)");
        assert_eq!(s, Secret::new(b"s3cret".to_vec()).unwrap());
        assert_ne!(s, Secret::new(b"s3creT".to_vec()).unwrap());
        assert_ne!(s, Secret::new(b"s3cre".to_vec()).unwrap());
        assert!(matches!(Secret::new(Vec::new()), Err(SecretError::Empty { .. })));
    }

    fn exchange() -> Exchange {
        Exchange {
            protocol: "kvxfer-test",
            connector_nonce: [1; NONCE_BYTES],
            acceptor_nonce: [2; NONCE_BYTES],
            connector: (0x10, 0x11),
            acceptor: (0x20, 0x21),
        }
    }

    #[test]
    fn exchange_proofs_are_mutual_and_bound_to_nonces_endpoints_direction_and_protocol() {
        let s = Secret::new(b"cluster".to_vec()).unwrap();
        let x = exchange();
        let (a, c) = (x.acceptor_proof(&s), x.connector_proof(&s));
        assert!(x.verify_acceptor(&s, &a) && x.verify_connector(&s, &c));
        assert_ne!(a, c, "one side's proof is not the other's");
        assert!(!x.verify_connector(&s, &a) && !x.verify_acceptor(&s, &c), "a proof cannot be reflected");
        assert!(!x.verify_acceptor(&Secret::new(b"other".to_vec()).unwrap(), &a), "another secret");
        assert!(!x.verify_acceptor(&s, &a[..PROOF_BYTES - 1]), "a truncated proof");
        // A captured exchange proves nothing once either nonce, either endpoint's identity or
        // instance, or the protocol differs.
        let changes: [fn(&mut Exchange); 9] = [
            |x| x.connector_nonce[0] ^= 1,
            |x| x.acceptor_nonce[NONCE_BYTES - 1] ^= 1,
            |x| x.connector.0 ^= 1,
            |x| x.connector.1 ^= 1,
            |x| x.acceptor.0 ^= 1,
            |x| x.acceptor.1 ^= 1,
            |x| std::mem::swap(&mut x.connector, &mut x.acceptor),
            |x| x.protocol = "kvxfer-other",
            |x| x.protocol = "kvxfer-tes",
        ];
        for change in changes {
            let mut y = exchange();
            change(&mut y);
            assert!(!y.verify_acceptor(&s, &a) && !y.verify_connector(&s, &c), "{y:?}");
        }
        // Swapping the two nonces (a connector replaying the acceptor's role) does not verify either.
        let mut y = exchange();
        std::mem::swap(&mut y.connector_nonce, &mut y.acceptor_nonce);
        assert!(!y.verify_acceptor(&s, &a) && !y.verify_connector(&s, &c));
        // The proof is deterministic: both sides compute the same bytes from the same exchange.
        assert_eq!(exchange().acceptor_proof(&s), a);
    }
}

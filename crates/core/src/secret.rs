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
    let mut n = [0u8; NONCE_BYTES];
    getrandom::getrandom(&mut n).map_err(std::io::Error::other)?;
    Ok(n)
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
}

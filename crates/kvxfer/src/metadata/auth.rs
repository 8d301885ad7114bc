//! The bootstrap service's optional shared secret: a challenge-response in which no reusable token
//! ever crosses the wire.
//!
//! When the service has a [`Secret`], it greets every connection with a line
//! `{"challenge":"<64 hex digits>"}`: 32 bytes from the operating system's random source, new for each
//! connection. The client answers with its request line, which starts with a proof:
//!
//! ```text
//! {"auth":"<64 hex digits>",<the rest of the request object>
//! ```
//!
//! The proof is `HMAC-SHA256(secret, "kvxfer-bootstrap-auth-v1" 0x00 || nonce || body)`, where
//! `body` is the request line without its newline and with the `"auth":"...",` member taken out
//! (that is, `{` followed by everything after the proof's comma). The proof covers both the
//! connection's nonce and every byte of the request, so a captured line is useless on any other
//! connection (another nonce) and cannot be altered on its own. The service checks the proof in
//! constant time before it parses the request; a missing or wrong proof is answered with an error and
//! the connection closes.
//!
//! What it does not do: it does not encrypt (anyone on the path reads keys and values), and the
//! client does not authenticate the service. Use a private network, or a tunnel, for that.

use std::fmt;

pub use kvxfer_core::secret::{nonce, Secret, SecretError, NONCE_BYTES, SECRET_ENV};

/// Domain separation: proofs of this protocol cannot be confused with other uses of the same secret.
const CONTEXT: &[u8] = b"kvxfer-bootstrap-auth-v1\0";

/// How a request line with a proof starts.
pub(crate) const AUTH_PREFIX: &str = "{\"auth\":\"";

/// Hex digits of a proof (HMAC-SHA256).
const PROOF_HEX: usize = 64;

/// Lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// Bytes from hex (either case); `None` if not hex or of odd length.
pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let b = s.as_bytes();
    if b.len() % 2 != 0 {
        return None;
    }
    b.chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

/// The greeting line of a connection (without its newline).
pub(crate) fn challenge_line(nonce: &[u8]) -> String {
    format!("{{\"challenge\":\"{}\"}}", hex(nonce))
}

/// The nonce of a greeting line, if it is one.
pub(crate) fn parse_challenge(line: &str) -> Option<Vec<u8>> {
    #[derive(serde::Deserialize)]
    struct Challenge {
        challenge: String,
    }
    let c: Challenge = serde_json::from_str(line.trim_end()).ok()?;
    unhex(&c.challenge).filter(|n| n.len() == NONCE_BYTES)
}

/// The request line to send (without newline) for a request serialized as `body` (a JSON object),
/// on a connection whose challenge was `nonce`.
pub(crate) fn sign(secret: &Secret, nonce: &[u8], body: &[u8]) -> Vec<u8> {
    let proof = hex(&secret.proof(&[CONTEXT, nonce, body]));
    let rest = body.strip_prefix(b"{").unwrap_or(body);
    let mut line = Vec::with_capacity(AUTH_PREFIX.len() + PROOF_HEX + 2 + rest.len());
    line.extend_from_slice(AUTH_PREFIX.as_bytes());
    line.extend_from_slice(proof.as_bytes());
    line.extend_from_slice(b"\",");
    line.extend_from_slice(rest);
    line
}

/// Why a request line was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No `{"auth":"<proof>",` at the start of the line.
    Missing,
    /// A proof that does not match this connection's nonce and the request's bytes.
    Wrong,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Missing => f.write_str(
                "authentication required: this bootstrap service has a shared secret; give the client the same one \
                 (KVXFER_SECRET, or --secret-file for kvxfer commands)",
            ),
            Refusal::Wrong => f.write_str(
                "authentication failed: the proof does not match this connection's challenge and request (a wrong \
                 secret, or a request replayed from another connection); give the client the service's secret",
            ),
        }
    }
}

/// Checks the proof at the start of `line` (no newline) against `nonce`; returns the request body
/// (the line without the proof) when it matches.
pub(crate) fn verify(secret: &Secret, nonce: &[u8], line: &str) -> Result<String, Refusal> {
    let rest = line.strip_prefix(AUTH_PREFIX).ok_or(Refusal::Missing)?;
    let (proof, rest) = rest.split_at_checked(PROOF_HEX).ok_or(Refusal::Missing)?;
    let rest = rest.strip_prefix("\",").ok_or(Refusal::Missing)?;
    let proof = unhex(proof).ok_or(Refusal::Missing)?;
    let mut body = String::with_capacity(rest.len() + 1);
    body.push('{');
    body.push_str(rest);
    if !secret.verify(&[CONTEXT, nonce, body.as_bytes()], &proof) {
        return Err(Refusal::Wrong);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_line_verifies_only_with_its_secret_nonce_and_bytes() {
        let s = Secret::new(b"s3cret".to_vec()).unwrap();
        let n1 = nonce().unwrap();
        let n2 = nonce().unwrap();
        assert_ne!(n1, n2);
        let body = br#"{"op":"get","key":"k","timeout_ms":0}"#;
        let line = String::from_utf8(sign(&s, &n1, body)).unwrap();
        assert!(line.starts_with(AUTH_PREFIX) && line.ends_with(r#""op":"get","key":"k","timeout_ms":0}"#), "{line}");
        // It parses as one JSON object carrying the request and the proof.
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!((v["op"].as_str(), v["auth"].as_str().map(str::len)), (Some("get"), Some(64)));
        assert_eq!(verify(&s, &n1, &line).unwrap().as_bytes(), body);
        // Another connection's nonce (a replay), another secret, a changed byte, no proof.
        assert_eq!(verify(&s, &n2, &line), Err(Refusal::Wrong));
        assert_eq!(verify(&Secret::new(b"other".to_vec()).unwrap(), &n1, &line), Err(Refusal::Wrong));
        assert_eq!(verify(&s, &n1, &line.replace("\"k\"", "\"j\"")), Err(Refusal::Wrong));
        assert_eq!(verify(&s, &n1, std::str::from_utf8(body).unwrap()), Err(Refusal::Missing));
        assert_eq!(verify(&s, &n1, "{\"auth\":\"zz\",\"op\":\"get\"}"), Err(Refusal::Missing));
        assert_eq!(verify(&s, &n1, "{\"auth\":\""), Err(Refusal::Missing));
        // The greeting round-trips; the secret never shows in Debug.
        assert_eq!(parse_challenge(&challenge_line(&n1)).unwrap(), n1.to_vec());
        assert_eq!(parse_challenge("{\"ok\":false}"), None);
        assert_eq!(format!("{s:?}"), "Secret(..)");
        assert!(matches!(Secret::new(Vec::new()), Err(SecretError::Empty { .. })));
    }

    #[test]
    fn a_secret_file_loses_its_trailing_newline_and_errors_name_only_the_file() {
        let dir = std::env::temp_dir().join(format!("kvxfer-secret-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("secret");
        std::fs::write(&f, "abc \n").unwrap();
        let s = Secret::from_file(&f).unwrap();
        assert_eq!(s, Secret::new(b"abc".to_vec()).unwrap());
        std::fs::write(&f, "\n").unwrap();
        let e = Secret::from_file(&f).unwrap_err().to_string();
        assert!(e.contains("empty") && e.contains("secret"), "{e}");
        let e = Secret::from_file(&dir.join("missing")).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

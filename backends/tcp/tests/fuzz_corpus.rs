//! The TCP backend's fuzz targets on stable Rust (`tcp_frame`, `tcp_handshake`, and its part of
//! `endpoint_metadata`): replay of the committed corpus, the seeds, and a bounded proptest fuzz.
//! See `fuzz/README.md`.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use kvxfer_tcp::fuzzing;

#[test]
fn tcp_frame_corpus_replays() {
    replay::replay("tcp_frame", fuzzing::frames);
}

#[test]
fn tcp_frame_seeds_are_committed_and_accepted() {
    replay::check_seeds("tcp_frame", &fuzzing::frame_seeds(), fuzzing::frames);
}

#[test]
fn tcp_frame_proptest_fuzz() {
    replay::fuzz("tcp_frame", &fuzzing::frame_seeds(), fuzzing::frames);
}

#[test]
fn tcp_handshake_corpus_replays() {
    replay::replay("tcp_handshake", fuzzing::handshake);
}

#[test]
fn tcp_handshake_seeds_are_committed_and_accepted() {
    replay::check_seeds("tcp_handshake", &fuzzing::handshake_seeds(), fuzzing::handshake);
}

#[test]
fn tcp_handshake_proptest_fuzz() {
    replay::fuzz("tcp_handshake", &fuzzing::handshake_seeds(), fuzzing::handshake);
}

#[test]
fn endpoint_metadata_corpus_replays_through_tcp() {
    replay::replay("endpoint_metadata", fuzzing::metadata);
}

#[test]
fn endpoint_metadata_tcp_seeds_are_committed_and_accepted() {
    replay::check_seeds("endpoint_metadata", &fuzzing::metadata_seeds(), fuzzing::metadata);
}

#[test]
fn endpoint_metadata_proptest_fuzz_through_tcp() {
    replay::fuzz("endpoint_metadata", &fuzzing::metadata_seeds(), fuzzing::metadata);
}

/// Found by the proptest fuzz: a HELLO reply with its reserved byte set decoded (and re-encoded
/// otherwise); the decoder now refuses it, and an accepted reply that carries a reason. Since
/// protocol 3 that byte holds the reply's flags: unknown flags are refused the same way, and so are a
/// rejection that carries a proof and proof bytes without the PROOF flag.
#[test]
fn regression_hello_reply_reserved_byte_and_accepted_reason_are_refused() {
    use kvxfer_tcp::wire;
    for name in [
        "crash-reply-reserved-byte",
        "edge-reply-accepted-with-reason",
        "edge-reply-rejected-with-proof",
        "edge-reply-proof-bytes-without-flag",
    ] {
        let data = std::fs::read(replay::fuzz_dir().join("corpus/tcp_handshake").join(name)).expect("corpus file");
        let head: &[u8; wire::HELLO_REPLY_LEN] = data[..wire::HELLO_REPLY_LEN].try_into().unwrap();
        let version = u16::from_le_bytes([data[4], data[5]]);
        assert_eq!(version, wire::PROTOCOL_VERSION, "{name} is not in this protocol's layout");
        assert!(wire::decode_hello_reply(head).is_err(), "{name} decoded");
        assert!(!fuzzing::handshake(&data), "{name} accepted");
    }
}

/// Protocol 3's canonical forms: a HELLO with proof bytes but no PROOF flag, and a CHALLENGE with an
/// unknown flag or of protocol 2, are refused.
#[test]
fn handshake_edges_of_protocol_3_are_refused() {
    use kvxfer_tcp::wire;
    let read = |name: &str| std::fs::read(replay::fuzz_dir().join("corpus/tcp_handshake").join(name)).unwrap();
    let h = read("edge-hello-proof-without-flag");
    assert!(wire::Hello::decode(h[..wire::HELLO_LEN].try_into().unwrap()).is_err());
    for name in ["edge-challenge-unknown-flag", "edge-challenge-version-2"] {
        let c = read(name);
        assert!(wire::Challenge::decode(c[..wire::CHALLENGE_LEN].try_into().unwrap()).is_err(), "{name}");
        assert!(!fuzzing::handshake(&c), "{name} accepted");
    }
}

/// Found by review, confirmed by the `endpoint_metadata` target's round-trip check: the token
/// parser took `+a` as a hex byte (`u8::from_str_radix` accepts a sign); it now takes hex digits only.
#[test]
fn regression_metadata_token_with_a_sign_is_refused() {
    use kvxfer_core::EndpointMetadata;
    let payload = std::fs::read(replay::fuzz_dir().join("corpus/endpoint_metadata/edge-tcp-token-with-sign"))
        .expect("corpus file");
    let m = kvxfer_tcp::TcpMetadata::from_envelope(&EndpointMetadata::new("tcp", 1, payload.clone())).expect("parses");
    assert!(m.token_bytes().is_err(), "a token with a sign was taken");
    assert!(!fuzzing::metadata(&payload));
}

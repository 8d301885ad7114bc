//! Fuzz entry point of the bootstrap protocol (target `bootstrap_request` of `fuzz/`).
//!
//! Shared by the libFuzzer target (nightly) and the stable replay and proptest tests
//! (`crates/kvxfer/tests/fuzz_corpus.rs`). It takes arbitrary bytes, must never panic on them, and
//! panics only when a property of the protocol is broken. Not part of the API.

use std::time::Instant;

use kvxfer_core::{Attention, EndpointMetadata, KvSpec, Layout, Parallel, RankId, Side, SideSpec, Topology};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::bootstrap::{check_compatible, check_pair, check_rank_in_config, describe, parse_request};
use crate::bootstrap::{RankRegistration, Request, Response};
use crate::metadata::auth::{self, Secret};
use crate::metadata::memory::{json_len, MemState, MemStoreError, StoreCall};
use crate::metadata::{LeaseId, RankRecord};
use crate::session::{region_id, KvPool, PoolBuffer};

/// The secret of the fuzzed service (requests signed with it verify).
pub const SECRET: &[u8] = b"kvxfer fuzz secret";
/// The challenge nonce of the fuzzed connection.
pub const NONCE: [u8; auth::NONCE_BYTES] = [0x42; auth::NONCE_BYTES];

fn secret() -> Secret {
    Secret::new(SECRET.to_vec()).expect("a valid secret")
}

/// JSON value re-serialization must be stable (what the service stores is what it answers).
fn json_round_trip<T: serde::Serialize + serde::de::DeserializeOwned>(v: &T) -> T {
    let a = serde_json::to_value(v).expect("serializes");
    let back: T = serde_json::from_value(a.clone()).expect("what was serialized parses");
    assert_eq!(serde_json::to_value(&back).expect("serializes"), a, "JSON round trip changed the value");
    back
}

/// `bootstrap_request`: `data` as a connection's bytes, read as the service reads them: one line (up
/// to the first newline) that must be UTF-8, its proof checked against [`SECRET`] and [`NONCE`] (a
/// service with a secret) or not (without one), then [`parse_request`]; and what the service and
/// its ranks then do without waiting: value sizes, the store call applied to a fresh in-memory
/// store, and, when the call puts a rank record ([`RankRecord`]), the checks a joining rank makes
/// of it against a prefill and a decode rank of the seed configuration (and its pool against the
/// topology, as a peer validates it). Also read as a client reads the service's lines (a
/// response, a challenge). Returns whether a request was parsed.
pub fn request(data: &[u8]) -> bool {
    let line = match data.iter().position(|b| *b == b'\n') {
        Some(i) => &data[..=i],
        None => data,
    };
    let Ok(line) = std::str::from_utf8(line) else { return false };
    let text = line.trim_end_matches(['\n', '\r']);
    let _ = auth::parse_challenge(text);
    if let Ok(resp) = serde_json::from_str::<Response>(text) {
        json_round_trip(&resp);
    }
    let mut parsed = false;
    if let Ok(body) = auth::verify(&secret(), &NONCE, text) {
        parsed |= serve(&body);
    }
    parsed |= serve(text);
    parsed
}

fn serve(body: &str) -> bool {
    let Ok(req) = parse_request(body) else { return false };
    let req = json_round_trip(&req);
    match req {
        Request::Store { call } => {
            if let StoreCall::Put { value, .. } | StoreCall::Create { value, .. } = &call {
                if let Ok(rec) = RankRecord::deserialize(value) {
                    register(&rec.registration);
                    json_round_trip(&rec);
                }
            }
            store(call)
        }
        Request::Stats => {}
    }
    true
}

/// What a rank joining the store checks of another rank's record.
fn register(entry: &RankRegistration) {
    let _ = describe(entry);
    let _ = check_rank_in_config(entry);
    for (side, other) in
        [(Side::Prefill, seed_registration(Side::Prefill)), (Side::Decode, seed_registration(Side::Decode))]
    {
        let _ = check_pair(entry, &other);
        let (p, d) = if side == Side::Prefill { (&other.spec, &entry.spec) } else { (&entry.spec, &other.spec) };
        if entry.role != side {
            if let Ok(topo) = check_compatible(p, d) {
                let _ = entry.pool.validate(&topo, entry.role, entry.rank);
            }
        }
    }
    let _ = Topology::new(&entry.spec, &entry.spec);
}

fn store(call: StoreCall) {
    let _ = call.describe();
    if let StoreCall::Put { value, .. } | StoreCall::Create { value, .. } = &call {
        let _ = json_len(value);
    }
    let now = Instant::now();
    let mut st = MemState::new();
    // A lease (1) and a key for the call to find.
    let _ = st.apply(StoreCall::Grant { ttl_ms: 10_000 }, now);
    let _ = st.apply(StoreCall::Put { key: "k".into(), value: json!(1), lease: Some(LeaseId(1)) }, now);
    for _ in 0..2 {
        let r = st.apply(call.clone(), now);
        // The service sends `r` as JSON; the client reads it back.
        let v = serde_json::to_value(&r).expect("serializes");
        let _: Result<Value, MemStoreError> = serde_json::from_value(v).expect("a store answer parses");
    }
    let _ = st.expire(now + std::time::Duration::from_secs(3600));
}

/// A registration of the seed configuration (TP 2, PP 1, 4 layers, GQA with 4 KV heads).
pub fn seed_registration(role: Side) -> RankRegistration {
    let spec = SideSpec {
        kv: KvSpec {
            attention: Attention::Gqa { kv_heads: 4, head_dim_k: 128, head_dim_v: 128 },
            layers: 4,
            dtype_bytes: 2,
            page_size: 16,
            layout: Layout::Nhd,
        },
        parallel: Parallel::new(2, 1),
    };
    let topo = Topology::new(&spec, &spec).expect("seed spec is valid");
    let rank = RankId::new(1, 0);
    let pages = 8;
    let buffers = (0..topo.stage_layers(role, 0))
        .flat_map(|layer| topo.kv().kinds().iter().map(move |&kind| kvxfer_core::BufferRef { layer, kind }))
        .map(|buffer| PoolBuffer {
            buffer,
            region: region_id(buffer),
            offset: 0,
            len: topo.buffer_bytes(role, buffer.kind, pages),
        })
        .collect();
    RankRegistration {
        role,
        rank,
        backend: "tcp".into(),
        endpoint: EndpointMetadata::new("tcp", 0x0001_0000_0000_0001, b"{}".to_vec()),
        pool: KvPool { pages, buffers },
        spec,
        label: "host-a pid 4242".into(),
        model: None,
        protocol: kvxfer_core::ProtocolRange::THIS_BUILD,
        warmup: None,
    }
}

/// Valid request lines made by the real encoders (unsigned, and signed with [`SECRET`] for
/// [`NONCE`]), and a response and a challenge line: the seed corpus of `bootstrap_request`.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let reqs: Vec<(&str, Request)> = vec![
        (
            "store-put-rank",
            Request::Store {
                call: StoreCall::Create {
                    key: "/kvxfer/ranks/decode/0.0".into(),
                    value: serde_json::to_value(RankRecord {
                        registration: seed_registration(Side::Decode),
                        left: false,
                    })
                    .expect("serializes"),
                    lease: Some(LeaseId(1)),
                },
            },
        ),
        ("stats", Request::Stats),
        ("store-grant", Request::Store { call: StoreCall::Grant { ttl_ms: 5_000 } }),
        ("store-keepalive", Request::Store { call: StoreCall::KeepAlive { lease: LeaseId(1) } }),
        ("store-revoke", Request::Store { call: StoreCall::Revoke { lease: LeaseId(1) } }),
        (
            "store-put",
            Request::Store {
                call: StoreCall::Put { key: "/kvxfer/a".into(), value: json!([1, "x"]), lease: Some(LeaseId(1)) },
            },
        ),
        (
            "store-create",
            Request::Store { call: StoreCall::Create { key: "k".into(), value: json!(null), lease: None } },
        ),
        ("store-get", Request::Store { call: StoreCall::Get { key: "k".into() } }),
        ("store-list", Request::Store { call: StoreCall::List { prefix: "/kvxfer/".into() } }),
        ("store-delete", Request::Store { call: StoreCall::Delete { key: "k".into() } }),
        ("store-watch", Request::Store { call: StoreCall::Watch { prefix: "".into(), after: 0, timeout_ms: 0 } }),
    ];
    let mut out = Vec::new();
    for (name, req) in reqs {
        let mut line = crate::bootstrap::request_body(&req).expect("serializes");
        let mut signed = auth::sign(&secret(), &NONCE, &line);
        line.push(b'\n');
        signed.push(b'\n');
        out.push((name.to_owned(), line));
        out.push((format!("{name}-signed"), signed));
    }
    let resp: Response = serde_json::from_str(r#"{"ok":true,"result":{"Ok":3}}"#).expect("a response");
    let mut line = serde_json::to_vec(&resp).expect("serializes");
    line.push(b'\n');
    out.push(("response".to_owned(), line));
    out.push(("challenge".to_owned(), format!("{}\n", auth::challenge_line(&NONCE)).into_bytes()));
    out
}

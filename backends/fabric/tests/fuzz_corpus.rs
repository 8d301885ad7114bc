//! The fabric backend's fuzz targets on stable Rust (`fabric_wire` and its part of `endpoint_metadata`):
//! replay of the committed corpus, the seeds, and a bounded proptest fuzz. See `fuzz/README.md`.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use kvxfer_fabric::fuzzing;

#[test]
fn fabric_wire_corpus_replays() {
    replay::replay("fabric_wire", fuzzing::messages);
}

#[test]
fn fabric_wire_seeds_are_committed_and_accepted() {
    replay::check_seeds("fabric_wire", &fuzzing::message_seeds(), fuzzing::messages);
}

#[test]
fn fabric_wire_proptest_fuzz() {
    replay::fuzz("fabric_wire", &fuzzing::message_seeds(), fuzzing::messages);
}

#[test]
fn endpoint_metadata_corpus_replays_through_fabric() {
    replay::replay("endpoint_metadata", fuzzing::metadata);
}

#[test]
fn endpoint_metadata_fabric_seeds_are_committed_and_accepted() {
    replay::check_seeds("endpoint_metadata", &fuzzing::metadata_seeds(), fuzzing::metadata);
}

#[test]
fn endpoint_metadata_proptest_fuzz_through_fabric() {
    replay::fuzz("endpoint_metadata", &fuzzing::metadata_seeds(), fuzzing::metadata);
}

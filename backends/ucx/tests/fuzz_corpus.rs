//! The ucx backend's fuzz targets on stable Rust (`ucx_wire` and its part of `endpoint_metadata`):
//! replay of the committed corpus, the seeds, and a bounded proptest fuzz. See `fuzz/README.md`.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use kvxfer_ucx::fuzzing;

#[test]
fn ucx_wire_corpus_replays() {
    replay::replay("ucx_wire", fuzzing::message);
}

#[test]
fn ucx_wire_seeds_are_committed_and_accepted() {
    replay::check_seeds("ucx_wire", &fuzzing::message_seeds(), fuzzing::message);
}

#[test]
fn ucx_wire_proptest_fuzz() {
    replay::fuzz("ucx_wire", &fuzzing::message_seeds(), fuzzing::message);
}

#[test]
fn endpoint_metadata_corpus_replays_through_ucx() {
    replay::replay("endpoint_metadata", fuzzing::metadata);
}

#[test]
fn endpoint_metadata_ucx_seeds_are_committed_and_accepted() {
    replay::check_seeds("endpoint_metadata", &fuzzing::metadata_seeds(), fuzzing::metadata);
}

#[test]
fn endpoint_metadata_proptest_fuzz_through_ucx() {
    replay::fuzz("endpoint_metadata", &fuzzing::metadata_seeds(), fuzzing::metadata);
}

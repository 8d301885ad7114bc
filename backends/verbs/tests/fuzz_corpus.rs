//! The ibverbs backend's fuzz targets on stable Rust (`verbs_wire` and its part of
//! `endpoint_metadata`): replay of the committed corpus, the seeds, and a bounded proptest fuzz.
//! See `fuzz/README.md`.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use kvxfer_verbs::fuzzing;

#[test]
fn verbs_wire_corpus_replays() {
    replay::replay("verbs_wire", fuzzing::wire);
}

#[test]
fn verbs_wire_seeds_are_committed_and_accepted() {
    replay::check_seeds("verbs_wire", &fuzzing::wire_seeds(), fuzzing::wire);
}

#[test]
fn verbs_wire_proptest_fuzz() {
    replay::fuzz("verbs_wire", &fuzzing::wire_seeds(), fuzzing::wire);
}

#[test]
fn endpoint_metadata_corpus_replays_through_verbs() {
    replay::replay("endpoint_metadata", fuzzing::metadata);
}

#[test]
fn endpoint_metadata_verbs_seeds_are_committed_and_accepted() {
    replay::check_seeds("endpoint_metadata", &fuzzing::metadata_seeds(), fuzzing::metadata);
}

#[test]
fn endpoint_metadata_proptest_fuzz_through_verbs() {
    replay::fuzz("endpoint_metadata", &fuzzing::metadata_seeds(), fuzzing::metadata);
}

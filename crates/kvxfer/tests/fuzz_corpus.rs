//! The `bootstrap_request` fuzz target on stable Rust: replay of the committed corpus, the seeds,
//! and a bounded proptest fuzz. See `fuzz/README.md`.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use kvxfer::fuzzing;

#[test]
fn bootstrap_request_corpus_replays() {
    replay::replay("bootstrap_request", fuzzing::request);
}

#[test]
fn bootstrap_request_seeds_are_committed_and_accepted() {
    let seeds: Vec<_> = fuzzing::seeds().into_iter().filter(|(n, _)| n != "response" && n != "challenge").collect();
    replay::check_seeds("bootstrap_request", &seeds, fuzzing::request);
    replay::commit_seeds("bootstrap_request", &fuzzing::seeds());
}

#[test]
fn bootstrap_request_proptest_fuzz() {
    replay::fuzz("bootstrap_request", &fuzzing::seeds(), fuzzing::request);
}

//! The `notification` fuzz target on stable Rust: replays the committed corpus
//! (`fuzz/corpus/notification/`), checks the seeds, and fuzzes with proptest for a bounded number
//! of cases. See `fuzz/README.md`.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use kvxfer_core::fuzzing;

fn notification(data: &[u8]) -> bool {
    fuzzing::notification(data)
}

#[test]
fn notification_corpus_replays() {
    replay::replay("notification", notification);
}

#[test]
fn notification_seeds_are_committed_and_accepted() {
    replay::check_seeds("notification", &fuzzing::notification_seeds(), notification);
}

#[test]
fn notification_proptest_fuzz() {
    replay::fuzz("notification", &fuzzing::notification_seeds(), notification);
}

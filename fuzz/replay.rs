//! Stable-Rust side of the fuzz targets, shared by every crate's `tests/fuzz_corpus.rs` (included
//! with `#[path]`): replays the committed corpus `fuzz/corpus/<target>/` through a target's entry
//! point, checks that its seeds (valid encodings from the real encoders) are accepted, and runs a
//! bounded proptest fuzz of random bytes and of mutated corpus inputs (bit flips, byte edits,
//! truncation, extension, insertion, removal, length-field edits, splices).
//!
//! `KVXFER_FUZZ_CASES` sets the proptest cases per target (default [`DEFAULT_CASES`]);
//! `KVXFER_FUZZ_WRITE_SEEDS=1` (re)writes each target's `seed-*` corpus files from the encoders.

#![allow(dead_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// Proptest cases per target in CI.
pub const DEFAULT_CASES: u32 = 10_000;

/// Largest random input the proptest fuzz generates from scratch.
const MAX_RANDOM: usize = 512;

/// `fuzz/` of this repository, found from the including crate's directory.
pub fn fuzz_dir() -> PathBuf {
    let mut dir = Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf();
    loop {
        let candidate = dir.join("fuzz").join("corpus");
        if candidate.is_dir() {
            return dir.join("fuzz");
        }
        assert!(dir.pop(), "no fuzz/corpus above {}", env!("CARGO_MANIFEST_DIR"));
    }
}

/// The committed corpus of `target`: `(file name, bytes)`, sorted by name.
pub fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = fuzz_dir().join("corpus").join(target);
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry"))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).expect("corpus file")))
        .collect();
    files.sort();
    files
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs `f` on `data`, naming the input when it panics.
fn run_named(target: &str, name: &str, data: &[u8], f: fn(&[u8]) -> bool) -> bool {
    match catch_unwind(AssertUnwindSafe(|| f(data))) {
        Ok(accepted) => accepted,
        Err(_) => panic!("fuzz target {target}: input {name} ({} bytes) panicked: {}", data.len(), hex(data)),
    }
}

/// Replays every committed corpus file of `target`; returns how many there were (at least one).
pub fn replay(target: &str, f: fn(&[u8]) -> bool) -> usize {
    let files = corpus(target);
    assert!(!files.is_empty(), "fuzz/corpus/{target} is empty");
    for (name, data) in &files {
        run_named(target, name, data, f);
    }
    files.len()
}

/// Checks that every seed is accepted by `f` and present in the committed corpus as `seed-<name>`
/// (with `KVXFER_FUZZ_WRITE_SEEDS=1`, writes them there instead).
pub fn check_seeds(target: &str, seeds: &[(String, Vec<u8>)], f: fn(&[u8]) -> bool) {
    assert!(!seeds.is_empty(), "{target}: no seeds");
    for (name, data) in seeds {
        assert!(run_named(target, name, data, f), "{target}: seed {name} is not accepted: {}", hex(data));
    }
    commit_seeds(target, seeds);
}

/// Checks that every seed is in the committed corpus as `seed-<name>` (with
/// `KVXFER_FUZZ_WRITE_SEEDS=1`, writes them there instead).
pub fn commit_seeds(target: &str, seeds: &[(String, Vec<u8>)]) {
    let dir = fuzz_dir().join("corpus").join(target);
    let write = std::env::var_os("KVXFER_FUZZ_WRITE_SEEDS").is_some_and(|v| v == "1");
    for (name, data) in seeds {
        let path = dir.join(format!("seed-{name}"));
        if write {
            std::fs::create_dir_all(&dir).expect("corpus directory");
            std::fs::write(&path, data).expect("writing a seed");
        } else {
            let committed = std::fs::read(&path).unwrap_or_default();
            assert!(
                committed == *data,
                "{target}: {} is missing or differs from what the encoder makes now; rerun with \
                 KVXFER_FUZZ_WRITE_SEEDS=1 and commit the corpus",
                path.display()
            );
        }
    }
}

/// One edit of an input.
#[derive(Debug, Clone)]
enum Mutation {
    /// Flip bit `1` of byte `0`.
    Flip(usize, u8),
    /// Set byte `0` to `1`.
    Set(usize, u8),
    /// Keep the first `0` bytes.
    Truncate(usize),
    /// Append bytes.
    Extend(Vec<u8>),
    /// Insert bytes at `0`.
    Insert(usize, Vec<u8>),
    /// Remove `1` bytes at `0`.
    Remove(usize, usize),
    /// Write `2` little endian in `1` bytes (1, 2, 4 or 8) at `0`: length and count fields.
    Field(usize, usize, u64),
    /// Replace the tail from `0` with the tail of another corpus input from `2` (index `1`).
    Splice(usize, usize, usize),
}

fn interesting() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(0x7f),
        Just(0x80),
        Just(0xff),
        Just(0x100),
        Just(0x7fff),
        Just(0xffff),
        Just(0x1_0000),
        Just(0x10_0000),
        Just(0x7fff_ffff),
        Just(0xffff_ffff),
        Just(0x1_0000_0000),
        Just(i64::MAX as u64),
        Just(u64::MAX),
        0u64..4096,
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        2 => any::<usize>().prop_map(Mutation::Truncate),
        1 => proptest::collection::vec(any::<u8>(), 1..32).prop_map(Mutation::Extend),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::Remove(i, n)),
        4 => (any::<usize>(), prop_oneof![Just(1usize), Just(2), Just(4), Just(8)], interesting())
            .prop_map(|(i, w, v)| Mutation::Field(i, w, v)),
        1 => (any::<usize>(), any::<usize>(), any::<usize>()).prop_map(|(i, s, j)| Mutation::Splice(i, s, j)),
    ]
}

fn apply(mut b: Vec<u8>, muts: &[Mutation], seeds: &[Vec<u8>]) -> Vec<u8> {
    for m in muts {
        let n = b.len();
        match m {
            Mutation::Flip(i, bit) if n > 0 => b[i % n] ^= 1 << bit,
            Mutation::Set(i, v) if n > 0 => b[i % n] = *v,
            Mutation::Truncate(i) => b.truncate(i % (n + 1)),
            Mutation::Extend(x) => b.extend_from_slice(x),
            Mutation::Insert(i, x) => {
                let at = i % (n + 1);
                b.splice(at..at, x.iter().copied());
            }
            Mutation::Remove(i, k) if n > 0 => {
                let at = i % n;
                b.drain(at..(at + k).min(n));
            }
            Mutation::Field(i, w, v) if n >= *w => {
                let at = i % (n - w + 1);
                b[at..at + w].copy_from_slice(&v.to_le_bytes()[..*w]);
            }
            Mutation::Splice(i, s, j) if !seeds.is_empty() => {
                let other = &seeds[s % seeds.len()];
                b.truncate(i % (n + 1));
                b.extend_from_slice(&other[j % (other.len() + 1)..]);
            }
            _ => {}
        }
    }
    b
}

/// Proptest cases per target: `KVXFER_FUZZ_CASES`, else [`DEFAULT_CASES`].
pub fn cases() -> u32 {
    std::env::var("KVXFER_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES)
}

/// The bounded proptest fuzz of `target`: random inputs and mutations of the committed corpus and
/// of `seeds`, [`cases`] of them; `f` must not panic.
pub fn fuzz(target: &str, seeds: &[(String, Vec<u8>)], f: fn(&[u8]) -> bool) {
    let mut base: Vec<Vec<u8>> = corpus(target).into_iter().map(|(_, d)| d).collect();
    base.extend(seeds.iter().map(|(_, d)| d.clone()));
    let input = prop_oneof![
        1 => proptest::collection::vec(any::<u8>(), 0..MAX_RANDOM).prop_map(|b| (usize::MAX, Vec::new(), b)),
        5 => (0..base.len(), proptest::collection::vec(mutation(), 1..6)).prop_map(|(i, m)| (i, m, Vec::new())),
    ];
    let config = Config { cases: cases(), failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&input, |(i, muts, random)| {
        let data = if i == usize::MAX { random } else { apply(base[i].clone(), &muts, &base) };
        match catch_unwind(AssertUnwindSafe(|| f(&data))) {
            Ok(_) => Ok(()),
            Err(_) => Err(TestCaseError::fail(format!("{} bytes: {}", data.len(), hex(&data)))),
        }
    });
    if let Err(e) = result {
        panic!(
            "fuzz target {target} panicked on a generated input; add it to fuzz/corpus/{target}/ (as a \
             crash-* file) with a named regression test, then fix the decoder: {e}"
        );
    }
}

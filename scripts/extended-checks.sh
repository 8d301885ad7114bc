#!/usr/bin/env bash
# Checks that do not fit CI's 50 minutes, run by hand before a release or after a change to what
# they cover (docs/testing.md, "Extended checks"). Needs what .ci/run installs, and root for the
# network namespaces of the link cases. Every step is bounded; the script stops at the first failure.
#
#   bash scripts/extended-checks.sh            # everything (about 70-80 minutes on 2 cores)
#   bash scripts/extended-checks.sh fuzz       # one part: fuzz | presumed-dead | etcd-stopped | rolling-upgrade | otel
#
# Runs: KVXFER_EXT_RUNS (default 10) for the presumed-dead parts.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
runs="${KVXFER_EXT_RUNS:-10}"
start=$(date +%s)
step() { printf '\n=== %s (%ss)\n' "$*" "$(( $(date +%s) - start ))"; }
bounded() { timeout --kill-after=30 "$1" "${@:2}"; }
part="${1:-}"

if [ -z "$part" ] || [ "$part" = fuzz ]; then
  step "fuzz: the proptest fuzz of every network decoder, 1,000,000 inputs per target (cargo test runs 10,000)"
  KVXFER_FUZZ_CASES=1000000 bounded 1800 cargo test -p kvxfer-core -p kvxfer-tcp -p kvxfer -p kvxfer-ucx \
    -p kvxfer-fabric -p kvxfer-verbs --test fuzz_corpus
fi

if [ -z "$part" ] || [ "$part" = presumed-dead ]; then
  step "presumed dead (issue 32), $runs runs of each case on tcp, ucx and fabric: the victim resumes after its peer gave up; the decode's whole pool is checked"
  cases=""
  for b in tcp ucx fabric; do
    for c in presumed_dead_stop_prefill presumed_dead_stop_decode presumed_dead_store_killed presumed_dead_link_healed; do
      cases="$cases${cases:+,}$c:$b"
    done
  done
  KVXFER_CHAOS_RUNS="$runs" KVXFER_CHAOS_CASES="$cases" bounded 5400 \
    cargo test -p kvxfer-cli --features etcd,ucx,fabric --test chaos -- --nocapture
fi

if [ -z "$part" ] || [ "$part" = etcd-stopped ]; then
  step "etcd stopped mid-run, $runs runs on every backend of the build (tcp, ucx, fabric)"
  KVXFER_CHAOS_RUNS="$runs" bounded 3600 \
    cargo test -p kvxfer-cli --features etcd,ucx,fabric --test metadata -- etcd_stopped --nocapture
fi

if [ -z "$part" ] || [ "$part" = rolling-upgrade ]; then
  step "rolling upgrade: the previous release's own binary against this one, both ways (builds it: about 8 minutes)"
  bounded 4000 bash scripts/rolling-upgrade.sh
fi

if [ -z "$part" ] || [ "$part" = otel ]; then
  step "request traces over OTLP (the otel feature): a demo with aborts against a collector stand-in"
  bounded 1800 cargo test -p kvxfer-cli --features otel --test otel
fi

step "done"

#!/usr/bin/env bash
# Rolling upgrade, with the previous release's own binary (docs/operations.md, "Versions and rolling
# upgrades"). Builds `kvxfer` of the previous release (KVXFER_PREV, default 4022094: protocol 2) in
# a git worktree (or takes KVXFER_PREV_BIN, one built already) and this tree's, then runs worker
# processes of both against each other over tcp on loopback, every decode byte verified:
#
#   1. old prefill ranks (TP 2) -> new decode rank, new bootstrap service
#   2. new prefill ranks -> old decode rank
#   3. a mixed prefill side (rank 0 new, rank 1 old) -> new decode rank, 30 % of requests aborted
#   4. new ranks on both sides through the old bootstrap service
#   5. a new decode rank with --digest and old prefill ranks: refused by name (digest needs protocol 3)
#
# Not in CI: building the previous release takes about 8 minutes on 2 cores (the run itself about a
# minute). Every process is bounded by `timeout`; the script stops at the first failure.
#
#   bash scripts/rolling-upgrade.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
prev="${KVXFER_PREV:-4022094}"
work="${KVXFER_UPGRADE_DIR:-$root/target/rolling-upgrade}"
start=$(date +%s)
step() { printf '\n=== %s (%ss)\n' "$*" "$(( $(date +%s) - start ))"; }
mkdir -p "$work/logs"

step "build the previous release ($prev) and this tree"
old="${KVXFER_PREV_BIN:-}"   # a kvxfer binary of the previous release, built already (skips its build)
if [ -z "$old" ]; then
  if [ ! -d "$work/prev" ]; then
    git worktree add --detach "$work/prev" "$prev" >/dev/null
  fi
  git -C "$work/prev" checkout -q --detach "$prev"
  (cd "$work/prev" && CARGO_TARGET_DIR="$work/target-prev" timeout 3000 cargo build -q --release -p kvxfer-cli)
  old="$work/target-prev/release/kvxfer"
fi
timeout 3000 cargo build -q --release -p kvxfer-cli
new="$root/target/release/kvxfer"
"$old" --version
"$new" --version

# A small model shape, the same for every worker.
workload=(--model llama3-8b --layers 4 --tokens 256 --requests 12 --inflight 3 --chunk-pages 4
          --prefill-tp 2 --decode-tp 1 --backend tcp --backend-opt listen=127.0.0.1:0)

pids=()
cleanup() { for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# bootstrap BIN -> sets $addr
bootstrap() {
  local log="$work/logs/bootstrap-$1.log"
  timeout 300 "$2" bootstrap --listen 127.0.0.1:0 --for-s 240 >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do
    addr=$(sed -n 's/^bootstrap listening on //p' "$log" | head -1)
    [ -n "$addr" ] && return 0
    sleep 0.1
  done
  echo "no bootstrap address in $log"; cat "$log"; exit 1
}

# worker NAME BIN ROLE TP [extra flags...] (in the background; its pid in $last)
worker() {
  local name=$1 bin=$2 role=$3 tp=$4
  shift 4
  timeout 180 "$bin" worker --bootstrap "$addr" --role "$role" --tp-rank "$tp" --timeout-s 60 \
    "${workload[@]}" "$@" >"$work/logs/$name.out" 2>"$work/logs/$name.err" &
  last=$!
  pids+=("$last")
}

# summary NAME: the worker's summary line
summary() { grep '"kind":"summary"' "$work/logs/$1.out" | tail -1; }

# A case: prefill binaries P0 P1, decode binary D, bootstrap binary B, decode flags.
run_case() {
  local case=$1 p0=$2 p1=$3 d=$4 b=$5
  shift 5
  bootstrap "$case" "$b"
  worker "$case-decode" "$d" decode 0 "$@"
  local dpid=$last
  worker "$case-prefill0" "$p0" prefill 0 "${prefill_flags[@]}"
  local p0pid=$last
  worker "$case-prefill1" "$p1" prefill 1 "${prefill_flags[@]}"
  local p1pid=$last
  local rc=0
  wait "$dpid" || rc=$?
  wait "$p0pid" || rc=$((rc + 100 * $?))
  wait "$p1pid" || rc=$((rc + 10000 * $?))
  echo "decode:   $(summary "$case-decode")"
  echo "prefill0: $(summary "$case-prefill0")"
  echo "prefill1: $(summary "$case-prefill1")"
  return $rc
}

# The decode summary must show every request handled, and every completed one verified.
check_decode() {
  python3 - "$(summary "$1-decode")" "$2" <<'EOF'
import json, sys
s = json.loads(sys.argv[1])["summary"]
want_aborts = sys.argv[2] == "aborts"
assert s["requests"] == 12, s
assert s["completed"] + s["aborted"] == 12, s
assert s["verified"] == s["completed"] and s["completed"] > 0, s
assert (s["aborted"] > 0) == want_aborts, s
print(f"  ok: {s['completed']} completed and verified, {s['aborted']} aborted")
EOF
}

prefill_flags=()
step "1. old prefill ranks -> new decode rank (new bootstrap)"
run_case 1 "$old" "$old" "$new" "$new"
check_decode 1 none

step "2. new prefill ranks -> old decode rank (new bootstrap)"
run_case 2 "$new" "$new" "$old" "$new"
check_decode 2 none

step "3. prefill rank 0 new, rank 1 old -> new decode rank, 30 % aborted (new bootstrap)"
prefill_flags=(--abort-rate 0.3)
run_case 3 "$new" "$old" "$new" "$new" --abort-rate 0.3
check_decode 3 aborts
prefill_flags=()

step "4. new ranks through the old bootstrap service"
run_case 4 "$new" "$new" "$new" "$old"
check_decode 4 none

step "5. a new decode rank with --digest, old prefill ranks: refused by name"
bootstrap 5 "$new"
worker 5-prefill0 "$old" prefill 0
p0=$last
worker 5-prefill1 "$old" prefill 1
p1=$last
worker 5-decode "$new" decode 0 --digest
if wait "$last"; then
  echo "the digest decode ran with protocol-2 prefill ranks"; exit 1
fi
kill "$p0" "$p1" 2>/dev/null || true
if ! grep -h "speaks kvxfer protocol 2, which has no digest" "$work"/logs/5-decode.*; then
  echo "the decode's refusal does not name the protocol:"; cat "$work"/logs/5-decode.*; exit 1
fi

step "done: the previous release ($prev) and this tree work together one protocol version apart"

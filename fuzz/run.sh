#!/usr/bin/env bash
# Fuzzes every libFuzzer target (or those named) for a bounded time each and prints the executions
# per target. Needs a nightly toolchain (`cargo +nightly`) and cargo-fuzz (`cargo install cargo-fuzz`).
#
#   fuzz/run.sh [seconds-per-target] [target...]
#
# Builds once (release, debug assertions, AddressSanitizer), then runs each target in one process
# on a scratch corpus fuzz/work/<target> seeded from the committed fuzz/corpus/<target> (which it
# never writes). Crashes land in fuzz/artifacts/<target>/; the script exits 1 if any target crashed.
# KVXFER_FUZZ_MERGE=1 afterwards merges the inputs that add coverage into fuzz/corpus/<target>.
# KVXFER_FUZZ_TARGET_DIR sets the build directory (default fuzz/target).
set -euo pipefail
cd "$(dirname "$0")"

secs=${1:-60}
shift || true
case $secs in '' | *[!0-9]*)
  echo "usage: fuzz/run.sh [seconds-per-target] [target...]" >&2
  exit 2
  ;;
esac

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz/run.sh: no nightly toolchain (cargo +nightly); the stable replay and proptest fuzz run with cargo test" >&2
  exit 3
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz/run.sh: cargo-fuzz is not installed (cargo install cargo-fuzz)" >&2
  exit 3
fi

# UCX's memory hooks (libucm, loaded with the UCX backend) crash under AddressSanitizer at start-up;
# the targets never start UCX, so they are turned off.
export UCX_MEM_EVENTS=no UCX_MEM_MMAP_HOOK_MODE=none

target_dir=${KVXFER_FUZZ_TARGET_DIR:-target}
cargo +nightly fuzz build -a --target-dir "$target_dir" >&2
bin_dir=$target_dir/$(rustc +nightly -vV | sed -n 's/^host: //p')/release

if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

# Per-target libFuzzer options: longer inputs for the stream and message-sequence targets, a JSON
# dictionary for the JSON decoders.
extra() {
  case $1 in
    tcp_frame | fabric_wire) echo "-max_len=16384" ;;
    bootstrap_request | endpoint_metadata) echo "-max_len=8192 -dict=dict/json.dict" ;;
    *) echo "-max_len=8192" ;;
  esac
}

crashed=0
summary=()
for t in "${targets[@]}"; do
  mkdir -p "work/$t" "artifacts/$t"
  log="work/$t.log"
  start=$(date +%s)
  set +e
  # shellcheck disable=SC2046
  "$bin_dir/$t" "work/$t" "corpus/$t" $(extra "$t") \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -use_value_profile=1 \
    -print_final_stats=1 -artifact_prefix="artifacts/$t/" >"$log" 2>&1
  rc=$?
  set -e
  took=$(($(date +%s) - start))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1 || true)
  cov=$({ grep -o 'cov: [0-9]*' "$log" || true; } | tail -1 | cut -d' ' -f2)
  if [ "$rc" -ne 0 ]; then
    crashed=1
    echo "== $t: CRASH (exit $rc); see fuzz/$log and fuzz/artifacts/$t/" >&2
    tail -40 "$log" >&2
  fi
  summary+=("$(printf '%-20s %6ss %12s execs %8s/s  cov %6s  corpus %6s  %s' "$t" "$took" "${execs:-?}" \
    "$(((${execs:-0}) / (took > 0 ? took : 1)))" "${cov:-?}" "$(find "work/$t" -type f | wc -l)" \
    "$([ "$rc" -eq 0 ] && echo ok || echo CRASH)")")
  if [ "${KVXFER_FUZZ_MERGE:-0}" = 1 ] && [ "$rc" -eq 0 ]; then
    # shellcheck disable=SC2046
    "$bin_dir/$t" -merge=1 "corpus/$t" "work/$t" $(extra "$t") >"work/$t.merge.log" 2>&1
  fi
done

echo
echo "target               time          executions     rate    coverage      corpus"
printf '%s\n' "${summary[@]}"
exit $crashed

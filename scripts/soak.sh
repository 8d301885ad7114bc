#!/usr/bin/env bash
# Sustained-load soak (issue 31, "Sustained load"; docs/testing.md, "Soak"). Not run by CI.
#
# Builds `kvxfer` (release), copies it into the log directory (so that a rebuild during the run does
# not change what the restarted rank runs), and runs its hidden `kvxfer soak` subcommand, which on
# 127.0.0.1 starts a bootstrap service, one decode worker and --prefill-tp prefill workers (TP 2 -> 1
# by default), all with `kvxfer worker --keep-going --duration-s` and --abort-rate 0.3. Every
# --kill-every it SIGKILLs the last prefill rank (1/0), waits until the decode names it lost, and
# restarts it (same rank, a new epoch); every --sample-every it samples the RSS (/proc/PID/status
# VmRSS) and open fd count (/proc/PID/fd) of the bootstrap, the decode and prefill rank 0/0.
#
#   bash scripts/soak.sh                                  # 30 minutes, a kill every 5 minutes
#   bash scripts/soak.sh --duration 10m --kill-every 2m   # shorter
#   bash scripts/soak.sh --format json > soak.json        # the whole report, every sample included
#
# Flags (all passed to `kvxfer soak`; `target/release/kvxfer soak --help` lists them):
#   --duration 30m        how long requests stream (90s, 30m, 1h)
#   --kill-every 5m       SIGKILL and restart prefill rank 1/0 this often (none in the last 20 s)
#   --sample-every 10s    RSS and fd samples
#   --warmup 2m           growth is measured from the first sample after this
#   --max-growth-pct 5    the flatness bound, for RSS and fds, last and largest sample
#   --prefill-tp 2 --abort-rate 0.3 --tokens 256 --inflight 4 --layers 4 --backend tcp
#   --lease-ttl-s 5 --request-timeout-s 20
#   --logs DIR            workers' logs and report.json, the JSON report (default: $TMPDIR/kvxfer-soak-PID)
#   --format table|json
# Environment: SOAK_NICE (default 10) is the niceness the run gets.
#
# Output: while it runs, one stderr line per sample and per kill. At the end (stdout) a table per
# long-lived process: RSS (MiB) and open fds at the first sample after warm-up, the last, the
# largest, and the growth in percent; the decode's request counts (completed = verified, aborted,
# failed and counted, quarantined, wrong-byte errors); one row per kill: when, the killed epoch,
# how long until the decode's `peer_lost` line named it, the restarted epoch, requests the restarted
# rank sent and the decode completed after its restart; the workers' exit codes; then "every check
# passed" or one FAILED line per failed check. Exit status 0 only if every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
logs=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [ "${args[$i]}" = --logs ] && [ $((i + 1)) -lt ${#args[@]} ]; then logs="${args[$((i + 1))]}"; fi
done
if [ -z "$logs" ]; then
  logs="${TMPDIR:-/tmp}/kvxfer-soak-$$"
  args+=(--logs "$logs")
fi
mkdir -p "$logs"
cargo build --release -p kvxfer-cli >&2
cp target/release/kvxfer "$logs/kvxfer"
exec nice -n "${SOAK_NICE:-10}" "$logs/kvxfer" soak "${args[@]}"

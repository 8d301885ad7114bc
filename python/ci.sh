#!/usr/bin/env bash
# Tier 0 of the Python package, as CI runs it: a venv, the pinned build and test tools, the extension
# built (release, abi3) and installed as a wheel, then the tests (numpy only: spawned rank processes
# over tcp on 127.0.0.1), the demo and the binding-overhead measurement.
#
#   bash python/ci.sh            # from anywhere; PYTHON=python3.12 to pick the interpreter
#
# Needs: cargo, a CPython >= 3.11 with venv (Debian: python3 python3-venv; no python3-dev: an abi3
# extension does not link libpython), and PyPI for the three pinned tools. Reuses python/.venv-ci and
# python/target across runs (warm); a fresh checkout builds everything (cold).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${KVXFER_PY_VENV:-.venv-ci}
start=$(date +%s)
step() { printf '\n=== python: %s (%ss)\n' "$*" "$(($(date +%s) - start))"; }

step "venv ($("$PY" --version 2>&1)) and pinned tools"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check maturin==1.16.0 numpy==2.4.6 pytest==9.2.0

step "rustfmt (the repository's rustfmt.toml) and clippy of the extension crate"
cargo fmt --check
cargo clippy --quiet --all-targets --locked -- -D warnings

step "build the wheel (release, abi3) and install it"
rm -rf dist
"$VENV/bin/maturin" build --release --locked --quiet --out dist
wheel=$(ls dist/kvxfer-*.whl)
printf 'wheel: %s, %s bytes\n' "$wheel" "$(stat -c %s "$wheel")"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"

step "tier 0 (pytest)"
# From outside the source tree, so the installed wheel is what is tested.
(cd tests && "../$VENV/bin/python" -m pytest -q -p no:cacheprovider .)

step "python -m kvxfer.demo"
(cd tests && "../$VENV/bin/python" -m kvxfer.demo)

step "python -m kvxfer.bench (send + poll from Python vs from Rust)"
(cd tests && "../$VENV/bin/python" -m kvxfer.bench)

step "done"

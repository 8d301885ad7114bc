#!/usr/bin/env bash
# Builds here (a CPU machine, with cargo and PyPI) everything scripts/gpu-check.sh needs on a GPU
# machine that has no network and no Rust, into one git-ignored folder, .gpu/ (about 30-50 MiB):
#
#   .gpu/wheel/kvxfer-*.whl      release abi3 wheel (cp311+, x86-64 manylinux) with the cuda-ipc backend
#   .gpu/deps/*.whl              pytest and its dependencies (pure Python), in case the GPU machine lacks it
#   .gpu/bin/cuda-driver         kvxfer-cuda's driver test (contexts, copies, IPC, dma-buf probe)
#   .gpu/bin/conformance-cuda-ipc, conformance-tcp-cuda, conformance-local-cuda
#                                the conformance suite on device pools (KVXFER_TEST_CUDA=real there)
#   .gpu/BUILD                   commit, rustc, date
#
# Then carry .gpu/ with the checkout and run `bash scripts/gpu-check.sh` on the GPU machine.
#   bash scripts/gpu-prepare.sh            # PYTHON=python3.11 to pick the interpreter for maturin
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu
start=$(date +%s)
step() { printf '\n=== gpu-prepare: %s (%ss)\n' "$*" "$(($(date +%s) - start))"; }

# Never committed: in .gitignore, and in this clone's info/exclude for older checkouts.
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
rm -rf "$OUT"
mkdir -p "$OUT/wheel" "$OUT/bin"

step "maturin in python/.venv-gpu"
PY=${PYTHON:-python3}
VENV=python/.venv-gpu
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check maturin==1.16.0

step "release wheel (abi3, features cuda-ipc)"
(cd python && ../"$VENV"/bin/maturin build --release --quiet --features cuda-ipc --out "../$OUT/wheel")
ls -l "$OUT"/wheel

step "pytest and its dependencies as wheels (the GPU machine has no network)"
"$VENV/bin/python" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --dest "$OUT/deps" pytest==9.2.0
ls "$OUT"/deps

step "test binaries (release): driver test and the three conformance suites on device pools"
json=$(mktemp)
cargo test --release --no-run --message-format=json \
  -p kvxfer-cuda --test driver \
  -p kvxfer-cuda-ipc --test conformance \
  -p kvxfer-tcp --test conformance_cuda \
  -p kvxfer-local --test conformance_cuda >"$json"
pick() { # crate-dir target -> executable path
  python3 - "$json" "$1" "$2" <<'PYEOF'
import json, sys
path, crate, target = sys.argv[1:]
for line in open(path):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == target \
            and m["manifest_path"].endswith("/" + crate + "/Cargo.toml"):
        print(m["executable"])
PYEOF
}
copy() { # crate-dir target name
  local exe
  exe=$(pick "$1" "$2" | tail -1)
  [ -n "$exe" ] || { echo "no executable for $1 $2" >&2; exit 1; }
  cp "$exe" "$OUT/bin/$3"
  strip --strip-debug "$OUT/bin/$3" 2>/dev/null || true
}
copy crates/cuda driver cuda-driver
copy backends/cuda-ipc conformance conformance-cuda-ipc
copy backends/tcp conformance_cuda conformance-tcp-cuda
copy backends/local conformance_cuda conformance-local-cuda
rm -f "$json"
ls -l "$OUT"/bin

{
  echo "commit $(git rev-parse HEAD)$(git diff --quiet || echo ' (dirty)')"
  rustc --version
  echo "built $(date -u +%FT%TZ) on $(uname -srm), glibc $(ldd --version | head -1 | awk '{print $NF}')"
} >"$OUT/BUILD"
cat "$OUT/BUILD"
step "done: $(du -sh "$OUT" | cut -f1) in $OUT/ -- carry it with the checkout, then run: bash scripts/gpu-check.sh"

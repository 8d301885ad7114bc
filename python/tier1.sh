#!/usr/bin/env bash
# Tier 1 of the Python package: the SGLang and vLLM adapters inside the real engines' code, at pinned
# versions, on a CPU-only machine (no GPU, no model weights, no download at test time).
#
#   bash python/tier1.sh          # CI runs it after python/ci.sh (which built the wheel in python/target)
#
# - vLLM 0.33.0 (tests/test_tier1_vllm.py, tests/vllm_harness.py): vLLM's real Scheduler built from a
#   VllmConfig whose kv_transfer_config names KvxferConnector by module path, the KV caches from vLLM's
#   allocate_kv_cache on CPU (the layout vLLM resolved, with the connector's preference), and vLLM's
#   worker-side driver ActiveKVConnector with the maybe_transfer_kv_layer wrapper around each layer; one
#   process per TP rank (gloo), outputs combined by KVOutputAggregator into update_from_output.
# - SGLang 0.5.23 (tests/test_tier1_sglang.py, tests/sglang_harness.py): SGLang's plugin loader, the real
#   PrefillBootstrapQueue / DecodePreallocQueue _init_kv_manager over SGLang's MHATokenToKVPool /
#   MLATokenToKVPool on CPU, polls through SGLang's poll_and_all_reduce on real gloo groups, one process
#   per rank.
# - Then the adapter tests and the rest of tier 0 against the same wheel (the engines installed).
#
# Install: both engines with --no-deps plus torch and the modules their code imports (the set below, the
# one this was verified with). PyPI serves only torch's CUDA build for Linux (about 3.5 GB of wheels,
# 6.9 GB installed); pip's cache (PIP_CACHE_DIR) makes a second install fast, and the venv is reused
# while this list is unchanged (a stamp of it is kept in the venv). TORCH_INDEX_URL picks another index
# for torch (e.g. https://download.pytorch.org/whl/cpu where it is reachable).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${KVXFER_TIER1_VENV:-.venv-tier1}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
start=$(date +%s)
step() { printf '\n=== tier 1: %s (%ss)\n' "$*" "$(($(date +%s) - start))"; }

TORCH=(torch==2.15.0 torchvision==0.29.2)
DEPS=(maturin==1.16.0 numpy==2.4.6 pytest==9.2.0 einops==0.8.2
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 packaging==26.4 pillow==13.0.0
  starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4 pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1
  aiohttp==3.14.5 transformers==5.24.0 dill==0.4.1 apache-tvm-ffi==0.1.11 sentencepiece==0.2.3
  compressed-tensors==0.20.1 gguf==0.19.0 cbor2==6.3.0 openai-harmony==0.0.8 openai==3.57.0
  cachetools==8.0.2 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 prometheus_client==0.26.0
  xgrammar==0.2.9 fastapi==0.165.0 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1)
ENGINES=(sglang==0.5.23 vllm==0.33.0)
stamp="${TORCH_INDEX_URL:-pypi} ${TORCH[*]} ${DEPS[*]} ${ENGINES[*]}"

step "venv and engines (${ENGINES[*]}, without their dependencies)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
if [ "$(cat "$VENV/.kvxfer-tier1-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "reused: $VENV has these pins installed"
else
  torch_index=()
  if [ -n "${TORCH_INDEX_URL:-}" ]; then torch_index=(--index-url "$TORCH_INDEX_URL"); fi
  pip install -q "${torch_index[@]}" "${TORCH[@]}"
  pip install -q "${DEPS[@]}"
  pip install -q --no-deps "${ENGINES[@]}"
  printf '%s' "$stamp" > "$VENV/.kvxfer-tier1-stamp"
  du -sh "$VENV" | sed 's/^/installed: /'
fi

step "build (--locked: python/Cargo.lock must match) and install kvxfer"
rm -rf dist-tier1
"$VENV/bin/maturin" build --release --locked --quiet --out dist-tier1
pip install -q --force-reinstall --no-deps dist-tier1/kvxfer-*.whl

step "tier 1: KvxferConnector in vLLM 0.33.0, the kvxfer backend in SGLang 0.5.23"
cd tests
# From outside the source tree, so the installed wheel is what is tested. -x: the first failure stops the
# run (each case spawns engine processes; a broken install would fail them all slowly).
"$VENV/bin/python" -m pytest -q -x --durations=20 -p no:cacheprovider -W ignore::UserWarning -W ignore::DeprecationWarning \
  test_tier1_vllm.py test_tier1_sglang.py

step "the adapter tests and tier 0 against the same wheel (engines installed)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -W ignore::UserWarning \
  test_sglang_adapter.py test_vllm_adapter.py test_tier0.py

step "done"

#!/usr/bin/env bash
# Tier 1 of the Python package: the SGLang and vLLM adapters against the real engines' classes, at
# pinned versions, on a CPU-only machine (no GPU needed; nothing is launched but the adapters and the
# engines' own plugin / connector-factory machinery).
#
#   bash python/tier1.sh
#
# - SGLang 0.5.23 and vLLM 0.33.0 are installed with --no-deps, plus torch and the modules their
#   disaggregation / KV-connector code imports (pinned below: the set this was verified with).
# - PyPI serves only torch's CUDA build for Linux, which pulls NVIDIA's CUDA wheels and triton: 118 wheels,
#   3.48 GB of downloads (torch 539 MB, cuDNN 519 MB, cuBLAS 405 MB, vLLM 336 MB, triton 286 MB, ...), 6.9 GB
#   installed. Measured here 2026-12-01: cold 8 min 40 s (5.5 min of it installing), warm about 1 min.
#   Where the PyTorch CPU index is reachable, TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu saves
#   most of the CUDA part (not tried here: that index is not reachable from this machine).
# - Then runs tests/test_sglang_adapter.py and tests/test_vllm_adapter.py: the adapters subclass the
#   engines' Base classes; SGLang's plugin loader finds kvxfer's entry point, --disaggregation-transfer-backend
#   kvxfer parses and get_kv_class returns kvxfer's classes; vLLM's KVConnectorFactory loads
#   KvxferConnector by module path; both adapters move real bytes between numpy pools, checked against the
#   numpy reference. The rest of tier 0 runs too (same wheel, engines installed).
#
# Not in CI (see README): the downloads alone exceed what a CI run should spend. Reuses python/.venv-tier1.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${KVXFER_TIER1_VENV:-.venv-tier1}
start=$(date +%s)
step() { printf '\n=== tier 1: %s (%ss)\n' "$*" "$(($(date +%s) - start))"; }

step "venv and engines (sglang==0.5.23, vllm==0.33.0 without their dependencies)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
torch_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then torch_index=(--index-url "$TORCH_INDEX_URL"); fi
pip install -q "${torch_index[@]}" torch==2.15.0 torchvision==0.29.2
pip install -q maturin==1.16.0 numpy==2.4.6 pytest==9.2.0 \
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 packaging==26.4 pillow==13.0.0 \
  starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4 pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 \
  aiohttp==3.14.5 transformers==5.24.0 dill==0.4.1 apache-tvm-ffi==0.1.11 sentencepiece==0.2.3 \
  compressed-tensors==0.20.1 gguf==0.19.0 cbor2==6.3.0 openai-harmony==0.0.8 openai==3.57.0 \
  cachetools==8.0.2 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 prometheus_client==0.26.0 \
  xgrammar==0.2.9 fastapi==0.165.0 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1
pip install -q --no-deps sglang==0.5.23 vllm==0.33.0
du -sh "$VENV" | sed 's/^/installed: /'

step "build and install kvxfer"
rm -rf dist-tier1
"$VENV/bin/maturin" build --release --quiet --out dist-tier1
pip install -q --force-reinstall --no-deps dist-tier1/kvxfer-*.whl

step "the adapters against SGLang's and vLLM's classes (then the rest of tier 0)"
cd tests
"../$VENV/bin/python" - <<'EOF'
import kvxfer.sglang as s, kvxfer.vllm as v
assert s.HAVE_SGLANG and v.HAVE_VLLM, "the engines' classes did not import"
print("sglang and vllm classes import; adapters subclass them")
EOF
"../$VENV/bin/python" -m pytest -q -p no:cacheprovider -W ignore::UserWarning test_sglang_adapter.py test_vllm_adapter.py
"../$VENV/bin/python" -m pytest -q -p no:cacheprovider test_tier0.py

step "done"

#!/usr/bin/env bash
# A separate environment for the SGLang HiCache backend tests (tests/sglang_engine): SGLang pins its own torch
# (2.14.1, a CUDA build: its host pools import torchvision, whose CPU-less wheels need that torch) and
# transformers, which the main test environment must not take.
#
#   .ci/sglang_env.sh /tmp/sglangenv && /tmp/sglangenv/bin/python -m pytest tests/sglang_engine -q
#
# SGLang is installed without its resolver's full closure (CUDA kernels, serving stack): only what importing its
# HiCache storage interface, host KV pools and backend factory needs. Then kvblocks, constrained to what is
# already installed so that it cannot move SGLang's pins.
set -euo pipefail
venv="${1:?usage: .ci/sglang_env.sh <venv-dir>}"
repo="$(cd "$(dirname "$0")/.." && pwd)"

python3 -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip --quiet)

"${pip[@]}" install --upgrade pip
"${pip[@]}" install "torch==2.14.1" "torchvision==0.29.1"
constraints="$venv/constraints.txt"
"$py" -m pip list --format=freeze >"$constraints"
"${pip[@]}" install --no-deps "sglang==0.5.23"
"${pip[@]}" install -c "$constraints" "transformers==5.19.*" aiohttp dill apache-tvm-ffi sentencepiece \
  compressed_tensors gguf pybase64 numpy pydantic requests psutil setproctitle orjson pyzmq msgspec uvloop \
  fastapi uvicorn pillow einops tqdm packaging huggingface_hub safetensors xxhash IPython

"$py" -m pip list --format=freeze --exclude-editable >"$constraints"
KVBLOCKS_PURE_PYTHON=1 "${pip[@]}" install -c "$constraints" -e "$repo[redis]" pytest hypothesis pytest-benchmark

"$py" - <<'PY'
import sglang.srt.mem_cache.hicache_storage  # noqa: F401  (fails here, not in the tests, if the environment is broken)
import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401

import kvblocks.integrations.sglang as k

print("sglang environment ready:", k.KVBlocksHiCacheStorage.__module__)
PY

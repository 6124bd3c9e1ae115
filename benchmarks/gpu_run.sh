#!/usr/bin/env bash
# Every GPU check of the engine and its kernels in one device call of at most 8 minutes, installs
# included; everything lands under $OUT (7 files, no folders):
#
#   gpu_run.log            everything below, as it ran (each stage's start, limit, status, time)
#   gpu_tests.log          the GPU tests: full-size kernels, decode CUDA graphs, the Triton engine
#                          path against the PyTorch one, the split-K decode and the chunk routing
#   gpu_engine_8b.json     benchmarks/gpu_engine.py, Qwen3-8B shape: batch 1 against the weight-read
#                          roofline, 64 streams (tok/s, decode tok/s, TTFT p50), a step profile
#   gpu_engine_hybrid.json the Qwen3.5-style hybrid, 1 and 64 streams, against HF generate
#   gpu_kernels.json       benchmarks/gpu_kernels.py: each Triton kernel against its reference,
#                          fla-core and the engine's SDPA path
#   gpu_engine.json        the Qwen3-0.6B shape at 1, 64 and 256 streams, graphs on and off at 1
#   gpu_tp.json            benchmarks/tensor_parallel.py on a small random llama: TP=2 against
#                          TP=1, greedy tokens identical (on one GPU the two ranks use gloo over
#                          CUDA tensors, NCCL refuses two ranks on one device; NCCL on 2+ GPUs)
#
# The stages run in that order, most wanted first, each under its own time limit in seconds
# (tests 140, 8B 110, hybrid 70, kernels 100, 0.6B 50, sized from the H200 runs of 2026-12-04,
# where they took 64, 78, 49, 56 and 48 s; tp 45, not yet run on a GPU; TESTS_S, ENGINE_8B_S,
# ENGINE_HYBRID_S, KERNELS_S, ENGINE_06B_S, TP_S override them), all under TOTAL_S (470): a stage that would start
# with less than 20 s left is skipped, and one cut off still leaves the JSON of what it finished
# (the benchmarks rewrite theirs after each level or case).
#
# For a shorter loan: GPU_RUN_STAGES picks stages and their order (default "tests engine-8b
# engine-hybrid kernels engine-0.6b tp"), KERNELS_ONLY limits the kernel benchmark to some ops
# (gpu_kernels.py --only, e.g. "gated_delta_rule,paged_attention"), and ENGINE_8B_PEER sets
# the 8B stage's HF generate levels ("" for none; default 64). E.g., in at most 285 s (the 8B
# stage's 115 s give its 64-stream level a 60 s budget to start in):
#   GPU_RUN_STAGES="tests engine-8b kernels engine-0.6b engine-hybrid" TOTAL_S=285 TESTS_S=80 \
#   ENGINE_8B_S=115 ENGINE_8B_PEER="" KERNELS_S=45 KERNELS_ONLY=gated_delta_rule \
#   ENGINE_06B_S=45 ENGINE_HYBRID_S=55 bash benchmarks/gpu_run.sh
#
# The GPU image lacks some Python packages: they travel as wheels in .whl/ (Python 3.12,
# manylinux x86-64; their own dependencies are in the image). Once, in the repository root of
# the checkout the device call sends (/.whl/ is in .gitignore):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
#     msgspec==0.23.0 asyncpg==0.32.0 llguidance==1.9.1 gguf==0.19.0 fla-core==0.6.0
# (llguidance 1.9.1 ships manylinux_2_31 only, hence that platform; about 8 MB in all.)
# Then run it with carry [".whl"] and a timeout_s of 560:
#   bash benchmarks/gpu_run.sh
# Exit status: 2 when it cannot start (no GPU, a wheel missing), 1 if any stage failed, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
TOTAL_S=${TOTAL_S:-470}
OUT=${OUT:-benchmarks/results/gpu_run}
export OUT PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

cuda=$($PY -c "import torch; print('yes' if torch.cuda.is_available() else 'torch.cuda.is_available() is False')" 2>&1 | tail -n 1)
if [[ $cuda != yes ]]; then
    echo "gpu_run: no CUDA device for $PY ($cuda): nothing run"
    exit 2
fi
# The engine and the tests' conftest import msgspec, asyncpg, llguidance and gguf; only the
# kernel benchmark uses fla-core, which gets its own folder: with it on the path, HF's Qwen3.5
# would run (and autotune) fla's kernels inside the engine stages' time.
ENGINE_WHEELS=(msgspec-0.23.0 asyncpg-0.32.0 llguidance-1.9.1 gguf-0.19.0)
KERNEL_WHEELS=(fla_core-0.6.0)
missing=()
for wheel in "${ENGINE_WHEELS[@]}" "${KERNEL_WHEELS[@]}"; do
    compgen -G ".whl/$wheel-*.whl" >/dev/null || missing+=("$wheel")
done
if ((${#missing[@]})); then
    echo "gpu_run: wheels missing from .whl/: ${missing[*]} (the download command is at the top of $0)"
    exit 2
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_run.log") 2>&1
tee_pid=$!
install() {  # folder, wheel names
    local target=$1
    shift
    local files=()
    for wheel in "$@"; do files+=(.whl/"$wheel"-*.whl); done
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$target" "${files[@]}"
}
install /tmp/site "${ENGINE_WHEELS[@]}" && install /tmp/site-fla "${KERNEL_WHEELS[@]}" || {
    echo "gpu_run: installing the wheels failed"
    exit 2
}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
echo "gpu_run: ready after $((SECONDS - START)) s"
status=0

# stage NAME LIMIT_S COMMAND...: run under min(LIMIT_S, what is left of TOTAL_S).
stage() {
    local name=$1 limit=$2
    shift 2
    local left=$((TOTAL_S - (SECONDS - START)))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        echo "== $name: skipped, ${left} s left of ${TOTAL_S}"
        status=1
        return
    fi
    echo "== $name: up to ${limit} s"
    local began=$SECONDS
    STAGE_LIMIT=$limit timeout -k 5 "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - began)) s"
    ((rc == 0)) || status=1
}

# gpu_engine.py starts no new level past --budget-s: a level's time before the stage's limit
# (half the limit at least, when TOTAL_S has cut the stage short).
engine() {  # RESERVE_S, gpu_engine.py arguments
    local reserve=$1 budget
    shift
    budget=$((STAGE_LIMIT - reserve))
    ((budget < STAGE_LIMIT / 2)) && budget=$((STAGE_LIMIT / 2))
    $PY -m benchmarks.gpu_engine --budget-s "$budget" "$@" >/dev/null
}

# The GPU-only tests (full-size kernels, CUDA graphs, the CUDA sampler), and the ones that run
# the Triton path against the PyTorch one or the split-K decode and chunk routing, compiled here;
# in two runs, the engine's paths first, so a stage cut short has run those.
gpu_tests() {
    set -o pipefail
    local rc=0
    $PY -m pytest -q -p no:cacheprovider --timeout=60 --durations=8 \
        tests/kernels/test_engine_ops.py tests/kernels/test_paged_attention.py \
        tests/engine/test_cuda_graphs.py tests/engine/test_sampler.py tests/kernels/test_gemv.py \
        -k "triton_path or test_decode_splits or long_chunks or split_decode_reads_strided or (test_split_decode and gqa4) or full_size or on_gpu or with_and_without_graphs or cuda_matches" \
        2>&1 | tee "$OUT/gpu_tests.log" || rc=1
    $PY -m pytest -q -p no:cacheprovider --timeout=60 --durations=5 -k full_size \
        tests/kernels/test_{causal_conv1d,gated_delta_rule,gdn_gating,kv_store,moe,rmsnorm,rotary,rotary_kv_store,silu_and_mul}.py \
        2>&1 | tee -a "$OUT/gpu_tests.log" || rc=1
    return $rc
}

kernels() {
    PYTHONPATH="$PYTHONPATH:/tmp/site-fla" $PY -m benchmarks.gpu_kernels --runs 3 --iters 10 \
        --only "${KERNELS_ONLY:-}" --out "$OUT/gpu_kernels.json" >/dev/null
}

export -f engine gpu_tests kernels
export PY KERNELS_ONLY ENGINE_8B_PEER=${ENGINE_8B_PEER-64}

run_stage() {  # NAME
    case $1 in
    tests) stage tests "${TESTS_S:-140}" bash -c gpu_tests ;;
    engine-8b) stage engine-8b "${ENGINE_8B_S:-110}" bash -c 'engine 55 --models qwen3-8b \
        --concurrency 1,64 --runs 2 --new 256 --peer-concurrency "$ENGINE_8B_PEER" \
        --graphs-off "" --profile 1,64 --out "$OUT/gpu_engine_8b.json"' ;;
    engine-hybrid) stage engine-hybrid "${ENGINE_HYBRID_S:-70}" bash -c 'engine 40 \
        --models qwen3.5-hybrid --concurrency 1,64 --runs 1 --new 128 --peer-concurrency 64 \
        --graphs-off "" --profile 1,64 --out "$OUT/gpu_engine_hybrid.json"' ;;
    kernels) stage kernels "${KERNELS_S:-100}" bash -c kernels ;;
    engine-0.6b) stage engine-0.6b "${ENGINE_06B_S:-50}" bash -c 'engine 25 --models qwen3-0.6b \
        --concurrency 1,64,256 --runs 2 --new 256 --peer-concurrency "" --graphs-off 1 \
        --profile 1,64 --out "$OUT/gpu_engine.json"' ;;
    tp) stage tp "${TP_S:-45}" bash -c '$PY -m benchmarks.tensor_parallel --random --device cuda \
        --tensor-parallel 2 --tokens 16 --out "$OUT/gpu_tp.json" >/dev/null' ;;
    *) echo "== $1: no such stage"; status=1 ;;
    esac
}
for name in ${GPU_RUN_STAGES:-tests engine-8b engine-hybrid kernels engine-0.6b tp}; do
    run_stage "$name"
done
echo "gpu_run: done after $((SECONDS - START)) s, exit $status"
exec >&- 2>&-
wait "$tee_pid"  # the log complete before the files are collected
exit $status

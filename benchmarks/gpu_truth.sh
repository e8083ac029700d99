#!/usr/bin/env bash
# Every CUDA check and GPU benchmark in one command, for a CUDA machine that may be a bare image
# (python3 with torch, triton, transformers, pytest; any other wheels, e.g. polars, go in .whl/
# and are installed into /tmp/site). Every stage has its own time limit and writes its log
# under $OUT (default out/gpu).
#
#   bash benchmarks/gpu_truth.sh check   # CUDA tests, an engine smoke run, compute-sanitizer
#                                        # memcheck + racecheck, the quick kernel benchmark
#   bash benchmarks/gpu_truth.sh bench   # the full kernel benchmark, the 8B-shaped engine runs
#
# Environment: TESTS_LIMIT, AUTOTUNE_TEST_LIMIT (0 skips that stage), KERNELS=full (check runs
# the full kernel table instead of the quick one), KERNELS_LIMIT (0 skips the kernel table in
# bench), ENGINE_LIMIT (0 skips the engine), ENGINE_SCALE, ENGINE_GRAPHS
# (engine.cuda_graph_max_tokens values, default 512,0: graphs against eager), ENGINE_WORKLOADS
# (case1,micro-2000-200-s16), ENGINE_POLICIES (batchllm,baseline), GRAPH_TESTS_LIMIT,
# SMOKE_LIMIT, SMOKE_LAYERS (2), SMOKE_SCALE (0.05), SMOKE_TOKENS (16), SMOKE_POLICIES
# (batchllm,baseline), OP_TABLE (0; N > 0 prints the smoke run's top N host ops and kernels of
# its profiled window).
#
# A 15-minute device lease (the machine's start takes 1-2 of them), two calls, the second
# while the first's machine is still warm (30 s). On an H200 the check below ran in 316 s, the
# kernel table alone (bench, ENGINE_LIMIT=0) in ~120 s, and the 8B engine eager on both
# workloads and policies at scale 0.1 (bench, KERNELS_LIMIT=0 ENGINE_GRAPHS=0) in 182 s, 68 of
# them loading the checkpoint; graphs and eager double the engine's runs, so split them:
#   GRAPH_TESTS_LIMIT=80 SMOKE_LAYERS=8 SMOKE_SCALE=0.1 SMOKE_TOKENS=64 \
#     SMOKE_POLICIES=batchllm SMOKE_LIMIT=150 TESTS_LIMIT=60 AUTOTUNE_TEST_LIMIT=0 \
#     bash benchmarks/gpu_truth.sh check
#   KERNELS_LIMIT=0 ENGINE_SCALE=0.1 ENGINE_POLICIES=batchllm ENGINE_LIMIT=300 \
#     bash benchmarks/gpu_truth.sh bench
# polars is not on the device image: `pip download` its wheels into .whl/ and carry .whl.
set -u
MODE=${1:-check}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# stage NAME LIMIT_S CMD...: run with a limit, log to $OUT/NAME.log, print its tail
source "$(dirname "$0")/lib/stage.sh"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    lscpu | grep -E 'Model name|^CPU\(s\)'
} >"$OUT/env.log" 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$OUT/env.log" 2>&1 || exit 1
    export PYTHONPATH=/tmp/site
fi
# kernels/ is batchjob.kernels through a package-dir remap (pip install); a link does the same
[ -e batchjob/kernels ] || ln -s ../kernels batchjob/kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import sys, torch, triton, transformers, polars; print(sys.version.split()[0], \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, \
'transformers', transformers.__version__)" >>"$OUT/env.log" 2>&1
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
echo "compute-sanitizer: ${SAN:-not found}" >>"$OUT/env.log"
cat "$OUT/env.log"

if [ "$MODE" = check ]; then
    # the first autotune config only (compiled once per shape, not 5-8 times); one test
    # below keeps autotuning (with autotuning everywhere, 140 s on an H100 ran 84 of 112 tests).
    export BATCHJOB_TRITON_AUTOTUNE=0
    # the CUDA-graph forward first: its tests, then graphs against eager on SMOKE_LAYERS layers
    TAIL=25 stage graph_tests "${GRAPH_TESTS_LIMIT:-90}" python3 -m pytest -v -p no:cacheprovider \
        -n 4 -m cuda tests/backends/native/test_cuda_graphs.py
    TAIL=16 stage engine_smoke "${SMOKE_LIMIT:-90}" python3 benchmarks/bench_gpu_engine.py \
        --model-dir "/tmp/l3-${SMOKE_LAYERS:-2}" --layers "${SMOKE_LAYERS:-2}" \
        --workloads micro-2000-200-s16 --scale "${SMOKE_SCALE:-0.05}" --max-tokens "${SMOKE_TOKENS:-16}" \
        --profile-iters 10 --cuda-graphs 512,0 --policies "${SMOKE_POLICIES:-batchllm,baseline}" \
        --op-table "${OP_TABLE:-0}"
    TAIL=25 stage tests "${TESTS_LIMIT:-140}" python3 -m pytest -v -p no:cacheprovider -n 8 \
        tests/kernels/test_kernels.py tests/backends/native/test_engine_hf_parity.py \
        -k "not test_greedy_matches_hf and not test_same_seed"
    if [ "${AUTOTUNE_TEST_LIMIT:-90}" != 0 ]; then
        BATCHJOB_TRITON_AUTOTUNE=1 stage tests "${AUTOTUNE_TEST_LIMIT:-90}" python3 -m pytest \
            -q -p no:cacheprovider -n 4 tests/kernels/test_kernels.py -k test_cuda_large_mixture
    fi
    stage sanitizer 25 python3 benchmarks/sanitize_kernels.py  # warm Triton's cache first
    if [ -n "$SAN" ]; then
        for tool in memcheck racecheck; do
            stage sanitizer 45 "$SAN" --tool "$tool" --error-exitcode 9 --print-limit 20 \
                python3 benchmarks/sanitize_kernels.py
        done
    fi
    unset BATCHJOB_TRITON_AUTOTUNE
    if [ "${KERNELS:-quick}" = full ]; then
        TAIL=40 stage kernels "${KERNELS_LIMIT:-170}" python3 benchmarks/bench_kernels.py \
            --rep 20 --out "$OUT/kernels.md"
    else
        stage kernels_quick 45 python3 benchmarks/bench_kernels.py --quick --rep 20
    fi
else
    SHM=/tmp
    [ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -gt 40 ] 2>/dev/null && SHM=/dev/shm
    df -h /dev/shm /tmp >>"$OUT/env.log" 2>&1
    if [ "${KERNELS_LIMIT:-170}" != 0 ]; then
        TAIL=40 stage kernels "${KERNELS_LIMIT:-170}" python3 benchmarks/bench_kernels.py \
            --rep 20 --out "$OUT/kernels.md"
    fi
    if [ "${ENGINE_LIMIT:-260}" != 0 ]; then
        TAIL=20 stage engine "${ENGINE_LIMIT:-260}" python3 benchmarks/bench_gpu_engine.py \
            --model-dir "$SHM/llama3-8b-random" \
            --workloads "${ENGINE_WORKLOADS:-case1,micro-2000-200-s16}" \
            --policies "${ENGINE_POLICIES:-batchllm,baseline}" \
            --scale "${ENGINE_SCALE:-0.2}" --max-tokens 64 --profile-iters 10 \
            --cuda-graphs "${ENGINE_GRAPHS:-512,0}" \
            --out "$OUT/engine.jsonl"
    fi
fi

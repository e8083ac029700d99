#!/usr/bin/env bash
# The CPU checks and real-shape peer cells a session runs first on a CPU class it seldom gets
# (an AMX Xeon above all), as stages with a time limit each; logs and tables under $OUT
# (default out/cpu). Needs `make install` (.venv with vLLM).
#
#   bash benchmarks/cpu_truth.sh check   # this CPU's kernel builds against their references,
#                                        # the vLLM backend's kernel inside vLLM, one layer's
#                                        # attention beside vLLM's at SmolLM2's and Qwen2.5-0.5B's
#                                        # heads (attention.log), the native engine's linear
#                                        # layers beside vLLM's at Qwen2.5-0.5B's shapes
#                                        # (linear.log); ~3 min on a Zen 4
#   bash benchmarks/cpu_truth.sh bench   # the real-shape cells, interleaved after a warm-up
#
# bench runs CELLS (comma list, default: every cell below), each a bench_peers.py table in
# bfloat16 (float32 where the CPU has no bf16) over WORKLOADS (natural-qa,micro-2000-200-s16,
# long-doc), REPEATS (3) interleaved repeats, both cores bound for vLLM, at nice -20:
#   native    the native engine against vLLM sorted, SHAPES (smollm2-135m,qwen2.5-0.5b)
#   backend   the vllm backend against vLLM sorted, SHAPES
#   backend0  the same with BATCHJOB_VLLM_PREFIX_ATTENTION=0 (vLLM's attention in every layer)
# Each cell at one shape takes 25-40 min on 2 vCPUs in bf16 (every vLLM run pays its 100-160 s
# start-up), about 60 min in float32 on an AVX2-only Zen 3: CELL_LIMIT (5400 s) bounds each.
# Record the tables in docs/benchmarks.md and the README with the CPU's model and flags
# (env.log), the data under benchmarks/results/.
set -u
MODE=${1:-check}
OUT=${OUT:-out/cpu}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}

# stage NAME LIMIT_S CMD...: run with a limit, log to $OUT/NAME.log, print its tail
source "$(dirname "$0")/lib/stage.sh"

{
    date -u
    lscpu | grep -E 'Model name|^CPU\(s\)|CPU family|^Model:'
    "$PY" -c "from batchjob.model.host_cpu import cpu_summary; print('cpu', cpu_summary())"
    "$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
    "$PY" -c "from batchjob.kernels.cpu.build import load_kernel as k; n = k(); print('kernel build', n and n.isa)"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

# what model.dtype = "auto" runs here (batchjob.model.host_cpu)
DTYPE=$("$PY" -c "from batchjob.model.host_cpu import host_cpu as h; print('bfloat16' if h().has_fast_bf16 else 'float32')")
if [ "$MODE" = check ]; then
    TAIL=6 stage kernel_tests "${TESTS_LIMIT:-900}" "$PY" -m pytest -q -p no:cacheprovider \
        tests/backends/native/test_attention_cpu_isa.py tests/backends/vllm/test_vllm_prefix_attention.py
    # one layer's attention: the backend's kernel beside vLLM's (AMX where the CPU has it)
    TAIL=16 stage attention 900 "$PY" benchmarks/bench_vllm_attention.py --dtype "$DTYPE" \
        --heads 9/3x64,14/2x64 --layers 8
    # oneDNN packed as the engine packs it, packed for the call's rows, vLLM's onednn_mm
    TAIL=16 stage linear 600 "$PY" benchmarks/bench_cpu_linear.py --dtype "$DTYPE" --peers \
        --rows 16,102,512,2048 --repeats 10 --shapes 896:1152,896:896,896:9728,4864:896
    exit 0
fi
for cell in $(echo "${CELLS:-native,backend,backend0}" | tr ',' ' '); do
    case $cell in
    native) systems=batchjob,vllm-sorted envs=() ;;
    backend) systems=batchjob-vllm,vllm-sorted envs=() ;;
    backend0) systems=batchjob-vllm,vllm-sorted envs=(BATCHJOB_VLLM_PREFIX_ATTENTION=0) ;;
    *) echo "unknown cell $cell" && continue ;;
    esac
    for shape in $(echo "${SHAPES:-smollm2-135m,qwen2.5-0.5b}" | tr ',' ' '); do
        TAIL=12 stage "${cell}_${shape}" "${CELL_LIMIT:-5400}" env "${envs[@]}" nice -n -20 \
            "$PY" benchmarks/bench_peers.py --model-shapes "$shape" --dtype "$DTYPE" \
            --workloads "${WORKLOADS:-natural-qa,micro-2000-200-s16,long-doc}" \
            --systems "$systems" --with-vllm --repeats "${REPEATS:-3}" --interleave \
            --out "$OUT/${cell}_${shape}_${DTYPE}"
    done
done

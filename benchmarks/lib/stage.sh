# Sourced by benchmarks/gpu_truth.sh and cpu_truth.sh (they set $OUT first).
stage() {  # stage NAME LIMIT_S CMD...: run with a limit, log to $OUT/NAME.log, print its tail
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name (limit ${limit} s) $(date -u +%T)"
    timeout "$limit" "$@" >>"$OUT/$name.log" 2>&1
    rc=$?
    echo "=== $name rc=$rc in $((SECONDS - start)) s"
    tail -n "${TAIL:-12}" "$OUT/$name.log" | cut -c1-400
}

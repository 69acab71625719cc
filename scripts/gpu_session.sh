#!/usr/bin/env bash
# The GPU checks of issues 3, 5 and 6 in few device calls; logs under ${OUT:-sample/gpu}.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/gpu_session.sh STEP...      (steps run in order; each writes OUT/<step>.log)

  kernel  sweep the split-KV decode attention configs against SDPA (scripts/bench_decode_attention.py)
  equiv   fast vs reference at GPT-XL shapes, bf16 and fp32, both backends (scripts/gpu_equivalence.py)
  bench   bench.py --random-weights for each of BENCH_RUNS (backend:compile-scope; default inductor:step
          inductor:block cudagraph:step), the reference timed in the first (REF_STEPS, default 100)
  cli     the single-image CLI on random GPT-XL t2i for each of CLI_RUNS (same form), cold then warm
          compile cache, then GPT-L c2i (skipped if CLI_SKIP_C2I is set)
  eval2   fast_eval.py under torchrun on 2 GPUs over a 64-image synthetic 512 px split (GPT-XL)

OUT (default sample/gpu) receives the logs; PYTHON picks the interpreter.
USAGE
}

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then usage; exit $(( $# < 1 ? 2 : 0 )); fi
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out=${OUT:-$root/sample/gpu}
py=${PYTHON:-python}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step_kernel() {
    "$py" "$here/bench_decode_attention.py" --rows 2,16,64 --positions 700
    "$py" "$here/bench_decode_attention.py" --rows 64 --positions 200,1100
}

step_equiv() {
    "$py" "$here/gpu_equivalence.py" --tokens 64 --precisions bf16,fp32 --backends inductor:step,inductor:block,cudagraph
}

step_bench() {
    # BENCH_RUNS: backend:compile-scope pairs; the first one also times the reference.
    local ref=${REF_STEPS:-100} run
    for run in ${BENCH_RUNS:-inductor:step inductor:block cudagraph:step}; do
        "$py" "$root/fast_inference/bench.py" --random-weights --backend "${run%%:*}" --compile-scope "${run##*:}" \
            --ref-steps "$ref" --out-dir "$out" --tag "_${run##*:}"
        ref=0
    done
}

step_cli() {
    # CLI_RUNS: backend:compile-scope pairs, each run with a cold then a warm compile cache.
    local data=$out/synthetic_cli cache run backend scope
    "$py" "$here/make_synthetic_set.py" "$data" --num 1 --size 512 >/dev/null
    for run in ${CLI_RUNS:-inductor:step inductor:block cudagraph:step}; do
        backend=${run%%:*} scope=${run##*:} cache=$(mktemp -d)
        for state in cold warm; do
            echo "== t2i GPT-XL --backend $backend --compile-scope $scope ($state compile cache)"
            time env TORCHINDUCTOR_CACHE_DIR="$cache" "$py" "$root/fast_inference/fast_engine.py" \
                --gpt-model GPT-XL --backend "$backend" --compile-scope "$scope" \
                --condition-type seg --condition-path "$data/control/0.png" \
                --caption-emb "$data/caption_emb/0.npz" --out "$out/cli_t2i_${backend}_$scope.png"
        done
    done
    [[ -n ${CLI_SKIP_C2I:-} ]] && return
    echo "== c2i GPT-L with CFG"
    "$py" "$root/fast_inference/fast_engine.py" --gpt-model GPT-L --gpt-type c2i --image-size 256 --class-label 3 \
        --condition-type canny --condition-path "$root/condition/example/canny.png" --condition-is-map \
        --image-H 256 --image-W 256 --out "$out/cli_c2i.png"
}

step_eval2() {
    local data=$out/synthetic_eval
    "$py" "$here/make_synthetic_set.py" "$data" --num 64 --size 512 >/dev/null
    PYTHON=$py "$here/eval_multigpu.sh" 2 --gpt-model GPT-XL --condition-type seg --data-path "$data" \
        --sample-dir "$out/eval2" --batch 16
    nvidia-smi --query-gpu=index,name,memory.used --format=csv
}

for step in "$@"; do
    case $step in
        kernel | equiv | bench | cli | eval2) "step_$step" 2>&1 | tee "$out/$step.log" ;;
        *) echo "error: unknown step '$step'" >&2; usage >&2; exit 2 ;;
    esac
done

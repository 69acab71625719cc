#!/usr/bin/env bash
# The GPU checks of issues 3, 5 and 6 in few device calls; logs under ${OUT:-sample/gpu}.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/gpu_session.sh STEP...      (steps run in order; each writes OUT/<step>.log)

  kernel  sweep the split-KV decode attention configs against SDPA (scripts/bench_decode_attention.py)
  equiv   fast vs reference at GPT-XL shapes, bf16 and fp32, both backends (scripts/gpu_equivalence.py)
  bench   bench.py --random-weights, inductor then cudagraph (n = 1, 8, 32)
  cli     the single-image CLI on random GPT-XL t2i (both backends) and GPT-L c2i, cold then warm cache
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
    "$py" "$here/gpu_equivalence.py" --tokens 64 --precisions bf16,fp32 --backends inductor,cudagraph
}

step_bench() {
    "$py" "$root/fast_inference/bench.py" --random-weights --backend inductor --ref-steps 100 --out-dir "$out"
    "$py" "$root/fast_inference/bench.py" --random-weights --backend cudagraph --ref-steps 0 --out-dir "$out"
}

step_cli() {
    local data=$out/synthetic_cli cache
    "$py" "$here/make_synthetic_set.py" "$data" --num 1 --size 512 >/dev/null
    cache=$(mktemp -d)
    for backend in inductor cudagraph; do
        for run in cold warm; do
            echo "== t2i GPT-XL --backend $backend ($run compile cache)"
            time env TORCHINDUCTOR_CACHE_DIR="$cache" "$py" "$root/fast_inference/fast_engine.py" \
                --gpt-model GPT-XL --backend "$backend" --condition-type seg --condition-path "$data/control/0.png" \
                --caption-emb "$data/caption_emb/0.npz" --out "$out/cli_t2i_$backend.png"
        done
    done
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

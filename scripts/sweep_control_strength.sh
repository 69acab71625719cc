#!/usr/bin/env bash
# Control adherence against --control-strength: one fast_eval.py run (with --metrics) per value.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/sweep_control_strength.sh OUT_DIR STRENGTHS [fast_eval.py arguments...]

  scripts/sweep_control_strength.sh sample/sweep_strength 0.5,0.75,1,1.25 \
      --gpt-ckpt checkpoints/edge_base.safetensors --adapter-size base \
      --vq-ckpt checkpoints/vq_ds16_t2i.pt --condition-type canny --data-path data/multigen_val

Writes OUT_DIR/strength_<value>/ for each value, with metrics.json. As in the official code,
control strength only acts when --cfg-scale > 1.
GPUS=N runs each through scripts/eval_multigpu.sh N; PYTHON picks the interpreter.
USAGE
}

if [[ $# -lt 2 || $1 == -h || $1 == --help ]]; then usage; exit $(( $# < 2 ? 2 : 0 )); fi
here=$(cd "$(dirname "$0")" && pwd)
exec "$here/sweep.sh" --control-strength strength "$1" "$2" "${@:3}" --metrics

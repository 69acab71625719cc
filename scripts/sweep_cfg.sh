#!/usr/bin/env bash
# Quality against the guidance scale: one fast_eval.py run (with --metrics) per --cfg-scale.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/sweep_cfg.sh OUT_DIR SCALES [fast_eval.py arguments...]

  scripts/sweep_cfg.sh sample/sweep_cfg 1.5,2,3,4,5 --gpt-ckpt checkpoints/edge_base.safetensors \
      --adapter-size base --vq-ckpt checkpoints/vq_ds16_t2i.pt --condition-type hed \
      --condition-ckpt checkpoints/ControlNetHED.pth --data-path data/multigen_val

Writes OUT_DIR/cfg_<scale>/ for each scale, with metrics.json (the control measure and FID).
GPUS=N runs each through scripts/eval_multigpu.sh N; PYTHON picks the interpreter.
USAGE
}

if [[ $# -lt 2 || $1 == -h || $1 == --help ]]; then usage; exit $(( $# < 2 ? 2 : 0 )); fi
here=$(cd "$(dirname "$0")" && pwd)
exec "$here/sweep.sh" --cfg-scale cfg "$1" "$2" "${@:3}" --metrics

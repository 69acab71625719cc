#!/usr/bin/env bash
# Throughput against --batch: one fast_eval.py run per batch size, each in its own sample dir.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/sweep_batch.sh OUT_DIR SIZES [fast_eval.py arguments...]

  scripts/sweep_batch.sh sample/sweep_batch 8,16,32,64 --gpt-ckpt checkpoints/edge_base.safetensors \
      --adapter-size base --vq-ckpt checkpoints/vq_ds16_t2i.pt --condition-type canny \
      --data-path data/multigen_val --end 256

Writes OUT_DIR/batch_<size>/ for each size (images, logs/*.jsonl with images/s per batch).
The seed depends on the batch size, so each size makes different (equally valid) samples.
GPUS=N runs each through scripts/eval_multigpu.sh N; PYTHON picks the interpreter.
USAGE
}

if [[ $# -lt 2 || $1 == -h || $1 == --help ]]; then usage; exit $(( $# < 2 ? 2 : 0 )); fi
here=$(cd "$(dirname "$0")" && pwd)
exec "$here/sweep.sh" --batch batch "$1" "$2" "${@:3}"

#!/usr/bin/env bash
# Reference vs fast engine in one process on one GPU (fast_inference/bench.py): table, JSON, plot.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/bench.sh [bench.py arguments...]

  scripts/bench.sh --random-weights                               # GPT-XL 512px, n = 1, 8, 32
  scripts/bench.sh --gpt-ckpt checkpoints/edge_base.safetensors --adapter-size base --batch-sizes 1,32
  CUDA_VISIBLE_DEVICES=1 scripts/bench.sh --random-weights --backend cudagraph --tag cudagraph

Results go to sample/bench/ (--out-dir). PYTHON picks the interpreter (default: python).
All of bench.py's flags: scripts/bench.sh --help
USAGE
}

if [[ $# -eq 0 ]]; then usage; exit 2; fi
if [[ $1 == -h || $1 == --help ]]; then usage; echo; fi
here=$(cd "$(dirname "$0")" && pwd)
exec "${PYTHON:-python}" "$here/../fast_inference/bench.py" "$@"

#!/usr/bin/env bash
# fast_eval.py on N GPUs through torchrun: rank r takes every N-th batch and GPU r.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/eval_multigpu.sh NUM_GPUS [fast_eval.py arguments...]

  scripts/eval_multigpu.sh 8 --gpt-ckpt checkpoints/edge_base.safetensors --adapter-size base \
      --vq-ckpt checkpoints/vq_ds16_t2i.pt --condition-type canny --data-path data/multigen_val \
      --sample-dir sample/multigen/canny --batch 32 --metrics

Several nodes: set NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT (default 29500) on each node
and run the same command there; the sample dir must be on a shared file system.
PYTHON picks the interpreter (default: python).
USAGE
}

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then usage; exit $(( $# < 1 ? 2 : 0 )); fi
if ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then echo "error: NUM_GPUS must be a positive integer, got '$1'" >&2; usage >&2; exit 2; fi
gpus=$1
shift
here=$(cd "$(dirname "$0")" && pwd)

if [[ ${NNODES:-1} -gt 1 ]]; then
    : "${NODE_RANK:?set NODE_RANK (0..NNODES-1) on each node}" "${MASTER_ADDR:?set MASTER_ADDR to node 0}"
    rendezvous=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}")
else
    rendezvous=(--standalone)
fi
exec "${PYTHON:-python}" -m torch.distributed.run "${rendezvous[@]}" --nproc_per_node "$gpus" \
    "$here/../fast_inference/fast_eval.py" "$@"

#!/usr/bin/env bash
# One fast_eval.py run per value of one flag, each in OUT_DIR/<name>_<value>/ (used by sweep_*.sh).
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/sweep.sh FLAG NAME OUT_DIR VALUES [fast_eval.py arguments...]

  scripts/sweep.sh --temperature temp sample/sweep_temp 0.8,1,1.2 --data-path data/multigen_val ...

Runs fast_eval.py "$@" FLAG <value> --sample-dir OUT_DIR/NAME_<value> for each comma-separated value.
GPUS=N runs each through scripts/eval_multigpu.sh N; PYTHON picks the interpreter.
USAGE
}

if [[ $# -lt 4 || $1 == -h || $1 == --help ]]; then usage; exit $(( $# < 4 ? 2 : 0 )); fi
flag=$1 name=$2 out=$3 values=$4
shift 4
here=$(cd "$(dirname "$0")" && pwd)
if [[ -n ${GPUS:-} ]]; then run=("$here/eval_multigpu.sh" "$GPUS"); else run=("${PYTHON:-python}" "$here/../fast_inference/fast_eval.py"); fi

IFS=, read -ra list <<< "$values"
for v in "${list[@]}"; do
    echo "== $flag $v"
    "${run[@]}" "$@" "$flag" "$v" --sample-dir "$out/${name}_$v"
done

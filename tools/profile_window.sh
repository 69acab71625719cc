#!/usr/bin/env bash
# Nsight Compute's profile of the window attention at a pass's shape, position 700, the default config: ROWS (default 2:
# n = 1 under CFG) of WINDOW queries (default 48, as a draft tree's at n = 1; n = 8's chain: ROWS=16 WINDOW=16).
# -> OUT/window_ncu.txt (its sections), OUT/window_sass.csv (per SASS instruction: executions and stall reasons),
# OUT/window.ncu-rep. Where a pass's 594 us of window attention go (issue 78, PERF_NOTES "Fourteenth session").
set -euo pipefail
out=${OUT:-sample/gpu}
py=${PYTHON:-python}
out=$(mkdir -p "$out" && cd "$out" && pwd)  # absolute: the profile runs from tools/
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
if [[ -z $ncu ]]; then echo "error: no ncu on this machine (Nsight Compute)" >&2; exit 2; fi
# the third launch (after the reference's and the error check's), outside bench_attention's CUDA graph
script='import sys, torch
sys.argv = ["bench_attention", "--window", "'"${WINDOW:-48}"'", "--rows", "'"${ROWS:-2}"'", "--positions", "700",
            "--default-only"]
import bench_attention
bench_attention.time_us = lambda f: (f(), torch.cuda.synchronize(), 1.0)[2]
bench_attention.main()'
(cd "$(dirname "$0")" && "$ncu" --set full --import-source yes -k regex:_window_partial_kernel --launch-skip 2 \
    --launch-count 1 -f -o "$out/window" "$py" -c "$script") > "$out/window_ncu.txt" 2>&1
"$ncu" --import "$out/window.ncu-rep" --page details >> "$out/window_ncu.txt"
"$ncu" --import "$out/window.ncu-rep" --page source --csv --print-source sass > "$out/window_sass.csv"
grep -E "Duration|Registers Per Thread|Achieved Occupancy" "$out/window_ncu.txt"

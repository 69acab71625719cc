#!/usr/bin/env bash
# The GPU checks of issues 3, 5 and 6 in few device calls; logs under ${OUT:-sample/gpu}.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: tools/gpu_session.sh STEP...      (steps run in order; each writes OUT/<step>.log)

  kernel  sweep the split-KV decode attention configs against SDPA (tools/bench_attention.py)
  window  sweep the window attention's tile, warps and splits at a pass's queries (tools/bench_attention.py --window):
          L = 16 and 48 at n = 1 (2 rows), 16 at n = 8 (16 rows), positions 300 and 700 (issues 75, 78: 26% of the
          tree pass at n = 1, "Tenth session")
  equiv   fast vs reference at GPT-XL shapes, bf16 and fp32, both backends (scripts/gpu_equivalence.py)
  bench   bench.py --random-weights for each of BENCH_RUNS (backend:compile-scope; default inductor:step
          inductor:block cudagraph:step), the reference timed in the first (REF_STEPS, default 100)
  cli     the single-image CLI on random GPT-XL t2i for each of CLI_RUNS (same form), cold then warm
          compile cache, then GPT-L c2i (skipped if CLI_SKIP_C2I is set)
  eval2   fast_eval.py under torchrun on 2 GPUs over a 64-image synthetic 512 px split (GPT-XL)
  gputests  the tests that need a GPU (tests/test_*_cuda.py, test_engine.py's CUDA test)
  ab      this checkout against BASE (another checkout's files, e.g. `git archive OLD | tar -x -C base`), each in
          processes of their own, alternating twice: engine_ab.py's decode ms/step and tokens' hash for AB_RUNS
          (backend:batch-sizes; default inductor:1,8,32 cudagraph:1,2); same hash, same tokens
  passab  a kernel change of a speculative pass, this checkout against BASE (e.g. `git archive OLD fast_inference tools
          | tar -x -C .base`, carried): the window attention's CUDA test here, then the kernel at the pass's shapes
          (tools/bench_attention.py --window --default-only, this checkout's script in both: L = 48 at n = 1, 16 at
          n = 8, positions 300 and 700), BASE, here, BASE, here; then tools/pass_ab.py's pass in BASE and here, each
          in a process of its own (the tree 4x3+2x3 at window 48, pathwise, n = 1; PASSAB_N8=1 adds the chain of 16
          at n = 8); PASSAB_PLANS: plan overrides timed here beside the default, e.g. PASSAB_PLANS="pass_prefetch=on"
  abbench bench.py --random-weights in BASE then here: inductor --batch-sizes 1,8,32 and cudagraph 1,2 (REF_STEPS)
  jacobi  speculative Jacobi decoding: its GPU tests, the marginals against the plain engine (tools/jacobi_marginals.py),
          bench.py --speculative jacobi at n = 1, 8, 32 on flat random weights and at target entropies 1.5 and 3
          nats, then windows 8 and 32, the left and above drafts at n = 1 and coupled drafts at n = 1, 8 (3 nats)
  trees   pathwise passes and draft trees (issue 78): the GPU tests, then bench.py at n = 1, 8, 32 and 3 nats for the
          gumbel chain (the default), the pathwise chain and 4x3 trees at windows 16 and 32, and at 1.5 nats the
          chain and the 32-window tree: each pass's ms at its rows beside the plain step's
  demo    the demo model's GPU preset (scripts/train_demo.py --preset gpu) in device calls of DEMO_SECONDS (default
          480) of training each, by DEMO_PHASE: vq (DEMO_VQ_STEPS, default 3000), gpt (a new run of DEMO_GPT_STEPS,
          default 2800, on the VQ in DEMO_VQ), resume (goes on with the run in DEMO_RUN, default /root/demo_run,
          which lasts while the machine is warm); returns OUT/demo/ (the log, the weights cut in 15 MB parts:
          cat gpt.safetensors.part.* > gpt.safetensors) and with DEMO_EVAL=1 scripts/eval_demo.py's measures
          (OUT/demo_eval.json, OUT/demo_model.png; at guidance DEMO_CFG, default 1.5 as the shipped model's: a
          run's folder is not the demo model to eval_demo.py, whose own default is the official 4) and
          tools/demo_binding.py's (OUT/demo_binding.txt).
          DEMO_GPT_FROM (gpt): start from a trained GPT folder (its gpt.safetensors only; a folder of
          train_demo.py --phase caption made here is carried: carry ["checkpoints/demo_caption"]); DEMO_ENTRY_WEIGHT,
          DEMO_COLOUR_WEIGHT, DEMO_HIDE_UNTIL (onset | e1), DEMO_HIDE_DROPPED=1, DEMO_RECOLOUR_SHARE, DEMO_GPT_BATCH,
          DEMO_GPT_LR, DEMO_KIND_WEIGHT, DEMO_BINDING_WEIGHT (gpt): --entry-weight, --colour-weight, --hide-until,
          --hide-dropped, --recolour-share, --gpt-batch, --gpt-lr, --kind-weight, --binding-weight (resume keeps the
          run's own);
          DEMO_TIMING="128 512": tools/train_step_timing.py at those batch sizes first (OUT/train_timing_B.txt).
          The shipped model's last phase (PERF_NOTES, "Eleventh session"): from the model before it, --hide-until e1
          with a decoy sliver in a tenth of the hidden rows (colour3/colour4 had half: their caption branch came to
          distrust a true sliver, and cfg 4 then pushed e1 off the named colour); DEMO_PHASE=resume ... DEMO_EVAL=1
          goes on where a phase stops early:
              DEMO_PHASE=gpt DEMO_VQ=checkpoints/demo_gpu DEMO_GPT_FROM=checkpoints/demo_gpu DEMO_ENTRY_WEIGHT=8 \
                  DEMO_COLOUR_WEIGHT=1 DEMO_HIDE_UNTIL=e1 DEMO_RECOLOUR_SHARE=0.1 DEMO_HIDE_DROPPED=1 \
                  DEMO_GPT_LR=2e-4 DEMO_GPT_STEPS=1600 DEMO_SECONDS=400 DEMO_EVAL=1 tools/gpu_session.sh demo
  ownpos  the window kernels and the fused verify (issue 75), by default 1. and 3., < 9 min of an H100:
              OUT=/some/dir tools/gpu_session.sh ownpos
          1. their CUDA tests (tests/test_window_attention.py, test_own_positions.py, test_verify_triton.py -k cuda;
             at most 200 s);
          2. tools/pass_ab.py: GPT-XL 512 px bf16 at 3 nats, L = 16, left drafts + gumbel coupling, in ONE process:
             the plain step and, after it, the pass with the window kernels off, on (attention + inputs), on with
             the fused block, and on with the fused block and verify=triton, at n = 1 then 8 (OWNPOS_SIZES): plain
             ms/step, pass ms, pass / step, tokens per pass, speculative tok/s and x plain, one table row each as it
             is measured (OUT/pass_ab.json), and the kernels of one replayed pass graph per plan at n = 1 (and of the
             plain step) summed by name, largest first, in OUT/pass_profile_n1.txt (at most 310 s);
          3. "splits": tools/pass_ab.py at n = 1, 8 with the plan's defaults (a split per tile + the merge kernel)
             against window_splits=fold (the window attention's splits folded into one launch), profiles in
             OUT/splits/pass_profile_n1.txt (at most 310 s);
          OWNPOS_PARTS (default "tests splits") picks parts; also "ab" (2. above), "greedy" (tools/window_greedy.py:
          float32 GPT-XL speculative greedy tokens on the window kernels against the plain engine's, OWNPOS_TOKENS,
          default 256),
          "bench" (bench.py --speculative jacobi at 3 nats, one process per plan) and OWNPOS_MARGINALS=1
          (tools/jacobi_marginals.py on the window kernels)
  serve   the server's tests on the GPU, then the server under load at GPT-XL shapes (random weights, 512 px): 32
          clients, 200 requests, images/s and latency p50/p95, against fast_eval.py --batch 32 over the same inputs
          and one image through fast_engine.py against a lone request, in one run (tools/load_serve.py --compare;
          OUT/serve_ahead0.json). The device has no package index: first, here, pip download -d .whl --only-binary=:all:
          --python-version 3.12 -r requirements-serve.txt, and carry .whl in the device call. SERVE_PLAN: the
          server's plan overrides (e.g. server_block=fused: its steps of up to 16 rows on the fused block's kernels);
          SERVE_AHEAD: the servers' --steps-ahead, a load run each (default 8; OUT/serve_ahead<N>.json), e.g. the
          A/B of the GPU's lag behind the engine thread, alternating: SERVE_AHEAD="8 0 8 0" OUT=$OUT tools/gpu_session.sh serve
          (the first server of a fresh machine compiled in its timed phase: PERF_NOTES, "Tenth session");
          SERVE_DECODERS: the servers' --decoders, a load run each inside each SERVE_AHEAD (default 1;
          OUT/serve_ahead<N>_decoders<D>.json past 1), e.g. SERVE_DECODERS="1 2 1 2"

  serverstep  the CUDA tests of the server's keyed draw, steps and captured admissions, then where a server's step goes
          (tools/server_step.py): the continuous batch of n one-image requests
          against the plain engine's step at n (SERVER_SIZES, default 1,8,32), its forward graph alone, the host's
          time, an admission's ms (the first, its graph's capture, replays), and both steps' and one replayed
          admission's kernels by name (OUT/server_step_profile.txt); SERVE_PLAN as the serve step's. Issue 75's owed
          A/B, the L2 prefetcher beside the server's steps (server_prefetch=on) and its w2 at 17-64 rows in the
          down kernel (since 244b13e), one process per plan, profiles in OUT/<plan, '=' as '-'>/:
              SERVER_SIZES=32,8,1 SERVER_PLANS="default server_prefetch=on server_down=off" \
                  OUT=$OUT tools/gpu_session.sh serverstep
          SERVERSTEP_TESTS=0 skips the tests (they took a whole 330 s call once: PERF_NOTES, "Eleventh session").

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
    "$py" "$here/bench_attention.py" --rows 2,16,64 --positions 700
    "$py" "$here/bench_attention.py" --rows 64 --positions 200,1100
}

step_window() {
    "$py" "$here/bench_attention.py" --window 16,48 --rows 2 --positions 300,700
    "$py" "$here/bench_attention.py" --window 16 --rows 16 --positions 700
}

step_equiv() {
    "$py" "$root/scripts/gpu_equivalence.py" --tokens 64 --precisions bf16,fp32 --backends inductor:step,inductor:block,cudagraph
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
    "$py" "$root/scripts/make_synthetic_set.py" "$data" --num 1 --size 512 >/dev/null
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
    "$py" "$root/scripts/make_synthetic_set.py" "$data" --num 64 --size 512 >/dev/null
    PYTHON=$py "$root/scripts/eval_multigpu.sh" 2 --gpt-model GPT-XL --condition-type seg --data-path "$data" \
        --sample-dir "$out/eval2" --batch 16
    nvidia-smi --query-gpu=index,name,memory.used --format=csv
}

step_gputests() {
    (cd "$root" && "$py" -m pytest -q -p no:cacheprovider tests/test_attention_cuda.py tests/test_block_cuda.py \
        tests/test_draw_cuda.py tests/test_inputs_cuda.py tests/test_eager_ops_cuda.py tests/test_engine.py -k "cuda")
}

# a checkout's engine_ab.py: tools/ now, scripts/ before the decode plan
ab_script() {
    if [[ -f $1/tools/engine_ab.py ]]; then
        echo "$1/tools/engine_ab.py"
    else
        echo "$1/scripts/engine_ab.py"
    fi
}

step_ab() {
    : "${BASE:?set BASE to the folder of the other checkout}"
    local run round tree
    for run in ${AB_RUNS:-inductor:1,8,32 cudagraph:1,2}; do
        for round in 1 2; do
            for tree in "$BASE" "$root"; do
                echo "== ${tree} backend ${run%%:*} round $round"
                (cd "$tree" && "$py" "$(ab_script "$tree")" --backend "${run%%:*}" --batch-sizes "${run##*:}" --once -- "")
            done
        done
    done
}

step_passab() {
    : "${BASE:?set BASE to the folder of the other checkout}"
    local tree round plans
    cp "$here/bench_attention.py" "$BASE/tools/"  # the same harness in both trees
    (cd "$root" && "$py" -m pytest -q -p no:cacheprovider tests/test_window_attention.py -k cuda)  # its outputs
    for round in 1 2; do
        for tree in "$BASE" "$root"; do
            echo "== $tree window attention, round $round"
            "$py" "$tree/tools/bench_attention.py" --window 48 --rows 2 --positions 300,700 --default-only
            "$py" "$tree/tools/bench_attention.py" --window 16 --rows 16 --positions 300,700 --default-only
        done
    done
    for tree in "$BASE" "$root"; do
        echo "== $tree pass"
        plans=("")
        [[ $tree == "$root" ]] && plans+=(${PASSAB_PLANS:-})  # this checkout's plan overrides beside its default
        (cd "$tree" && "$py" tools/pass_ab.py --batch-sizes 1 --entropy 3 --draft-coupling pathwise --draft-window 48 \
            --draft-tree 4x3+2x3 --runs 3 --plans "${plans[@]}")
        if [[ ${PASSAB_N8:-0} == 1 ]]; then
            (cd "$tree" && "$py" tools/pass_ab.py --batch-sizes 8 --entropy 3 --runs 3 --plans "${plans[@]}")
        fi
    done
}

step_abbench() {
    : "${BASE:?set BASE to the folder of the other checkout}"
    local tree
    for tree in "$BASE" "$root"; do
        echo "== $tree"
        (cd "$tree" && "$py" fast_inference/bench.py --random-weights --batch-sizes 1,8,32 --ref-steps "${REF_STEPS:-20}" \
            --e2e-runs 3 --out-dir "$out" --tag "_$(basename "$tree")" \
         && "$py" fast_inference/bench.py --random-weights --backend cudagraph --batch-sizes 1,2 --ref-steps 0 \
            --e2e-runs 0 --out-dir "$out" --tag "_$(basename "$tree")_cudagraph")
    done
}

step_jacobi() {
    (cd "$root" && "$py" -m pytest -q -p no:cacheprovider tests/test_speculative.py -k cuda)
    "$py" "$here/jacobi_marginals.py" --images 1024 --tokens 64 --entropy 2.0
    local bench=("$py" "$root/fast_inference/bench.py" --random-weights --speculative jacobi --e2e-runs 0 --out-dir "$out")
    "${bench[@]}" --batch-sizes 1,8,32 --ref-steps "${REF_STEPS:-20}" --tag _jacobi_flat
    local h w init
    for h in 1.5 3; do
        "${bench[@]}" --batch-sizes 1,8,32 --ref-steps 0 --target-entropy "$h" --tag "_jacobi_h$h"
    done
    for w in 8 32; do
        "${bench[@]}" --batch-sizes 1 --ref-steps 0 --target-entropy 3 --draft-window "$w" --tag "_jacobi_w$w"
    done
    for init in left above; do
        "${bench[@]}" --batch-sizes 1 --ref-steps 0 --target-entropy 3 --draft-init "$init" --tag "_jacobi_$init"
    done
    "${bench[@]}" --batch-sizes 1,8 --ref-steps 0 --target-entropy 3 --draft-coupling gumbel --tag _jacobi_gumbel
}

step_trees() {
    (cd "$root" && "$py" -m pytest -q -p no:cacheprovider tests/test_speculative.py -k cuda)
    local bench=("$py" "$root/fast_inference/bench.py" --random-weights --speculative jacobi --e2e-runs 0 --out-dir "$out"
                 --batch-sizes 1,8,32 --ref-steps 0)
    "${bench[@]}" --target-entropy 3 --tag _trees_chain16
    "${bench[@]}" --target-entropy 3 --draft-coupling pathwise --tag _trees_path16
    "${bench[@]}" --target-entropy 3 --draft-coupling pathwise --draft-tree 4x3 --tag _trees_path16_4x3
    "${bench[@]}" --target-entropy 3 --draft-coupling pathwise --draft-window 32 --draft-tree 4x3 --tag _trees_path32_4x3
    # side branches (issue 78): 62 and 63 rows per image
    "${bench[@]}" --target-entropy 3 --draft-coupling pathwise --draft-window 32 --draft-tree 4x3+7x3 \
        --tag _trees_path32_4x3+7x3
    "${bench[@]}" --target-entropy 3 --draft-coupling pathwise --draft-window 48 --draft-tree 4x3+2x3 \
        --tag _trees_path48_4x3+2x3
    "${bench[@]}" --target-entropy 1.5 --tag _trees_chain16_h1.5
    "${bench[@]}" --target-entropy 1.5 --draft-coupling pathwise --draft-window 32 --draft-tree 4x3 \
        --tag _trees_path32_4x3_h1.5
}

step_ownpos() {
    # OWNPOS_PARTS picks the parts (default: tests splits, < 9 min together); a failing check is reported and the
    # timings still run; each part has its own time limit, and pass_ab.py prints its rows as it measures them
    local parts=" ${OWNPOS_PARTS:-tests splits} " on="window_attention=triton,window_inputs=triton"
    if [[ $parts == *" tests "* ]]; then
        (cd "$root" && timeout 200 "$py" -m pytest -q -p no:cacheprovider tests/test_window_attention.py \
            tests/test_own_positions.py tests/test_verify_triton.py -k cuda) \
            || echo "== FAILED (or over 200 s): the window kernels' and the fused verify's CUDA tests"
    fi
    if [[ $parts == *" ab "* ]]; then
        timeout 310 "$py" "$here/pass_ab.py" --batch-sizes "${OWNPOS_SIZES:-1,8}" --entropy 3 --plans "" "$on" \
            "$on,window_block=fused" "$on,window_block=fused,verify=triton" --profile-dir "$out" \
            --json "$out/pass_ab.json" || echo "== FAILED (or over 310 s): tools/pass_ab.py"
    fi
    if [[ $parts == *" splits "* ]]; then  # the window attention's one launch against its split + merge form
        mkdir -p "$out/splits"
        timeout 310 "$py" "$here/pass_ab.py" --batch-sizes "${OWNPOS_SIZES:-1,8}" --entropy 3 --plans "" \
            "window_splits=fold" --profile-dir "$out/splits" --json "$out/splits/pass_ab.json" \
            || echo "== FAILED (or over 310 s): tools/pass_ab.py, window_splits"
    fi
    if [[ $parts == *" greedy "* ]]; then
        "$py" "$here/window_greedy.py" --images 2 --tokens "${OWNPOS_TOKENS:-256}" --plans "$on" \
            "$on,window_block=fused" || echo "== FAILED: greedy tokens on the window kernels differ from the plain's"
    fi
    if [[ $parts == *" bench "* ]]; then
        local bench=("$py" "$root/fast_inference/bench.py" --random-weights --speculative jacobi --target-entropy 3
                     --in-process --batch-sizes "${OWNPOS_SIZES:-1,8}" --ref-steps 0 --e2e-runs 0 --out-dir "$out")
        "${bench[@]}" --tag _ownpos_off
        "${bench[@]}" --plan window_attention=triton --plan window_inputs=triton --tag _ownpos_on
        "${bench[@]}" --plan window_attention=triton --plan window_inputs=triton --plan window_block=fused \
            --tag _ownpos_fused
    fi
    if [[ -n ${OWNPOS_MARGINALS:-} ]]; then
        "$py" "$here/jacobi_marginals.py" --images 512 --tokens 64 --entropy 2.0 --plan window_attention=triton \
            --plan window_inputs=triton
    fi
}

step_serve() {
    # the device has no index: the serving packages come from wheels carried in .whl (see the step's help)
    if ! "$py" -c "import starlette, uvicorn" 2>/dev/null; then
        "$py" -m pip install -q --no-index --find-links "$root/.whl" -r "$root/requirements-serve.txt" || {
            echo "error: no Starlette/uvicorn on the device: fill .whl (see the serve step's help) and carry it" >&2
            return 2; }
    fi
    (cd "$root" && "$py" -m pytest -q -p no:cacheprovider tests/test_continuous.py tests/test_scheduler.py)
    local ahead decoders name compare=--compare
    for ahead in ${SERVE_AHEAD:-8}; do  # a server per --steps-ahead and --decoders; the CLIs timed beside the first only
        for decoders in ${SERVE_DECODERS:-1}; do
            name=serve_ahead$ahead$([[ $decoders == 1 ]] || echo "_decoders$decoders")
            echo "== the server with --steps-ahead $ahead --decoders $decoders"
            "$py" "$here/load_serve.py" --clients 32 --requests 200 --size 512 $compare --eval-batch 32 \
                --server-args "--steps-ahead $ahead --decoders $decoders" --json "$out/$name.json" \
                -- --gpt-model GPT-XL ${SERVE_PLAN:+--plan "$SERVE_PLAN"}
            compare=
        done
    done
}

step_serverstep() {
    # the server's keyed draws and steps on CUDA first, then where its step goes: the continuous batch against the
    # plain step at n = 1, 8, 32, kernels by name
    if [[ ${SERVERSTEP_TESTS:-1} != 0 ]]; then
        (cd "$root" && timeout 360 "$py" -m pytest -q -p no:cacheprovider tests/test_draw_triton.py \
            tests/test_own_positions.py tests/test_continuous.py -k cuda) \
            || echo "== FAILED (or over 360 s): the keyed draw's and the server steps' CUDA tests"
    fi
    local plan dir
    for plan in ${SERVER_PLANS:-${SERVE_PLAN:-default}}; do  # a process per plan: its own captures and compiles
        dir=$out/$(tr '=,' '-_' <<<"$plan")  # a returned folder's name takes no '=' or ','
        mkdir -p "$dir"
        echo "== the server's plan: $plan"
        "$py" "$here/server_step.py" --sizes "${SERVER_SIZES:-1,8,32}" $([[ $plan == default ]] || echo --plan "$plan") \
            --profile-dir "$dir" --json "$dir/server_step.json"
    done
}

step_demo() {
    # The run's state stays in DEMO_RUN, outside OUT: it lasts while the machine is warm, so the next call resumes.
    local run=${DEMO_RUN:-/root/demo_run} phase=${DEMO_PHASE:?set DEMO_PHASE to vq, gpt or resume} f
    local train=("$py" "$root/scripts/train_demo.py" --preset gpu --device cuda --log-every 100 --out "$run"
                 --time-limit "${DEMO_SECONDS:-480}" ${DEMO_ENTRY_WEIGHT:+--entry-weight "$DEMO_ENTRY_WEIGHT"}
                 ${DEMO_COLOUR_WEIGHT:+--colour-weight "$DEMO_COLOUR_WEIGHT"} ${DEMO_GPT_BATCH:+--gpt-batch "$DEMO_GPT_BATCH"}
                 ${DEMO_GPT_LR:+--gpt-lr "$DEMO_GPT_LR"} ${DEMO_HIDE_UNTIL:+--hide-until "$DEMO_HIDE_UNTIL"}
                 ${DEMO_RECOLOUR_SHARE:+--recolour-share "$DEMO_RECOLOUR_SHARE"}
                 ${DEMO_KIND_WEIGHT:+--kind-weight "$DEMO_KIND_WEIGHT"}
                 ${DEMO_BINDING_WEIGHT:+--binding-weight "$DEMO_BINDING_WEIGHT"})
    if [[ ${DEMO_HIDE_DROPPED:-0} == 1 ]]; then train+=(--hide-dropped); fi
    mkdir -p "$run" "$out/demo"
    for b in ${DEMO_TIMING:-}; do  # a training step's parts and kernels at these batch sizes, before training
        "$py" "$here/train_step_timing.py" --device cuda --steps 20 --batch "$b" --entry-weight "${DEMO_ENTRY_WEIGHT:-1}" \
            | tee "$out/train_timing_$b.txt"
    done
    case $phase in
        vq) "${train[@]}" --phase vq --vq-steps "${DEMO_VQ_STEPS:-3000}" ;;
        gpt) "${train[@]}" --phase gpt --gpt-steps "${DEMO_GPT_STEPS:-2800}" --vq-from "${DEMO_VQ:?set DEMO_VQ to a trained VQ folder}" \
                 ${DEMO_GPT_FROM:+--gpt-from "$DEMO_GPT_FROM"} ;;
        resume) "${train[@]}" --phase gpt --resume ;;
        *) echo "error: DEMO_PHASE $phase: use vq, gpt or resume" >&2; return 2 ;;
    esac || return
    cp "$run/train_log.jsonl" "$out/demo/"
    for f in "$run"/*.safetensors; do  # a returned file holds 16 MB at most; the VQ comes back from its own phase only
        if [[ $phase == vq || $f != */vq.safetensors ]]; then split -b 15M "$f" "$out/demo/$(basename "$f").part."; fi
    done
    if [[ $phase == vq ]]; then cp "$run/vq.json" "$out/demo/"; return; fi
    cp "$run/gpt.json" "$out/demo/"
    if [[ ${DEMO_EVAL:-0} == 1 ]]; then
        "$py" "$root/scripts/eval_demo.py" --device cuda --gpt-model "$run/gpt.json" --gpt-ckpt "$run/gpt.safetensors" \
            --vq-model "$run/vq.json" --vq-ckpt "$run/vq.safetensors" --cfg-scale "${DEMO_CFG:-1.5}" \
            --out "$out/demo_eval.json" --figure "$out/demo_model.png"
        "$py" "$here/demo_binding.py" --model "$run" --device cuda --kinds --attention | tee "$out/demo_binding.txt"
    fi
}

for step in "$@"; do
    case $step in
        kernel | window | equiv | bench | cli | eval2 | gputests | ab | passab | abbench | jacobi | trees | ownpos \
            | demo | serve | serverstep)
            "step_$step" 2>&1 | tee "$out/$step.log" ;;
        *) echo "error: unknown step '$step'" >&2; usage >&2; exit 2 ;;
    esac
done

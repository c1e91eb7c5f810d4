#!/usr/bin/env bash
# An H200 call's measurements, by step name: each writes its JSON under $OUT (the device tool's folder
# that comes back: 8 files at most), and every step's output goes to $OUT/steps.log. From the repository
# root on the device machine, with .whl carried (runtime/bench/device_wheels.sh fetches it here):
#
#     OUT=$OUT CTX=8192 bash runtime/bench/h200.sh smi rounds rounds-old profile
#
# Steps: smi, profile, profile-tiles, gaps, idle, gemm-rows, gemm-pad, rounds-tiles, rounds, rounds-vocab, rounds-zlab, rounds-bucket-split, rounds-old, rounds-8b,
# rounds-8b-old, rounds-8b-vocab, cost-lone, cost-lone-old, cost-lone-events, gdn-tree, gdn-tree-old, attn, attn-splits, attn-kernels, attn-waves, attn-draft, fp8, fp8-gemm, fp8-large, fp8-tail,
# fp8-verify-rows, graph-memory, http, http-mixed, http-cost, cuda-tests, interpreter-tests, reship, reship-h100. Round figures are compared
# only within one call (the lent machines' GEMMs differ by ~4%): `rounds-old` and `cost-lone-old` run on another tree, OLD
# (a tarball of its runtime/, carried: `git archive REV runtime | gzip > .dev/old.tgz`). CTX: the 27B's context
# (8192, the issue's).
# A step that fails is reported and the next one runs; the exit status says whether any failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder the results go to}"
CTX=${CTX:-8192}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "the carried wheels did not install"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
here=$PWD
bench() {  # bench TREE SCRIPT ARGS...: a runtime/bench script (or -c CODE) on the runtime of TREE
    local tree=$1 script=$2
    shift 2
    [ "$script" = -c ] || script="$tree/runtime/bench/$script"
    PYTHONPATH="$tree/runtime:$tree/runtime/bench:$here/runtime/devtools:${PYTHONPATH:-}" python3 "$script" "$@"
}
old_tree() {  # OLD unpacked once, in /tmp/old
    [ -n "${OLD:-}" ] || { echo "OLD: a tarball of the tree to compare against (git archive REV runtime)"; return 1; }
    [ -d /tmp/old/runtime ] || { mkdir -p /tmp/old && tar -xzf "$OLD" -C /tmp/old; }
}
rounds() {  # rounds TREE LABEL SHAPE CONTEXT [DRAFT_VOCAB] [BATCH_BENCH_ARGS...]
    local tree=$1 label=$2 shape=$3 context=$4 vocab=${5:-}
    shift $(( $# < 5 ? $# : 5 ))
    bench "$tree" batch_bench.py --shape "$shape" --context "$context" --batches 1,16 --cases ar,ddtree@16 \
        ${vocab:+--draft-vocab $vocab} --label "$label" --out "$OUT/rounds-$label.json" "$@"
}
fp8_large() {  # fp8_large NAME [ROWS]: fp8_gemm_bench.py --large (at ROWS, else its own rows) into $OUT/NAME.json
    bench "$here" fp8_gemm_bench.py --large ${2:+--rows $2} ${FP8_PROJECTIONS:+--projections $FP8_PROJECTIONS} \
        --out "$OUT/$1.json"
}
cost_lone() {  # cost_lone TREE LABEL
    bench "$1" batch_bench.py --shape qwen3.6-27b --context "$CTX" --batches 1 --cases ar,cost --rounds 200 \
        --out "$OUT/cost-lone-$2.json"
}

step() {
    case $1 in
    smi) nvidia-smi > "$OUT/smi.txt" && python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)' ;;
    profile) bench "$here" gpu_profile.py --shape qwen3.6-27b --context "$CTX" --batch 1,16 --out "$OUT/profile.json" ;;
    gaps)  # the same steps' device idle time, and the engine code the host ran in it (host_gaps.py)
        bench "$here" gpu_profile.py --shape qwen3.6-27b --context "$CTX" --batch 1,16 --reps 10 --gaps \
            --out "$OUT/gaps.json" ;;
    idle)  # the rounds' phases by CUDA events, no sync (gpu_bench.EventPhases), then `profile`: a phase's
           # device time beside its kernels' says where an unprofiled round waits for the host
        bench "$here" batch_bench.py --shape qwen3.6-27b --context "$CTX" --batches 1,16 --cases ar,ddtree@16 \
            --event-phases --label idle --out "$OUT/idle.json" && step profile ;;
    gemm-rows)  # the 27B layer's bf16 GEMMs at a verify's row counts around the tile boundaries (gemm_probe.py)
        bench "$here" gemm_probe.py --shape qwen3.6-27b --out "$OUT/gemm-rows-27b.json" ;;
    gemm-pad)  # the 27B's GEMMs at 256-320 rows: whether padding a 272-row verify, cuBLASLt's own heuristic or
               # a cuBLAS workspace without room for split-K leaves the split-K kernels for less time
        for way in default cublaslt workspace; do
            ( [ "$way" = workspace ] && export CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0
              bench "$here" gemm_probe.py --shape qwen3.6-27b --rows 16 256 272 288 304 320 \
                  --blas "${way/workspace/default}" --out "$OUT/gemm-pad-$way.json" ) || return 1
        done ;;
    rounds-tiles)  # trees of 2^k nodes (budget 2^k - 1) beside root + 2^k, at 1, 8 and 16 running
        bench "$here" batch_bench.py --shape qwen3.6-27b --context "$CTX" --batches 1,8,16 \
            --cases ddtree@7,ddtree@8,ddtree@15,ddtree@16 --label tiles --out "$OUT/rounds-tiles.json" ;;
    profile-tiles)  # the 16-row step at 16 nodes and at 17, kernel by kernel: where a 17-node round's extra
                    # ~3 ms goes beyond its GEMMs' ~0.6 (session 27, H100)
        for nodes in 16 17; do
            bench "$here" gpu_profile.py --shape qwen3.6-27b --context "$CTX" --batch 16 --nodes "$nodes" \
                --out "$OUT/profile-16x$nodes.json" || return 1
        done ;;
    rounds) rounds "$here" new qwen3.6-27b "$CTX" ;;
    rounds-vocab)  # `rounds` with the drafter's vocabulary cut to DRAFT_VOCAB (32768) of the 248,320 tokens
        rounds "$here" vocab qwen3.6-27b "$CTX" "${DRAFT_VOCAB:-32768}" ;;
    rounds-old) old_tree && rounds /tmp/old old qwen3.6-27b "$CTX" ;;
    rounds-bucket-split)  # `rounds` with the tree attention's split the KV bucket's (DDTREE_FIT_SPLIT=0) rather
                          # than fitted to the rows' lengths (kernels.fitted_attention): the A/B in one tree
        DDTREE_FIT_SPLIT=0 rounds "$here" bucket-split qwen3.6-27b "$CTX" ;;
    rounds-zlab)  # `rounds` with the drafter laid out as z-lab's Qwen3.6 drafters (the mission's: four sliding
                  # layers of a 4,096-token window, then a full one) rather than five full layers
        rounds "$here" zlab qwen3.6-27b "$CTX" "" --draft-layout zlab ;;
    rounds-8b) rounds "$here" 8b-new qwen3-8b 512 ;;
    rounds-8b-old) old_tree && rounds /tmp/old 8b-old qwen3-8b 512 ;;
    rounds-8b-vocab) rounds "$here" 8b-vocab qwen3-8b 512 "${DRAFT_VOCAB:-32768}" ;;
    cost-lone)  # the cost policy alone over a request's life, against AR: tokens/s and each budget's phases
        cost_lone "$here" new ;;
    cost-lone-old) old_tree && cost_lone /tmp/old old ;;
    cost-lone-events)  # the same by CUDA events at the phases, no sync: where a probe's first tree round after
                       # AR rounds spends its ~2x (session 30: 45.8 ms against 23.7 after a tree round)
        bench "$here" batch_bench.py --shape qwen3.6-27b --context "$CTX" --batches 1 --cases cost --rounds 200 \
            --event-phases --out "$OUT/cost-lone-events.json" ;;
    gdn-tree)  # GDN_LAUNCHES: launch names to time (all 42 compile for ~8 min: pick)
        bench "$here" gdn_tree_bench.py ${GDN_LAUNCHES:+--launches $GDN_LAUNCHES} --out "$OUT/gdn-tree.json" ;;
    gdn-tree-old) old_tree && bench /tmp/old gdn_tree_bench.py ${GDN_LAUNCHES:+--launches $GDN_LAUNCHES} \
        --out "$OUT/gdn-tree-old.json" ;;
    attn)  # the 27B's tree attention over the paged pool: one row and 16, at 4.6K and 8.7K keys (ATTN_GRID:
           # attn_probe's --grid, e.g. "stages=3,4 keys=32,64"; ATTN_BUCKETS: e.g. 8704 alone)
        bench "$here" attn_probe.py --batched --page-size 16 --heads 24,4,256 --batches 1 16 --queries 17 \
            --buckets ${ATTN_BUCKETS:-4608 8704} ${ATTN_GRID:+--grid $ATTN_GRID} --out "$OUT/attn.json" ;;
    attn-splits)  # the 16- and 8-row tree attention's split: the served rule's (powers of two up to 2,048) against
                  # splits fitted to one wave of 128 programs (2 a row's KV head at 16 rows, 4 at 8), 4.6K to 33K keys,
                  # rows of equal length, then one long row among short ones (--mixed)
        for mixed in "" --mixed; do
            bench "$here" attn_probe.py --batched --page-size 16 --heads 24,4,256 --batches 8 16 --queries 17 \
                --buckets 4608 8704 33280 --grid block_rows=128 warps=8 keys=64 \
                splits=1024,1152,2048,2176,2304,4352,8320,16640 $mixed --out "$OUT/attn-splits$mixed.json" || return 1
        done ;;
    attn-waves)  # the fit spread over two waves (DDTREE_FIT_WAVES=2) against the bucket's split: the 8B's heads,
                 # whose 16 rows fill one wave (there the one-wave fit is not taken), and the 27B's (the same
                 # choices by arithmetic), rows of equal length and one long among short
        for heads in 32,8,128 24,4,256; do
            for mixed in "" --mixed; do
                DDTREE_FIT_WAVES=2 bench "$here" attn_probe.py --batched --page-size 16 --heads $heads --batches 8 16 \
                    --queries 17 --buckets 4608 8704 --grid block_rows=128 warps=8 keys=64 splits=2048 $mixed \
                    --out "$OUT/attn-waves-${heads//,/-}$mixed.json" || return 1
            done
        done ;;
    attn-kernels)  # the 27B tree attention's kernels one by one (bucket, fitted and fixed splits, equal rows): which
                   # kernel a difference in attn-splits lies in
        bench "$here" attn_kernels.py --out "$OUT/attn-kernels.json" ;;
    attn-draft)  # the drafter's block attention (32 / 8 heads of 128, 16 queries: its full layer) at 8 and 16 rows,
                 # the served launch against the bucket's splits and the fitted one, equal rows and mixed
        for mixed in "" --mixed; do
            bench "$here" attn_probe.py --batched --page-size 16 --heads 32,8,128 --batches 8 16 --queries 16 \
                --buckets 4608 8704 --grid block_rows=64 warps=4 keys=64 splits=1024,2048 $mixed \
                --out "$OUT/attn-draft$mixed.json" || return 1
        done ;;
    fp8)  # FP8_GEMM: --fp8-gemm, a comma list measures each against one bf16 run (e.g. triton,auto)
        bench "$here" fp8_bench.py --shapes qwen3.6-27b ${FP8_GEMM:+--fp8-gemm $FP8_GEMM} \
            --out "$OUT/fp8${FP8_GEMM:+-${FP8_GEMM//,/-}}.json" ;;
    fp8-gemm)  # the weight-major Triton tiles at every (projection, rows) point beside bf16, scaled_mm and what
               # the engine runs, and whether a row's bits hold across tiles and row counts (FP8_PROJECTIONS:
               # e.g. o_proj,down_proj when time is short)
        bench "$here" fp8_gemm_bench.py --weight-major-only --runtime ${FP8_PROJECTIONS:+--projections $FP8_PROJECTIONS} \
            --out "$OUT/fp8-gemm.json" ;;
    fp8-large)  # whether one FP8 arithmetic can serve every row count at no more than bf16's time: the
                # weight-major tiles and, from 64 rows, the wgmma family's large ones, beside bf16, scaled_mm, the runtime
        fp8_large fp8-large ;;
    fp8-tail)  # what the wgmma tiles' last, mostly empty 64-row tile costs a 272-row verify: the same tiles at 256,
               # 272 and 320 rows beside cuBLASLt, and at 272 the `_tail` launches (that tile weight-major)
        fp8_large fp8-tail 256,272,320 ;;
    fp8-verify-rows)  # the wgmma tiles at the row counts a verify of 17-node trees leaves short (4, 8, 12 and 16
                      # running) and at 4,096: plain, `_tail`, `_pad` (what --fp8-gemm triton serves) and `_tail_pad`
        fp8_large fp8-verify-rows 68,136,204,272,4096 ;;
    http)  # through HTTP against the engine, 8B, 16 clients, 128 tokens (issue 38's figure)
        bench "$here" -c "from pathlib import Path; import start_bench as s; s.write_checkpoints('qwen3-8b', 'bfloat16', Path('/tmp/ckpt-8b'), 'cuda')" \
            && bench "$here" load_bench.py --target /tmp/ckpt-8b/target --draft /tmp/ckpt-8b/draft --concurrency 16 \
                --requests 160 --max-tokens 128 --warm-up 0 --out "$OUT/http-8b.json" \
            && bench "$here" batch_bench.py --shape qwen3-8b --batches 16 --cases ddtree@16 --out "$OUT/http-engine-8b.json" ;;
    http-mixed)  # 8 clients (the 8B's rows fill half the wave at 8: the fit's bound) over contexts of different
                 # lengths (one ~8K prompt to three ~512), with the tree attention's split fitted to the rows'
                 # lengths (the default) and the bucket's (DDTREE_FIT_SPLIT=0), after `http` (its checkpoints)
        for fit in 1 0; do
            DDTREE_FIT_SPLIT=$fit bench "$here" load_bench.py --target /tmp/ckpt-8b/target --draft /tmp/ckpt-8b/draft \
                --max-running 8 --concurrency 8 --requests 48 --max-tokens 128 --prompt-tokens 8192,512,512,512 \
                --out "$OUT/http-mixed-fit$fit-8b.json" || return 1
        done ;;
    http-cost)  # the same clients with the budget chosen by cost (16 running, each client's next request arriving as
                # its last finishes), after `http` (its checkpoints)
        bench "$here" load_bench.py --target /tmp/ckpt-8b/target --draft /tmp/ckpt-8b/draft --concurrency 16 \
            --requests 160 --max-tokens 128 --warm-up 0 --server-arg=--tree-policy --server-arg=cost \
            --out "$OUT/http-cost-8b.json" ;;
    cuda-tests)
        PYTHONPATH="$here/runtime:$here/runtime/devtools:$here:${PYTHONPATH:-}" python3 -m pytest -q -p no:cacheprovider \
            tests/runtime/test_gated_attention_cuda.py tests/runtime/test_gdn_prompt_cuda.py \
            tests/runtime/test_prompt_attention_cuda.py tests/runtime/test_conv_tail_cuda.py tests/runtime/test_compile_pool.py \
            tests/runtime/test_draft_vocab_cuda.py tests/runtime/test_tree_attention_cuda.py ;;
    interpreter-tests)  # the Triton interpreter's suite (CI runs it on the CPU with Triton 3.5) on the image's
                        # Triton (3.6: its interpreter's changed patch hook failed every test in session 24);
                        # TESTS_K: pytest's -k, a part of it (the whole took more than a call in session 29)
        PYTHONPATH="$here/runtime:$here/runtime/devtools:$here:${PYTHONPATH:-}" python3 -m pytest -x -q -p no:cacheprovider \
            --tb=short ${TESTS_K:+-k "$TESTS_K"} tests/runtime/test_triton_kernels.py ;;
    graph-memory)  # what the warm-up leaves on the 96 GB emulation at 16 x 8K: fixed ddtree@16, then the cost
                   # policy's sweep over every (batch, tree) shape (each graph keeps its own logits)
        for policy in fixed cost; do
            bench "$here" burst_bench.py --warm-up-only --tree-policy $policy --out "$OUT/graph-memory-$policy.json" \
                || return 1
        done ;;
    reship-h100)  # the same at max_context 32768 (an H100 cannot hold the 96 GB emulation's pool): its record,
                  # merged into the shipped one here (record_merge.py), keeps the shipped launches it did not reach
        rm -rf /tmp/tc && TRITON_CACHE_DIR=/tmp/tc bench "$here" burst_bench.py --warm-up-only --max-context 32768 \
            --out "$OUT/reship-h100.json" && cp /tmp/tc/ddtree-compiles.pkl "$OUT/" ;;
    reship)  # the warm-up over an empty Triton cache; its record replaces the shipped one (kernels changed)
        rm -rf /tmp/tc && TRITON_CACHE_DIR=/tmp/tc bench "$here" burst_bench.py --warm-up-only --out "$OUT/reship.json" \
            && cp /tmp/tc/ddtree-compiles.pkl "$OUT/" ;;
    *) echo "unknown step $1"; return 2 ;;
    esac
}

failed=0
for name in "$@"; do
    began=$SECONDS
    echo "=== $name"
    if step "$name" 2>&1 | tee -a "$OUT/steps.log" | tail -n 25; then
        echo "=== $name: done in $((SECONDS - began)) s"
    else
        echo "=== $name: FAILED after $((SECONDS - began)) s (steps.log has its output)"
        failed=1
    fi
done
exit $failed

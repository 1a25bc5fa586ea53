#!/usr/bin/env bash
# The GPU session's jobs, one verb each, so that a device call stays a short command line.
# Run in the repository root on the GPU machine after `source scripts/device/env.sh`
# (docs/gpu_ci.md, "Runbook"). Every job writes what must come back under its OUT dir at
# once: a machine that goes cold loses everything else.
#
#   gpu_session.sh data                 unpack .dz/*.jsonl.gz (carried) into .data/
#   gpu_session.sh shape_model_dir      copy .smol_shape (carried) where the engine looks for the embedded model; print it
#   gpu_session.sh train OUT            train the embedded model's draft; OUT/draft/ comes
#                                       back, and env.sh installs it in the checkout from the
#                                       next call of this lease on
#   gpu_session.sh train_general OUT    the general draft (Magpie user turns mixed with GSM8K train, one call
#                                       of under 10 minutes); OUT/draft/ comes back and is installed as by train;
#                                       the checkout's draft is kept in /root/draft_old first
#   gpu_session.sh train_dspark OUT [NAME FLAGS...]  the dspark block draft on eagle v4's prompt set with soft
#                                       labels (one call of under 10 minutes; the answers are generated once a
#                                       lease, then read from /root); OUT/draft/ comes back and env.sh installs it
#                                       as the checkout's dspark draft from the next call on (the old one is kept
#                                       in /root/dspark_old). With NAME: the recipe's flags then FLAGS, kept in
#                                       /root/dspark_NAME only (an ablation: ~260 s once the answers exist)
#   gpu_session.sh quality_dspark OUT [DRAFT...]  tokens/step at K = DSPARK_QUALITY_STEPS (default 3), strict and
#                                       ASD usage, of the drafts (default: /root/dspark_old if any, and the
#                                       checkout's) on 200 test questions and the held-out prompts by kind, then
#                                       eagle's at K = 3 in the same call (QUALITY_FLAGS=--deterministic: strict
#                                       MTP must then differ from no-MTP in no request)
#   gpu_session.sh batch1_line OUT [S]  issue 30's batch-1 usage line: 64 GSM8K prompts, 128 new tokens, concurrency 1,
#                                       K = 3 with the usage flags; one server each: eagle, dspark, dspark, eagle
#                                       (timeout S seconds, default 300)
#   gpu_session.sh asd_dspark OUT       GSM8K test (all 1319), dspark K = 3: strict, B = 0, usage, and no MTP
#   gpu_session.sh prefill OUT          ms per one-request prefill (120 tokens), K = 0 and 3, rows from graphs
#                                       (the default) vs the prefill forward (--graph_max_prefill_tokens 0)
#   gpu_session.sh diag OUT             prefill time per request (batch 1, K = 0 and 3, profiled), then
#                                       asd_dspark with every server log in OUT/eval_dspark.tgz
#   gpu_session.sh quality OUT          draft quality, 200 test questions, K = 1..4
#   gpu_session.sh quality_general OUT [DRAFT...]  tokens/step (strict and ASD usage) on 200 test questions and the held-out prompts
#                                       by kind, K = 1..4, for each draft (default: /root/draft_old or the
#                                       checkout's, and /root/draft_new when there is one)
#   gpu_session.sh eval OUT K SWEEP B   calibrate + evaluate all arms at K (sweep budgets SWEEP,
#                                       '' for none; time budget B s); OUT/eval_kK.tgz
#   gpu_session.sh suite OUT [PATHS]    the whole test suite on this GPU (unit_tests/run_gpu_ci.sh)
#   gpu_session.sh multi_gpu OUT [WHAT] the two-GPU tests (WHAT=tests), tp 1 vs --tp 2 --dp 2
#                                       throughput (WHAT=bench), or both (default)
#   gpu_session.sh tp OUT               --tp 1 / 2 / 4 throughput of the 8B-shaped dummy (bench_tp.py), graphs and eager
#   gpu_session.sh arms OUT NAME        in-process strict / usage / B = 8 arms at K = 3 and K = 2
#                                       with the checkout's draft (OUT/arms_NAME_kK.json)
#   gpu_session.sh budgets OUT K [CONC] [NQ] [BUDGETS]   one server, budgets (default 0 / usage / 8) in 3
#                                       interleaved rounds of NQ questions (default all 1319) at concurrency CONC:
#                                       ASD's tok/s ratio to B = 0 (OUT/budgets_kK_cCONC$BUDGETS_NAME.json;
#                                       BUDGETS_SERVER_ARGS: more server flags, e.g. --disable_mixed_steps;
#                                       BUDGETS_MTP_MODE: the draft, default eagle_with_att, e.g. dspark;
#                                       BUDGETS_ARMS: servers compared in the same run, ';'-separated NAME=FLAGS)
#   gpu_session.sh spy OUT [SECONDS]    B = 0 budgets waves (K = 3, concurrency 64) with py-spy (carried in .pyspy/)
#                                       sampling the router process for SECONDS (default 25) once the first wave
#                                       runs: OUT/router_spy.txt, collapsed stacks of every thread, idle included
#   gpu_session.sh prefix OUT           the prompt cache on vs off (bench_e2e_throughput --prefix_cache)
#   gpu_session.sh resend OUT           a resent 6k-token prompt: where its time to first token goes in-process
#                                       (profile_resend.py), then over HTTP (--prefix_cache's resend workload)
#   gpu_session.sh profile OUT          where a decode step's time goes (batch 256, K = 0 and 3)
#   gpu_session.sh graphs OUT          CUDA graph vs eager: the graph tests, then ms per decode step at
#                                       batch 1 / 64 / 256, K = 0 and 3, and the 8B-shaped dummy model
#   gpu_session.sh overlap OUT          the overlap schedule: its GPU tests, the step
#                                       with and without it, the matrix with both arms
#   gpu_session.sh perf OUT [MODELS] [MODES]  one decode step profiled (batch 1), then benchmarks/bench_e2e_throughput.py
#                                       --matrix: engine vs transformers (OUT/bench_vs_hf.json)
#   gpu_session.sh attention OUT        benchmarks/bench_attention.py: the attention kernel vs SDPA flash
#                                       (prefill TFLOP/s, decode KV bandwidth, MTP rows; OUT/attention.json)
#   gpu_session.sh long_context OUT     bench_e2e_throughput.py --long_context: TTFT at 512 / 2k / 6k tokens vs
#                                       transformers' forward, 16 concurrent 6000- vs 150-token prompts
#   gpu_session.sh serving OUT          bench_e2e_throughput.py --serving: plain / MTP K = 3 / ASD usage servers, 512 streamed
#                                       requests each at concurrency 64 (80% GSM8K, 20% 2k-4k tokens): tok/s, TTFT, ITL
#                                       (SERVING_MODES: other arms, e.g. "mtp mtp_chunk512")
#   gpu_session.sh steps OUT            decode step ms on the engine's graphs: batch 1 / 64, plain and MTP K = 3
#   gpu_session.sh steps_ab OUT [NAME=PATCH...]  decode step ms of the checkout and of copies of it with each PATCH
#                                       (a `git diff` against the checkout, in the carried tree) applied, interleaved
#                                       in STEPS_AB_ROUNDS rounds (default 2) over STEPS_AB_CASES (';'-separated
#                                       profile_decode_step.py flags); with .smol_shape carried (the embedded model's
#                                       config and tokenizer, no weights) dummy weights of that shape: no model parts
#   gpu_session.sh mixed_calls OUT [N]  carrying .smol_shape and .dz, no model: each attention call of mixed and
#                                       decode step N (default 40) on the serving-like mix, replayed alone (eager,
#                                       dummy weights; a mixed head also as a decode plan), then the graphed run's
#                                       kernels by step kind (--trace_steps)
#   gpu_session.sh serving_ab OUT [NAME=PATCH...]  the serving mix (SERVING_MODES, default plain) in the checkout
#                                       and in copies with each PATCH applied (SERVING_AB_ARMS: server flags in the
#                                       checkout, "NAME=FLAGS;..."), interleaved in SERVING_AB_ROUNDS rounds;
#                                       carrying .smol_shape, .whl and .dz (no model): dummy weights
#   gpu_session.sh gaps OUT [NAME=PATCH...]  where the serving mix's long inter-token gaps come from
#                                       (profile_serving_gaps.py, in process, no HTTP) at each GAPS_ARMS entry
#                                       (';'-separated server flags; default the engine's defaults, then
#                                       --mixed_max_prefill_tokens 256; GAPS_FLAGS: more of the script's flags) in the
#                                       checkout and in copies with each PATCH applied, GAPS_ROUNDS rounds (default 1);
#                                       carrying .smol_shape, .dz (no model): dummy weights
#   gpu_session.sh attention_ab OUT [NAME=PATCH...]  bench_attention.py (ATTENTION_FLAGS; default --cases decode
#                                       mtp_rows) in the checkout and in copies with each PATCH applied, interleaved
#                                       in ATTENTION_AB_ROUNDS rounds (default 2)
#   gpu_session.sh mixed OUT [COMMIT]   where a mixed step's time goes (profile_mixed_step.py --trace_steps) on GSM8K
#                                       and on the serving mix (every 5th prompt 3000 tokens) at chunk budgets 512
#                                       and 2048, eagle K = 3; with COMMIT also at that commit (a git worktree);
#                                       MIXED_ARMS: some of "gsm8k long512 long2048"
#   gpu_session.sh pack                 everything under $OUT into $OUT/out.tgz (at most 8 files
#                                       come back from a call)
set -uo pipefail

# trees: the checkout ("$PWD:checkout"), then a copy per NAME=PATCH argument with the patch (a `git diff` against the
# checkout, in the carried tree) applied ("/tmp/ab_NAME:NAME"); a patch that does not apply is reported and left out
# .dz/*.jsonl.gz (carried) unpacked into .data/
unpack_data() {
    mkdir -p .data
    local f
    for f in .dz/*.jsonl.gz; do gunzip -c "$f" > ".data/$(basename "$f" .gz)"; done
}

# the embedded model's config and tokenizer (.smol_shape, carried, no weights) where the engine looks for the
# model: prints that folder, for --model_dir with --load_format dummy
shape_model_dir() {
    local m=${LIGHTLLM_CACHE_DIR:-/root/lightllm_cache}/models/SmolLM2-135M-Instruct
    mkdir -p "$m" && cp .smol_shape/* "$m/" && echo "$m"
}

patched_trees() {
    trees=("$PWD:checkout")
    local arm name patch dir
    for arm in "$@"; do
        name=${arm%%=*}; patch=$(readlink -f "${arm#*=}"); dir=/tmp/ab_$name
        rm -rf "$dir" && mkdir -p "$dir"
        tar --exclude=./.git --exclude=./.mparts --exclude=./.whl --exclude=./.dz -cf - . | tar -xf - -C "$dir"
        if (cd "$dir" && git apply "$patch"); then trees+=("$dir:$name"); else echo "$patch does not apply" >&2; fi
    done
}

TRAIN_FLAGS=(--mtp_mode eagle_with_att --init last_layer --unroll 4 --max_new_tokens 200
             --gen_batch_size 768 --epochs 8 --lr 1e-3 --batch_size 64 --max_gen_seconds 240
             --max_train_seconds 200 --device cuda)
# the general mixture (issue 16): 15000 new user turns (--seed 1) in five Magpie domains (default, code, writing,
# advice, explanation) at 20% GSM8K, soft labels (the target's own distribution), depth 0 reading fc of target
# layers 2, 10, 20 and 29 (EAGLE-3's fusion; fc starts as the identity on layer 29), fine-tuning the ninth
# session's draft (v3), which the job takes from git (GENERAL_INIT_COMMIT) so that the recipe reproduces whatever
# the checkout ships. The 240 s generation budget is shared (user turns at most 40%, the answers the rest, cut
# at the deadline), training 270 s, held-out answers and top-1 ~5 s: about 480 s in all.
GENERAL_INIT_COMMIT=fbdc936
TRAIN_GENERAL_FLAGS=(--prompt_source mix --magpie_count 15000 --magpie_domains default,code,writing,advice,explanation
                     --gsm8k_fraction 0.2 --magpie_seed_mode batch --seed 1
                     --mtp_mode eagle_with_att --init_from /root/draft_init --target_layer_ids 2 10 20 29
                     --unroll 4 --max_new_tokens 200 --gen_batch_size 768 --epochs 6 --lr 5e-4 --batch_size 64
                     --max_gen_seconds 240 --max_train_seconds 270 --soft_label_weight 1.0 --device cuda)
# dspark: the eagle v4 draft's prompt set replayed (no user-turn sampling) with its soft labels (the target's
# distribution), answers ~150 s, training 240 s. The packaged dspark draft (seventh session) was trained on the
# first set, docs/data/drafts/eagle_with_att_general_prompt_set.jsonl.gz, with hard labels.
DSPARK_BLOCK=4
DSPARK_PROMPTS=(--prompt_source file --prompt_set docs/data/drafts/eagle_with_att_general_v4_prompt_set.jsonl.gz)
TRAIN_DSPARK_FLAGS=(--mtp_mode dspark
                    --block_size $DSPARK_BLOCK --draft_layers 2 --anchors_per_seq 48 --max_new_tokens 200 --gen_batch_size 768 --epochs 10
                    --lr 1e-3 --batch_size 64 --soft_label_weight 1.0 --max_gen_seconds 150 --max_train_seconds 240
                    --device cuda)
DSPARK_DIR=lightllm/drafts/SmolLM2-135M-Instruct/dspark
DSPARK_ANSWERS=${DSPARK_ANSWERS:-/root/dspark_answers_v4.pt}  # (env: another prompt set's) the target's answers to that prompt set, generated once a lease
DRAFT_DIR=lightllm/drafts/SmolLM2-135M-Instruct/eagle_with_att
CALIB_QUESTIONS=64
EVAL_CONCURRENCY=256
EVAL_NEW_TOKENS=256

job=${1:?usage: gpu_session.sh data|attention|attention_ab|long_context|serving|serving_ab|steps|steps_ab|mixed|mixed_calls|overlap|prefill|prefix|resend|diag|spy|gaps|train|train_general|train_dspark|quality|quality_general|quality_dspark|asd_dspark|eval|suite|multi_gpu|tp|arms|budgets|batch1_line|profile|graphs|perf|shape_model_dir|pack ...}
shift

case "$job" in
graphs)
    out=${1:?OUT}; mkdir -p "$out"
    python -m pytest -q -p no:cacheprovider unit_tests/server/router/model_infer/test_cuda_graph_decode.py \
        unit_tests/server/router/model_infer/test_decode_step.py > "$out/graph_tests.log" 2>&1
    tail -3 "$out/graph_tests.log"
    for b in 1 64 256; do for k in 0 3; do for g in "" --disable_cudagraph; do
        python benchmarks/profile_decode_step.py --batch $b --mtp_step $k --rows 0 --steps 50 $g 2>>"$out/steps.err" | tail -1
    done; done; done | tee "$out/steps.txt"
    python -c "from benchmarks.bench_e2e_throughput import write_dummy_model_dir, LLAMA3_8B_SHAPE as S
from lightllm.utils.embedded_model import get_default_model_dir as d; write_dummy_model_dir('/root/d8b', S, d())"
    for b in 1 64; do for g in "" --disable_cudagraph; do
        python benchmarks/profile_decode_step.py --model_dir /root/d8b --load_format dummy --batch $b --rows 0 --steps 30 $g \
            2>>"$out/steps.err" | tail -1
    done; done | tee -a "$out/steps.txt"
    ;;
overlap)
    # the overlap schedule: its GPU tests, the step with and without it, then the matrix with both
    # arms of plain decoding (plain, plain_no_overlap) and the MTP rows
    out=${1:?OUT}; mkdir -p "$out"
    timeout 200 python -m pytest -q -p no:cacheprovider -m "" unit_tests/server/router/model_infer/test_overlap_schedule_cuda.py \
        --junitxml "$out/tests.xml" > "$out/tests.log" 2>&1
    tail -3 "$out/tests.log"
    for b in 1 64; do for o in "" --disable_overlap_schedule; do
        python benchmarks/profile_decode_step.py --batch $b --rows 0 --steps 100 $o 2>>"$out/perf.err" | tail -1
    done; done | tee "$out/steps.txt"
    timeout 230 python benchmarks/bench_e2e_throughput.py --matrix --matrix_models embedded \
        --matrix_modes plain plain_no_overlap mtp3 asd_usage --max_new_tokens 128 \
        --gsm8k .data/test.jsonl --out "$out/bench_vs_hf.json" > "$out/bench.log" 2>>"$out/perf.err"
    tail -12 "$out/bench.log"
    ;;
perf)
    out=${1:?OUT}; models=${2:-embedded llama3_8b_dummy}; modes=${3:-}; mkdir -p "$out"
    python benchmarks/profile_decode_step.py --batch 1 --rows 30 --steps 50 > "$out/profile_b1.txt" 2>>"$out/perf.err"
    head -3 "$out/profile_b1.txt"
    python benchmarks/bench_e2e_throughput.py --matrix --matrix_models $models ${modes:+--matrix_modes $modes} --max_new_tokens 128 \
        --gsm8k .data/test.jsonl --out "$out/bench_vs_hf.json" > "$out/bench.log" 2>>"$out/perf.err"
    tail -14 "$out/bench.log"
    ;;
attention)
    out=${1:?OUT}; mkdir -p "$out"
    python benchmarks/bench_attention.py ${ATTENTION_FLAGS-} --out "$out/attention.json" > "$out/attention.log" 2>&1
    status=$?; tail -40 "$out/attention.log"; exit $status
    ;;
long_context)
    out=${1:?OUT}; mkdir -p "$out"
    python benchmarks/bench_e2e_throughput.py --long_context --gsm8k .data/test.jsonl --out "$out/long_context.json" \
        > "$out/long_context.log" 2>&1
    status=$?; grep -v " INFO " "$out/long_context.log" | tail -30; exit $status
    ;;
prefix)
    # the prompt cache on vs off: multi-turn chats, a shared document, a resent 6k prompt, a small pool
    out=${1:?OUT}; mkdir -p "$out"
    timeout 560 python benchmarks/bench_e2e_throughput.py --prefix_cache --gsm8k .data/test.jsonl \
        --out "$out/prefix_cache.json" > "$out/prefix_cache.log" 2>&1
    status=$?; grep -v " INFO " "$out/prefix_cache.log" | grep -v "req/s\]" | tail -40; exit $status
    ;;
resend)
    out=${1:?OUT}; mkdir -p "$out"
    timeout 200 python benchmarks/profile_resend.py --gsm8k .data/test.jsonl --out "$out/resend_profile.json" \
        > "$out/resend_profile.log" 2>&1; s1=$?
    grep -v " INFO " "$out/resend_profile.log" | head -45
    timeout 300 python benchmarks/bench_e2e_throughput.py --prefix_cache --prefix_workloads resend \
        --gsm8k .data/test.jsonl --out "$out/prefix_resend.json" > "$out/prefix_resend.log" 2>&1; s2=$?
    grep -v " INFO " "$out/prefix_resend.log" | grep -v "req/s\]" | tail -25; exit $((s1 | s2))
    ;;
spy)
    out=${1:?OUT}; secs=${2:-25}; mkdir -p "$out" /tmp/pyspy
    python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .pyspy/*.whl || exit 1
    python benchmarks/bench_asd_budgets.py --data .data/test.jsonl --mtp_step 3 --budgets 0 --rounds 3 \
        --concurrency 64 --max_new_tokens "$EVAL_NEW_TOKENS" --out "$out/spy_budgets.json" \
        > "$out/spy_budgets.log" 2>&1 &
    bench=$!
    until grep -q "round 0 B=0" "$out/spy_budgets.log" 2>/dev/null; do sleep 0.5; kill -0 $bench || break; done
    pid=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | head -1)
    echo "router pid $pid"
    /tmp/pyspy/bin/py-spy record --pid "$pid" --duration "$secs" --rate 1000 --format raw --idle --threads \
        --nonblocking -o "$out/router_spy.txt" > "$out/spy.log" 2>&1; echo "py-spy rc $?"; tail -3 "$out/spy.log"
    wait $bench; grep -E "^\|" "$out/spy_budgets.log"
    ;;
serving)
    # 3 arms, each: server start, a 64-request warm-up, 512 requests (about 30-60 s); the JSON is written after every arm
    out=${1:?OUT}; mkdir -p "$out"
    timeout 540 python benchmarks/bench_e2e_throughput.py --serving --gsm8k .data/test.jsonl --out "$out/serving.json" \
        ${SERVING_MODES:+--serving_modes $SERVING_MODES} > "$out/serving.log" 2>&1
    status=$?; grep -v " INFO " "$out/serving.log" | grep -v "req/s\]" | tail -20; exit $status
    ;;
gaps)
    out=${1:?OUT}; shift; mkdir -p "$out"
    unpack_data
    m=$(shape_model_dir)
    patched_trees "$@"
    IFS=';' read -r -a gap_arms <<< "${GAPS_ARMS:- ;--mixed_max_prefill_tokens 256}"
    data=$PWD/.data/test.jsonl
    for round in $(seq "${GAPS_ROUNDS:-1}"); do
        i=0
        for arm in "${gap_arms[@]}"; do
            i=$((i + 1))
            for tree in "${trees[@]}"; do
                dir=${tree%%:*}; tag=${tree##*:}; name="gaps_${tag}_${i}_r$round"
                (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 240 python benchmarks/profile_serving_gaps.py \
                    --gsm8k "$data" ${GAPS_FLAGS:-} --server_args "--model_dir $m --load_format dummy $arm" \
                    --out "$out/$name.json" > "$out/$name.log" 2>&1)
                echo "round $round | $tag | arm $i ($arm) | rc $?"; grep -v " INFO " "$out/$name.log" | tail -60
            done
        done
    done | tee "$out/gaps.txt"
    ;;
batch1_line)
    out=${1:?OUT}; mkdir -p "$out"
    u="--mtp_step 3 --mtp_asd_regret_budget 2.0625 --mtp_asd_local_regret_ratio 0.25 --mtp_asd_block_max_mismatch 2"
    timeout "${2:-300}" python benchmarks/bench_e2e_throughput.py --skip_hf --concurrency 1 --num_prompts 64 \
        --max_new_tokens 128 --gsm8k .data/test.jsonl --out "$out/batch1_usage_line.json" \
        --configs "eagle=--mtp_mode eagle_with_att $u;dspark=--mtp_mode dspark $u;dspark_2=--mtp_mode dspark $u;eagle_2=--mtp_mode eagle_with_att $u" \
        > "$out/batch1.log" 2>&1
    grep -v " INFO " "$out/batch1.log" | tail -14
    gzip -f "$out/batch1.log"
    ;;
serving_ab)
    # the serving mix (SERVING_MODES, default plain) in the checkout and in patched copies, interleaved in
    # SERVING_AB_ROUNDS rounds (default 2): one JSON per tree and round, a line each. With .smol_shape carried
    # (and .whl, .dz; no model parts) the embedded shape with dummy weights (SERVING_AB_REAL=1: the real model)
    # SERVING_AB_ARMS: more arms in the checkout, ';'-separated NAME=SERVER_FLAGS (e.g. a flag's values)
    out=${1:?OUT}; shift; mkdir -p "$out"
    unpack_data
    patched_trees "$@"
    declare -A arm_flags=()
    IFS=';' read -r -a flag_arms <<< "${SERVING_AB_ARMS:-}"
    for arm in "${flag_arms[@]}"; do
        [ -n "$arm" ] || continue
        trees+=("$PWD:${arm%%=*}"); arm_flags[${arm%%=*}]=${arm#*=}
    done
    data=$PWD/.data/test.jsonl; base=""
    if [ -d .smol_shape ] && [ -z "${SERVING_AB_REAL:-}" ]; then
        m=$(shape_model_dir) && base="--model_dir $m --load_format dummy"
    fi
    for round in $(seq "${SERVING_AB_ROUNDS:-2}"); do
        # round r starts at arm r - 1, so that an arm's place in the call (a first server has run slower, and faster) cancels over rounds
        n=${#trees[@]}; k=$(( (round - 1) % n ))
        for tree in "${trees[@]:k}" "${trees[@]:0:k}"; do
            dir=${tree%%:*}; tag=${tree##*:}; json="$out/serving_${tag}_r$round.json"
            (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 300 python benchmarks/bench_e2e_throughput.py --serving \
                --gsm8k "$data" --serving_modes ${SERVING_MODES:-plain} \
                --server_args "$base ${arm_flags[$tag]:-}" --out "$json" \
                > "$out/serving_${tag}_r$round.log" 2>&1)
            echo "round $round | $tag | rc $?"
            python3 -c "
import json, sys
for a in json.load(open(sys.argv[1]))['arms']:
    print('  ', a['mode'], *(f'{k} {a[k] if a[k] is not None else float(\"nan\"):.2f}' for k in ('output_tok_s', 'itl_short_ms_p50', 'itl_short_ms_p99',
          'itl_short_p99_over_p50', 'chunk_gap_short_ms_p50', 'itl_router_ms_p50', 'itl_router_ms_p99', 'http_cpu_share', 'mixed_step_ms', 'decode_step_ms', 'mixed_steps', 'mean_decode_batch')),
          *(f'{k} {a[k]:.2f}' for k in ('update_delivery_ms_p50', 'update_delivery_ms_p99', 'client_loop_lag_ms_p99')
            if a.get(k) is not None),
          *([f'http_cpu_by_process {\"/\".join(f\"{c:.2f}\" for c in a[\"http_cpu_share_by_process\"])}'] if a.get('http_cpu_share_by_process') else []))" "$json"
        done
    done | tee "$out/serving_ab.txt"
    ;;
steps_ab)
    out=${1:?OUT}; shift; mkdir -p "$out"
    patched_trees "$@"
    model=()
    if [ -d .smol_shape ]; then
        m=$(shape_model_dir) && model=(--model_dir "$m" --load_format dummy)
    fi
    IFS=';' read -r -a cases <<< "${STEPS_AB_CASES:---batch 64;--batch 64 --mtp_step 3;--batch 1 --mtp_step 3}"
    for round in $(seq "${STEPS_AB_ROUNDS:-2}"); do
        for args in "${cases[@]}"; do
            for tree in "${trees[@]}"; do
                dir=${tree%%:*}; tag=${tree##*:}
                # each tree imports its own lightllm (env.sh put the checkout on PYTHONPATH)
                ms=$(cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 120 python benchmarks/profile_decode_step.py $args \
                     "${model[@]}" --rows 0 --steps 100 2>>"$out/steps_ab.err" | grep -o "[0-9.]* ms per decode step")
                echo "round $round | $tag | $args | ${ms:-failed}"
            done
        done
    done | tee "$out/steps_ab.txt"
    ;;
attention_ab)
    # bench_attention.py (ATTENTION_FLAGS, default the decode and MTP-rows cases; e.g. "--cases prefill chunk") in the checkout and in patched
    # copies, interleaved in ATTENTION_AB_ROUNDS rounds (default 2); each tree's JSON per round
    out=${1:?OUT}; shift; mkdir -p "$out"
    patched_trees "$@"
    for round in $(seq "${ATTENTION_AB_ROUNDS:-2}"); do
        for tree in "${trees[@]}"; do
            dir=${tree%%:*}; tag=${tree##*:}
            echo "== round $round | $tag"
            (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 200 python benchmarks/bench_attention.py \
                ${ATTENTION_FLAGS:---cases decode mtp_rows} --out "$out/attention_${tag}_r$round.json" \
                2>>"$out/attention_ab.err" | grep -E "^(prefill|decode|mtp_rows|chunk) ")
        done
    done | tee "$out/attention_ab.txt"
    ;;
steps)
    out=${1:?OUT}; mkdir -p "$out"
    for args in "--batch 1" "--batch 1 --mtp_step 3" "--batch 64" "--batch 64 --mtp_step 3"; do
        echo "== $args"; python benchmarks/profile_decode_step.py $args --rows 0 --steps 50 2>>"$out/steps.err" | tail -3
    done | tee "$out/steps.txt"
    ;;
data)
    unpack_data
    ls -la .data
    ;;
train)
    out=${1:?OUT}; mkdir -p "$out/draft"
    python -m lightllm.tools.train_mtp_draft --data .data/train.jsonl --out "$out/draft" "${TRAIN_FLAGS[@]}" \
        > "$out/train.log" 2>&1 || { tail -20 "$out/train.log"; exit 1; }
    # env.sh installs it in the checkout at the next call (not now: other jobs may be loading the draft)
    mkdir -p /root/draft_new && cp "$out"/draft/* /root/draft_new/
    tail -3 "$out/train.log"
    ;;
train_general)
    out=${1:?OUT}; mkdir -p "$out/draft"
    # the checkout's draft, before env.sh replaces it with this job's at the next call
    [[ -d /root/draft_old || -f /root/draft_new/model.safetensors ]] || { mkdir -p /root/draft_old && cp "$DRAFT_DIR"/* /root/draft_old/; }
    mkdir -p /root/draft_init
    for f in config.json model.safetensors; do git show "$GENERAL_INIT_COMMIT:$DRAFT_DIR/$f" > "/root/draft_init/$f" || exit 1; done
    python -m lightllm.tools.train_mtp_draft --data .data/train.jsonl --out "$out/draft" "${TRAIN_GENERAL_FLAGS[@]}" \
        > "$out/train.log" 2>&1 || { tail -20 "$out/train.log"; exit 1; }
    mkdir -p /root/draft_new && cp "$out"/draft/* /root/draft_new/
    grep -E "prompt set:|generated|held-out |time budget|saved the draft" "$out/train.log" | cut -c 1-300
    ;;
train_dspark)
    # train_dspark OUT: the recipe, installed as the checkout's draft from the next call; train_dspark OUT NAME FLAGS...:
    # a variant (the recipe's flags, then FLAGS) in /root/dspark_NAME. Every run of a lease trains on the same answers.
    out=${1:?OUT}; name=${2-}; mkdir -p "$out/draft"
    extra=("${@:3}")
    # the checkout's dspark draft, before env.sh replaces it with this job's at the next call
    [[ -d /root/dspark_old || -f /root/dspark_new/model.safetensors ]] || { mkdir -p /root/dspark_old && cp "$DSPARK_DIR"/* /root/dspark_old/; }
    # FLAGS with their own --prompt_source replace the replayed prompt set
    prompts=("${DSPARK_PROMPTS[@]}"); [[ " ${extra[*]} " == *" --prompt_source "* ]] && prompts=()
    python -m lightllm.tools.train_mtp_draft --out "$out/draft" "${prompts[@]}" "${TRAIN_DSPARK_FLAGS[@]}" "${extra[@]}" \
        --answers_cache "$DSPARK_ANSWERS" --prompt_set_out /root/dspark_prompt_set.jsonl > "$out/train.log" 2>&1 \
        || { tail -20 "$out/train.log"; exit 1; }
    dest=/root/dspark_new; [[ -n "$name" ]] && dest=/root/dspark_$name
    mkdir -p "$dest" && cp "$out"/draft/* "$dest"/
    # files come back at most 16 MiB each: the weights in 15 MiB parts (cat them back in order)
    split -b 15m "$out/draft/model.safetensors" "$out/draft/model.safetensors.part_" && rm "$out/draft/model.safetensors"
    grep -E "prompt set:|generated|answers|held-out |time budget|saved the draft" "$out/train.log" | cut -c 1-300
    ;;
quality_dspark)
    # quality_dspark OUT [DRAFT...]: tokens/step at K = $DSPARK_QUALITY_STEPS (default 3), strict and usage, of the
    # drafts (default: the one train_dspark replaced, if any, and the checkout's), then eagle's at K = 3
    out=${1:?OUT}; shift; mkdir -p "$out"
    drafts=("$@")
    if (( ${#drafts[@]} == 0 )); then drafts=(default); [[ -d /root/dspark_old ]] && drafts=(/root/dspark_old default); fi
    python benchmarks/bench_mtp_draft_quality.py --data .data/test.jsonl --num_questions 200 \
        --steps ${DSPARK_QUALITY_STEPS:-3} --asd_usage --mtp_mode dspark --draft_dir "${drafts[@]}" ${QUALITY_FLAGS-} \
        --out "$out/mtp_draft_quality_dspark.json" > "$out/quality_dspark.log" 2>&1
    status=$?
    tail -30 "$out/quality_dspark.log"
    if [[ ${QUALITY_EAGLE:-1} == 1 ]]; then  # QUALITY_EAGLE=0: the dspark drafts only
        python benchmarks/bench_mtp_draft_quality.py --data .data/test.jsonl --num_questions 200 --steps 3 \
            ${QUALITY_FLAGS-} --out "$out/mtp_draft_quality_eagle_k3.json" > "$out/quality_eagle.log" 2>&1 || status=1
        tail -8 "$out/quality_eagle.log"
    fi
    exit $status
    ;;
prefill)
    out=${1:?OUT}; mkdir -p "$out"
    for k in 0 3; do for m in 512 0; do
        python benchmarks/profile_decode_step.py --prefill --batch 20 --prompt_len 120 --mtp_step $k --rows 0 \
            --graph_max_prefill_tokens $m 2>>"$out/prefill.err" | tail -1
    done; done | tee "$out/prefill.txt"
    ;;
diag)
    out=${1:?OUT}; mkdir -p "$out"
    for k in 0 3; do
        python benchmarks/profile_decode_step.py --prefill --batch 20 --prompt_len 120 --mtp_step $k --rows 30 2>&1
    done > "$out/prefill_profile.txt"
    grep "per request" "$out/prefill_profile.txt"
    bash "$0" asd_dspark "$out"
    status=$?
    for f in "$out"/eval_dspark/server_*.log; do echo "== $f"; grep -v "INFO" "$f" | tail -40; done
    tar czf "$out/eval_dspark.tgz" -C "$out" eval_dspark && rm -rf "$out/eval_dspark"
    exit $status
    ;;
asd_dspark)
    out=${1:?OUT}; mkdir -p "$out"
    python -m lightllm.tools.eval_gsm8k --data .data/test.jsonl --out_dir "$out/eval_dspark" --mtp_mode dspark \
        --mtp_step 3 --arms strict,asd_b0,asd_usage --sweep '' --with_baseline --concurrency "$EVAL_CONCURRENCY" \
        --max_new_tokens "$EVAL_NEW_TOKENS" > "$out/eval_dspark.log" 2>&1
    status=$?
    tail -12 "$out/eval_dspark.log"
    exit $status
    ;;
quality_general)
    out=${1:?OUT}; shift; mkdir -p "$out"
    drafts=("$@")
    if (( ${#drafts[@]} == 0 )); then
        if [[ -d /root/draft_old ]]; then drafts=(/root/draft_old); else drafts=(default); fi
        [[ -f /root/draft_new/model.safetensors ]] && drafts+=(/root/draft_new)
    fi
    python benchmarks/bench_mtp_draft_quality.py --data .data/test.jsonl --num_questions 200 --steps 1 2 3 4 --asd_usage \
        --draft_dir "${drafts[@]}" --out "$out/mtp_draft_quality_general.json" > "$out/quality_general.log" 2>&1
    status=$?
    tail -40 "$out/quality_general.log"
    exit $status
    ;;
quality)
    out=${1:?OUT}; mkdir -p "$out"
    python benchmarks/bench_mtp_draft_quality.py --data .data/test.jsonl --num_questions 200 --steps 1 2 3 4 --asd_usage \
        --out "$out/mtp_draft_quality.json" > "$out/quality.log" 2>&1
    tail -12 "$out/quality.log"
    ;;
eval)
    out=${1:?OUT}; k=${2:?K}; sweep=${3-}; budget=${4:-420}; mkdir -p "$out"
    work=$(mktemp -d)
    python -m lightllm.tools.asd_calibrate --data .data/train.jsonl --num_questions "$CALIB_QUESTIONS" \
        --mtp_step "$k" --max_new_tokens "$EVAL_NEW_TOKENS" --out "$work/calib_k$k.json" > "$out/eval_k$k.log" 2>&1 &&
    python -m lightllm.tools.eval_gsm8k --data .data/test.jsonl --out_dir "$work/eval_k$k" --mtp_step "$k" \
        --concurrency "$EVAL_CONCURRENCY" --max_new_tokens "$EVAL_NEW_TOKENS" --calib "$work/calib_k$k.json" \
        --sweep "$sweep" --time_budget_s "$budget" >> "$out/eval_k$k.log" 2>&1
    status=$?
    tar czf "$out/eval_k$k.tgz" -C "$work" .
    tail -3 "$out/eval_k$k.log"
    exit $status
    ;;
suite)
    out=${1:?OUT}; shift
    GPU_CI_PATHS="${*:-unit_tests}" bash unit_tests/run_gpu_ci.sh "$out" -q -p no:cacheprovider > "$out.log" 2>&1
    status=$?
    rm -f "$out/pytest.log"  # the summary, failures and junit come back; the log is $out.log
    cat "$out/summary.txt" "$out/failed.txt" "$out/failed_live.txt"
    exit $status
    ;;
multi_gpu)
    out=${1:?OUT}; what=${2:-all}; mkdir -p "$out"
    if [[ "$what" != bench ]]; then
        GPU_CI_WORKERS=0 GPU_CI_PATHS=unit_tests/server/test_multi_gpu.py bash unit_tests/run_gpu_ci.sh "$out/tests" \
            -v -p no:cacheprovider > "$out/tests.log" 2>&1
        cat "$out/tests/summary.txt"
    fi
    [[ "$what" == tests ]] && exit 0
    python benchmarks/bench_e2e_throughput.py --num_prompts 256 --max_new_tokens 128 --ignore_eos \
        --concurrency 128 --skip_hf --gsm8k .data/test.jsonl \
        --configs "tp1=;tp2_dp2=--tp 2 --dp 2;tp1_mtp3=--mtp_mode eagle_with_att --mtp_step 3;tp2_dp2_mtp3=--tp 2 --dp 2 --mtp_mode eagle_with_att --mtp_step 3" \
        --out "$out/e2e_tp.json" > "$out/e2e.log" 2>&1
    tail -8 "$out/e2e.log"
    ;;
tp)
    # issue 31: the 8B-shaped dummy at --tp 1 and each larger --tp this machine has GPUs for (graphs with
    # --enable_tp_cudagraph, and eager), plain and MTP K = 3 with a random draft, batch 1 / 64 / 256 (TP_FLAGS: more)
    out=${1:?OUT}; mkdir -p "$out"
    unpack_data
    timeout "${TP_TIMEOUT:-560}" python benchmarks/bench_tp.py --gsm8k .data/test.jsonl ${TP_FLAGS:-} \
        --out "$out/tp.json" > "$out/tp.log" 2>&1
    echo "rc $?"; grep -v " INFO " "$out/tp.log" | tail -40
    ;;
arms)
    out=${1:?OUT}; name=${2:?NAME}; mkdir -p "$out"
    for k in 3 2; do
        python benchmarks/asd_arms_inprocess.py --data .data/test.jsonl --num_questions 256 --max_new_tokens 256 \
            --mtp_step "$k" --arms strict,2.0625:0.25:2,8:0.25:2 --out "$out/arms_${name}_k$k.json" 2>&1 | grep "^|"
    done
    ;;
budgets)
    out=${1:?OUT}; k=${2:?K}; conc=${3:-$EVAL_CONCURRENCY}; nq=${4:-}; budgets=${5:-0,2.0625,8}; mkdir -p "$out"
    name=budgets${BUDGETS_MTP_MODE:+_$BUDGETS_MTP_MODE}_k${k}_c$conc${BUDGETS_NAME:-}
    arms=()  # BUDGETS_ARMS="w0=--router_max_wait_tokens 0;w4=--router_max_wait_tokens 4": servers in one run
    if [ -n "${BUDGETS_ARMS:-}" ]; then IFS=';' read -ra specs <<< "$BUDGETS_ARMS"; arms=(--arms "${specs[@]}"); fi
    python benchmarks/bench_asd_budgets.py --data .data/test.jsonl --mtp_step "$k" --budgets "$budgets" --rounds "${BUDGETS_ROUNDS:-3}" \
        --concurrency "$conc" ${nq:+--num_questions "$nq"} --max_new_tokens "$EVAL_NEW_TOKENS" \
        ${BUDGETS_MTP_MODE:+--mtp_mode "$BUDGETS_MTP_MODE"} "${arms[@]}" \
        --server_args "${BUDGETS_SERVER_ARGS:-}" --out "$out/$name.json" > "$out/$name.log" 2>&1
    grep -E "^\||identical|^== arm|^Arms" "$out/$name.log"
    ;;
mixed)
    out=${1:?OUT}; old=${2:-}; mkdir -p "$out"
    trees=(".:new")
    if [ -n "$old" ]; then
        # the machine's .git may hold only the session start's commits: the checkout's profiler runs there
        if git worktree add -f --detach /tmp/mixed_old "$old" > "$out/worktree.log" 2>&1; then
            cp benchmarks/profile_mixed_step.py /tmp/mixed_old/benchmarks/ && trees+=("/tmp/mixed_old:old")
        else
            echo "no worktree at $old (see worktree.log)"
        fi
    fi
    data=$(pwd)/.data/test.jsonl
    for tree in "${trees[@]}"; do
        dir=${tree%%:*}; tag=${tree##*:}
        for name in ${MIXED_ARMS:-gsm8k long512 long2048}; do
            case $name in
                gsm8k) arm="--num_prompts 512";;
                long512) arm="--num_prompts 320 --long_every 5 --batch_max_tokens 512";;
                long2048) arm="--num_prompts 320 --long_every 5";;
                *) echo "unknown mixed arm $name (gsm8k, long512, long2048)" >&2; continue;;
            esac
            # env.sh puts the checkout on PYTHONPATH: each tree must import its own lightllm
            (cd "$dir" && PYTHONPATH=/tmp/site:$PWD python benchmarks/profile_mixed_step.py --gsm8k "$data" $arm --prompt_cache \
                --trace_steps 20 --out "$out/mixed_${name}_$tag.json" > "$out/mixed_${name}_$tag.log" 2>&1)
            echo "== $tag $name"; grep -E "^engine steps|^traced" "$out/mixed_${name}_$tag.log"
        done
    done
    ;;
mixed_calls)
    # no model parts: .smol_shape (the embedded shape, dummy weights) and .dz; the serving-like mix at 512-token
    # chunks, eagle K = 3: each attention call of mixed and decode step N (eager), then the graphed steps' kernels
    out=${1:?OUT}; n=${2:-40}; mkdir -p "$out"
    unpack_data
    m=$(shape_model_dir) || exit 1
    mix=(--gsm8k .data/test.jsonl --model_dir "$m" --load_format dummy --num_prompts 200 --long_every 5
         --long_tokens 3000 --batch_max_tokens 512)
    timeout 240 python benchmarks/profile_mixed_step.py "${mix[@]}" --attention_calls "$n" --out "$out/calls.json" \
        > "$out/calls.log" 2>&1; echo "calls rc $?"
    grep -A 70 "^attention calls of" "$out/calls.log" | grep -E "^attention|#0[0-3]|sum"
    timeout 240 python benchmarks/profile_mixed_step.py "${mix[@]}" --trace_steps 20 --out "$out/trace.json" \
        > "$out/trace.log" 2>&1; echo "trace rc $?"
    grep -E "^engine steps|^traced" "$out/trace.log"
    ;;
profile)
    out=${1:?OUT}; mkdir -p "$out"
    for k in 0 3; do
        python benchmarks/profile_decode_step.py --batch 256 --mtp_step "$k" > "$out/profile_k$k.txt" 2>&1
        head -1 "$out/profile_k$k.txt"
    done
    ;;
shape_model_dir)
    shape_model_dir
    ;;
pack)
    tar czf /tmp/out.tgz -C "${OUT:?}" . && rm -rf "${OUT:?}"/* && mv /tmp/out.tgz "$OUT/out.tgz"
    ls -la "$OUT"
    ;;
*)
    echo "unknown job $job" >&2; exit 2
    ;;
esac

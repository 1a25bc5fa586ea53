#!/usr/bin/env bash
# Session 42's device calls (docs/gpu_ci.md), one verb each, in this order on one warm machine:
#   call_l.sh att      slimmed tree, .mparts/part_aa, part_ab: as session41/call_k.sh att (the fused kernels' CUDA
#                      tests, then the attention's decode and MTP-rows cases beside the bare read: issue 25's floor)
#   call_l.sh attab    slimmed tree (the model's parts only to stage them for later calls): the attention's CUDA
#                      tests (ATTAB_TESTS=0: not), then bench_attention's decode and MTP-rows cases (the bare read
#                      beside each: issue 25's floor) in the checkout and against one_row_loads_old.patch (one-row
#                      blocks read their row tables before the first keys, as before this session's kernel change)
#                      and no_merge_diag.patch (a diagnostic, wrong output: no counter and no merge, the split
#                      merge's cost), ATTAB_ROUNDS (1) rounds
#   call_l.sh fused    slimmed tree, .mparts/part_ac, part_ad, .smol_shape: as call_k.sh fused (first time on an H200)
#   call_l.sh mixprof  slimmed tree, .mparts/part_ac, part_ad, .smol_shape, .dz: profile_mixed_step.py (plain, dummy
#                      weights, the serving-like mix: every fifth prompt 3000 tokens) at 256- and 2048-token chunks,
#                      GPU kernels of 20 mixed and 20 decode steps (why a 256-token mixed step costs ~1.1 ms over a
#                      decode step, docs/decode_step.md)
#   call_l.sh wait     whole tree, .dz, .whl, .smol_shape: eagle's budgets at --router_max_wait_tokens 1 (default)
#                      and 4, WAIT_ROUNDS (3) rounds (issue 26's decode batch and gain ratio)
#   call_l.sh dspark   same carry: dspark's budgets, B = 0 and usage, DSPARK_ROUNDS (3) rounds
#   call_l.sh mixed    same carry: the serving mix at --mixed_max_prefill_tokens 384 beside the default, MIXED_ROUNDS (2)
#   call_l.sh pace     same carry: the serving mix (plain, dummy weights) at --mixed_prefill_pace_steps 4 and 16 beside
#                      the default (PACE_ARMS: others), PACE_ROUNDS (2) rounds, then with PACE_ASD=1 (the model's
#                      parts carried before) ASD usage on the real model at 16 beside the default (one round): short
#                      requests' ITL p99 / p50 and tok/s (issue 26)
#   call_l.sh batch1   same carry: gpu_session.sh batch1_line (issue 30: dspark's batch-1 usage line against eagle)
V=${1:?att, attab, fused, mixprof, wait, dspark, mixed, pace or batch1}
case $V in
att|fused) exec bash docs/data/perf/session41/call_k.sh "$@" ;;
attab) source scripts/device/env.sh >/dev/null 2>&1; nvidia-smi --query-gpu=name --format=csv,noheader
       P=docs/data/perf/session42; S=$(date +%s)
       [ "${ATTAB_TESTS:-1}" = 1 ] && timeout 150 python -m pytest -q -p no:cacheprovider \
           unit_tests/models/llama/triton_kernel/test_unified_attention.py unit_tests/models/llama/test_attention_backends.py \
           2>&1 | tail -2
       ATTENTION_AB_ROUNDS=${ATTAB_ROUNDS:-1} timeout ${ATTAB_S:-300} bash scripts/device/gpu_session.sh attention_ab \
           "${OUT:?}/attab" old_rows=$P/one_row_loads_old.patch no_merge=$P/no_merge_diag.patch \
           2>&1 | tail -40
       echo "attab $(( $(date +%s) - S )) s"; exit 0 ;;
wait) export WAIT_ROUNDS=${WAIT_ROUNDS:-3} WAIT_ARMS="w1=--router_max_wait_tokens 1;w4=--router_max_wait_tokens 4"
      exec bash docs/data/perf/session40/call_j.sh wait ;;
dspark|mixed|batch1|mixprof|pace) ;;
*) echo "unknown verb $V" >&2; exit 2 ;;
esac
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}; G=scripts/device/gpu_session.sh
nvidia-smi --query-gpu=name --format=csv,noheader
bash $G data >/dev/null 2>&1
case $V in
dspark) BUDGETS_MTP_MODE=dspark BUDGETS_ROUNDS=${DSPARK_ROUNDS:-3} timeout ${DSPARK_S:-420} \
            bash $G budgets "$O/b" 3 64 1319 0,2.0625 2>&1 | grep -E "^== arm|^\| (0|2.0625) " | cut -c1-220 ;;
mixed) SERVING_AB_ROUNDS=${MIXED_ROUNDS:-2} SERVING_AB_ARMS="m384=--mixed_max_prefill_tokens 384" \
           timeout ${MIXED_S:-330} bash $G serving_ab "$O/sab" 2>&1 | tail -14 ;;
mixprof) m=$(bash $G shape_model_dir)
         for c in 256 2048; do
             timeout ${MIXPROF_S:-150} python benchmarks/profile_mixed_step.py --gsm8k .data/test.jsonl --model_dir "$m" \
                 --load_format dummy --mtp_step 0 --num_prompts 320 --long_every 5 --long_tokens 3000 \
                 --batch_max_tokens $c --trace_steps 20 --out "$O/mixprof_$c.json" > "$O/mixprof_$c.log" 2>&1
             echo "== chunks $c rc $?"; grep -E "^engine steps|^traced|^ +[0-9.]+ us" "$O/mixprof_$c.log" | head -36
         done ;;
pace) SERVING_AB_ROUNDS=${PACE_ROUNDS:-2} SERVING_AB_ARMS=${PACE_ARMS:-"p4=--mixed_prefill_pace_steps 4;p16=--mixed_prefill_pace_steps 16"} \
          timeout ${PACE_S:-330} bash $G serving_ab "$O/pace" 2>&1 | tail -14
      [ -n "${PACE_ASD:-}" ] && SERVING_AB_ROUNDS=1 SERVING_AB_REAL=1 SERVING_MODES=asd_usage SERVING_AB_ARMS="p16=--mixed_prefill_pace_steps 16" \
          timeout ${PACE_ASD_S:-200} bash $G serving_ab "$O/pace_asd" 2>&1 | tail -8 ;;
batch1) timeout ${BATCH1_S:-420} bash $G batch1_line "$O/b1" 2>&1 | tail -20 ;;
esac
echo "total $(( $(date +%s) - S )) s"

#!/usr/bin/env bash
# Session 39's device calls (docs/gpu_ci.md), one verb each:
#   call_i.sh ab|gaps|suite|serving   as docs/data/perf/session38/call_h.sh (the A/B against admission_old.patch,
#                      the whole suite): run by it
#   call_i.sh tune     whole tree, .dz, .whl, .smol_shape, the model's parts left by two calls before: the serving mix
#                      at mixed-step prompt budgets 512 and 1024 beside the default (one round, dummy weights), then
#                      eagle's budgets at --router_max_wait_tokens 0, 2 and 4 (one server each, rounds interleaved)
#   call_i.sh wait     the model's parts first, then the whole tree, .dz, .whl, .smol_shape: eagle's budgets at
#                      --router_max_wait_tokens 0, 1, 2 and 4 in three rounds (about 6-7 minutes on an H200)
#   call_i.sh mtpmix   the model's parts first, then the whole tree, .dz, .whl, .smol_shape: MTP mixed steps left in
#                      flight (20efe86, fdf3e9d, 74baea1) against patches/mtp_mixed_sync.patch over HTTP, the real model, ASD's usage
#                      line (eagle K = 3) on the serving mix, two rounds interleaved (about 5 minutes), then their
#                      CUDA test
#   call_i.sh mixed    slimmed tree, .dz, .smol_shape, .whl: the serving mix at --mixed_max_prefill_tokens 256, 512 and
#                      1024 beside the default, two rounds (dummy weights; about 6 minutes), then the two tests fixed
#                      in 356cc08 and the attention's decode cases beside the bare read of the same bytes (read_floor.py)
case ${1:?ab, gaps, suite, serving, tune, wait, mixed or mtpmix} in
ab|gaps|suite|serving) exec bash docs/data/perf/session38/call_h.sh "$@" ;;
tune|wait|mixed|mtpmix) ;;
*) echo "unknown verb $1" >&2; exit 2 ;;
esac
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}; G=scripts/device/gpu_session.sh
nvidia-smi --query-gpu=name --format=csv,noheader
case $1 in
tune) SERVING_AB_ROUNDS=1 SERVING_AB_ARMS="m512=--mixed_max_prefill_tokens 512;m1024=--mixed_max_prefill_tokens 1024" \
          timeout 170 bash $G serving_ab "$O/sab" 2>&1 | tail -6
      bash $G data >/dev/null 2>&1
      BUDGETS_NAME=_wait BUDGETS_ARMS="w0=--router_max_wait_tokens 0;w2=--router_max_wait_tokens 2;w4=--router_max_wait_tokens 4" \
          timeout ${TUNE_BUDGETS_S:-260} bash $G budgets "$O/b" 3 64 1319 0,2.0625 2>&1 | grep -E "^== arm|^\| (0|2.0625) " | cut -c1-220 ;;
wait) bash $G data >/dev/null 2>&1
      BUDGETS_NAME=_wait BUDGETS_ARMS="w0=--router_max_wait_tokens 0;w1=--router_max_wait_tokens 1;w2=--router_max_wait_tokens 2;w4=--router_max_wait_tokens 4" \
          timeout ${WAIT_S:-560} bash $G budgets "$O/b" 3 64 1319 0,2.0625 2>&1 | grep -E "^== arm|^\| (w[0-9]|0|2.0625) " | cut -c1-220 ;;
mtpmix) bash $G data >/dev/null 2>&1
        SERVING_AB_REAL=1 SERVING_MODES=asd_usage SERVING_AB_ROUNDS=2 timeout ${MTPMIX_S:-420} bash $G serving_ab \
            "$O/sab" sync=docs/data/perf/session39/patches/mtp_mixed_sync.patch 2>&1 | tail -12
        timeout 150 python -m pytest -q -p no:cacheprovider unit_tests/server/router/model_infer/test_mixed_steps_cuda.py \
            2>&1 | tail -3 ;;
mixed) SERVING_AB_ROUNDS=2 SERVING_AB_ARMS="m256=--mixed_max_prefill_tokens 256;m512=--mixed_max_prefill_tokens 512;m1024=--mixed_max_prefill_tokens 1024" \
           timeout ${MIXED_S:-480} bash $G serving_ab "$O/sab" 2>&1 | tail -18
       timeout 90 python -m pytest -q -p no:cacheprovider unit_tests/benchmarks/test_profile_serving_gaps.py \
           unit_tests/benchmarks/test_bench_tp.py 2>&1 | tail -3
       ATTENTION_FLAGS="--cases decode mtp_rows" timeout 120 bash $G attention "$O/att" 2>&1 | tail -14 ;;
esac
echo "total $(( $(date +%s) - S )) s"

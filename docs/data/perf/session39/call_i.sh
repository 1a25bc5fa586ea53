#!/usr/bin/env bash
# Session 39's device calls (docs/gpu_ci.md), one verb each:
#   call_i.sh gaps     slimmed tree, .dz, .smol_shape (no model: dummy weights of its shape; model parts may ride
#                      along, env.sh assembles them for a later suite): with GAPS_TESTS=1 the admission and reap CUDA
#                      tests first, then the serving mix's gaps and host phases, the checkout against the tree
#                      before them (the old patch), GAPS_ROUNDS interleaved rounds (default 2)
#   call_i.sh suite    call 3 (whole tree, .dz, .whl, .smol_shape): the whole GPU suite with the model
#   call_i.sh serving  call 4 (the same carry): client ITL and tok/s, the checkout against the old patch
#   call_i.sh tune     whole tree, .dz, .whl, .smol_shape, the model's parts left by two calls before: the serving mix
#                      at mixed-step prompt budgets 512 and 1024 beside the default (one round, dummy weights), then
#                      eagle's budgets at --router_max_wait_tokens 0, 2 and 4 (one server each, rounds interleaved)
#   call_i.sh wait     the model's parts first, then the whole tree, .dz, .whl, .smol_shape: eagle's budgets at
#                      --router_max_wait_tokens 0, 1, 2 and 4 in three rounds (about 6-7 minutes on an H200)
#   call_i.sh mixed    slimmed tree, .dz, .smol_shape, .whl: the serving mix at --mixed_max_prefill_tokens 256, 512 and
#                      1024 beside the default, two rounds (dummy weights; about 6 minutes), then the two tests fixed
#                      in 356cc08
#   call_i.sh ab       one call instead of 1, 2 and 4 (slimmed tree, .dz, .smol_shape, .whl; no model parts): the CUDA
#                      tests of the change, the gaps A/B (two rounds), then serving_ab (one round), ~8 minutes
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}; G=scripts/device/gpu_session.sh
OLD=old=docs/data/perf/session38/patches/admission_old.patch
tests() {
    timeout 120 python -m pytest -q -p no:cacheprovider unit_tests/common/basemodel/triton_kernel/test_init_req_rows.py \
        unit_tests/server/router/test_worker_survival.py 2>&1 | tail -3
}
gaps_ab() {
    GAPS_ARMS=" " GAPS_ROUNDS=${GAPS_ROUNDS:-2} GAPS_FLAGS=${GAPS_FLAGS:---num_prompts 384} timeout ${GAPS_S:-420} bash $G gaps "$O/gaps" \
        $OLD 2>&1 | grep -E "^round|p50|p99|gap|admit|reap|stage|launch|idle_ms\"|left_idle" | cut -c1-160 | head -90
}
case ${1:?gaps, suite, serving, ab, tune, wait or mixed} in
gaps) nvidia-smi --query-gpu=name --format=csv,noheader
      if [[ -n "${GAPS_TESTS:-}" ]]; then tests; fi
      gaps_ab ;;
ab) nvidia-smi --query-gpu=name --format=csv,noheader
    tests
    GAPS_S=220 gaps_ab
    SERVING_AB_ROUNDS=1 timeout 230 bash $G serving_ab "$O/sab" $OLD 2>&1 | tail -8 ;;
tune) nvidia-smi --query-gpu=name --format=csv,noheader
      SERVING_AB_ROUNDS=1 SERVING_AB_ARMS="m512=--mixed_max_prefill_tokens 512;m1024=--mixed_max_prefill_tokens 1024" \
          timeout 170 bash $G serving_ab "$O/sab" 2>&1 | tail -6
      bash $G data >/dev/null 2>&1
      BUDGETS_NAME=_wait BUDGETS_ARMS="w0=--router_max_wait_tokens 0;w2=--router_max_wait_tokens 2;w4=--router_max_wait_tokens 4" \
          timeout ${TUNE_BUDGETS_S:-260} bash $G budgets "$O/b" 3 64 1319 0,2.0625 2>&1 | grep -E "^== arm|^\| (0|2.0625) " | cut -c1-220 ;;
wait) nvidia-smi --query-gpu=name --format=csv,noheader
      bash $G data >/dev/null 2>&1
      BUDGETS_NAME=_wait BUDGETS_ARMS="w0=--router_max_wait_tokens 0;w1=--router_max_wait_tokens 1;w2=--router_max_wait_tokens 2;w4=--router_max_wait_tokens 4" \
          timeout ${WAIT_S:-560} bash $G budgets "$O/b" 3 64 1319 0,2.0625 2>&1 | grep -E "^== arm|^\| (w[0-9]|0|2.0625) " | cut -c1-220 ;;
mixed) nvidia-smi --query-gpu=name --format=csv,noheader
       SERVING_AB_ROUNDS=2 SERVING_AB_ARMS="m256=--mixed_max_prefill_tokens 256;m512=--mixed_max_prefill_tokens 512;m1024=--mixed_max_prefill_tokens 1024" \
           timeout ${MIXED_S:-480} bash $G serving_ab "$O/sab" 2>&1 | tail -18
       timeout 90 python -m pytest -q -p no:cacheprovider unit_tests/benchmarks/test_profile_serving_gaps.py \
           unit_tests/benchmarks/test_bench_tp.py 2>&1 | tail -3 ;;
suite) bash $G data >/dev/null 2>&1
       GPU_CI_WORKERS=12 timeout ${SUITE_S:-420} bash $G suite "$O/suite" 2>&1 | tail -14 ;;
serving) SERVING_AB_ROUNDS=${SERVING_AB_ROUNDS:-2} timeout 560 bash $G serving_ab "$O/sab" $OLD 2>&1 | tail -12 ;;
esac
echo "total $(( $(date +%s) - S )) s"

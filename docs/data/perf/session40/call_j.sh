#!/usr/bin/env bash
# Session 40's device calls (docs/gpu_ci.md), one verb each:
#   call_j.sh parts    the model's parts carried by this call (source env.sh leaves them in /root/m)
#   call_j.sh wait     whole tree, .dz, .whl, .smol_shape, the model assembled by two parts calls before:
#                      test_mixed_steps_cuda.py (MTP mixed steps left in flight, token ids against one request
#                      at a time), then eagle's budgets at --router_max_wait_tokens 0, 1, 2 and 4, WAIT_ROUNDS rounds
#   call_j.sh fused    .smol_shape (dummy weights; else the model the parts calls left): the fused SwiGLU / residual-norm kernels' CUDA tests,
#                      then decode steps (dummy weights, graphs) against patches/unfused_ffn.patch, FUSED_ROUNDS rounds
#   call_j.sh mtpmix | mixed   as docs/data/perf/session39/call_i.sh (MIXED_ROUNDS: mixed's rounds)
case ${1:?parts, wait, fused, mtpmix or mixed} in
parts) source scripts/device/env.sh >/dev/null 2>&1; ls /root/m; nvidia-smi --query-gpu=name --format=csv,noheader
       exit 0 ;;
mtpmix) exec bash docs/data/perf/session39/call_i.sh "$@" ;;
mixed) sed "s/SERVING_AB_ROUNDS=2 SERVING_AB_ARMS=\"m256/SERVING_AB_ROUNDS=${MIXED_ROUNDS:-2} SERVING_AB_ARMS=\"m256/" \
           docs/data/perf/session39/call_i.sh > /tmp/call_i.sh && exec bash /tmp/call_i.sh mixed ;;
wait|fused) ;;
*) echo "unknown verb $1" >&2; exit 2 ;;
esac
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}; G=scripts/device/gpu_session.sh
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$1" = fused ]; then
    timeout 150 python -m pytest -q -p no:cacheprovider unit_tests/common/basemodel/triton_kernel/test_silu_and_mul.py \
        unit_tests/common/basemodel/triton_kernel/test_fused_norm_rotary.py unit_tests/models/llama/test_fused_layer_ops.py \
        2>&1 | tail -3
    STEPS_AB_ROUNDS=${FUSED_ROUNDS:-2} STEPS_AB_CASES="--batch 1;--batch 64;--batch 64 --mtp_step 3" timeout ${FUSED_S:-400} \
        bash $G steps_ab "$O/sab" unfused=docs/data/perf/session40/patches/unfused_ffn.patch 2>&1 | tail -14
    echo "total $(( $(date +%s) - S )) s"; exit 0
fi
bash $G data >/dev/null 2>&1
timeout 150 python -m pytest -q -p no:cacheprovider unit_tests/server/router/model_infer/test_mixed_steps_cuda.py 2>&1 | tail -3
BUDGETS_ROUNDS=${WAIT_ROUNDS:-2} BUDGETS_NAME=_wait \
    BUDGETS_ARMS=${WAIT_ARMS:-"w0=--router_max_wait_tokens 0;w1=--router_max_wait_tokens 1;w2=--router_max_wait_tokens 2;w4=--router_max_wait_tokens 4"} \
    timeout ${WAIT_S:-420} bash $G budgets "$O/b" 3 64 1319 0,2.0625 2>&1 | grep -E "^== arm|^\| (w[0-9]|0|2.0625) " | cut -c1-220
echo "total $(( $(date +%s) - S )) s"

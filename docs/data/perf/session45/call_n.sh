#!/usr/bin/env bash
# Session 45's device calls (docs/gpu_ci.md), slimmed tree, carry .whl, .dz, .smol_shape:
#   call_n.sh sweep   the serving mix (plain, dummy weights) at the default beside --mixed_prefill_pace_steps 16
#                     and --mixed_max_prefill_tokens 256, SWEEP_ROUNDS (2) rounds in rotated order: the client's and
#                     the router's short-request ITL p99 / p50 against tok/s (issue 26), since the HTTP process's
#                     0.5 ms switch interval
V=${1:?sweep}
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}; G=scripts/device/gpu_session.sh
nvidia-smi --query-gpu=name --format=csv,noheader
bash $G data >/dev/null 2>&1
case $V in
sweep) SERVING_AB_ROUNDS=${SWEEP_ROUNDS:-2} \
           SERVING_AB_ARMS=${SWEEP_ARMS:-"p16=--mixed_prefill_pace_steps 16;m256=--mixed_max_prefill_tokens 256"} \
           timeout ${SWEEP_S:-540} bash $G serving_ab "$O/sweep" 2>&1 | tail -8
       rm -f "$O"/*/*.log ;;
*) echo "unknown verb $V" >&2; exit 2 ;;
esac
echo "total $(( $(date +%s) - S )) s"

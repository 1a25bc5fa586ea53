#!/usr/bin/env bash
# Session 41's device calls (docs/gpu_ci.md), one verb each, in this order on one warm machine:
#   call_k.sh att      slimmed tree, .mparts/part_aa, part_ab (left in /root/m): the fused kernels' CUDA tests, then
#                      the attention's decode and MTP-rows cases beside the bare read of the same bytes (read_floor.py)
#   call_k.sh fused    slimmed tree, .mparts/part_ac, part_ad (the model assembles), .smol_shape: the fused layer
#                      against the op-by-op one, then decode steps (dummy weights, graphs) against
#                      patches/unfused_ffn.patch, FUSED_ROUNDS rounds (plain only: a slimmed tree has no draft weights;
#                      the MTP case ran with the whole tree, gpu_ci.md row 2026-12-07 04:08)
#   call_k.sh wait     whole tree, .dz, .whl, .smol_shape: as session40/call_j.sh wait (MTP mixed steps' CUDA test,
#                      eagle's budgets at --router_max_wait_tokens 0, 1, 2, 4)
#   call_k.sh mixed    whole tree, .dz, .whl, .smol_shape: the serving mix at --mixed_max_prefill_tokens 256, 512,
#                      1024 beside the default (dummy weights, MIXED_ROUNDS rounds), then graphs against eager with
#                      the fused layer on the real model (test_cuda_graph_decode.py)
#   call_k.sh mtpmix   as session40/call_j.sh mtpmix
case ${1:?att, fused, wait, mixed or mtpmix} in
mtpmix|wait) exec bash docs/data/perf/session40/call_j.sh "$@" ;;
att|fused|mixed) ;;
*) echo "unknown verb $1" >&2; exit 2 ;;
esac
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}; G=scripts/device/gpu_session.sh; T=unit_tests/common/basemodel/triton_kernel
nvidia-smi --query-gpu=name --format=csv,noheader; ls /root/m
case $1 in
att) timeout 120 python -m pytest -q -p no:cacheprovider $T/test_silu_and_mul.py $T/test_fused_norm_rotary.py 2>&1 | tail -2
     ATTENTION_FLAGS="--cases decode mtp_rows" timeout ${ATT_S:-240} bash $G attention "$O/att" 2>&1 | tail -16 ;;
fused) timeout 120 python -m pytest -q -p no:cacheprovider unit_tests/models/llama/test_fused_layer_ops.py 2>&1 | tail -2
       STEPS_AB_ROUNDS=${FUSED_ROUNDS:-1} STEPS_AB_CASES="--batch 1;--batch 64" timeout ${FUSED_S:-240} \
           bash $G steps_ab "$O/sab" unfused=docs/data/perf/session41/patches/unfused_ffn.patch 2>&1 | tail -14 ;;
mixed) SERVING_AB_ROUNDS=${MIXED_ROUNDS:-1} SERVING_AB_ARMS="m256=--mixed_max_prefill_tokens 256;m512=--mixed_max_prefill_tokens 512;m1024=--mixed_max_prefill_tokens 1024" \
           timeout ${MIXED_S:-330} bash $G serving_ab "$O/sab" 2>&1 | tail -18
       timeout ${GRAPHS_S:-200} python -m pytest -q -p no:cacheprovider \
           unit_tests/server/router/model_infer/test_cuda_graph_decode.py 2>&1 | tail -3 ;;
esac
echo "total $(( $(date +%s) - S )) s"

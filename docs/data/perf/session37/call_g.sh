#!/usr/bin/env bash
# Session 37's device calls (docs/gpu_ci.md, the thirty-sixth session's list), one verb each:
#   call_g.sh att      call 1 (slimmed tree, model parts aa, ab): issue 25's decode and MTP-rows bars (no model)
#   call_g.sh gaps     call 2 (slimmed tree, parts ac, ad, .dz, .smol_shape; env.sh assembles the model): the serving
#                      mix's gaps and host phases, the checkout against the schedule before d4dd3c1 (the old patch),
#                      two interleaved rounds
#   call_g.sh suite    call 3 (whole tree, .dz, .whl, .smol_shape): the whole GPU suite with the model
#   call_g.sh serving  call 4 (the same carry): client ITL and tok/s, the checkout against the old schedule
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}; G=scripts/device/gpu_session.sh
OLD=old=docs/data/perf/session36/patches/mixed_gate_old.patch
case ${1:?att, gaps, suite or serving} in
att) nvidia-smi --query-gpu=name --format=csv,noheader
     ATTENTION_FLAGS="--cases decode mtp_rows" timeout 280 bash $G attention "$O/att" 2>&1 | tail -12 ;;
gaps) GAPS_ARMS=" " GAPS_ROUNDS=2 GAPS_FLAGS="--num_prompts 384" timeout 300 bash $G gaps "$O/gaps" $OLD 2>&1 \
        | grep -E "^round|p50|p99|gap|host|wait|admi|stag|reap" | cut -c1-160 | head -80 ;;
suite) bash $G data >/dev/null 2>&1
       GPU_CI_WORKERS=12 timeout ${SUITE_S:-400} bash $G suite "$O/suite" 2>&1 | tail -14 ;;
serving) SERVING_AB_ROUNDS=2 timeout 560 bash $G serving_ab "$O/sab" $OLD 2>&1 | tail -12 ;;
esac
echo "total $(( $(date +%s) - S )) s"

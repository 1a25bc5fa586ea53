#!/usr/bin/env bash
# Session 48's device call (docs/gpu_ci.md), slimmed tree, carry .whl, .dz, .smol_shape:
#   call_q.sh auto   on either card, issue 25's batch-1 decode (0.42 of copy there, target 0.5): bench_attention's decode
#                    cases (ATTV_FLAGS) in the checkout and with each small-grid variant of this folder's patches
#                    (splits64: 64 splits of 128 keys, 4 programs an SM; splits16: 16 of 512; warps8: 8 warps;
#                    tile64: 64-key tiles), ATTV_ROUNDS (1), the bare read beside; then (Q_NEXT=1) one round of
#                    the serving mix with two HTTP processes (session46/call_o.sh workers) on an H200, or on an H100
#                    session45/call_n.sh hot (the front end alone, HOT_SERVE=0 HOT_REQS=512)
P=docs/data/perf/session48
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $gpu"
source scripts/device/env.sh >/dev/null 2>&1; S=$(date +%s)
ATTENTION_AB_ROUNDS=${ATTV_ROUNDS:-1} ATTENTION_FLAGS=${ATTV_FLAGS:-"--cases decode"} \
    timeout ${ATTV_S:-300} bash scripts/device/gpu_session.sh attention_ab "${OUT:?}/attv" \
    splits64=$P/splits64.patch splits16=$P/splits16.patch warps8=$P/warps8.patch tile64=$P/tile64.patch \
    2>&1 | grep -v '\.\.\.$' | tail -40
echo "attv $(( $(date +%s) - S )) s"
tar -C "$OUT" -czf "$OUT/attv.tgz" attv && rm -rf "$OUT/attv"  # files back: 8 at most
[ "${Q_NEXT:-1}" = 1 ] || exit 0
case $gpu in
*H200*) WORKERS_ROUNDS=1 WORKERS_S=${Q_WORKERS_S:-240} bash docs/data/perf/session46/call_o.sh workers ;;
*) HOT_SERVE=0 HOT_REQS=512 FRONT_S=70 bash docs/data/perf/session45/call_n.sh hot ;;
esac

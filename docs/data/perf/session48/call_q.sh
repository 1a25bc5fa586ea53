#!/usr/bin/env bash
# Session 48's device call (docs/gpu_ci.md), slimmed tree, carry .whl, .dz, .smol_shape:
#   call_q.sh auto   on either card, issue 25's batch-1 decode (0.42 of copy there, target 0.5): bench_attention's decode
#                    cases (ATTV_FLAGS) in the checkout and with each small-grid variant of this folder's patches
#                    (splits64: 64 splits of 128 keys, 4 programs an SM; splits16: 16 of 512; warps8: 8 warps;
#                    tile64: 64-key tiles), ATTV_ROUNDS (1), the bare read beside; then (Q_NEXT=1) one round of
#                    the serving mix with two HTTP processes (session46/call_o.sh workers) on an H200, or on an H100
#                    call_q.sh client
#   call_q.sh client the front end alone (session46/call_o.sh front: even 2.1-ms fake steps, one HTTP process) with 2, 4, 8 client
#                    processes: the client's ITL p99 / p50 beside the server's own (when the app handed each part to
#                    the socket) and the clients' loop lag (issue 26: is the 2.0x at the front end the client's own
#                    stamping?)
P=docs/data/perf/session48
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $gpu"
source scripts/device/env.sh >/dev/null 2>&1; S=$(date +%s)
if [ "${1:-auto}" = client ]; then
    exec env FRONT_ROUNDS=1 FRONT_S=${CLIENT_S:-90} FRONT_REQS=${CLIENT_REQS:-1024} \
        FRONT_ARMS="p2=--client_procs 2;p4=--client_procs 4;p8=--client_procs 8" \
        FRONT_KEYS="output_tok_s itl_ms_p50 itl_ms_p99 itl_p99_over_p50 server_itl_ms_p50 server_itl_ms_p99 \
server_itl_p99_over_p50 tokens_per_chunk loop_lag_ms_p99 client_loop_lag_ms_p50 client_loop_lag_ms_p99" \
        bash docs/data/perf/session46/call_o.sh front
fi
ATTENTION_AB_ROUNDS=${ATTV_ROUNDS:-1} ATTENTION_FLAGS=${ATTV_FLAGS:-"--cases decode"} \
    timeout ${ATTV_S:-300} bash scripts/device/gpu_session.sh attention_ab "${OUT:?}/attv" \
    splits64=$P/splits64.patch splits16=$P/splits16.patch warps8=$P/warps8.patch tile64=$P/tile64.patch \
    2>&1 | grep -v '\.\.\.$' | tail -40
echo "attv $(( $(date +%s) - S )) s"
tar -C "$OUT" -czf "$OUT/attv.tgz" attv && rm -rf "$OUT/attv"  # files back: 8 at most
[ "${Q_NEXT:-1}" = 1 ] || exit 0
case $gpu in
*H200*) WORKERS_ROUNDS=1 WORKERS_S=${Q_WORKERS_S:-240} bash docs/data/perf/session46/call_o.sh workers ;;
*) bash "$0" client ;;
esac

#!/usr/bin/env bash
# Session 47's device call (docs/gpu_ci.md), slimmed tree, carry .whl, .dz, .smol_shape:
#   call_p.sh auto   on an H200, issue 25's batch-1 decode A/B first (session42/call_l.sh attab, no tests), then
#                    (P_WORKERS=1, the default) the serving mix with two HTTP processes (session46/call_o.sh workers,
#                    one round); on an H100 the workers call alone, P_ROUNDS (2) rounds: whichever card comes runs
#                    what it can answer
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $gpu"
case $gpu in
*H200*) ATTAB_TESTS=0 ATTAB_S=${P_ATTAB_S:-280} bash docs/data/perf/session42/call_l.sh attab
        tar -C "$OUT" -czf "$OUT/attab.tgz" attab && rm -rf "$OUT/attab"  # files back: 8 at most
        [ "${P_WORKERS:-1}" = 1 ] && WORKERS_ROUNDS=1 WORKERS_S=${P_WORKERS_S:-240} \
            bash docs/data/perf/session46/call_o.sh workers ;;
*) WORKERS_ROUNDS=${P_ROUNDS:-2} bash docs/data/perf/session46/call_o.sh workers ;;
esac

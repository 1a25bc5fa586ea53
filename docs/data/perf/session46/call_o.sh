#!/usr/bin/env bash
# Session 46's device calls (docs/gpu_ci.md), slimmed tree, carry .whl, .dz, .smol_shape:
#   call_o.sh workers   the serving mix (plain, dummy weights) at the default beside --httpserver_workers 2, and
#                       --mixed_max_prefill_tokens 256 with --httpserver_workers 2 (WORKERS_ARMS: others),
#                       WORKERS_ROUNDS (2) rounds in rotated order: the client's and the router's short-request ITL
#                       p99 / p50 against tok/s (issue 26) with the HTTP side spread over two processes
V=${1:?workers}
case $V in
workers) SWEEP_ROUNDS=${WORKERS_ROUNDS:-2} SWEEP_S=${WORKERS_S:-560} \
             SWEEP_ARMS=${WORKERS_ARMS:-"w2=--httpserver_workers 2;m256w2=--mixed_max_prefill_tokens 256 --httpserver_workers 2"} \
             exec bash docs/data/perf/session45/call_n.sh sweep ;;
*) echo "unknown verb $V" >&2; exit 2 ;;
esac

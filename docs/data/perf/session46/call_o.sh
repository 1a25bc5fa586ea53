#!/usr/bin/env bash
# Session 46's device calls (docs/gpu_ci.md), slimmed tree, carry .whl, .dz, .smol_shape:
#   call_o.sh workers   the serving mix (plain, dummy weights) at the default beside --httpserver_workers 2, and
#                       --mixed_max_prefill_tokens 256 with --httpserver_workers 2 (WORKERS_ARMS: others),
#                       WORKERS_ROUNDS (2) rounds in rotated order: the client's and the router's short-request ITL
#                       p99 / p50 against tok/s (issue 26) with the HTTP side spread over two processes
#   call_o.sh front     the front end alone (bench_http_frontend.py: the real HTTP app over a fake worker stepping
#                       evenly every 2.1 ms, 1024 requests of 256 tokens, streamed) at --httpserver_workers 1 and 2,
#                       FRONT_ROUNDS (2) rounds interleaved: the client's ITL p99 / p50 with the HTTP side over one
#                       process and over two (~60 s an arm); FRONT_ARMS ("name=bench flags;..."), FRONT_KEYS (the
#                       row's fields printed)
V=${1:?workers or front}
case $V in
front) source scripts/device/env.sh >/dev/null 2>&1; nvidia-smi --query-gpu=name --format=csv,noheader
       S=$(date +%s); G=scripts/device/gpu_session.sh; bash $G data >/dev/null 2>&1; m=$(bash $G shape_model_dir)
       IFS=';' read -ra arms <<< "${FRONT_ARMS:-w1=--httpserver_workers 1;w2=--httpserver_workers 2}"
       for r in $(seq 1 ${FRONT_ROUNDS:-2}); do for arm in "${arms[@]}"; do
           name=${arm%%=*}
           timeout ${FRONT_S:-100} python benchmarks/bench_http_frontend.py --model_dir "$m" ${arm#*=} \
               --arms stream --step_ms 2.1 --num_requests ${FRONT_REQS:-1024} --max_new_tokens 256 \
               --gsm8k .data/test.jsonl --out "$OUT/front_${name}_r$r.json" > "$OUT/front_${name}_r$r.log" 2>&1
           echo "== $name r$r | rc $?"
           python -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(' '.join(
               f'{k} {r[k]:.2f}' for k in sys.argv[2].split() if r.get(k) is not None), 'client cores',
               round(r['cpu_cores']['client'], 2))" "$OUT/front_${name}_r$r.json" "${FRONT_KEYS:-output_tok_s itl_ms_p50 \
itl_ms_p99 tokens_per_chunk http_main_cpu_us_per_token loop_lag_ms_p99}"
       done; done
       rm -f "$OUT"/front_*.log; echo "total $(( $(date +%s) - S )) s" ;;
workers) SWEEP_ROUNDS=${WORKERS_ROUNDS:-2} SWEEP_S=${WORKERS_S:-560} \
             SWEEP_ARMS=${WORKERS_ARMS:-"w2=--httpserver_workers 2;m256w2=--mixed_max_prefill_tokens 256 --httpserver_workers 2"} \
             exec bash docs/data/perf/session45/call_n.sh sweep ;;
*) echo "unknown verb $V" >&2; exit 2 ;;
esac

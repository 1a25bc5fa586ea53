#!/usr/bin/env bash
# Session 44's device calls (docs/gpu_ci.md), slimmed tree, carry .whl (httptools' wheel in it), .dz, .smol_shape:
#   call_m.sh front   bench_http_frontend.py's stream arm (the real HTTP app over a fake worker stepping every
#                     FRONT_STEP_MS, 2.1: the serving mix's decode step) under --http h11 and the default (auto:
#                     httptools), FRONT_ROUNDS (1) rounds: the HTTP process's CPU per token and the client's ITL
#                     p99 / p50 with perfectly even steps
#   call_m.sh serve   the serving mix (plain, dummy weights) with --http h11 beside the default, SERVE_ROUNDS (1)
#   call_m.sh interval  the front end (as front) at --stream_interval 1, 2 and 4, then the serving mix at 2 beside the
#                     default (1; INTERVAL_ARMS for more), INTERVAL_ROUNDS (1): the client's ITL p99 / p50, tok/s (issue 26)
#   call_m.sh switch  the front end and the serving mix in the checkout (the HTTP process's GIL switch interval
#                     0.5 ms, since this session) against switch_python_default.patch (Python's 5 ms); the serving
#                     mix also against switch_router.patch (0.5 ms in the router process too: its queue's feeder)
V=${1:?front, serve, interval or switch}
P=docs/data/perf/session44
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}; G=scripts/device/gpu_session.sh
nvidia-smi --query-gpu=name --format=csv,noheader
bash $G data >/dev/null 2>&1
case $V in
front) m=$(bash $G shape_model_dir)
       for r in $(seq 1 ${FRONT_ROUNDS:-1}); do
           for h in h11 auto; do
               timeout ${FRONT_S:-100} python benchmarks/bench_http_frontend.py --model_dir "$m" --http $h --arms stream \
                   --step_ms ${FRONT_STEP_MS:-2.1} --num_requests 1024 --max_new_tokens 256 --gsm8k .data/test.jsonl \
                   --out "$O/front_${h}_r$r.json" > "$O/front_${h}_r$r.log" 2>&1
               echo "== round $r | --http $h | rc $?"
               python -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(r['http'], ' '.join(
                   f'{k} {r[k]:.2f}' for k in ('output_tok_s', 'itl_ms_p50', 'itl_ms_p99', 'tokens_per_chunk',
                   'http_cpu_us_per_token', 'http_main_cpu_us_per_token', 'loop_lag_ms_p99', 'egress_ms_p50')))" \
                   "$O/front_${h}_r$r.json"
           done
       done ;;
interval|switch)
       m=$(bash $G shape_model_dir)
       if [ $V = switch ]; then  # the checkout against a copy with switch_python_default.patch applied
           rm -rf /tmp/switch_tree && cp -r . /tmp/switch_tree && git -C /tmp/switch_tree apply "$PWD/$P/switch_python_default.patch"
           trees="$PWD:checkout /tmp/switch_tree:py5ms"; sis=1
       else
           trees="$PWD:checkout"; sis="1 2 4 1c8"  # 1c8: N = 1 with 8 client processes (is the client's loop the tail?)
       fi
       for tree in $trees; do for si in $sis; do
           name=${tree#*:}_si$si; procs=4; [ "${si#*c}" != "$si" ] && procs=${si#*c}
           (cd ${tree%%:*} && timeout ${FRONT_S:-100} python benchmarks/bench_http_frontend.py --model_dir "$m" \
               --stream_interval ${si%c*} --client_procs $procs --arms stream --step_ms ${FRONT_STEP_MS:-2.1} --num_requests 1024 \
               --max_new_tokens 256 --gsm8k "$OLDPWD/.data/test.jsonl" --out "$O/front_$name.json" > "$O/front_$name.log" 2>&1)
           echo "== $name | rc $?"
           python -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(' '.join(
               f'{k} {r[k]:.2f}' for k in ('output_tok_s', 'itl_ms_p50', 'itl_ms_p99', 'tokens_per_chunk',
               'http_main_cpu_us_per_token', 'loop_lag_ms_p99', 'egress_out_q_ms_p50', 'ttft_ms_p50')))" "$O/front_$name.json"
       done; done
       rm -f "$O"/front_*.log
       if [ $V = switch ]; then
           SERVING_AB_ROUNDS=${SWITCH_ROUNDS:-1} timeout ${SWITCH_S:-330} bash $G serving_ab "$O/switch" \
               py5ms=$P/switch_python_default.patch router=$P/switch_router.patch 2>&1 | tail -10
       else
           SERVING_AB_ROUNDS=${INTERVAL_ROUNDS:-1} SERVING_AB_ARMS=${INTERVAL_ARMS:-"si2=--stream_interval 2"} \
               timeout ${INTERVAL_S:-300} bash $G serving_ab "$O/interval" 2>&1 | tail -8
       fi
       rm -f "$O"/*/*.log ;;
serve) SERVING_AB_ROUNDS=${SERVE_ROUNDS:-1} SERVING_AB_ARMS="h11=--http h11" \
           timeout ${SERVE_S:-330} bash $G serving_ab "$O/serve" 2>&1 | tail -14 ;;
*) echo "unknown verb $V" >&2; exit 2 ;;
esac
echo "total $(( $(date +%s) - S )) s"

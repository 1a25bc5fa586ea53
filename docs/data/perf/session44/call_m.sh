#!/usr/bin/env bash
# Session 44's device calls (docs/gpu_ci.md), slimmed tree, carry .whl (httptools' wheel in it), .dz, .smol_shape:
#   call_m.sh front   bench_http_frontend.py's stream arm (the real HTTP app over a fake worker stepping every
#                     FRONT_STEP_MS, 2.1: the serving mix's decode step) under --http h11 and the default (auto:
#                     httptools), FRONT_ROUNDS (1) rounds: the HTTP process's CPU per token and the client's ITL
#                     p99 / p50 with perfectly even steps
#   call_m.sh serve   the serving mix (plain, dummy weights) with --http h11 beside the default, SERVE_ROUNDS (1)
#   call_m.sh interval  the front end (as front) at --stream_interval 1, 2 and 4, then the serving mix at 2 and 4 beside
#                     the default (1), INTERVAL_ROUNDS (2) rounds: the client's ITL p99 / p50 and tok/s (issue 26)
V=${1:?front, serve or interval}
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
interval) m=$(bash $G shape_model_dir)
       for si in 1 2 4; do
           timeout ${FRONT_S:-100} python benchmarks/bench_http_frontend.py --model_dir "$m" --stream_interval $si \
               --arms stream --step_ms ${FRONT_STEP_MS:-2.1} --num_requests 1024 --max_new_tokens 256 \
               --gsm8k .data/test.jsonl --out "$O/front_si${si}.json" > "$O/front_si${si}.log" 2>&1
           echo "== --stream_interval $si | rc $?"
           python -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(' '.join(
               f'{k} {r[k]:.2f}' for k in ('output_tok_s', 'itl_ms_p50', 'itl_ms_p99', 'tokens_per_chunk',
               'http_main_cpu_us_per_token', 'loop_lag_ms_p99', 'ttft_ms_p50')))" "$O/front_si${si}.json"
       done
       rm -f "$O"/front_si*.log
       SERVING_AB_ROUNDS=${INTERVAL_ROUNDS:-2} SERVING_AB_ARMS="si2=--stream_interval 2;si4=--stream_interval 4" \
           timeout ${INTERVAL_S:-420} bash $G serving_ab "$O/interval" 2>&1 | tail -14
       rm -f "$O"/interval/*.log ;;
serve) SERVING_AB_ROUNDS=${SERVE_ROUNDS:-1} SERVING_AB_ARMS="h11=--http h11" \
           timeout ${SERVE_S:-330} bash $G serving_ab "$O/serve" 2>&1 | tail -14 ;;
*) echo "unknown verb $V" >&2; exit 2 ;;
esac
echo "total $(( $(date +%s) - S )) s"

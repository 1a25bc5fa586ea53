#!/usr/bin/env bash
# Session 44's device calls (docs/gpu_ci.md), slimmed tree, carry .whl (httptools' wheel in it), .dz, .smol_shape:
#   call_m.sh front   bench_http_frontend.py's stream arm (the real HTTP app over a fake worker stepping every
#                     FRONT_STEP_MS, 2.1: the serving mix's decode step) under --http h11 and the default (auto:
#                     httptools), FRONT_ROUNDS (1) rounds: the HTTP process's CPU per token and the client's ITL
#                     p99 / p50 with perfectly even steps
#   call_m.sh serve   the serving mix (plain, dummy weights) with --http h11 beside the default, SERVE_ROUNDS (1)
V=${1:?front or serve}
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
serve) SERVING_AB_ROUNDS=${SERVE_ROUNDS:-1} SERVING_AB_ARMS="h11=--http h11" \
           timeout ${SERVE_S:-330} bash $G serving_ab "$O/serve" 2>&1 | tail -14 ;;
*) echo "unknown verb $V" >&2; exit 2 ;;
esac
echo "total $(( $(date +%s) - S )) s"

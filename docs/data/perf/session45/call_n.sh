#!/usr/bin/env bash
# Session 45's device calls (docs/gpu_ci.md), slimmed tree, carry .whl, .dz, .smol_shape:
#   call_n.sh sweep   the serving mix (plain, dummy weights) at the default beside --mixed_prefill_pace_steps 16
#                     and --mixed_max_prefill_tokens 256, SWEEP_ROUNDS (2) rounds in rotated order: the client's and
#                     the router's short-request ITL p99 / p50 against tok/s (issue 26), since the HTTP process's
#                     0.5 ms switch interval
#   call_n.sh hot     the HTTP hot path (401d235) on uvloop and on asyncio against hot_path_old.patch (uvloop):
#                     the front end over even 2.1-ms fake
#                     steps (HOT_ROUNDS, 1), then the serving mix at the default, one round: the event loop's
#                     CPU per token, the client's ITL p99 / p50, the updates' delivery (HOT_SERVE=0: the front
#                     end only; HOT_REQS requests, 1024; HOT_FLAGS more bench flags, e.g. --long_fraction 0.2)
V=${1:?sweep or hot}
P=docs/data/perf/session45
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}; G=scripts/device/gpu_session.sh
nvidia-smi --query-gpu=name --format=csv,noheader
bash $G data >/dev/null 2>&1
case $V in
sweep) SERVING_AB_ROUNDS=${SWEEP_ROUNDS:-2} \
           SERVING_AB_ARMS=${SWEEP_ARMS:-"p16=--mixed_prefill_pace_steps 16;m256=--mixed_max_prefill_tokens 256"} \
           timeout ${SWEEP_S:-540} bash $G serving_ab "$O/sweep" 2>&1 | tail -8
       rm -f "$O"/*/*.log ;;
hot)   m=$(bash $G shape_model_dir)
       rm -rf /tmp/old_tree && cp -r . /tmp/old_tree && git -C /tmp/old_tree apply "$PWD/$P/hot_path_old.patch"
       # arms: the checkout on uvloop (the default once installed) and on asyncio, the old hot path (uvicorn's
       # own auto loop: uvloop too, as .whl installs it)
       for r in $(seq 1 ${HOT_ROUNDS:-1}); do for arm in "$PWD:checkout:" "$PWD:asyncio:--loop asyncio" "/tmp/old_tree:old:"; do
           tree=${arm%:*}; flags=${arm##*:}; name=${tree#*:}_r$r
           (cd ${tree%%:*} && timeout ${FRONT_S:-100} python benchmarks/bench_http_frontend.py --model_dir "$m" $flags ${HOT_FLAGS:-} \
               --arms stream --step_ms 2.1 --num_requests ${HOT_REQS:-1024} --max_new_tokens 256 --gsm8k "$OLDPWD/.data/test.jsonl" \
               --out "$O/front_$name.json" > "$O/front_$name.log" 2>&1)
           echo "== $name | rc $?"
           python -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(r.get('loop'), ' '.join(
               f'{k} {r[k]:.2f}' for k in ('output_tok_s', 'itl_ms_p50', 'itl_ms_p99', 'tokens_per_chunk',
               'http_main_cpu_us_per_token', 'loop_lag_ms_p99', 'egress_out_q_ms_p50', 'egress_handover_ms_p50')))" "$O/front_$name.json"
       done; done
       rm -f "$O"/front_*.log
       [ "${HOT_SERVE:-1}" = 1 ] && SERVING_AB_ROUNDS=1 timeout ${HOT_SERVE_S:-200} bash $G serving_ab "$O/hot" \
           old=$P/hot_path_old.patch 2>&1 | tail -4
       rm -f "$O"/*/*.log ;;
*) echo "unknown verb $V" >&2; exit 2 ;;
esac
echo "total $(( $(date +%s) - S )) s"

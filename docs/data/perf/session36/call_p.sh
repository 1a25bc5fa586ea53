#!/usr/bin/env bash
# Session 36, call 1 (carries the model's first two parts, the slimmed tree and .smol_shape; no wheels):
# the attention kernel as a programmatic dependent launch (issue 25's batch-1 floor, ATTENTION_PDL).
# Its CUDA tests, the kernel A/B (bench_attention --pdl_ab), then the batch-1 step with and without it,
# interleaved twice (dummy weights in the embedded model's shape; the first of each arm compiles).
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}
GPU_CI_PATHS=unit_tests/models/llama timeout 170 bash unit_tests/run_gpu_ci.sh "$O/ci" -k "programmatic or compile" 2>&1 | tail -3
cat "$O/ci/summary.txt" "$O/ci/failed.txt" 2>/dev/null
echo "tests $(( $(date +%s) - S )) s"
timeout 150 python benchmarks/bench_attention.py --cases decode mtp_rows --pdl_ab --out "$O/attention_pdl.json" \
    > "$O/attention_pdl.log" 2>&1; echo "bench rc $?"; tail -24 "$O/attention_pdl.log"
echo "bench $(( $(date +%s) - S )) s"
M=$(bash scripts/device/gpu_session.sh shape_model_dir)
for round in 1 2; do
    for arm in plain pdl; do
        flag=""; [ "$arm" = pdl ] && flag=--attention_pdl
        timeout 100 python -u benchmarks/profile_decode_step.py --model_dir "$M" --load_format dummy --batch 1 \
            --steps 200 --rows 30 $flag > "$O/profile_b1_${arm}_$round.txt" 2>&1
        echo "$arm $round rc $?: $(grep -m1 "per decode step" "$O/profile_b1_${arm}_$round.txt")"; grep -m2 -i attention "$O/profile_b1_${arm}_$round.txt" | cut -c1-160
    done
done
echo "total $(( $(date +%s) - S )) s"

#!/usr/bin/env bash
# Session 36: the attention kernel as a programmatic dependent launch (issue 25's batch-1 floor, ATTENTION_PDL),
# spread over the model transfer's two calls (the slimmed tree; a third carried folder would pass 64 MiB).
# (Ran in rows 2026-12-06 05:00 and 05:04 of docs/gpu_ci.md; its flags --pdl_ab and --attention_pdl left with the
# variant in a718996, so it documents that run and no longer runs.)
#   call_p.sh kernel   call 1 (model parts aa, ab): its CUDA tests, then the kernel A/B (bench_attention --pdl_ab)
#   call_p.sh step     call 2 (parts ac, ad, .whl; env.sh assembles the model): the batch-1 decode step of the
#                      embedded model with and without it, interleaved twice (the first of each arm compiles)
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}
if [ "${1:?kernel or step}" = kernel ]; then
GPU_CI_PATHS=unit_tests/models/llama timeout 170 bash unit_tests/run_gpu_ci.sh "$O/ci" -k "programmatic or compile" 2>&1 | tail -3
cat "$O/ci/summary.txt" "$O/ci/failed.txt" 2>/dev/null
echo "tests $(( $(date +%s) - S )) s"
timeout 150 python benchmarks/bench_attention.py --cases decode mtp_rows --pdl_ab --out "$O/attention_pdl.json" \
    > "$O/attention_pdl.log" 2>&1; echo "bench rc $?"; tail -24 "$O/attention_pdl.log"
else
for round in 1 2; do
    for arm in plain pdl; do
        flag=""; [ "$arm" = pdl ] && flag=--attention_pdl
        timeout 100 python -u benchmarks/profile_decode_step.py --batch 1 \
            --steps 200 --rows 30 $flag > "$O/profile_b1_${arm}_$round.txt" 2>&1
        echo "$arm $round rc $?: $(grep -m1 "per decode step" "$O/profile_b1_${arm}_$round.txt")"; grep -m2 -i attention "$O/profile_b1_${arm}_$round.txt" | cut -c1-160
    done
done
fi
echo "total $(( $(date +%s) - S )) s"

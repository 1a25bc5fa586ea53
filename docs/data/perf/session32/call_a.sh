#!/usr/bin/env bash
# Session 32, one call without the model (.smol_shape, .dz, .whl carried; dummy weights):
# 1. issue 26's inter-token tail: gaps at the default and 256-token mixed budgets, each with and without
#    --router_admit_behind_step; 2. the MTP overlap schedule's step cost (never measured since the ninth
#    session) at batch 64 and 1 against plain; 3. the dspark step before / after its kernel cut (steps_ab).
source scripts/device/env.sh >/dev/null 2>&1
bash scripts/device/gpu_session.sh data >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}
m=$(bash scripts/device/gpu_session.sh shape_model_dir 2>/dev/null | tail -1)
GAPS_ARMS=" ;--router_admit_behind_step;--mixed_max_prefill_tokens 256;--mixed_max_prefill_tokens 256 --router_admit_behind_step" \
GAPS_FLAGS="--num_prompts 384" bash scripts/device/gpu_session.sh gaps "$O/g" > /dev/null 2>&1
echo "gaps $(( $(date +%s) - S )) s"
for f in "$O"/g/gaps_*.log; do
    echo "== $f"; grep -E "requests in|tail_gap_ms_mean|tail_admitted|tail_finished|calls_waiting|\"idle_ms\"" "$f" | head -8
done
for args in "--batch 64" "--batch 64 --mtp_step 3" "--batch 64 --mtp_step 3 --mtp_overlap" \
            "--batch 1 --mtp_step 3 --mtp_overlap"; do
    timeout 60 python benchmarks/profile_decode_step.py --model_dir "$m" --load_format dummy $args --steps 200 \
        --rows 50 > "$O/prof.txt" 2>&1
    echo "$args | $(head -1 "$O/prof.txt")"
    cat "$O/prof.txt" >> "$O/profiles.txt"
done | tee "$O/steps.txt"
rm -f "$O/prof.txt"
STEPS_AB_CASES="--batch 1 --mtp_step 3 --mtp_mode dspark;--batch 1 --mtp_step 3 --mtp_mode eagle_with_att" \
    timeout $((570 - $(date +%s) + S)) bash scripts/device/gpu_session.sh steps_ab "$O/st" \
    old=docs/data/perf/session32/patches/dspark_step_old.patch 2>&1 | tail -10
echo "total $(( $(date +%s) - S )) s"
cd "$O" && tar czf gaps.tgz g && rm -rf g && gzip -f profiles.txt

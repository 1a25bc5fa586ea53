#!/usr/bin/env bash
# Session 33, with the model in /root/m (two transfer calls before), .dz, .smol_shape carried:
# 1. session 32's CUDA tests (call_c.sh's list); 2. the MTP overlap schedule's step cost against plain at batch 64
# (dummy weights, call_a.sh's profiles, whose model dir came out empty there); 3. issue 30's batch-1 usage line.
source scripts/device/env.sh >/dev/null 2>&1
bash scripts/device/gpu_session.sh data >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}
D=unit_tests/server/router/model_infer
GPU_CI_WORKERS=${GPU_CI_WORKERS:-8} timeout 240 bash scripts/device/gpu_session.sh suite "$O/ci" \
    unit_tests/common/basemodel/triton_kernel/test_fused_norm_rotary.py $D/test_dspark_cuda.py \
    $D/test_overlap_schedule_cuda.py $D/test_mixed_steps_cuda.py 2>&1 | tail -8
echo "tests $(( $(date +%s) - S )) s"
m=/root/lightllm_cache/models/SmolLM2-135M-Instruct; mkdir -p "$m" && cp .smol_shape/* "$m/"
for args in "--batch 64" "--batch 64 --mtp_step 3" "--batch 64 --mtp_step 3 --mtp_overlap" \
            "--batch 1 --mtp_step 3" "--batch 1 --mtp_step 3 --mtp_overlap"; do
    timeout 50 python benchmarks/profile_decode_step.py --model_dir "$m" --load_format dummy $args --steps 200 \
        --rows 30 > "$O/prof.txt" 2>&1
    echo "$args | $(head -1 "$O/prof.txt")"
    cat "$O/prof.txt" >> "$O/profiles.txt"
done | tee "$O/steps.txt"
rm -f "$O/prof.txt"
U="--mtp_step 3 --mtp_asd_regret_budget 2.0625 --mtp_asd_local_regret_ratio 0.25 --mtp_asd_block_max_mismatch 2"
timeout $((575 - $(date +%s) + S)) python benchmarks/bench_e2e_throughput.py --skip_hf --concurrency 1 \
    --num_prompts 48 --max_new_tokens 128 --gsm8k .data/test.jsonl --out "$O/batch1_usage_line.json" \
    --configs "eagle=--mtp_mode eagle_with_att $U;dspark=--mtp_mode dspark $U;dspark_2=--mtp_mode dspark $U;eagle_2=--mtp_mode eagle_with_att $U" \
    > "$O/batch1.log" 2>&1
grep -v " INFO " "$O/batch1.log" | tail -14
echo "total $(( $(date +%s) - S )) s"
gzip -f "$O/batch1.log" "$O/profiles.txt"; cd "$O" && tar czf ci.tgz ci ci.log && rm -rf ci ci.log

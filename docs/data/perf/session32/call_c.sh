#!/usr/bin/env bash
# Session 32, with the model in /root/m (two calls before) and the whole tree (.dz, .whl carried):
# 1. the CUDA tests of this session's changes (the k/v-only rotary kernel, the dspark step, the overlap schedule
#    with dspark, mixed steps with --router_admit_behind_step); 2. issue 30's batch-1 usage line, eagle and
#    dspark interleaved (one server each, eagle, dspark, dspark, eagle).
source scripts/device/env.sh >/dev/null 2>&1
bash scripts/device/gpu_session.sh data >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}
D=unit_tests/server/router/model_infer
GPU_CI_WORKERS=${GPU_CI_WORKERS:-8} timeout 300 bash scripts/device/gpu_session.sh suite "$O/ci" \
    unit_tests/common/basemodel/triton_kernel/test_fused_norm_rotary.py $D/test_dspark_cuda.py \
    $D/test_overlap_schedule_cuda.py $D/test_mixed_steps_cuda.py 2>&1 | tail -15
echo "tests $(( $(date +%s) - S )) s"
U="--mtp_step 3 --mtp_asd_regret_budget 2.0625 --mtp_asd_local_regret_ratio 0.25 --mtp_asd_block_max_mismatch 2"
timeout $((580 - $(date +%s) + S)) python benchmarks/bench_e2e_throughput.py --skip_hf --concurrency 1 \
    --num_prompts 64 --max_new_tokens 128 --gsm8k .data/test.jsonl --out "$O/batch1_usage_line.json" \
    --configs "eagle=--mtp_mode eagle_with_att $U;dspark=--mtp_mode dspark $U;dspark_2=--mtp_mode dspark $U;eagle_2=--mtp_mode eagle_with_att $U" \
    > "$O/batch1.log" 2>&1
grep -v " INFO " "$O/batch1.log" | tail -14
echo "total $(( $(date +%s) - S )) s"
gzip -f "$O/batch1.log"; cd "$O" && tar czf ci.tgz ci ci.log && rm -rf ci ci.log

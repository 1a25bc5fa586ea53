#!/usr/bin/env bash
# Session 35: the whole suite with the model (the overlap schedule with MTP on by default), then, with
# DRAFT=/root/dspark_NAME, issue 30's batch-1 usage line with that draft installed as the checkout's dspark.
source scripts/device/env.sh >/dev/null 2>&1
bash scripts/device/gpu_session.sh data >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}
GPU_CI_WORKERS=12 timeout ${SUITE_S:-330} bash scripts/device/gpu_session.sh suite "$O/suite" 2>&1 | tail -12
echo "suite $(( $(date +%s) - S )) s"
if [ -n "${DRAFT:-}" ]; then
    cp "$DRAFT"/* lightllm/drafts/SmolLM2-135M-Instruct/dspark/
    U="--mtp_step 3 --mtp_asd_regret_budget 2.0625 --mtp_asd_local_regret_ratio 0.25 --mtp_asd_block_max_mismatch 2"
    timeout $((585 - $(date +%s) + S)) python benchmarks/bench_e2e_throughput.py --skip_hf --concurrency 1 \
        --num_prompts 64 --max_new_tokens 128 --gsm8k .data/test.jsonl --out "$O/batch1_usage_line.json" \
        --configs "eagle=--mtp_mode eagle_with_att $U;dspark=--mtp_mode dspark $U;dspark_2=--mtp_mode dspark $U;eagle_2=--mtp_mode eagle_with_att $U" \
        > "$O/batch1.log" 2>&1
    grep -v " INFO " "$O/batch1.log" | tail -14
    gzip -f "$O/batch1.log"
fi
echo "total $(( $(date +%s) - S )) s"

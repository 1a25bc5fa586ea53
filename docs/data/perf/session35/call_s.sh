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
    bash scripts/device/gpu_session.sh batch1_line "$O" $((585 - $(date +%s) + S))
fi
echo "total $(( $(date +%s) - S )) s"

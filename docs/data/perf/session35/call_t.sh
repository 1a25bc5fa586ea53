#!/usr/bin/env bash
# Session 35 (issue 30): dspark's fresh sample without a new Magpie draw. ft4's prompt set holds 14,107 prompts,
# of which the engine answered the first 7,104 before its deadline, so lines 7,105 on were never trained on.
# Fine-tune the packaged ft4 on their answers (ft5t), then draft quality: ft5t, ft4 (the checkout's), eagle.
source scripts/device/env.sh >/dev/null 2>&1
bash scripts/device/gpu_session.sh data >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}
zcat docs/data/drafts/dspark_ft4_prompt_set.jsonl.gz | tail -n +7105 > /root/ft4_tail.jsonl
wc -l /root/ft4_tail.jsonl
DSPARK_ANSWERS=/root/dspark_answers_tail.pt timeout 330 bash scripts/device/gpu_session.sh train_dspark "$O/t" ft5t \
    --init_from lightllm/drafts/SmolLM2-135M-Instruct/dspark --prompt_source file --prompt_set /root/ft4_tail.jsonl \
    --max_gen_seconds 150 --max_train_seconds 200
echo "train $(( $(date +%s) - S )) s"
[ -f /root/dspark_ft5t/model.safetensors ] && timeout $((585 - $(date +%s) + S)) \
    bash scripts/device/gpu_session.sh quality_dspark "$O/q" /root/dspark_ft5t default
echo "total $(( $(date +%s) - S )) s"
gzip -f "$O"/t/train.log "$O"/q/*.log 2>/dev/null

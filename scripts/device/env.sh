# Sourced at the start of every command on the GPU machine (see docs/gpu_ci.md).
# Reassembles the embedded model (carried in two halves), installs the server's wheels.
M=/root/m
GGUF=$M/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ] && [ -f .model_b/part ] && [ -f "$M/part_a" ]; then
  cat "$M/part_a" .model_b/part > "$GGUF"
fi
# Or four 25 MiB parts (.mparts/part_aa..ad, one carried per call: the tree with both drafts is
# ~30 MB, too much beside a 47 MiB half): each call leaves its part in $M, the fourth assembles.
if [ ! -f "$GGUF" ] && [ -d .mparts ]; then
  mkdir -p "$M" && cp .mparts/part_a? "$M/" 2>/dev/null
  if [ "$(ls "$M"/part_a? 2>/dev/null | wc -l)" -eq 4 ]; then cat "$M"/part_a? > "$GGUF"; fi
fi
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
# only when assembled: without the parts, tests that need the model skip instead of failing on a missing path
if [ -f "$GGUF" ]; then export LIGHTLLM_GGUF_PATH=$GGUF; fi
export LIGHTLLM_GSM8K_DIR=$PWD/.data
export LIGHTLLM_CACHE_DIR=/root/lightllm_cache
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# A draft trained on this machine in this lease (gpu_session.sh train) replaces the checkout's:
# every call re-sends the repository's tracked draft files.
if [ -f /root/draft_new/model.safetensors ]; then
  cp /root/draft_new/config.json /root/draft_new/model.safetensors /root/draft_new/training_info.json \
    lightllm/drafts/SmolLM2-135M-Instruct/eagle_with_att/ && echo "env.sh: using the draft trained in this lease"
fi
if [ -f /root/dspark_new/model.safetensors ]; then
  mkdir -p lightllm/drafts/SmolLM2-135M-Instruct/dspark
  cp /root/dspark_new/config.json /root/dspark_new/model.safetensors /root/dspark_new/training_info.json \
    lightllm/drafts/SmolLM2-135M-Instruct/dspark/ && echo "env.sh: using the dspark draft trained in this lease"
fi

#!/usr/bin/env bash
# Run here (not on the GPU machine): the drafts' weights out of the checkout and back, so that a device call
# that only carries the model's parts (docs/gpu_ci.md, runbook) sends a ~10 MiB tree beside two 25 MiB parts.
#   scripts/device/slim_tree.sh out    move them to $HOLD (default /tmp/lightllm_drafts_hold)
#   scripts/device/slim_tree.sh in     move them back (run it before any call that runs code)
set -euo pipefail
cd "$(dirname "$0")/../.."
HOLD=${HOLD:-/tmp/lightllm_drafts_hold}
DRAFTS=lightllm/drafts/SmolLM2-135M-Instruct
case ${1:-} in
out)
    for d in "$DRAFTS"/*/; do
        name=$(basename "$d"); mkdir -p "$HOLD/$name"
        if [ -f "$d/model.safetensors" ]; then mv "$d/model.safetensors" "$HOLD/$name/"; fi
    done
    ;;
in)
    for h in "$HOLD"/*/; do
        name=$(basename "$h")
        if [ -f "$h/model.safetensors" ]; then mv "$h/model.safetensors" "$DRAFTS/$name/"; fi
    done
    ;;
*) echo "usage: $0 out|in" >&2; exit 2 ;;
esac
git status --short -- "$DRAFTS"

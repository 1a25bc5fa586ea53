#!/usr/bin/env bash
# Session 33, no model (.smol_shape, .whl carried; dummy weights): 1. the MTP overlap schedule's step cost against
# plain at batch 64 and 1; 2. the CUDA cases of the fused rotary / k-v-only cache kernel (283d7e6).
source scripts/device/env.sh >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}
m=$(bash scripts/device/gpu_session.sh shape_model_dir | tail -1)
for args in "--batch 64" "--batch 64 --mtp_step 3" "--batch 64 --mtp_step 3 --mtp_overlap" \
            "--batch 1 --mtp_step 3" "--batch 1 --mtp_step 3 --mtp_overlap"; do
    timeout 40 python benchmarks/profile_decode_step.py --model_dir "$m" --load_format dummy $args --steps 200 \
        --rows 30 > "$O/prof.txt" 2>&1
    echo "$args | $(head -1 "$O/prof.txt")"
    cat "$O/prof.txt" >> "$O/profiles.txt"
done | tee "$O/steps.txt"
rm -f "$O/prof.txt"; gzip -f "$O/profiles.txt"
timeout $((280 - $(date +%s) + S)) python -m pytest -q -p no:cacheprovider -k "cuda" \
    unit_tests/common/basemodel/triton_kernel/test_fused_norm_rotary.py > "$O/rotary_cuda.txt" 2>&1
tail -3 "$O/rotary_cuda.txt"; echo "total $(( $(date +%s) - S )) s"

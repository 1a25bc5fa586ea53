"""Compile the unified attention kernels for sm_90 (no GPU needed), in every variant the engine
launches: prefill-shaped and decode-shaped tiles, split and unsplit, bf16 / fp16 / fp32.

Runs in a fresh process without TRITON_INTERPRET: in interpreter mode the @triton.jit helpers
inside triton.language (tl.sum, tl.max) are interpreter objects that the real compiler cannot call.
"""
from unit_tests.triton_compile_util import run_compile_child

COMPILE_SCRIPT = """
from unit_tests.triton_compile_util import compile_for_sm90
from lightllm.models.llama.triton_kernel.unified_attention import (
    BLOCK_N, _combine_splits_kernel, _unified_attention_kernel, block_shape)

ATTENTION_ARGS = ["q_ptr", "k_ptr", "v_ptr", "req_to_token_ptr", "row_req_idx_ptr", "row_seq_len_ptr",
                  "row_seq_start_ptr", "block_first_row_ptr", "out_ptr", "part_acc_ptr", "part_ml_ptr", "num_rows",
                  "qk_scale", "stride_q_row", "stride_q_head", "stride_k_slot", "stride_k_head", "stride_v_slot",
                  "stride_v_head", "stride_req_row", "stride_out_row", "stride_out_head"]
TYPES = {"req_to_token_ptr": "*i64", "row_req_idx_ptr": "*i64", "row_seq_len_ptr": "*i32", "row_seq_start_ptr": "*i32",
         "block_first_row_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32"}
# (dtype, head_dim, group, rows per block hint, splits): SmolLM2-135M prefill / decode / MTP, Llama-3-8B
# prefill / split decode, fp32 with a head_dim that is not a power of two
CASES = (("*bf16", 64, 3, 4096, 1), ("*bf16", 64, 3, 1, 16), ("*bf16", 64, 3, 4, 8), ("*bf16", 128, 4, 8192, 1),
         ("*bf16", 128, 4, 1, 8), ("*fp16", 128, 8, 4, 4), ("*fp32", 80, 2, 64, 1))
for dtype, head_dim, group, rows, splits in CASES:
    block_q, block_m = block_shape(group, rows, deterministic=False)
    block_dmodel = 1 << (head_dim - 1).bit_length()
    signature = {name: TYPES.get(name, dtype if name.endswith("_ptr") else "i32") for name in ATTENTION_ARGS}
    constexprs = {"HEAD_DIM": head_dim, "GROUP": group, "BLOCK_Q": block_q, "BLOCK_M": block_m,
                  "BLOCK_DMODEL": block_dmodel, "BLOCK_N": BLOCK_N, "NUM_SPLITS": splits,
                  "IEEE_DOT": dtype == "*fp32", "EVEN_D": head_dim == block_dmodel}
    signature.update({name: "constexpr" for name in constexprs})
    compiled = compile_for_sm90(_unified_attention_kernel, signature, constexprs, {"num_warps": 8 if block_m * block_dmodel > 8192 else 4})
    assert "ptx" in compiled.asm, (dtype, head_dim, group)
    if splits > 1:
        sig = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": dtype, "stride_out_row": "i32",
               "stride_out_head": "i32", "HEAD_DIM": "constexpr", "BLOCK_DMODEL": "constexpr", "NUM_SPLITS": "constexpr"}
        compiled = compile_for_sm90(_combine_splits_kernel, sig,
                                    {"HEAD_DIM": head_dim, "BLOCK_DMODEL": block_dmodel, "NUM_SPLITS": splits})
        assert "ptx" in compiled.asm
print("compiled", len(CASES))
"""


def test_unified_attention_compiles_for_sm90():
    assert "compiled" in run_compile_child(["-c", COMPILE_SCRIPT])

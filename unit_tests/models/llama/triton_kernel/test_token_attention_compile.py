"""Compile the Triton attention kernels for sm_90 (no GPU needed).

Runs in a fresh process without TRITON_INTERPRET: in interpreter mode the
@triton.jit helpers inside triton.language (tl.sum, tl.max) are interpreter
objects that the real compiler cannot call.
"""
from unit_tests.triton_compile_util import run_compile_child

COMPILE_SCRIPT = """
from unit_tests.triton_compile_util import compile_for_sm90
from lightllm.models.llama.triton_kernel.token_attention import TOKEN_BLOCK, _token_decode_attention_kernel

# (dtype, head_dim, GQA group): SmolLM2-135M, Qwen3-0.6B, fp32 with a non power of two head_dim
for dtype, head_dim, group in (("*bf16", 64, 3), ("*bf16", 128, 2), ("*fp32", 80, 1)):
    signature = {
        "q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype,
        "req_to_token_ptr": "*i64", "b_req_idx_ptr": "*i64", "b_seq_len_ptr": "*i32", "out_ptr": dtype,
        "sm_scale": "fp32",
        "stride_q_row": "i32", "stride_q_head": "i32", "stride_k_slot": "i32", "stride_k_head": "i32",
        "stride_v_slot": "i32", "stride_v_head": "i32", "stride_req_row": "i32",
        "stride_out_row": "i32", "stride_out_head": "i32",
        "HEAD_DIM": "constexpr", "GQA_GROUP": "constexpr", "BLOCK_DMODEL": "constexpr", "BLOCK_N": "constexpr",
    }
    block_dmodel = 1 << (head_dim - 1).bit_length()
    constexprs = {"HEAD_DIM": head_dim, "GQA_GROUP": group, "BLOCK_DMODEL": block_dmodel, "BLOCK_N": TOKEN_BLOCK}
    compiled = compile_for_sm90(_token_decode_attention_kernel, signature, constexprs)
    assert "ptx" in compiled.asm, (dtype, head_dim)
"""


def test_token_decode_attention_compiles_for_sm90():
    run_compile_child(["-c", COMPILE_SCRIPT])

"""Compile the unified attention kernels for sm_90 (no GPU needed), in every variant the engine
launches: prefill-shaped and decode-shaped tiles, split and unsplit, bf16 / fp16 / fp32.

Runs in a fresh process without TRITON_INTERPRET: in interpreter mode the @triton.jit helpers
inside triton.language (tl.sum, tl.max) are interpreter objects that the real compiler cannot call.
"""
from unit_tests.triton_compile_util import run_compile_child

COMPILE_SCRIPT = """
from unit_tests.triton_compile_util import compile_for_sm90, sm90_resource_usage
from lightllm.models.llama.triton_kernel.unified_attention import (
    DYNAMIC_SPLIT_KEYS, LENGTH_SPLIT_ONE_LOOP, MAX_KV_SPLITS, SMALL_GRID_MAX_KV_SPLITS, SPLIT_MAX_BLOCK_M,
    _combine_dynamic_splits_kernel, _unified_attention_kernel, block_shape, launch_config)

SM90_SHARED_BYTES = 232448  # an H100 / H200 block's shared memory limit
SM90_REGISTERS = 65536  # per SM
WIDE_PROGRAMS_PER_SM = 4  # the embedded model's wide decode tile: 4 programs per SM (3 at MAX_KV_SPLITS 32)

ATTENTION_ARGS = ["q_ptr", "k_ptr", "v_ptr", "req_to_token_ptr", "row_req_idx_ptr", "row_seq_len_ptr",
                  "row_seq_start_ptr", "block_first_row_ptr", "out_ptr", "part_acc_ptr", "part_ml_ptr",
                  "active_blocks_ptr", "row_split_ptr", "work_ptr", "split_counter_ptr", "num_rows", "num_part_rows",
                  "fill_programs", "target_programs", "qk_scale", "stride_q_row", "stride_q_head", "stride_k_slot",
                  "stride_k_head", "stride_v_slot", "stride_v_head", "stride_req_row", "stride_out_row",
                  "stride_out_head"]
TYPES = {"req_to_token_ptr": "*i64", "row_req_idx_ptr": "*i64", "row_seq_len_ptr": "*i32", "row_seq_start_ptr": "*i32",
         "block_first_row_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "active_blocks_ptr": "*i32",
         "row_split_ptr": "*i32", "work_ptr": "*i32", "split_counter_ptr": "*i32",
         "qk_scale": "fp32"}
# what a launch on aligned tensors sees as multiples of 16 (the slot table's row stride may not be one)
DIVISIBLE = [n for n in ATTENTION_ARGS if n.endswith("_ptr") or (n.startswith("stride_") and n != "stride_req_row")]
# (dtype, head_dim, group, rows per block hint, splits, dynamic): SmolLM2-135M prefill (dynamic splits) /
# decode / MTP (splits by length), Llama-3-8B prefill (dynamic) / decode / MTP rows, fp32 prefill at head_dim
# 128 and with one that is not a power of two, without dynamic splits, a deterministic (unsplit) decode, and
# batch-1 decode of both models (small grids: SMALL_GRID_MAX_KV_SPLITS)
CASES = (("*bf16", 64, 3, 4096, 8, True), ("*bf16", 64, 3, 1, MAX_KV_SPLITS, False), ("*bf16", 64, 3, 4, 1, False),
         ("*bf16", 128, 4, 8192, 8, True), ("*bf16", 128, 4, 1, 8, False), ("*bf16", 128, 4, 4, 1, False),
         ("*fp16", 128, 8, 4, 4, False), ("*fp32", 128, 4, 8192, 8, True), ("*fp32", 80, 2, 64, 8, True),
         ("*bf16", 64, 3, 4096, 1, False), ("*bf16", 128, 4, 1, 1, False), ("*fp32", 64, 3, 4, 32, False),
         ("*bf16", 64, 3, 1, SMALL_GRID_MAX_KV_SPLITS, False), ("*bf16", 128, 4, 1, SMALL_GRID_MAX_KV_SPLITS, False))
ELEM_BYTES = {"*bf16": 2, "*fp16": 2, "*fp32": 4}
for dtype, head_dim, group, rows, splits, dynamic in CASES:
    block_q, block_m = block_shape(group, rows, deterministic=False)
    block_dmodel = 1 << (head_dim - 1).bit_length()
    by_length = splits > 1 and not dynamic
    cfg = launch_config(block_m, block_dmodel, by_length and rows == 1, ELEM_BYTES[dtype],
                        small=splits == SMALL_GRID_MAX_KV_SPLITS)
    signature = {name: TYPES.get(name, dtype if name.endswith("_ptr") else "i32") for name in ATTENTION_ARGS}
    constexprs = {"HEAD_DIM": head_dim, "GROUP": group, "BLOCK_Q": block_q, "BLOCK_M": block_m,
                  "BLOCK_DMODEL": block_dmodel, "BLOCK_N": cfg.block_n, "NUM_SPLITS": splits,
                  "IEEE_DOT": dtype == "*fp32", "EVEN_D": head_dim == block_dmodel, "DYNAMIC_SPLITS": dynamic,
                  "SPLIT_KEYS": DYNAMIC_SPLIT_KEYS, "LENGTH_SPLITS": by_length,
                  "ONE_LOOP": by_length and LENGTH_SPLIT_ONE_LOOP}
    signature.update({name: "constexpr" for name in constexprs})
    compiled = compile_for_sm90(_unified_attention_kernel, signature, constexprs,
                                {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, DIVISIBLE)
    if block_m <= SPLIT_MAX_BLOCK_M:  # decode-shaped tiles (every decode step): no register spilled
        usage = sm90_resource_usage(compiled)
        assert usage["STACK"] == 0, (dtype, head_dim, rows, usage)
        if (dtype, head_dim, rows, splits) == ("*bf16", 64, 1, MAX_KV_SPLITS):  # the embedded model's wide tile
            assert usage["REG"] <= SM90_REGISTERS // (WIDE_PROGRAMS_PER_SM * cfg.num_warps * 32), usage
    assert "ptx" in compiled.asm, (dtype, head_dim, group)
    # the launch would fail with OutOfResources past the limit
    assert compiled.metadata.shared <= SM90_SHARED_BYTES, (dtype, head_dim, rows, compiled.metadata.shared)
    # the length splits' merge: one acquire-release add per split program
    assert by_length == ("atom.global.gpu.acq_rel.add" in compiled.asm["ptx"]), (dtype, head_dim, rows)
    if dynamic:
        sig = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": dtype, "row_split_ptr": "*i32",
               "num_part_rows": "i32", "stride_out_row": "i32", "stride_out_head": "i32", "Q_HEADS": "constexpr",
               "HEAD_DIM": "constexpr", "BLOCK_H": "constexpr", "BLOCK_DMODEL": "constexpr", "NUM_SPLITS": "constexpr"}
        q_heads = group * 3
        compiled = compile_for_sm90(_combine_dynamic_splits_kernel, sig, {
            "Q_HEADS": q_heads, "HEAD_DIM": head_dim, "BLOCK_H": 1 << (q_heads - 1).bit_length(),
            "BLOCK_DMODEL": block_dmodel, "NUM_SPLITS": splits}, {"num_warps": 2})
        assert "ptx" in compiled.asm
print("compiled", len(CASES))
"""


def test_unified_attention_compiles_for_sm90():
    assert "compiled" in run_compile_child(["-c", COMPILE_SCRIPT])

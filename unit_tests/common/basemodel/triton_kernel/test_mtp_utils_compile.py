"""Compile every kernel of mtp_utils.py for sm_90, with the constexprs the wrappers use.

The interpreter accepts code the compiler rejects, so this runs the real compiler (no
GPU needed). It runs in a child process without TRITON_INTERPRET: under the interpreter,
triton.language's own @jit helpers (tl.min, tl.sum, ...) are interpreter objects that
patch triton.language when the compiler calls them, which breaks later compilations.
"""
import json

import pytest

from unit_tests.triton_compile_util import compile_in_child

# Next-token table widths: the engine's (K <= 7), a plain-decode table and the widest one.
TABLE_WIDTHS = [1, 8, 16]

_TABLE_ARGS = {
    "req_to_next_token_ids": "*i64",
    "req_to_next_token_ids_stride": "i32",
    "table_width": "i32",
    "b_req_mtp_start_loc": "*i32",
    "new_next_token_ids": "*i64",
    "b_req_idx": "*i32",
}
STRICT_SIGNATURE = {
    **_TABLE_ARGS,
    "mtp_accept_len": "*i32",
    "accepted_index": "*i32",
    "batch_size": "i32",
    "BLOCK_SIZE": "constexpr",
}
SCATTER_SIGNATURE = {
    "req_to_next_token_ids": "*i64",
    "req_to_next_token_ids_stride": "i32",
    "all_next_token_ids": "*i64",
    "all_next_token_ids_stride": "i32",
    "b_req_mtp_start_loc": "*i32",
    "b_req_idx": "*i32",
    "mtp_accept_len": "*i32",
    "num_cols": "i32",
    "BLOCK_SIZE": "constexpr",
}


def asd_signature(logits_type: str) -> dict:
    return {
        **_TABLE_ARGS,
        "logits": logits_type,
        "logits_stride": "i32",
        "req_to_asd_cum_regret": "*fp32",
        "req_to_asd_budget": "*fp32",
        "mtp_accept_len": "*i32",
        "accepted_index": "*i32",
        "relaxed_mask": "*i32",
        "batch_size": "i32",
        "vocab_size": "i32",
        "local_regret_ratio": "fp32",
        "block_max_mismatch": "i32",
        "BLOCK_SIZE": "constexpr",
        "HAS_RELAXED_MASK": "constexpr",
    }


def compile_cases() -> dict:
    """name -> (kernel attribute, signature, table width)."""
    cases = {}
    for width in TABLE_WIDTHS:
        cases[f"mtp_verify-W{width}"] = ("_fwd_kernel_mtp_verify", STRICT_SIGNATURE, width)
        cases[f"mtp_scatter-W{width}"] = ("_fwd_kernel_mtp_scatter_next_token_ids", SCATTER_SIGNATURE, width)
        for logits_type in ("*fp32", "*bf16", "*fp16"):
            cases[f"mtp_asd_verify-{logits_type[1:]}-W{width}"] = (
                "_fwd_kernel_mtp_asd_verify",
                asd_signature(logits_type),
                width,
            )
    return cases


# PTX instructions the ASD kernel must (or must not) contain.
PTX_MARKERS = {
    "ieee_div": "div.rn.f32",  # r / v correctly rounded, like torch
    "approx_div": "div.full.f32",
    "nan_max": "max.NaN.f32",  # a NaN regret stays NaN
}


def _compile_all() -> dict:
    """Runs in the child: name -> {"status": "ok" or the compiler's error, marker: found}."""
    from lightllm.common.basemodel.triton_kernel import mtp_utils
    from unit_tests.triton_compile_util import compile_for_sm90

    results = {}
    for name, (kernel_name, signature, width) in compile_cases().items():
        constexprs = {"BLOCK_SIZE": mtp_utils.verify_block_size(width)}
        if "HAS_RELAXED_MASK" in signature:
            constexprs["HAS_RELAXED_MASK"] = True
        try:
            ptx = compile_for_sm90(getattr(mtp_utils, kernel_name), signature, constexprs).asm["ptx"]
            results[name] = {"status": "ok", **{k: marker in ptx for k, marker in PTX_MARKERS.items()}}
        except Exception as e:  # reported by the test of this case
            results[name] = {"status": f"{type(e).__name__}: {e}"}
    return results


@pytest.fixture(scope="module")
def compile_results() -> dict:
    return compile_in_child("unit_tests.common.basemodel.triton_kernel.test_mtp_utils_compile")


@pytest.mark.parametrize("name", list(compile_cases()))
def test_kernel_compiles_for_sm90(compile_results, name):
    assert compile_results[name]["status"] == "ok"


# W = 1 has no drafts, so its ASD walk (and the division) is empty.
ASD_CASES_WITH_DRAFTS = [n for n in compile_cases() if n.startswith("mtp_asd_verify") and not n.endswith("-W1")]


@pytest.mark.parametrize("name", ASD_CASES_WITH_DRAFTS)
def test_asd_kernel_uses_ieee_division_and_nan_max(compile_results, name):
    """The local-ratio gate needs correctly rounded r / v (as the fp32 reference), and the
    regret's max must keep NaN so a NaN regret fails every gate."""
    result = compile_results[name]
    assert result["ieee_div"] and not result["approx_div"]
    assert result["nan_max"]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))

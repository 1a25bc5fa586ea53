"""The per-row logits kernels against float64 torch (written here): first argmax (torch.argmax's tie rule),
log-sum-exp and log p(token), on rows with -inf entries (a grammar's mask), a row of only -inf, ties
across chunks and lanes, a vocabulary that is not a multiple of the chunk, strided rows and bf16 logits.
CPU: the Triton interpreter; CUDA in the GPU suite. A child process compiles both kernels for sm_90."""
import pytest
import torch

from lightllm.common.basemodel.triton_kernel.logits_rows import (
    VOCAB_CHUNK, VOCAB_TILE, argmax_lse, argmax_rows, token_logprobs_triton,
)
from unit_tests.devices import KERNEL_DEVICES
from unit_tests.triton_compile_util import run_compile_child

pytestmark = pytest.mark.spread  # a kernel test without fixtures
ATOL = 1e-5


def reference_lse(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.double(), dim=-1).float()


def reference_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first column holding the row's max, by a plain loop (torch.argmax's documented rule)."""
    out = []
    for row in logits.double().tolist():
        best = max(row)
        out.append(row.index(best))
    return torch.tensor(out, dtype=torch.int64)


def hard_rows(vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn((7, vocab), generator=gen) * 8
    logits[1, ::3] = float("-inf")  # masked tokens: no weight
    logits[2, :] = float("-inf")
    logits[2, vocab - 1] = 3.0  # one allowed token: its log p is 0
    logits[3, 0] = 1e4  # far above the rest
    logits[4, :] = float("-inf")  # nothing allowed: argmax 0, log-sum-exp -inf
    logits[5, [vocab // 2, vocab - 2, 1]] = 50.0  # a tie across chunks and lanes: the first column wins
    logits[6, :] = 0.5  # all equal: column 0
    return logits


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("vocab", [7, VOCAB_TILE + 3, 2 * VOCAB_CHUNK + 5])
def test_matches_float64_torch(device, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = hard_rows(vocab, gen)
    ids, lse = argmax_lse(logits.to(device))
    assert ids.dtype == torch.int64 and lse.dtype == torch.float32
    assert ids.cpu().tolist() == reference_argmax(logits).tolist()
    torch.testing.assert_close(lse.cpu(), reference_lse(logits), atol=ATOL, rtol=1e-6)
    assert argmax_rows(logits.to(device)).cpu().tolist() == ids.cpu().tolist()
    tokens = torch.randint(0, vocab, (logits.shape[0],), generator=gen)
    tokens[1], tokens[2] = 1, vocab - 1  # an allowed token of the masked row (1 % 3 != 0), the only one
    got = token_logprobs_triton(logits.to(device), tokens.to(device)).cpu()
    want = (logits.double().gather(1, tokens[:, None])[:, 0] - reference_lse(logits).double()).float()
    keep = torch.arange(logits.shape[0]) != 4  # -inf - -inf
    torch.testing.assert_close(got[keep], want[keep], atol=ATOL, rtol=1e-6)
    assert got[2] == 0.0


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_bf16_strided_rows_and_no_rows(device):
    gen = torch.Generator().manual_seed(1)
    wide = (torch.randn((3, 2 * VOCAB_CHUNK), generator=gen) * 4).to(torch.bfloat16)
    logits = wide[:, :VOCAB_CHUNK + 3]  # rows strided by the wide tensor's row
    ids, lse = argmax_lse(logits.to(device))
    assert ids.cpu().tolist() == reference_argmax(logits.float()).tolist()
    torch.testing.assert_close(lse.cpu(), reference_lse(logits.float()), atol=ATOL, rtol=1e-6)
    tokens = torch.tensor([0, 5, VOCAB_CHUNK + 2])
    got = token_logprobs_triton(logits.to(device), tokens.to(device), lse).cpu()
    want = logits.float().gather(1, tokens[:, None])[:, 0] - reference_lse(logits.float())
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-6)
    empty_ids, empty_lse = argmax_lse(torch.zeros((0, 9), device=device))
    assert empty_ids.shape == (0,) and empty_lse.shape == (0,)
    assert token_logprobs_triton(torch.zeros((0, 9), device=device),
                                 torch.zeros(0, dtype=torch.int64, device=device)).shape == (0,)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_row_does_not_depend_on_the_others(device):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn((5, VOCAB_CHUNK + 17), generator=gen)
    ids, lse = argmax_lse(logits.to(device))
    alone_ids, alone_lse = argmax_lse(logits[3:4].to(device))
    assert alone_ids.item() == ids[3].item() and alone_lse.item() == lse[3].item()  # bit for bit


COMPILE_SCRIPT = """
from unit_tests.triton_compile_util import compile_for_sm90
from lightllm.common.basemodel.triton_kernel.logits_rows import (NUM_WARPS, VOCAB_CHUNK, VOCAB_TILE, _chunk_kernel,
                                                                  _combine_kernel)
for dtype in ("fp32", "bf16"):
    for with_lse in (True, False):
        sig = {"logits_ptr": "*" + dtype, "part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "part_sum_ptr": "*fp32",
               "vocab": "i32", "stride_row": "i32", "num_chunks": "i32", "CHUNK": "constexpr", "TILE": "constexpr",
               "WITH_LSE": "constexpr"}
        compiled = compile_for_sm90(_chunk_kernel, sig, {"CHUNK": VOCAB_CHUNK, "TILE": VOCAB_TILE, "WITH_LSE": with_lse},
                                    {"num_warps": NUM_WARPS},
                                    divisible=["logits_ptr", "part_val_ptr", "part_idx_ptr", "part_sum_ptr", "vocab",
                                               "stride_row"])
        assert "ptx" in compiled.asm
        sig = {"part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "part_sum_ptr": "*fp32", "ids_ptr": "*i64",
               "lse_ptr": "*fp32", "num_chunks": "i32", "BLOCK_C": "constexpr", "WITH_LSE": "constexpr"}
        compiled = compile_for_sm90(_combine_kernel, sig, {"BLOCK_C": 16, "WITH_LSE": with_lse}, {"num_warps": 1})
        assert "ptx" in compiled.asm
print("compiled")
"""


def test_compiles_for_sm90():
    assert "compiled" in run_compile_child(["-c", COMPILE_SCRIPT])

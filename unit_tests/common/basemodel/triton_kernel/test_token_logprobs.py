"""The one-pass token log-prob kernel against log_softmax in float64 (written here), on rows with
-inf entries (a grammar's mask), a vocabulary that is not a multiple of the tile, and a row of
strided logits. CPU: the Triton interpreter; CUDA in the GPU suite. A child process compiles
the kernel for sm_90 without a GPU."""
import pytest
import torch

from lightllm.common.basemodel.triton_kernel.token_logprobs import VOCAB_TILE, token_logprobs_triton
from unit_tests.devices import KERNEL_DEVICES
from unit_tests.triton_compile_util import run_compile_child

pytestmark = pytest.mark.spread  # a kernel test without fixtures
ATOL = 1e-5


def reference(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    x = logits.double()
    lse = x.max(dim=-1, keepdim=True).values
    lse = lse + torch.log(torch.exp(x - lse).sum(dim=-1, keepdim=True))
    return (x.gather(1, token_ids.long()[:, None]) - lse)[:, 0].float()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("vocab", [7, VOCAB_TILE, 2 * VOCAB_TILE + 5])
def test_matches_float64_log_softmax(device, vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = torch.randn((rows, vocab), generator=gen) * 8
    logits[1, ::3] = float("-inf")  # masked tokens: no weight
    logits[2, :] = float("-inf")
    logits[2, vocab - 1] = 3.0  # one allowed token: log p = 0
    logits[3, 0] = 1e4  # far above the rest
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    ids[1] = 1  # an allowed token of the masked row (1 % 3 != 0)
    ids[2] = vocab - 1
    got = token_logprobs_triton(logits.to(device), ids.to(device)).cpu()
    torch.testing.assert_close(got, reference(logits, ids), atol=ATOL, rtol=0)
    assert got[2] == 0.0


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_strided_rows_and_no_rows(device):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn((3, 2 * VOCAB_TILE), generator=gen)
    logits = wide[:, :VOCAB_TILE + 3]  # rows strided by the wide tensor's row
    ids = torch.tensor([0, 5, VOCAB_TILE + 2])
    got = token_logprobs_triton(logits.to(device), ids.to(device)).cpu()
    torch.testing.assert_close(got, reference(logits, ids), atol=ATOL, rtol=0)
    assert token_logprobs_triton(torch.zeros((0, 9), device=device), torch.zeros(0, dtype=torch.int64,
                                                                                device=device)).shape == (0,)


COMPILE_SCRIPT = """
from unit_tests.triton_compile_util import compile_for_sm90
from lightllm.common.basemodel.triton_kernel.token_logprobs import NUM_WARPS, VOCAB_TILE, _token_logprob_kernel
sig = {"logits_ptr": "*fp32", "token_ids_ptr": "*i64", "out_ptr": "*fp32", "vocab": "i32", "stride_row": "i32",
       "TILE": "constexpr"}
compiled = compile_for_sm90(_token_logprob_kernel, sig, {"TILE": VOCAB_TILE}, {"num_warps": NUM_WARPS},
                            divisible=["logits_ptr", "token_ids_ptr", "out_ptr", "vocab", "stride_row"])
assert "ptx" in compiled.asm
print("compiled")
"""


def test_compiles_for_sm90():
    assert "compiled" in run_compile_child(["-c", COMPILE_SCRIPT])

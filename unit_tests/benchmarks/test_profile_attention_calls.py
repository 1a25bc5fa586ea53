"""The CPU parts of profile_decode_step.py's ``--attention_calls``: a recorded attention call replays as it ran
after the step's row buffers change (a later step overwrites them), and a mixed step's decode head planned as a
decode step gives the head's rows the same output. Under the Triton interpreter; no timing."""
import importlib.util
import os

import torch

import lightllm.models.llama.layer_infer.attention_backends as ab
from lightllm.models.llama.triton_kernel.unified_attention import plan_split_rows, unified_attention
from unit_tests.devices import needs_triton_cpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("profile_decode_step",
                                               os.path.join(REPO, "benchmarks", "profile_decode_step.py"))
profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile)

Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # the embedded model's heads
ROWS_PER_REQ = 4  # K + 1 at K = 3
TABLE_WIDTH = 1000  # slot table columns per request
SCALE = 0.125


def _mixed_rows():
    """Four decode requests (600 and 60 keys, 4 rows each), a 20-row prompt chunk, padding rows to 48."""
    req, lens = [], []
    for b in range(4):
        length = 600 if b % 2 == 0 else 60
        req += [b] * ROWS_PER_REQ
        lens += list(range(length - ROWS_PER_REQ + 1, length + 1))
    req += [9] * 20
    lens += list(range(101, 121))
    req += [10] * (48 - len(req))
    lens += [1] * (48 - len(lens))
    return torch.tensor(req), torch.tensor(lens, dtype=torch.int32)


@needs_triton_cpu
def test_recorded_call_replays_as_it_ran_and_its_decode_twin_agrees():
    req, lens = _mixed_rows()
    head_rows = 4 * ROWS_PER_REQ
    head, _ = plan_split_rows(req, lens, Q_HEADS, KV_HEADS, torch.tensor([head_rows], dtype=torch.int32),
                              ROWS_PER_REQ, 4, 20, 6, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    slots = 11 * TABLE_WIDTH
    q = torch.randn(req.shape[0], Q_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen)
    table = torch.randperm(slots, generator=gen).view(11, TABLE_WIDTH).contiguous()
    with profile.recording_attention([]) as calls:
        out = ab.unified_attention(q, k, v, table, head, SCALE)[:head_rows].clone()
    # a later step reuses the row buffers the plan's tensors view, the activations and the slot table
    lens.fill_(TABLE_WIDTH - 1)
    req.zero_()
    q.zero_()
    table.zero_()
    (call,) = calls
    assert call.label.startswith("bm16 bq4 length") and "blocks 4" in call.label
    torch.testing.assert_close(unified_attention(*call.args)[:head_rows], out)
    twin = profile.decode_twin(*call.args)
    assert twin is not None and twin[0].shape[0] == head_rows
    torch.testing.assert_close(unified_attention(*twin), out, atol=1e-4, rtol=1e-4)
    assert profile.decode_twin(*call.args[:4], _mixed_rows_rest_plan(), SCALE) is None


def _mixed_rows_rest_plan():
    req, lens = _mixed_rows()
    _, rest = plan_split_rows(req, lens, Q_HEADS, KV_HEADS, torch.tensor([4 * ROWS_PER_REQ], dtype=torch.int32),
                              ROWS_PER_REQ, 4, 20, 6, HEAD_DIM)
    return rest

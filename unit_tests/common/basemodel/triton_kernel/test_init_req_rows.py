"""Admission's batched table writes (init_req_rows.py, ReqSamplingParamsManager.init_reqs_sampling_params)
against the scalar writes of each request, one table entry at a time (written here), on fresh tables and on
tables that hold other requests' values: extreme values round-trip bit for bit, rows of other requests stay.
The kernel on CPU runs in the Triton interpreter, on CUDA in the GPU suite; a child process compiles it for
sm_90 without a GPU."""
import random
from dataclasses import dataclass
from typing import List

import numpy as np
import pytest
import torch

from lightllm.common.basemodel.triton_kernel.init_req_rows import init_req_rows_triton, pack_req_rows
from lightllm.common.basemodel.triton_kernel.mtp_utils import NO_DRAFT_TOKEN_ID
from lightllm.common.constants import MTP_TABLE_WIDTH
from lightllm.common import req_manager
from lightllm.common.req_manager import INT32_MAX, INT32_MIN, FP32_MAX, ReqSamplingParamsManager
from lightllm.server.core.objs.sampling_params import SamplingParams
from unit_tests.devices import KERNEL_DEVICES, needs_cuda, needs_triton_cpu
from unit_tests.triton_compile_util import run_compile_child

pytestmark = pytest.mark.spread  # kernel and table tests without fixtures
MAX_REQS = 12
SCALARS = ("temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
TINY_FP32 = float(np.finfo(np.float32).tiny)


@dataclass
class Req:
    """What the tables read of a request."""
    req_idx: int
    params: SamplingParams
    asd_budget: float = 0.0
    prompt_ids: tuple = (1, 2)

    @property
    def has_penalty(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def params(**fields) -> SamplingParams:
    """Values the worker's tables must hold as they are, past the HTTP edge's ranges (check_req's only)."""
    sp = SamplingParams()
    for name, value in fields.items():
        object.__setattr__(sp, name, value)  # SamplingParams is frozen
    return sp


def random_reqs(n: int, seed: int) -> List[Req]:
    rng = random.Random(seed)
    idx = rng.sample(range(MAX_REQS), n)
    floats = [0.0, -0.0, 1.0, 0.7, TINY_FP32, 1e-30, FP32_MAX, -FP32_MAX, 2.5e5]
    reqs = []
    for i in idx:
        p = params(temperature=rng.choice(floats[2:]), top_k=rng.choice([-1, 1, 40, INT32_MAX, INT32_MIN]),
                           top_p=rng.choice([1.0, 0.3, TINY_FP32]),
                           repetition_penalty=rng.choice([1.0, 1.3]), presence_penalty=rng.choice(floats),
                           frequency_penalty=rng.choice(floats))
        reqs.append(Req(i, p, asd_budget=rng.choice([0.0, 2.0625, 1e30, FP32_MAX])))
    return reqs


def tables(device: str, asd: bool, width: int = MTP_TABLE_WIDTH) -> dict:
    """Tables holding another request's values in every row (what admission overwrites)."""
    rows = MAX_REQS + 1
    t = {name: torch.full((rows,), 9.5, dtype=torch.float32, device=device) for name in SCALARS}
    t["top_k"] = torch.full((rows,), 77, dtype=torch.int32, device=device)
    t["next"] = torch.full((rows, width), 123, dtype=torch.int64, device=device)
    if asd:
        t["asd_budget"] = torch.full((rows,), 5.0, dtype=torch.float32, device=device)
        t["asd_cum_regret"] = torch.full((rows,), 3.25, dtype=torch.float32, device=device)
    return t


def reference(t: dict, reqs: List[Req]) -> dict:
    """The scalar writes of each request, one table entry at a time."""
    t = {k: v.clone().cpu() for k, v in t.items()}
    for r in reqs:
        for name in SCALARS:
            t[name][r.req_idx] = getattr(r.params, name)
        t["next"][r.req_idx] = NO_DRAFT_TOKEN_ID
        if "asd_budget" in t:
            t["asd_budget"][r.req_idx] = r.asd_budget
            t["asd_cum_regret"][r.req_idx] = 0.0
    return t


def assert_bit_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        g, w = got[k].cpu(), want[k]
        assert g.dtype == w.dtype and torch.equal(g.view(torch.int32) if g.dtype == torch.float32 else g,
                                                  w.view(torch.int32) if w.dtype == torch.float32 else w), k


def packed(reqs: List[Req], device: str) -> torch.Tensor:
    p = [r.params for r in reqs]
    rows = pack_req_rows([r.req_idx for r in reqs], [x.top_k for x in p], [x.temperature for x in p],
                         [x.top_p for x in p], [x.repetition_penalty for x in p], [x.presence_penalty for x in p],
                         [x.frequency_penalty for x in p], [r.asd_budget for r in reqs])
    return torch.from_numpy(rows).to(device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("asd", [False, True])
@pytest.mark.parametrize("n,width", [(1, MTP_TABLE_WIDTH), (7, MTP_TABLE_WIDTH), (MAX_REQS, 5), (0, 3)])
def test_kernel_matches_scalar_writes(device, asd, n, width):
    reqs = random_reqs(n, seed=n * 10 + width + asd)
    t = tables(device, asd, width)
    want = reference(t, reqs)
    init_req_rows_triton(packed(reqs, device), t["temperature"], t["top_k"], t["top_p"], t["repetition_penalty"],
                         t["presence_penalty"], t["frequency_penalty"], t["next"], t.get("asd_budget"),
                         t.get("asd_cum_regret"))
    assert_bit_equal(t, want)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_without_the_next_token_table(device):
    reqs = random_reqs(4, seed=3)
    t = tables(device, asd=False)
    want = reference(t, reqs)
    want["next"] = t["next"].clone().cpu()  # untouched
    init_req_rows_triton(packed(reqs, device), t["temperature"], t["top_k"], t["top_p"], t["repetition_penalty"],
                         t["presence_penalty"], t["frequency_penalty"])
    assert_bit_equal(t, want)


def test_kernel_refuses_a_bad_row_table():
    t = tables("cpu", asd=False)
    with pytest.raises(ValueError, match="int32"):
        init_req_rows_triton(torch.zeros((2, 8), dtype=torch.int64), *(t[k] for k in SCALARS))
    with pytest.raises(ValueError, match="together"):
        init_req_rows_triton(packed(random_reqs(1, 0), "cpu"), *(t[k] for k in SCALARS), t["next"],
                             asd_budget=t["temperature"])


# (device, path): the CPU backend's per-table writes, the kernel path on CPU tensors (the interpreter), CUDA's
MANAGER_PATHS = [("cpu", "tables"), pytest.param("cpu", "kernel", marks=needs_triton_cpu),
                 pytest.param("cuda", "kernel", marks=needs_cuda)]


@pytest.mark.parametrize("device,path", MANAGER_PATHS)
@pytest.mark.parametrize("asd", [False, True])
def test_manager_writes_what_scalar_writes_would(device, path, asd, monkeypatch):
    """Both of the manager's write paths, over tables that served other requests; a penalized request also
    gets its count rows cleared and its prompt marked seen."""
    monkeypatch.setattr(req_manager, "writes_by_kernel", lambda _: path == "kernel")
    pm = ReqSamplingParamsManager(MAX_REQS, vocab_size=16, device=device, asd_enabled=asd)
    old = random_reqs(MAX_REQS, seed=1)
    pm.init_reqs_sampling_params(old)
    pm.req_to_out_token_counts.fill_(4)
    pm.req_to_token_seen.fill_(True)
    if asd:
        pm.req_to_asd_cum_regret.fill_(1.5)
    nxt = torch.full((MAX_REQS + 1, MTP_TABLE_WIDTH), 7, dtype=torch.int64, device=device)
    reqs = random_reqs(5, seed=2)
    reqs[0].params = params(repetition_penalty=1.3)
    reqs[0].prompt_ids = (3, 5)
    reqs[1].params = params(temperature=0.5, top_k=5)  # no penalty
    t = {name: getattr(pm, f"req_to_{name}") for name in SCALARS}
    t["next"] = nxt
    if asd:
        t["asd_budget"], t["asd_cum_regret"] = pm.req_to_asd_budget, pm.req_to_asd_cum_regret
    want = reference(t, reqs)
    pm.init_reqs_sampling_params(reqs, nxt)
    assert_bit_equal(t, want)
    penalized = [r.req_idx for r in reqs if r.has_penalty]
    plain = [r.req_idx for r in reqs if not r.has_penalty]  # their count rows are not theirs to touch
    assert penalized and plain
    assert int(pm.req_to_out_token_counts[penalized].abs().sum()) == 0
    assert pm.req_to_token_seen[reqs[0].req_idx].nonzero().flatten().tolist() == [3, 5]
    assert bool((pm.req_to_out_token_counts[plain] == 4).all()) and bool(pm.req_to_token_seen[plain].all())


COMPILE_SCRIPT = """
from unit_tests.triton_compile_util import compile_for_sm90
from lightllm.common.basemodel.triton_kernel.init_req_rows import _init_req_rows_kernel
from lightllm.common.constants import MTP_TABLE_WIDTH
ptrs = ["rows_ptr", "temperature_ptr", "top_k_ptr", "top_p_ptr", "repetition_ptr", "presence_ptr",
        "frequency_ptr", "asd_budget_ptr", "asd_regret_ptr", "next_ptr"]
types = ["*i32", "*fp32", "*i32", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32", "*i64"]
sig = dict(zip(ptrs, types), next_stride="i32", NEXT_WIDTH="constexpr", NEXT_BLOCK="constexpr",
           HAS_ASD="constexpr", HAS_NEXT="constexpr")
for flags in ((True, True), (False, False)):
    consts = dict(NEXT_WIDTH=MTP_TABLE_WIDTH, NEXT_BLOCK=MTP_TABLE_WIDTH, HAS_ASD=flags[0], HAS_NEXT=flags[1])
    assert "ptx" in compile_for_sm90(_init_req_rows_kernel, sig, consts, {"num_warps": 1}).asm
print("compiled")
"""


def test_compiles_for_sm90():
    assert "compiled" in run_compile_child(["-c", COMPILE_SCRIPT])

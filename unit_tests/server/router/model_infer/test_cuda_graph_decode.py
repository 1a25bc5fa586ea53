"""CUDA graph decode against the eager step (--disable_cudagraph) on the embedded model, bf16:
plain, strict MTP, ASD B = 0 and ASD at the usage setting, with batches on and between the
captured sizes and requests joining and finishing mid-run. Also, with graphs on, strict MTP
equals plain decoding and B = 0 equals strict. Runs in the GPU CI (skips without CUDA)."""

import pytest
import torch

from lightllm.server.core.objs.start_args_type import StartArgs
from unit_tests.devices import needs_cuda
from unit_tests.server.router.model_infer.embedded_modes import MODES, run_embedded

pytestmark = [needs_cuda, pytest.mark.slow]

# 11 requests, at most 6 at once (a size between the captured 4 and 8); lengths differ, so the
# batch shrinks through other sizes and waiting requests join while others decode.
NUM_REQS = 11
# Two logits closer than this (fp32 reference) are a near-tie that bf16 rounding may flip.
NEAR_TIE_LOGIT_GAP = 0.25
RUNNING = 6
# Decode-only steps (the decode graphs and the prefill rows, which these tests compare): mixed steps run
# their rows in other GEMM shapes again (test_mixed_steps_cuda.py).
ENGINE = dict(running_max_req_size=RUNNING, max_req_total_len=512, max_total_token_num=8192,
              graph_max_batch_size=8, disable_mixed_steps=True)


def _prompts():
    from unit_tests.data_paths import embedded_gsm8k_prompts

    return embedded_gsm8k_prompts(NUM_REQS)[2]


def _run(mode: str, graphs: bool):
    return _run_args(MODES[mode], graphs)


def _run_args(mode_args: dict, graphs: bool):
    res, captured = run_embedded(StartArgs(**mode_args, **ENGINE, disable_cudagraph=not graphs), _prompts())
    return [(r.token_ids, r.logprobs) for r in res], captured


@pytest.fixture(scope="module")
def outputs():
    return {(mode, g): _run(mode, g) for mode in MODES for g in (True, False)}


@pytest.mark.parametrize("mode", list(MODES))
def test_graphs_equal_eager(outputs, mode):
    (with_graphs, captured), (eager, eager_captured) = outputs[(mode, True)], outputs[(mode, False)]
    assert captured and not eager_captured
    assert [t for t, _ in with_graphs] == [t for t, _ in eager]
    assert [lp for _, lp in with_graphs] == [lp for _, lp in eager]  # bit-exact, not close


def test_b0_equals_strict_with_graphs(outputs):
    mtp, asd0 = (outputs[(m, True)][0] for m in ("mtp", "asd0"))
    assert [t for t, _ in asd0] == [t for t, _ in mtp]


def _first_divergence_gaps(prompts, a, b):
    """For each request whose outputs differ, |z[a_i] - z[b_i]| at the first differing position i,
    from transformers' own model in fp32 (the independent reference)."""
    from transformers import AutoModelForCausalLM

    from lightllm.utils.embedded_model import get_default_model_dir

    model = AutoModelForCausalLM.from_pretrained(get_default_model_dir(), dtype=torch.float32).to("cuda").eval()
    gaps = []
    for prompt, x, y in zip(prompts, a, b):
        i = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if i is None:
            continue
        with torch.no_grad():
            z = model(torch.tensor([prompt + x[:i]], device="cuda")).logits[0, -1]
        gaps.append(abs(float(z[x[i]] - z[y[i]])))
    return gaps


def test_strict_mtp_equals_plain_with_graphs_up_to_bf16_near_ties(outputs):
    """Strict MTP verifies K+1 rows per request in one forward, plain decoding one: bf16 GEMMs of
    other shapes may round a near-tie the other way. Any request that differs must differ first
    at a near-tie of the fp32 reference (printed)."""
    plain, mtp = ([t for t, _ in outputs[(m, True)][0]] for m in ("plain", "mtp"))
    gaps = _first_divergence_gaps(_prompts(), plain, mtp)
    print(f"strict MTP vs plain (graphs, bf16): {len(gaps)} of {NUM_REQS} requests differ; fp32 logit gaps {gaps}")
    assert all(g < NEAR_TIE_LOGIT_GAP for g in gaps), gaps


@pytest.mark.parametrize("mode", ["plain", "mtp"])
def test_prefill_rows_equal_the_prefill_forward_up_to_bf16_near_ties(outputs, mode):
    """Short prefills run as decode rows from graphs (the default) or as the prefill forward
    (--graph_max_prefill_tokens 0): the same math in GEMMs of other shapes. Any request that
    differs must differ first at a near-tie of the fp32 reference (printed)."""
    rows = [t for t, _ in outputs[(mode, True)][0]]
    forward = [t for t, _ in _run_args(dict(MODES[mode], graph_max_prefill_tokens=0), True)[0]]
    gaps = _first_divergence_gaps(_prompts(), rows, forward)
    print(f"{mode}: prefill rows vs prefill forward (bf16): {len(gaps)} of {NUM_REQS} requests differ; gaps {gaps}")
    assert all(g < NEAR_TIE_LOGIT_GAP for g in gaps), gaps


def test_a_fusion_draft_with_graphs_equals_eager_and_plain_up_to_near_ties(outputs, tmp_path):
    """An eagle draft whose depth 0 reads fc of target layers 2 and the last (EAGLE-3's fusion; a random
    one, so most proposals are rejected): graphs equal eager bit-exactly, and strict MTP with it equals
    plain decoding up to bf16 near-ties."""
    from transformers import AutoConfig

    from lightllm.models.llama_mtp.train_module import random_draft
    from lightllm.utils.embedded_model import get_default_model_dir

    cfg = AutoConfig.from_pretrained(get_default_model_dir())
    draft = random_draft(cfg, str(tmp_path / "fusion"), True, 1, seed=0, std=0.02,
                         target_layer_ids=[2, cfg.num_hidden_layers - 1])
    args = dict(MODES["mtp"], mtp_draft_model_dir=[draft])
    (with_graphs, captured), (eager, _) = _run_args(args, True), _run_args(args, False)
    assert captured and with_graphs == eager
    plain = [t for t, _ in outputs[("plain", True)][0]]
    gaps = _first_divergence_gaps(_prompts(), plain, [t for t, _ in with_graphs])
    print(f"fusion draft, strict MTP vs plain (graphs, bf16): {len(gaps)} of {NUM_REQS} requests differ; gaps {gaps}")
    assert all(g < NEAR_TIE_LOGIT_GAP for g in gaps), gaps

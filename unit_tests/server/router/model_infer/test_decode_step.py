"""DecodeStep's host side on CPU: the graph ladder, the packed host result, the commit
(hand-computed cases), and --load_format dummy against transformers' own shapes."""
import os

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from lightllm.common.basemodel.cuda_graph import GraphLadder
from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.decode_step import HostStepResult, commit_step
from lightllm.server.router.model_infer.infer_batch import FinishReason, InferReq
from unit_tests.models.tiny_checkpoints import tiny_model
from unit_tests.server.router.engine_util import make_engine


def test_ladder_is_powers_of_two_then_steps():
    assert GraphLadder.from_flags(256, 32, 16).sizes == (1, 2, 4, 8, 16, 32) + tuple(range(48, 257, 16))
    assert GraphLadder.from_flags(64, 32, 16).sizes == (1, 2, 4, 8, 16, 32, 48, 64)
    assert GraphLadder.from_flags(50, 32, 16).sizes == (1, 2, 4, 8, 16, 32, 48, 50)
    assert GraphLadder.from_flags(6, 6, 16).sizes == (1, 2, 4, 6)
    assert GraphLadder.from_flags(1, 1, 1).sizes == (1,)


def test_bucket_is_the_smallest_size_that_fits():
    ladder = GraphLadder.from_flags(64, 32, 16)
    assert [ladder.bucket_size(n) for n in (1, 3, 8, 9, 33, 48, 64)] == [1, 4, 8, 16, 48, 48, 64]
    assert ladder.bucket_size(65) is None


@pytest.mark.parametrize("bad", [(0, 32, 16), (64, 0, 16), (64, 32, 0)])
def test_ladder_rejects_sizes_below_one(bad):
    with pytest.raises(ValueError):
        GraphLadder.from_flags(*bad)


@pytest.mark.parametrize("asd", [False, True])
def test_packed_result_round_trips(asd):
    ids = torch.tensor([5, 49151, 0, 7], dtype=torch.int64)
    lps = torch.tensor([-0.5, -1e-7, -30.25, 0.0], dtype=torch.float32)
    acc = torch.tensor([2, 1], dtype=torch.int32)
    extra = (torch.tensor([False, True, False, False]), torch.tensor([0.125, 3.0], dtype=torch.float32)) if asd else ()
    packed = HostStepResult.pack(ids, lps, acc, *extra)
    assert packed.numel() == HostStepResult.packed_size(4, 2, asd)
    host = HostStepResult.unpack(packed, 4, 2, asd)
    assert host.ids == [5, 49151, 0, 7]
    assert host.logprobs == lps.tolist()  # fp32 values, exactly
    assert host.accept_len == [2, 1]
    if asd:
        assert host.relaxed == [False, True, False, False]
        assert host.spent == [0.125, 3.0]
    else:
        assert host.relaxed is None and host.spent is None


def _req(max_new_tokens=100, eos=(), stop=()):
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=[list(s) for s in stop])
    return InferReq(req_id=1, prompt_ids=[1, 2, 3], params=params, eos_token_ids=list(eos), kv_len=3)


def test_commit_keeps_accepted_rows_and_frees_the_rest():
    # K = 2: three rows per request. Request 0 accepts 3, request 1 accepts 1.
    a, b = _req(), _req()
    host = HostStepResult(ids=[10, 11, 12, 20, 21, 22], logprobs=[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0],
                          accept_len=[3, 1], relaxed=[False, True, False, False, False, False], spent=[0.5, 0.0])
    commits, free = commit_step([a, b], host, [100, 101, 102, 200, 201, 202], rows_per_req=3)
    assert [c.tokens for c in commits] == [[10, 11, 12], [20]]
    assert [c.logprobs for c in commits] == [[-1.0, -2.0, -3.0], [-4.0]]
    assert free == [201, 202]
    assert a.slots == [100, 101, 102] and b.slots == [200]
    assert a.kv_len == 6 and b.kv_len == 4
    assert (a.mtp_accepted_token_num, b.mtp_accepted_token_num) == (2, 0)
    assert (a.asd_relaxed_token_num, a.asd_regret_spent) == (1, 0.5)


def test_commit_stops_at_eos_inside_an_accepted_block():
    req = _req(eos=[11])
    host = HostStepResult(ids=[10, 11, 12], logprobs=[0.0, 0.0, 0.0], accept_len=[3])
    commits, free = commit_step([req], host, [7, 8, 9], rows_per_req=3)
    assert commits[0].tokens == [10, 11] and free == [9]
    assert req.finish_reason == FinishReason.EOS
    assert req.mtp_accepted_token_num == 2  # both kept tokens were accepted drafts


def test_commit_stops_at_length_and_stop_ids():
    short = _req(max_new_tokens=1)
    stopped = _req(stop=[[21, 22]])
    host = HostStepResult(ids=[10, 11, 21, 22], logprobs=[0.0] * 4, accept_len=[2, 2])
    commits, free = commit_step([short, stopped], host, [1, 2, 3, 4], rows_per_req=2)
    assert [c.tokens for c in commits] == [[10], [21, 22]]
    assert free == [2]
    assert (short.finish_reason, stopped.finish_reason) == (FinishReason.LENGTH, FinishReason.STOP)



def test_commit_drops_a_request_that_finished_before_the_step():
    """An overlapped step still has rows of a request that finished (or was aborted) in the step
    committed before it: that request keeps nothing, gets None, and all its rows' slots are
    freed; the requests around it commit as usual (K = 2: three rows per request)."""
    a, c = _req(), _req(stop=[[31]])
    done = _req()
    done.output_ids, done.output_logprobs, done.kv_len, done.slots = [7], [-0.5], 4, [50, 51, 52, 53]
    done.finish_reason, done.decode_steps, done.asd_regret_spent = FinishReason.EOS, 1, 1.0
    host = HostStepResult(ids=[10, 11, 12, 20, 21, 22, 30, 31, 32], logprobs=[-1.0] * 3 + [-2.0] * 3 + [-3.0] * 3,
                          accept_len=[2, 3, 3], relaxed=[False] * 9, spent=[0.5, 9.0, 0.25])
    slots = [100, 101, 102, 200, 201, 202, 300, 301, 302]
    commits, free = commit_step([a, done, c], host, slots, rows_per_req=3)
    assert commits[1] is None
    assert [commits[0].tokens, commits[2].tokens] == [[10, 11], [30, 31]]
    assert free == [102, 200, 201, 202, 302]  # every row of the finished request
    # the finished request is left as it was
    assert (done.output_ids, done.kv_len, done.slots) == ([7], 4, [50, 51, 52, 53])
    assert (done.finish_reason, done.decode_steps, done.asd_regret_spent) == (FinishReason.EOS, 1, 1.0)
    assert done.mtp_accepted_token_num == 0
    # the others: as without it
    assert (a.slots, a.kv_len, a.mtp_accepted_token_num, a.asd_regret_spent) == ([100, 101], 5, 1, 0.5)
    assert (c.slots, c.kv_len, c.mtp_accepted_token_num, c.finish_reason) == ([300, 301], 5, 2, FinishReason.STOP)

def _kept_by_rule(output_len, ids, max_new, eos, ignore_eos):
    """The documented per-token rule, written out: each token is kept; EOS (unless ignored) ends the
    request at that token, else reaching max_new_tokens does. Returns (kept, finish reason)."""
    for j, t in enumerate(ids):
        if not ignore_eos and t in eos:
            return j + 1, FinishReason.EOS
        if output_len + j + 1 >= max_new:
            return j + 1, FinishReason.LENGTH
    return len(ids), None


@pytest.mark.parametrize("seed", range(4))
def test_append_tokens_keeps_what_the_per_token_rule_keeps(seed):
    """The one-pass append (no grammar, no stop sequences) against the rule above, over random
    blocks: EOS inside / at the end / past a length cut, ignore_eos, several EOS ids."""
    rng = torch.Generator().manual_seed(seed)
    for case in range(200):
        eos = [5, 9][: 1 + case % 2]
        ignore = case % 5 == 0
        max_new = int(torch.randint(1, 8, (1,), generator=rng))
        done_before = int(torch.randint(0, max_new, (1,), generator=rng))
        ids = torch.randint(3, 12, (int(torch.randint(1, 5, (1,), generator=rng)),), generator=rng).tolist()
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore)
        req = InferReq(req_id=1, prompt_ids=[1], params=params, eos_token_ids=eos)
        req.output_ids, req.output_logprobs = [4] * done_before, [-1.0] * done_before
        lps = [-0.1 * (j + 1) for j in range(len(ids))]
        kept = req.append_tokens(ids, lps)
        want, reason = _kept_by_rule(done_before, ids, max_new, eos, ignore)
        assert (kept, req.finish_reason) == (want, reason), (ids, max_new, done_before, eos, ignore)
        assert req.output_ids == [4] * done_before + ids[:want]
        assert req.output_logprobs == [-1.0] * done_before + lps[:want]


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory):
    """A model dir with config.json only (no weights)."""
    d = tmp_path_factory.mktemp("dummy")
    full = tiny_model("llama", root=d, seed=1).model_dir
    only = d / "config_only"
    only.mkdir()
    with open(os.path.join(full, "config.json")) as f:
        (only / "config.json").write_text(f.read())
    return str(only)


def test_dummy_weights_have_transformers_shapes(config_only_dir):
    eng = make_engine(config_only_dir, load_format="dummy", max_req_total_len=64, max_total_token_num=200)
    model = eng.backend.model
    ref = LlamaForCausalLM(AutoConfig.from_pretrained(config_only_dir)).state_dict()
    layer = model.trans_layers_weight[0]
    q, k, v = (ref[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert layer.qkv_proj.shape == torch.cat([q, k, v]).shape
    assert layer.o_proj.shape == ref["model.layers.0.self_attn.o_proj.weight"].shape
    assert layer.down_proj.shape == ref["model.layers.0.mlp.down_proj.weight"].shape
    assert model.pre_post_weight.embed_tokens.shape == ref["model.embed_tokens.weight"].shape
    assert len(model.trans_layers_weight) == AutoConfig.from_pretrained(config_only_dir).num_hidden_layers


def test_dummy_weights_generate_reproducibly(config_only_dir):
    outs = []
    for _ in range(2):
        eng = make_engine(config_only_dir, load_format="dummy", max_req_total_len=64, max_total_token_num=200)
        res = eng.generate([[1, 2, 3, 4]], [{"max_new_tokens": 6, "ignore_eos": True}])
        outs.append(res[0].token_ids)
    assert len(outs[0]) == 6 and outs[0] == outs[1]


@pytest.mark.parametrize("flags, message", [
    (dict(graph_max_batch_size=0), "--graph_max_batch_size"),
    (dict(graph_split_batch_size=0), "--graph_split_batch_size"),
    (dict(graph_grow_step_size=-1), "--graph_grow_step_size"),
    (dict(graph_max_prefill_tokens=-1), "--graph_max_prefill_tokens"),
    (dict(load_format="dummy"), "--load_format"),  # needs --model_dir
    (dict(load_format="npz"), "--load_format"),
])
def test_bad_graph_and_load_flags_fail_at_start_up(flags, message):
    from lightllm.server.api_start import StartArgsError, validate_start_args
    from lightllm.server.core.objs.start_args_type import StartArgs

    with pytest.raises(StartArgsError, match=message):
        validate_start_args(StartArgs(**flags))

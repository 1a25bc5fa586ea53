"""Strict MTP is lossless: greedy MTP output equals the engine without MTP, in all four modes."""
import pytest
import torch

from lightllm.models.llama_mtp.train_module import MTPDraftTrainModule
from lightllm.server.core.objs.sampling_params import SamplingParams
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import hf_greedy, make_engine

MODES = ["vanilla_with_att", "eagle_with_att", "vanilla_no_att", "eagle_no_att"]
FUSED = "fused"  # the drafts' key of an eagle draft whose depth 0 reads fc of two target layers


def _fusion_layers(hf):
    """Two target layers, the last first: fc's blocks follow this order, not the layers' own."""
    return [hf.config.num_hidden_layers - 1, 0]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    m = tiny_model(request.param, seed=2, root=tmp_path_factory.mktemp("mtp_" + request.param))
    drafts = {(att, n): m.draft(f"draft_{att}_{n}", att, n, seed=3) for att in (True, False) for n in (1, 3)}
    drafts[FUSED] = m.draft("draft_fused", True, 1, seed=4, target_layer_ids=_fusion_layers(m.hf))
    return m.hf, m.model_dir, drafts


def _draft_dirs(drafts, mode, k):
    if mode == FUSED:
        return [drafts[FUSED]]
    att = mode.endswith("_with_att")
    return [drafts[(att, 1)]] if mode.startswith("eagle") else [drafts[(att, 3)]]


def _workload(vocab, seed=0):
    prompts = random_prompts(vocab, 7, range(1, 30), seed)
    params = [{"max_new_tokens": 4 + 3 * i, "ignore_eos": True} for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("mode", MODES + [FUSED])
def test_strict_mtp_is_token_identical_to_plain_decoding(tiny, mode):
    hf, d, drafts = tiny
    k = 3
    prompts, params = _workload(hf.config.vocab_size)
    common = dict(max_req_total_len=96, running_max_req_size=4, batch_max_tokens=48, max_total_token_num=600)
    plain = make_engine(d, **common).generate(prompts, params)
    mtp_mode = "eagle_with_att" if mode == FUSED else mode
    mtp_eng = make_engine(d, mtp_mode=mtp_mode, mtp_step=k, mtp_draft_model_dir=_draft_dirs(drafts, mode, k), **common)
    mtp = mtp_eng.generate(prompts, params)
    for i in range(len(prompts)):
        assert mtp[i].token_ids == plain[i].token_ids, f"request {i}"
        assert mtp[i].token_ids == hf_greedy(hf, prompts[i], params[i]["max_new_tokens"])
        assert all(1 <= a <= k + 1 for a in mtp[i].accept_lens)
        assert mtp[i].mtp_accepted_token_num == sum(a - 1 for a in mtp[i].accept_lens) - _overshoot(mtp[i], params[i])
    assert mtp_eng.backend.mem_manager.available_size == mtp_eng.backend.mem_manager.size


def _overshoot(res, p):
    """Accepted drafts dropped because max_new_tokens ended the request inside a block."""
    committed = sum(res.accept_lens) + 1  # + the token sampled at prefill
    return committed - len(res.token_ids)


def test_eos_and_stop_inside_an_accepted_block(tiny):
    """A self-draft (the target's own greedy tokens as drafts) accepts whole blocks;
    eos / a stop sequence in the middle of a block ends the request right there."""
    hf, d, drafts = tiny
    prompt = [5, 6, 7, 8]
    ref = hf_greedy(hf, prompt, 20)
    eng = make_engine(d, mtp_mode="eagle_with_att", mtp_step=4, mtp_draft_model_dir=[drafts[(True, 1)]],
                      max_req_total_len=96, max_total_token_num=400)
    eos = ref[6]
    res = eng.generate([prompt], [{"max_new_tokens": 20}], eos_token_ids=[eos])[0]
    assert res.token_ids == ref[: ref.index(eos) + 1] and res.finish_reason == "eos"
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=[ref[8:10]])
    res = eng.generate([prompt], [sp])[0]
    end = next(i for i in range(2, 21) if ref[i - 2:i] == ref[8:10])
    assert res.token_ids == ref[:end] and res.finish_reason == "stop"
    assert eng.backend.mem_manager.available_size == eng.backend.mem_manager.size


def _reference_depth0_input(hf, prompt, fused_dir):
    """Depth 0's hidden input by hand from transformers: the final norm's input, or fc times the asked
    layers' outputs side by side (read from the draft's own safetensors)."""
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states  # embeddings, then layers
        captured = {}
        hook = hf.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("h", i[0]))
        hf(torch.tensor([prompt]))
        hook.remove()
    if fused_dir is None:
        return captured["h"]
    from safetensors.torch import load_file

    last = hf.config.num_hidden_layers - 1
    layer_out = {j: (captured["h"] if j == last else states[j + 1]) for j in _fusion_layers(hf)}
    fc = load_file(f"{fused_dir}/model.safetensors")["model.fc.weight"].float()
    return torch.cat([layer_out[j] for j in _fusion_layers(hf)], dim=-1) @ fc.T


@pytest.mark.parametrize("draft", [True, False, FUSED])
def test_draft_proposals_match_the_reference_module(tiny, draft):
    """After prefill, the engine's K proposals equal the PyTorch training module's greedy chain."""
    hf, d, drafts = tiny
    k = 3
    att = draft is not False
    draft_dir = drafts[FUSED] if draft == FUSED else drafts[(att, 1)]
    eng = make_engine(d, mtp_mode="eagle_with_att" if att else "eagle_no_att", mtp_step=k,
                      mtp_draft_model_dir=[draft_dir], max_req_total_len=64, max_total_token_num=200)
    prompt = [11, 12, 13, 14, 15, 16, 17]
    res = eng.generate([prompt], [{"max_new_tokens": 1, "ignore_eos": True}])[0]
    first = res.token_ids[0]
    # reference: depth 0's input from transformers' hidden states, then the module's chain
    mod = MTPDraftTrainModule.load_draft(hf.config, draft_dir).eval()
    seq = prompt + [first]
    hidden, guess = _reference_depth0_input(hf, prompt, draft_dir if draft == FUSED else None), None
    proposals = []
    with torch.no_grad():
        for depth in range(k):
            toks = [seq[s + depth + 1] if s + depth + 1 < len(seq) else None for s in range(len(prompt))]
            t = torch.tensor([[x if x is not None else int(guess[s]) for s, x in enumerate(toks)]])
            hidden = mod.step(depth, hidden, t, hf.model.embed_tokens)
            logits = hf.lm_head(hf.model.norm(hidden))[0]
            guess = logits.argmax(-1)
            proposals.append(int(guess[-1]))
    # the engine freed the request; its table row still holds the last proposals
    table = eng.backend.req_to_next_token_ids
    rows = [r for r in range(table.shape[0]) if int(table[r, 0]) == first]
    assert any(table[r, 1:k + 1].tolist() == proposals for r in rows)


def test_a_draft_naming_layers_the_target_lacks_fails_at_start_up(tiny, tmp_path):
    hf, d, _ = tiny
    from unit_tests.models.tiny_checkpoints import random_draft

    bad = random_draft(hf.config, str(tmp_path / "bad"), True, 1, seed=0, target_layer_ids=[0, 7])
    with pytest.raises(ValueError, match=r"target_layer_ids \[7\] are not layers of the target"):
        make_engine(d, mtp_mode="eagle_with_att", mtp_step=2, mtp_draft_model_dir=[bad], max_req_total_len=64,
                    max_total_token_num=200)

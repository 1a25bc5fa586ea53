"""MTP draft training (lightllm/tools/train_mtp_draft.py) on a tiny random Llama, on CPU.

The tiny target answers random prompts greedily (through the engine, as the tool
does); the draft trains on those sequences, must learn (loss down, depth-1 top-1
up), and the saved bf16 dir must load in the engine, stay lossless (strict MTP)
and get drafts accepted on the prompts it trained on.
"""
import dataclasses
import json
import os
import random

import pytest
import torch

from lightllm.models.llama_mtp.model import MTPDraftConfig
from lightllm.models.llama_mtp.train_module import MTPDraftTrainModule
from lightllm.tools import train_mtp_draft as tool
from lightllm.tools.train_mtp_draft import (
    IGNORE_INDEX,
    TRAINING_INFO_FILENAME,
    TrainConfig,
    TrainSequence,
    collate,
    depth_inputs,
    evaluate,
    generate_answers,
    init_from_last_layer,
    new_draft_module,
    train_draft,
    training_info,
)
from lightllm.utils import embedded_model
from lightllm.utils.embedded_model import CACHE_DIR_ENV, EMBEDDED_MODEL_NAME, default_draft_dir_for
from unit_tests.models.tiny_checkpoints import build_hf_model, save_checkpoint
from unit_tests.server.router.engine_util import make_engine

NUM_PROMPTS = 40
ANSWER_TOKENS = 24
UNROLL = 3
MTP_STEP = 2
# 32 training sequences / batch 8 = 4 steps an epoch: 32 steps, enough for the draft
# to learn the training sequences and clearly beat its initialisation on them
TRAIN_CFG = TrainConfig(mtp_mode="eagle_with_att", unroll=UNROLL, epochs=8, lr=3e-3, batch_size=8,
                        heldout_fraction=0.2, seed=0)


@pytest.fixture(scope="module")
def one_thread():
    # tiny matrices: extra threads only add overhead (and contention on a busy machine)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(tool.INIT_SCHEMES))
def trained(request, one_thread, tmp_path_factory):
    cfg = dataclasses.replace(TRAIN_CFG, init=request.param)
    root = tmp_path_factory.mktemp("train_mtp_" + request.param)
    hf = build_hf_model("llama", seed=0)
    target_dir = save_checkpoint(hf, str(root / "target"), sharded=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(rng.randrange(4, 12))] for _ in range(NUM_PROMPTS)]
    seqs = generate_answers(target_dir, prompts, ANSWER_TOKENS, eos_token_ids=[], device="cpu", dtype="float32",
                            progress=False)
    result = train_draft(hf, seqs, cfg, "cpu", progress=False)
    draft_dir = str(root / "draft")
    tool.save_outputs(result, draft_dir, training_info(result, cfg, {"data_path": "synthetic"}))
    return hf, target_dir, seqs, result, draft_dir, cfg


def test_depth_inputs_shift_tokens_and_mask_labels_to_the_answer():
    batch = collate([TrainSequence([10, 11, 12, 13, 14, 15], 3), TrainSequence([20, 21, 22], 1)], "cpu")
    tokens0, labels0 = depth_inputs(batch, 0)
    assert tokens0[0].tolist() == [11, 12, 13, 14, 15, 0]
    # label at s is x_{s+2}, kept only where it is an answer token (index >= prompt_len)
    assert labels0[0].tolist() == [IGNORE_INDEX, 13, 14, 15, IGNORE_INDEX, IGNORE_INDEX]
    assert labels0[1].tolist() == [22] + [IGNORE_INDEX] * 5
    tokens2, labels2 = depth_inputs(batch, 2)
    assert tokens2[0].tolist() == [13, 14, 15, 0, 0, 0]
    assert labels2[0].tolist() == [14, 15] + [IGNORE_INDEX] * 4
    assert (labels2[1] == IGNORE_INDEX).all()


def test_last_layer_init_copies_the_last_layer_and_is_identity_on_the_hidden_half(one_thread):
    hf = build_hf_model("llama", seed=1)
    mod = MTPDraftTrainModule(hf.config, with_attention=True, num_modules=2)
    batch = collate([TrainSequence(list(range(1, 12)), 4), TrainSequence(list(range(20, 26)), 2)], "cpu")
    init_from_last_layer(mod, hf, batch)
    scale = tool.measure_hidden_scale(hf, batch)
    last = hf.model.layers[-1].state_dict()
    h = hf.config.hidden_size
    for m in mod.mtp:
        for k, v in m.layer.state_dict().items():
            assert torch.equal(v, last[k])
        assert torch.equal(m.enorm.weight, torch.ones(h)) and torch.equal(m.hnorm.weight, torch.ones(h))
        assert torch.equal(m.eh_proj.weight[:, :h], torch.zeros(h, h))
        assert torch.equal(m.eh_proj.weight[:, h:], scale * torch.eye(h))


def test_random_init_is_small_normal_with_unit_norms(one_thread):
    hf = build_hf_model("llama", seed=1)
    batch = collate([TrainSequence(list(range(1, 12)), 4)], "cpu")
    torch.manual_seed(0)
    mod = new_draft_module(hf, TrainConfig(init="random"), batch, "cpu")
    for name, p in mod.mtp.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(float(p.detach().std()) - hf.config.initializer_range) < 0.003, name
    torch.manual_seed(0)
    again = new_draft_module(hf, TrainConfig(init="random"), batch, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(mod.parameters(), again.parameters()))  # seeded


def test_training_lowers_the_loss_and_raises_depth1_accuracy(trained):
    hf, _, seqs, result, _, cfg = trained
    first, last = result.loss_history[:4], result.loss_history[-4:]
    assert sum(last) / 4 < 0.8 * sum(first) / 4, result.loss_history
    # on the sequences it trained on: the trained draft beats its initialisation clearly
    train_seqs, heldout = tool.split_heldout(seqs, cfg.heldout_fraction, cfg.seed)
    head = tool.TargetHead(hf)
    torch.manual_seed(cfg.seed)  # the module training started from
    untrained = new_draft_module(hf, cfg, collate(train_seqs[: cfg.batch_size], "cpu"), "cpu")
    before = evaluate(untrained, hf, head, train_seqs, cfg, "cpu")
    after = evaluate(result.module, hf, head, train_seqs, cfg, "cpu")
    assert after.top1_by_depth[0] > before.top1_by_depth[0] + 0.1, (before, after)
    assert after.loss_by_depth[0] < before.loss_by_depth[0]
    # and it generalises a little: a lower held-out loss than at the start
    assert len(heldout) == result.num_heldout_sequences == 8
    assert result.heldout_after.loss_by_depth[0] < result.heldout_before.loss_by_depth[0]


def test_saved_dir_is_bf16_with_training_info(trained):
    hf, _, _, result, draft_dir, _ = trained
    cfg = MTPDraftConfig.load(draft_dir)
    assert cfg.with_attention and cfg.num_modules == 1 and cfg.hidden_size == hf.config.hidden_size
    from safetensors.torch import load_file

    state = load_file(os.path.join(draft_dir, "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    with open(os.path.join(draft_dir, TRAINING_INFO_FILENAME)) as f:
        info = json.load(f)
    assert info["steps"] == result.steps == 32 and info["config"]["unroll"] == UNROLL
    assert len(info["heldout_after"]["top1_by_depth"]) == UNROLL
    # the saved module is the trained one (up to bf16 rounding)
    back = MTPDraftTrainModule.load_draft(hf.config, draft_dir)
    w, w_back = result.module.mtp[0].eh_proj.weight, back.mtp[0].eh_proj.weight
    assert torch.equal(w_back, w.to(torch.bfloat16).float())


def test_trained_draft_in_the_engine_is_lossless_and_gets_accepted(trained):
    _, target_dir, seqs, _, draft_dir, _ = trained
    prompts = [s.token_ids[: s.prompt_len] for s in seqs]
    params = [{"max_new_tokens": ANSWER_TOKENS, "ignore_eos": True}] * len(prompts)
    common = dict(max_req_total_len=64, running_max_req_size=16, max_total_token_num=2048)
    plain = make_engine(target_dir, **common).generate(prompts, params)
    mtp = make_engine(target_dir, mtp_mode="eagle_with_att", mtp_step=MTP_STEP, mtp_draft_model_dir=[draft_dir],
                      **common).generate(prompts, params)
    assert [r.token_ids for r in mtp] == [r.token_ids for r in plain]
    assert [r.token_ids for r in plain] == [s.token_ids[s.prompt_len:] for s in seqs]
    train_seqs, _ = tool.split_heldout(seqs, TRAIN_CFG.heldout_fraction, TRAIN_CFG.seed)
    trained_on = {tuple(s.token_ids) for s in train_seqs}
    accept = [a for s, r in zip(seqs, mtp) if tuple(s.token_ids) in trained_on for a in r.accept_lens]
    assert sum(accept) / len(accept) > 1.2, accept  # about 1.3 (1 = no draft ever accepted)


def test_generation_time_budget_keeps_partial_answers(trained):
    _, target_dir, seqs, _, _, _ = trained
    prompts = [s.token_ids[: s.prompt_len] for s in seqs]
    # a budget of 0 s: everything is aborted after the first engine step (one prefill of all prompts)
    cut = generate_answers(target_dir, prompts, ANSWER_TOKENS, eos_token_ids=[], device="cpu", dtype="float32",
                           progress=False, max_seconds=0.0)
    assert 0 < len(cut) <= len(prompts)
    full = {tuple(s.token_ids[: s.prompt_len]): s.token_ids for s in seqs}
    for s in cut:
        assert s.prompt_len < len(s.token_ids) < len(full[tuple(s.token_ids[: s.prompt_len])])
        assert s.token_ids == full[tuple(s.token_ids[: s.prompt_len])][: len(s.token_ids)]


def test_lr_schedule_warms_up_decays_and_follows_the_time_budget():
    sched = tool.LRSchedule(lr=1.0, total_steps=100, kind="cosine")
    assert sched.lr_at(0, 0.0) == pytest.approx(1 / 5)  # 5 warm-up steps
    assert sched.lr_at(4, 0.0) == pytest.approx(1.0)
    assert sched.lr_at(99, 0.0) == pytest.approx(tool.MIN_LR_FRACTION, abs=1e-3)
    lin = tool.LRSchedule(lr=1.0, total_steps=100, kind="linear")
    assert lin.lr_at(50, 0.0) == pytest.approx(tool.MIN_LR_FRACTION + (1 - tool.MIN_LR_FRACTION) * 0.5)
    timed = tool.LRSchedule(lr=1.0, total_steps=100, kind="cosine", max_seconds=10.0)
    assert timed.progress(10, 5.0) == 0.5 and timed.progress(60, 5.0) == 0.6 and timed.progress(10, 11.0) == 1.0
    assert timed.lr_at(10, 10.0) == pytest.approx(tool.MIN_LR_FRACTION)


def test_train_config_rejects_bad_values():
    with pytest.raises(ValueError, match="valid names"):
        TrainConfig(mtp_mode="medusa")
    with pytest.raises(ValueError, match="valid names: last_layer, random"):
        TrainConfig(init="zeros")
    with pytest.raises(ValueError, match="unroll"):
        TrainConfig(unroll=0)
    assert TrainConfig(mtp_mode="vanilla_no_att", unroll=3).num_modules == 3
    assert TrainConfig(mtp_mode="eagle_no_att", unroll=3).num_modules == 1


def test_default_draft_dir_only_for_the_embedded_model_in_eagle_with_att(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    model_dir = tmp_path / "cache" / "models" / EMBEDDED_MODEL_NAME
    model_dir.mkdir(parents=True)
    draft = tmp_path / "drafts" / "eagle_with_att"
    monkeypatch.setitem(embedded_model.EMBEDDED_DRAFT_DIRS, "eagle_with_att", str(draft))
    # not trained / packaged yet: None
    assert default_draft_dir_for(str(model_dir), "eagle_with_att") is None
    draft.mkdir(parents=True)
    (draft / "config.json").write_text("{}")
    assert default_draft_dir_for(str(model_dir), "eagle_with_att") == str(draft)
    link = tmp_path / "link"
    link.symlink_to(model_dir)  # the same dir by another path
    assert default_draft_dir_for(str(link), "eagle_with_att") == str(draft)
    for mode in ("vanilla_with_att", "eagle_no_att", "vanilla_no_att"):
        assert default_draft_dir_for(str(model_dir), mode) is None
    other = tmp_path / "other_model"
    other.mkdir()
    assert default_draft_dir_for(str(other), "eagle_with_att") is None


def test_packaged_draft_location():
    path = embedded_model.EMBEDDED_DRAFT_DIRS["eagle_with_att"]
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(embedded_model.__file__)))
    assert path == os.path.join(pkg_root, "drafts", EMBEDDED_MODEL_NAME, "eagle_with_att")

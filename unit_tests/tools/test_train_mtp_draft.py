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
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from lightllm.models.dspark.train_module import DSPARK, DSparkTrainOptions
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
    draft_outputs,
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


@pytest.fixture(scope="module")
def target_answers(one_thread, tmp_path_factory):
    """The tiny target (transformers, fp32), its checkpoint dir and its greedy answers to random prompts."""
    root = tmp_path_factory.mktemp("train_mtp_target")
    hf = build_hf_model("llama", seed=0)
    target_dir = save_checkpoint(hf, str(root / "target"), sharded=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(rng.randrange(4, 12))] for _ in range(NUM_PROMPTS)]
    seqs = generate_answers(target_dir, prompts, ANSWER_TOKENS, eos_token_ids=[], device="cpu", dtype="float32",
                            progress=False)
    return hf, target_dir, seqs


FUSED_INIT = "last_layer+fusion"  # last_layer, depth 0 reading fc of target layers 0 and 1 (the last)


@pytest.fixture(scope="module", params=[*tool.INIT_SCHEMES, FUSED_INIT])
def trained(request, target_answers, tmp_path_factory):
    fused = request.param == FUSED_INIT
    cfg = dataclasses.replace(TRAIN_CFG, init="last_layer" if fused else request.param,
                              target_layer_ids=(0, 1) if fused else ())
    root = tmp_path_factory.mktemp("train_mtp_" + request.param.replace("+", "_"))
    hf, target_dir, seqs = target_answers
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


def test_init_from_a_draft_dir_starts_from_its_weights(one_thread, tmp_path):
    from safetensors.torch import load_file

    hf = build_hf_model("llama", seed=1)
    src = MTPDraftTrainModule(hf.config, with_attention=True, num_modules=1)
    tool.init_random(src, hf, None)
    src.save_draft(str(tmp_path / "src"))
    cfg = dataclasses.replace(TRAIN_CFG, init_from=str(tmp_path / "src"))
    mod = tool.new_draft_module(hf, cfg, None, "cpu")
    mod.save_draft(str(tmp_path / "again"))
    saved, again = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("src", "again"))
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    with pytest.raises(ValueError, match="does not fit"):
        tool.new_draft_module(hf, dataclasses.replace(cfg, mtp_mode="eagle_no_att"), None, "cpu")


def test_target_hidden_is_the_final_norm_input_and_the_asked_layers_in_order(one_thread):
    hf = build_hf_model("qwen3", seed=1)  # 3 layers
    tokens = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    captured = {}
    hook = hf.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("h", i[0]))
    with torch.no_grad():
        states = hf(tokens, output_hidden_states=True).hidden_states  # embeddings, then each layer's output
    hook.remove()
    h0, aux = tool.target_hidden(hf, tokens, [1, 0])
    assert torch.equal(h0, captured["h"].float())
    assert torch.equal(aux, torch.cat([states[2], states[1]], dim=-1).float())
    h0_alone, none = tool.target_hidden(hf, tokens)
    assert none is None and torch.equal(h0_alone, h0)


def test_fusion_added_to_a_draft_starts_as_that_draft_and_round_trips(one_thread, tmp_path):
    """--target_layer_ids on an --init_from draft without fusion: fc = identity on the last layer's block,
    so every depth's logits equal the source draft's; the saved dir reads the layers back."""
    hf = build_hf_model("llama", seed=1)
    last = hf.config.num_hidden_layers - 1
    src = MTPDraftTrainModule(hf.config, with_attention=True, num_modules=1)
    tool.init_random(src, hf, None)
    src.save_draft(str(tmp_path / "src"))
    cfg = dataclasses.replace(TRAIN_CFG, init_from=str(tmp_path / "src"), target_layer_ids=(0, last))
    fused = tool.new_draft_module(hf, cfg, None, "cpu")
    h = hf.config.hidden_size
    assert fused.fc.weight.shape == (h, 2 * h)
    assert torch.equal(fused.fc.weight, torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1))
    batch = collate([TrainSequence(list(range(1, 14)), 4), TrainSequence(list(range(30, 40)), 3)], "cpu")
    head = tool.TargetHead(hf)
    saved_src = MTPDraftTrainModule.load_draft(hf.config, str(tmp_path / "src"))  # its bf16 weights, as fused has
    with torch.no_grad():
        before, after = (draft_outputs(m, hf, head, batch, TRAIN_CFG)[0] for m in (saved_src, fused))
    for a, b in zip(before.ce_by_depth, after.ce_by_depth):
        assert float(a) == pytest.approx(float(b), rel=1e-6)
    with torch.no_grad():
        fused.fc.weight.normal_(0.0, 0.1)
        changed = draft_outputs(fused, hf, head, batch, TRAIN_CFG)[0]
    assert abs(float(changed.ce_by_depth[0]) - float(before.ce_by_depth[0])) > 1e-3  # fc is on the path
    fused.save_draft(str(tmp_path / "fused"))
    assert MTPDraftConfig.load(str(tmp_path / "fused")).target_layer_ids == [0, last]
    again = tool.new_draft_module(hf, dataclasses.replace(cfg, init_from=str(tmp_path / "fused")), None, "cpu")
    assert torch.allclose(again.fc.weight, fused.fc.weight.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="reads target layers"):
        tool.new_draft_module(hf, dataclasses.replace(cfg, init_from=str(tmp_path / "fused"), target_layer_ids=()),
                              None, "cpu")


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


# ---- soft labels (--soft_label_weight): the target's full distribution as the label ----

FP32_RTOL = 1e-5  # fp32 sums over a few hundred vocab entries, against a float64 reference
SOFT_SEQ_LENS = ((12, 3), (7, 2), (10, 6))  # (length, prompt_len): every depth has labels, with padding
SOFT_WEIGHTS = (0.0, 0.5, 1.0)


def _soft_batch(hf):
    rng = random.Random(1)
    seqs = [TrainSequence([rng.randrange(hf.config.vocab_size) for _ in range(n)], p) for n, p in SOFT_SEQ_LENS]
    return seqs, collate(seqs, "cpu")


def _random_draft(hf, batch):
    torch.manual_seed(0)
    return new_draft_module(hf, dataclasses.replace(TRAIN_CFG, init="random"), batch, "cpu")


@torch.no_grad()
def _draft_logits_by_depth(module, hf, head, batch):
    """The draft's logits [batch, seq, vocab] at every position, per depth (its forward, not under test)."""
    hidden = tool.target_hidden(hf, batch.tokens)[0]
    logits = []
    for depth in range(UNROLL):
        hidden = module.step(depth, hidden, depth_inputs(batch, depth)[0], head.embed)
        logits.append(head.logits(hidden))
    return logits


@torch.no_grad()
def _reference_ce_by_depth(hf, seqs, draft_logits, target_offset=1):
    """Per depth d: (hard CE, soft CE), float64 means over the positions s whose label x_{s+d+2} is an answer
    token, by explicit loops. The soft label is the target's own transformers forward on the unpadded
    sequence at position s + d + target_offset (1: the position predicting the label)."""
    target_logits = [hf(torch.tensor([seq.token_ids])).logits[0].double() for seq in seqs]
    hard, soft = [], []
    for d in range(UNROLL):
        hard_sum, soft_sum, n = 0.0, 0.0, 0
        for b, seq in enumerate(seqs):
            for s in range(len(seq.token_ids)):
                label_pos = s + d + 2
                if label_pos >= len(seq.token_ids) or label_pos < seq.prompt_len:
                    continue
                log_q = torch.log_softmax(draft_logits[d][b, s].double(), dim=-1)
                p = torch.softmax(target_logits[b][s + d + target_offset], dim=-1)
                hard_sum -= float(log_q[seq.token_ids[label_pos]])
                soft_sum -= float((p * log_q).sum())
                n += 1
        assert n > 0
        hard.append(hard_sum / n)
        soft.append(soft_sum / n)
    return hard, soft


def _floats(xs):
    return [float(x.detach()) for x in xs]


def test_soft_label_loss_matches_a_loop_reference(one_thread):
    hf = build_hf_model("llama", seed=1)
    seqs, batch = _soft_batch(hf)
    module, head = _random_draft(hf, batch), tool.TargetHead(hf)
    hard, soft = _reference_ce_by_depth(hf, seqs, _draft_logits_by_depth(module, hf, head, batch))
    outs = {w: draft_outputs(module, hf, head, batch, dataclasses.replace(TRAIN_CFG, soft_label_weight=w))
            for w in SOFT_WEIGHTS}
    weights = TRAIN_CFG.depth_weights
    out1, loss1 = outs[1.0]
    assert _floats(out1.loss_by_depth) == pytest.approx(soft, rel=FP32_RTOL)
    assert float(loss1.detach()) == pytest.approx(sum(w * x for w, x in zip(weights, soft)), rel=FP32_RTOL)
    # the reported (hard) CE does not depend on the weight
    for out, _ in outs.values():
        assert _floats(out.ce_by_depth) == pytest.approx(hard, rel=FP32_RTOL)
    # w = 0.5: per depth the average of the hard-only and the soft-only losses
    (out0, loss0), (half, loss_half) = outs[0.0], outs[0.5]
    for d in range(UNROLL):
        mid = 0.5 * (_floats(out0.loss_by_depth)[d] + _floats(out1.loss_by_depth)[d])
        assert _floats(half.loss_by_depth)[d] == pytest.approx(mid, rel=FP32_RTOL)
    total0, total_half, total1 = _floats((loss0, loss_half, loss1))
    assert total_half == pytest.approx(0.5 * (total0 + total1), rel=FP32_RTOL)
    # the reference tells the positions apart: the target's distribution one position off gives other numbers
    for offset in (0, 2):
        shifted = _reference_ce_by_depth(hf, seqs, _draft_logits_by_depth(module, hf, head, batch), offset)[1]
        assert all(abs(a - b) > 100 * FP32_RTOL * abs(b) for a, b in zip(shifted, soft)), (offset, shifted, soft)
    assert all(abs(a - b) > 100 * FP32_RTOL * abs(b) for a, b in zip(hard, soft))
    # the soft label is a constant: gradients reach the draft only
    loss1.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.parameters())


def _hard_outputs_before_soft_labels(module, hf, head, batch, cfg):
    """draft_outputs' per-depth CE and loss as they were before --soft_label_weight (a copy of that code)."""
    hidden = tool.target_hidden(hf, batch.tokens)[0]
    ces = []
    for depth in range(cfg.unroll):
        tokens_in, labels = depth_inputs(batch, depth)
        hidden = module.step(depth, hidden, tokens_in, head.embed)
        valid = labels != IGNORE_INDEX
        logits = head.logits(hidden[valid])
        ces.append(F.cross_entropy(logits, labels[valid]) if valid.any() else hidden.sum() * 0.0)
    return ces, sum(w * ce for w, ce in zip(cfg.depth_weights, ces))


def test_zero_soft_label_weight_is_the_hard_loss_exactly_without_target_logits(one_thread, monkeypatch):
    hf = build_hf_model("llama", seed=1)
    seqs, batch = _soft_batch(hf)
    module, head = _random_draft(hf, batch), tool.TargetHead(hf)
    cfg = dataclasses.replace(TRAIN_CFG, soft_label_weight=0.0)
    before_ces, before_loss = _hard_outputs_before_soft_labels(module, hf, head, batch, cfg)
    hard = _reference_ce_by_depth(hf, seqs, _draft_logits_by_depth(module, hf, head, batch))[0]
    calls = []
    logits = head.logits
    monkeypatch.setattr(head, "logits", lambda hidden: calls.append(hidden.shape[0]) or logits(hidden))
    out, loss = draft_outputs(module, hf, head, batch, cfg)
    assert torch.equal(loss, before_loss)
    assert all(torch.equal(a, b) for a, b in zip(out.ce_by_depth, before_ces))
    assert all(torch.equal(a, b) for a, b in zip(out.loss_by_depth, before_ces))
    assert _floats(out.ce_by_depth) == pytest.approx(hard, rel=FP32_RTOL)
    # lm_head once per depth, for the draft only: no target logits
    assert len(calls) == UNROLL
    # w > 0: once more per depth, only at the labelled positions; evaluate stays hard-label (no target logits)
    calls.clear()
    soft_cfg = dataclasses.replace(cfg, soft_label_weight=1.0)
    out = draft_outputs(module, hf, head, batch, soft_cfg)[0]
    assert calls == [int(v.sum()) for v in out.valid_by_depth for _ in range(2)]
    calls.clear()
    metrics = evaluate(module, hf, head, seqs, soft_cfg, "cpu")
    assert len(calls) == UNROLL and metrics == evaluate(module, hf, head, seqs, cfg, "cpu")


def test_train_config_checks_the_soft_label_weight():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="soft_label_weight must be in"):
            TrainConfig(soft_label_weight=bad)
    assert TrainConfig(soft_label_weight=1.0).soft_label_weight == 1.0
    dspark = DSparkTrainOptions()
    assert TrainConfig(mtp_mode=DSPARK, unroll=1, dspark=dspark).soft_label_weight == 0.0
    assert TrainConfig(mtp_mode=DSPARK, unroll=1, dspark=dspark, soft_label_weight=0.5).soft_label_weight == 0.5


def test_soft_label_training_lowers_the_heldout_loss(target_answers):
    hf, _, seqs = target_answers
    cfg = dataclasses.replace(TRAIN_CFG, soft_label_weight=1.0)
    result = train_draft(hf, seqs, cfg, "cpu", progress=False)
    first, last = result.loss_history[:4], result.loss_history[-4:]
    assert sum(last) < sum(first), result.loss_history
    # held-out metrics are the hard-label ones, comparable across weights
    assert result.heldout_after.loss_by_depth[0] < result.heldout_before.loss_by_depth[0]
    assert result.heldout_after.top1_by_depth[0] >= result.heldout_before.top1_by_depth[0]
    info = training_info(result, cfg, {})
    assert info["config"]["soft_label_weight"] == 1.0


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


# ---- prompt sources, the prompt set, the held-out set and training_info (tiny Llama, CPU) ----

from lightllm.tools import magpie_prompts as mp  # noqa: E402
from unit_tests.tools.test_magpie_prompts import tiny_tokenizer, user_turn_prefix  # noqa: E402

MAGPIE_PROMPTS = [f"w{10 + i} w{40 + i} w{70 + i} w{100 + i}" for i in range(12)]
GSM8K_QUESTIONS = [f"w{130 + i} w{160 + i} w{190 + i}" for i in range(10)]
HELDOUT_ROWS = [{"id": "code-1", "kind": "code", "prompt": "w220 w221 w222", "source": "test"},
                {"id": "writing-1", "kind": "writing", "prompt": "w223 w224 w225 w226", "source": "test"},
                {"id": "math-1", "kind": "math", "prompt": "w227 w228", "source": "test"}]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny_run(one_thread, tmp_path_factory):
    """A tiny target with a chat-template tokenizer, a GSM8K train file and a held-out file."""
    from unit_tests.models.tiny_checkpoints import tiny_model

    root = tmp_path_factory.mktemp("train_sources")
    model = tiny_model("llama", root)
    tiny_tokenizer().save_pretrained(model.model_dir)
    data = _write_jsonl(root / "train.jsonl", [{"question": q, "answer": "#### 1"} for q in GSM8K_QUESTIONS])
    heldout = _write_jsonl(root / "heldout.jsonl", HELDOUT_ROWS)
    return root, model.model_dir, data, heldout


@pytest.fixture
def fake_magpie(monkeypatch):
    """Magpie sampling replaced by MAGPIE_PROMPTS (the sampler has its own tests), labelled with cfg.domains
    in turn; records its config."""
    seen = []

    def fake(model_dir, cfg, device=None, progress=False):
        seen.append(cfg)
        prompts = MAGPIE_PROMPTS[: cfg.count]
        domains = [cfg.domains[i % len(cfg.domains)] for i in range(len(prompts))]
        shares = [mp.DomainShare(d, cfg.domain_system_prompt(d), domains.count(d), domains.count(d),
                                 domains.count(d), 1) for d in cfg.domains]
        return mp.MagpieResult(prompts, requests=cfg.count + 3, rounds=1,
                               dropped={**{r: 0 for r in mp.DROP_REASONS}, mp.DROP_OVERLONG: 3}, seconds=0.25,
                               prefix=user_turn_prefix(tiny_tokenizer()), domains=domains, shares=shares)

    monkeypatch.setattr(mp, "generate_magpie_prompts", fake)
    return seen


def _argv(tiny_run, out, *extra):
    root, model_dir, data, heldout = tiny_run
    return ["--out", str(out), "--model_dir", model_dir, "--data", data, "--heldout", heldout,
            "--max_new_tokens", "6", "--unroll", "2", "--epochs", "1", "--batch_size", "4", "--gen_batch_size", "8",
            "--device", "cpu", *extra]


def _strings(obj):
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def test_prompt_sources_select_and_mix(tiny_run, fake_magpie):
    root = tiny_run[0]
    a = tool.parse_args(_argv(tiny_run, root / "o"))
    assert a.prompt_source == "gsm8k" and a.prompt_set_out == str(root / "o" / tool.PROMPT_SET_FILENAME)
    records, sampled = tool.build_prompt_set(a, "unused", "cpu", None)
    assert [r.prompt for r in records] == GSM8K_QUESTIONS and sampled is None and not fake_magpie  # file order
    a = tool.parse_args(_argv(tiny_run, root / "o", "--num_questions", "4"))
    assert [r.prompt for r in tool.build_prompt_set(a, "unused", "cpu", None)[0]] == GSM8K_QUESTIONS[:4]
    a = tool.parse_args(_argv(tiny_run, root / "o", "--prompt_source", "magpie", "--magpie_count", "5"))
    records, sampled = tool.build_prompt_set(a, "unused", "cpu", 7.0)
    assert [r.prompt for r in records] == MAGPIE_PROMPTS[:5] and {r.source for r in records} == {mp.SOURCE_MAGPIE}
    cfg = fake_magpie[-1]
    assert (cfg.count, cfg.seed_mode, cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.max_seconds) == (
        5, "batch", 1.0, 0.95, 96, 7.0)
    assert cfg.domains == ("default",) and {r.domain for r in records} == {"default"}
    # mix: 12 general and 10 GSM8K at 0.4 -> as many as the pools allow: 20 (12 + 8)
    a = tool.parse_args(_argv(tiny_run, root / "o", "--prompt_source", "mix", "--magpie_count", "12",
                              "--gsm8k_fraction", "0.4"))
    records, _ = tool.build_prompt_set(a, "unused", "cpu", None)
    assert Counter(r.source for r in records) == {mp.SOURCE_MAGPIE: 12, mp.SOURCE_GSM8K: 8}
    a = tool.parse_args(_argv(tiny_run, root / "o", "--prompt_source", "mix", "--magpie_count", "12",
                              "--gsm8k_fraction", "0.25", "--num_prompts", "8"))
    records, _ = tool.build_prompt_set(a, "unused", "cpu", None)
    assert Counter(r.kind for r in records) == {mp.KIND_GENERAL: 6, mp.KIND_MATH: 2}
    with pytest.raises(SystemExit):
        tool.parse_args(_argv(tiny_run, root / "o", "--prompt_source", "file"))  # needs --prompt_set


def test_magpie_domains_flag(tiny_run, fake_magpie, capsys):
    out = tiny_run[0] / "o"
    plain = tool.parse_args(_argv(tiny_run, out, "--prompt_source", "magpie"))
    named = tool.parse_args(_argv(tiny_run, out, "--prompt_source", "magpie", "--magpie_domains", "default"))
    # default-only is the same run as not passing the flag
    assert plain.magpie_domains == named.magpie_domains == ("default",) and vars(plain) == vars(named)
    expected = mp.MagpieConfig(count=256, seed_mode="batch", gen_batch_size=8, domains=("default",))
    assert tool.magpie_config(plain, None) == tool.magpie_config(named, None) == expected
    assert tool.build_prompt_set(plain, "unused", "cpu", None)[0] == tool.build_prompt_set(named, "unused", "cpu",
                                                                                            None)[0]
    every = tool.parse_args(_argv(tiny_run, out, "--magpie_domains", "default,code,writing,advice,explanation"))
    assert tool.magpie_config(every, None).domains == ("default", "code", "writing", "advice", "explanation")
    for bad, message in (("code,poetry", "unknown Magpie domain(s) 'poetry'; valid names: default, code, "
                                         "writing, advice, explanation"),
                         ("code,code", "distinct")):
        with pytest.raises(SystemExit):
            tool.parse_args(_argv(tiny_run, out, "--magpie_domains", bad))
        err = capsys.readouterr().err
        assert "argument --magpie_domains: " in err and message in err


def test_mix_run_writes_a_replayable_prompt_set_and_training_info(tiny_run, fake_magpie, tmp_path):
    first = tmp_path / "mix"
    tool.main(_argv(tiny_run, first, "--prompt_source", "mix", "--magpie_count", "9", "--gsm8k_fraction", "0.25",
                    "--num_prompts", "12", "--max_gen_seconds", "100", "--magpie_domains", "code,writing"))
    records = mp.read_prompt_set(str(first / tool.PROMPT_SET_FILENAME))
    assert Counter(r.source for r in records) == {mp.SOURCE_MAGPIE: 9, mp.SOURCE_GSM8K: 3}
    # the fake labels the 9 Magpie prompts code, writing, code, ...: 5 and 4; GSM8K has no domain
    assert Counter(r.domain for r in records) == {"code": 5, "writing": 4, None: 3}
    assert fake_magpie[-1].domains == ("code", "writing")
    assert fake_magpie[-1].max_seconds == pytest.approx(tool.MAGPIE_TIME_SHARE * 100)
    info = json.loads((first / TRAINING_INFO_FILENAME).read_text())
    assert info["prompt_source"] == "mix" and info["num_prompts"] == 12
    assert info["prompts_by_source"] == {"magpie": 9, "gsm8k_train": 3}
    assert info["prompts_by_kind"] == {"general": 9, "math": 3} and sum(info["answered_by_kind"].values()) == 12
    assert info["recipe"]["gsm8k_fraction"] == 0.25 and info["recipe"]["magpie_count"] == 9
    assert info["magpie"]["prompts"] == 9 and info["magpie"]["dropped"]["overlong"] == 3
    assert info["magpie"]["seed_mode"] == "batch"
    assert info["recipe"]["magpie_domains"] == ["code", "writing"] and info["magpie"]["domains"] == ["code", "writing"]
    assert info["magpie"]["by_domain"]["writing"] == {"system_prompt": mp.MAGPIE_DOMAINS["writing"], "wanted": 4,
                                                      "prompts": 4, "requests": 4, "rounds": 1}
    assert info["prompts_by_domain"] == {"code": 5, "writing": 4}
    assert set(info["seconds"]) >= {"prompts", "generate", "heldout_generate", "train", "heldout_eval", "total"}
    by_kind = info["heldout_by_kind"]
    assert set(by_kind) == {"code", "writing", "math", tool.NON_MATH}
    assert by_kind[tool.NON_MATH]["sequences"] == 2 and by_kind["math"]["sequences"] == 1
    assert all(len(m["top1_by_depth"]) == 2 for m in by_kind.values())
    # no absolute machine path anywhere
    paths = _strings(info)
    assert not [s for s in paths if os.path.isabs(s) or str(tmp_path) in s or str(tiny_run[0]) in s]
    assert info["recipe"]["out"] == os.path.join(tool.OUTSIDE_REPO, "mix")
    # replay: the same prompts in the same order
    again = tmp_path / "again"
    tool.main(_argv(tiny_run, again, "--prompt_source", "file", "--prompt_set",
                    str(first / tool.PROMPT_SET_FILENAME), "--soft_label_weight", "0.5"))
    assert mp.read_prompt_set(str(again / tool.PROMPT_SET_FILENAME)) == records
    info2 = json.loads((again / TRAINING_INFO_FILENAME).read_text())
    assert info["recipe"]["soft_label_weight"] == info["config"]["soft_label_weight"] == 0.0
    assert info2["recipe"]["soft_label_weight"] == info2["config"]["soft_label_weight"] == 0.5
    assert info2["magpie"] is None and info2["prompts_by_source"] == info["prompts_by_source"]
    assert info2["answer_tokens"] == info["answer_tokens"]


def test_a_heldout_prompt_in_the_training_set_refuses_the_run(tiny_run, tmp_path, monkeypatch):
    bad = [mp.PromptRecord("general", "magpie", "w1 w2 w3"),
           mp.PromptRecord("general", "magpie", "  W223 w224, w225 w226!")]  # held-out writing-1, normalised
    mp.write_prompt_set(str(tmp_path / "bad.jsonl"), bad)
    monkeypatch.setattr(tool, "generate_answers", lambda *a, **k: pytest.fail("generated despite the overlap"))
    with pytest.raises(tool.HeldoutOverlapError, match="1 training prompt"):
        tool.main(_argv(tiny_run, tmp_path / "o", "--prompt_source", "file", "--prompt_set",
                        str(tmp_path / "bad.jsonl")))
    assert mp.read_prompt_set(str(tmp_path / "o" / tool.PROMPT_SET_FILENAME)) == bad  # written for inspection


def test_drop_heldout_trains_without_the_overlapping_prompts(tiny_run, tmp_path, monkeypatch):
    mixed = [mp.PromptRecord("general", "magpie", "w1 w2 w3"),
             mp.PromptRecord("general", "magpie", "  W223 w224, w225 w226!"),  # held-out writing-1, normalised
             mp.PromptRecord("general", "magpie", "w4 w5 w6")]
    mp.write_prompt_set(str(tmp_path / "mixed.jsonl"), mixed)
    seen = []
    real = tool.generate_answers

    def spy(model_dir, prompt_ids, *a, **k):
        seen.append(len(prompt_ids))
        return real(model_dir, prompt_ids, *a, **k)

    monkeypatch.setattr(tool, "generate_answers", spy)
    tool.main(_argv(tiny_run, tmp_path / "o", "--prompt_source", "file", "--prompt_set",
                    str(tmp_path / "mixed.jsonl"), "--drop_heldout"))
    assert mp.read_prompt_set(str(tmp_path / "o" / tool.PROMPT_SET_FILENAME)) == [mixed[0], mixed[2]]
    assert seen[0] == 2  # the training answers: the two prompts outside the held-out set


def test_portable_path(monkeypatch, tmp_path):
    monkeypatch.setenv(tool.GSM8K_DIR_ENV, str(tmp_path / "gsm8k"))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert tool.portable_path(str(tmp_path / "gsm8k" / "train.jsonl")) == "$LIGHTLLM_GSM8K_DIR/train.jsonl"
    assert tool.portable_path(str(tmp_path / "cache" / "models" / "M")) == "$LIGHTLLM_CACHE_DIR/models/M"
    assert tool.portable_path(os.path.join(tool.REPO, "benchmarks", "x.jsonl")) == "benchmarks/x.jsonl"
    assert tool.portable_path(None) is None
    beside = os.path.join(os.path.dirname(tool.REPO), "shared", "data", "gsm8k", "train.jsonl")
    assert tool.portable_path(beside) == "../shared/data/gsm8k/train.jsonl"
    assert tool.portable_path(str(tmp_path / "elsewhere")) == os.path.join(tool.OUTSIDE_REPO, "elsewhere")


def _fusion_draft(tiny_run) -> str:
    """An eagle draft of the tiny_run target whose depth 0 reads fc of target layers 1 and 0."""
    from transformers import AutoConfig

    from lightllm.models.llama_mtp.train_module import random_draft

    config = AutoConfig.from_pretrained(tiny_run[1])
    return random_draft(config, str(tiny_run[0] / "fusion_draft"), True, 1, seed=0, target_layer_ids=[1, 0])


def test_a_bad_training_flag_is_a_usage_error_at_start_up(tiny_run, capsys):
    """TrainConfig's checks reach the command line as argparse errors (exit 2, the message), not tracebacks."""
    for flags, message in ((["--soft_label_weight", "2"], "soft_label_weight must be in [0, 1], got 2.0"),
                           (["--epochs", "0"], "epochs must be >= 1, got 0"),
                           (["--target_layer_ids", "0", "5"], "--target_layer_ids [5] are not layers of the target"),
                           (["--target_layer_ids", "0", "0", "1"], "target_layer_ids must be distinct"),
                           (["--target_layer_ids", "0"], "must include the target's last layer 1"),
                           (["--init_from", _fusion_draft(tiny_run)], "reads target layers [1, 0], not "
                                                                      "--target_layer_ids []")):
        with pytest.raises(SystemExit) as exit_info:
            tool.main(_argv(tiny_run, tiny_run[0] / "bad", *flags))
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


# ---- --answers_cache: generate once, train several recipes on the same answers

def test_answer_cache_round_trip_and_key_check(tmp_path):
    from lightllm.tools import answer_cache as ac

    seqs = [TrainSequence([5, 6, 7, 8], 2), TrainSequence([9], 1), TrainSequence(list(range(40, 70)), 7)]
    heldout = {"code": [TrainSequence([1, 2, 3], 2)], "math": []}
    key = ac.make_key("m", 6, [[5, 6], [9], list(range(40, 47))], [[1, 2]])
    path = str(tmp_path / "sub" / "answers.pt")
    ac.save(path, key, seqs, heldout)
    assert ac.load(path, key, TrainSequence) == (seqs, heldout)
    # the digest sees where one prompt ends and the next begins
    assert ac.ids_digest([[1, 2], [3]]) != ac.ids_digest([[1], [2, 3]])
    other = dataclasses.replace(key, max_new_tokens=7)
    with pytest.raises(ValueError, match=r"holds other answers: max_new_tokens 6 \(now 7\)"):
        ac.load(path, other, TrainSequence)


def test_answers_cache_trains_the_same_draft_without_generating(tiny_run, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    cache = str(tmp_path / "answers.pt")
    first, second = tmp_path / "first", tmp_path / "second"
    tool.main(_argv(tiny_run, first, "--answers_cache", cache))
    assert os.path.exists(cache)
    monkeypatch.setattr(tool, "generate_answers", lambda *a, **k: pytest.fail("generated despite the cache"))
    tool.main(_argv(tiny_run, second, "--answers_cache", cache))
    a, b = (load_file(str(d / "model.safetensors")) for d in (first, second))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same seed, same answers, CPU
    info1, info2 = (json.loads((d / TRAINING_INFO_FILENAME).read_text()) for d in (first, second))
    assert info2["answer_tokens"] == info1["answer_tokens"] and info2["heldout_by_kind"] == info1["heldout_by_kind"]
    assert "generate" in info1["seconds"] and "answers_cache" in info2["seconds"] and "generate" not in info2["seconds"]
    assert info2["recipe"]["answers_cache"] == os.path.join(tool.OUTSIDE_REPO, "answers.pt")  # portable
    # other answers (another length limit) are refused at start-up with the reason, never reused
    with pytest.raises(SystemExit):
        tool.main(_argv(tiny_run, tmp_path / "third", "--answers_cache", cache, "--max_new_tokens", "5"))
    assert "holds other answers: max_new_tokens 6 (now 5)" in capsys.readouterr().err

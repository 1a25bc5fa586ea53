"""The DSpark training module (lightllm/models/dspark/train_module.py) on the tiny random targets, on CPU.

References: transformers' own decoder layer (a draft layer whose context is the input norm of a
target hidden state is that layer over context + block, non-causal in the block), the one-anchor
reference (plain softmax, no mask, no batch) for the batched multi-anchor forward, the target's
hidden states for ``target_aux_hidden``, and the tool's ``main`` for the end-to-end run."""
import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from lightllm.models.dspark import train_module as ds
from lightllm.models.dspark.config import DSparkConfig
from lightllm.models.dspark.train_module import (
    DSparkTrainModule,
    DSparkTrainOptions,
    propose_greedy,
    random_dspark_draft,
    target_aux_hidden,
    teacher_forced_logits,
)
from lightllm.tools import train_mtp_draft as tool
from lightllm.tools.train_mtp_draft import TargetHead, TrainConfig, TrainSequence, collate
from unit_tests.models.tiny_checkpoints import MODEL_KINDS, build_hf_model

ATOL = 1e-4  # fp32, different summation orders
SEQ_LEN = 24
K = 3  # depths compared (block_size - 1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matrices: extra threads only add overhead
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=MODEL_KINDS)
def drafted(request, tmp_path_factory):
    """A tiny target, a random fp32 draft for it (Markov head on) and random token sequences."""
    hf = build_hf_model(request.param, seed=0)
    draft_dir = random_dspark_draft(hf.config, str(tmp_path_factory.mktemp("dspark_" + request.param)), seed=1)
    module = DSparkTrainModule.load_draft(hf.config, draft_dir)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, hf.config.vocab_size, (2, SEQ_LEN), generator=gen)
    aux = target_aux_hidden(hf, tokens, module.config.target_layer_ids)
    return hf, TargetHead(hf), module, tokens, aux, draft_dir


def test_batched_anchors_equal_the_one_anchor_reference(drafted):
    hf, head, module, tokens, aux, _ = drafted
    # first possible anchors, the middle, the last with all depths inside, and a repeated anchor
    anchors = torch.tensor([[1, 7, SEQ_LEN - K, 7], [2, 12, 19, 5]])
    with torch.no_grad():
        out = module(aux, tokens, anchors, head, K)
    assert out.logits.shape == (2, 4, K, hf.config.vocab_size) and out.confidence_logits.shape == (2, 4, K)
    for b in range(2):
        for a in range(anchors.shape[1]):
            p = int(anchors[b, a])
            logits, conf = teacher_forced_logits(module, head, aux[b], p, tokens[b, p: p + K].tolist())
            torch.testing.assert_close(out.logits[b, a], logits, atol=ATOL, rtol=0)
            torch.testing.assert_close(out.confidence_logits[b, a], conf, atol=ATOL, rtol=0)


def test_propose_greedy_feeds_back_its_argmax(drafted):
    _, head, module, tokens, aux, _ = drafted
    p = 9
    proposed, confidences = propose_greedy(module, head, aux[0], int(tokens[0, p]), p, K)
    logits, conf = teacher_forced_logits(module, head, aux[0], p, [int(tokens[0, p])] + proposed[:-1])
    assert proposed == logits.argmax(-1).tolist()
    assert confidences == pytest.approx(torch.sigmoid(conf).tolist(), abs=1e-6)
    # aux rows at positions >= p are never read
    assert propose_greedy(module, head, aux[0, :p], int(tokens[0, p]), p, K) == (proposed, confidences)
    with pytest.raises(ValueError, match="k must be"):
        propose_greedy(module, head, aux[0], int(tokens[0, p]), p, module.config.block_size)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_one_draft_layer_is_transformers_decoder_layer_over_context_and_block(kind):
    """fc = I, hidden_norm = the layer's input_layernorm: c(s) = input_layernorm(a(s)), so the draft layer is
    transformers' layer over [a(0..p-1), block], the block rows seeing every row of the block."""
    hf = build_hf_model(kind, seed=3)
    head = TargetHead(hf)
    options = DSparkTrainOptions(num_hidden_layers=1, markov_rank=4, target_layer_ids=(0,))
    module = DSparkTrainModule(hf.config, options.draft_config(hf.config))
    ds.init_from_last_layers(module, hf)
    layer = module.model.layers[0]
    layer.self_attn.config._attn_implementation = "eager"
    tokens = torch.randint(0, hf.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    aux = target_aux_hidden(hf, tokens, [0])
    p, size = 10, module.config.block_size
    block = torch.tensor([int(tokens[0, p])] + [module.config.mask_token_id] * (size - 1))
    x = torch.cat([aux[:, :p], head.embed(block)[None]], dim=1)  # [1, p + size, hidden]
    n = p + size
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    visible[p:, p:] = True  # the block is not causal
    mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        ref = layer(x, attention_mask=mask, position_embeddings=module.rotary(x, torch.arange(n)[None]))
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0, p:]
        f = module.block_hidden(module.context_kv(aux), tokens, torch.tensor([[p]]), head.embed)[0, 0]
    torch.testing.assert_close(f, ref, atol=ATOL, rtol=0)
    # step 3 by hand: the Markov term starts at 0 (markov_up = 0), the confidence at 1/2
    logits, conf = teacher_forced_logits(module, head, aux[0], p, tokens[0, p: p + K].tolist())
    torch.testing.assert_close(logits, hf.lm_head(hf.model.norm(ref[1: K + 1])), atol=ATOL, rtol=0)
    assert torch.equal(conf, torch.zeros(K))


def test_block_is_not_causal_and_sees_only_context_before_the_anchor(drafted):
    _, head, module, tokens, aux, _ = drafted
    p = 11
    anchors = torch.tensor([[p], [p]])

    def block(aux_in, embed=head.embed):
        with torch.no_grad():
            return module.block_hidden(module.context_kv(aux_in), tokens, anchors, embed)[0, 0]

    f = block(aux)
    later = aux.clone()
    later[:, p:] += 1.0  # the anchor's own position and everything after it
    assert torch.equal(block(later), f)
    earlier = aux.clone()
    earlier[:, p - 1] += 1.0
    assert not torch.allclose(block(earlier), f, atol=ATOL)

    def embed_last_changed(t):
        e = head.embed(t).clone()
        e[..., -1, :] += 1.0  # the block's last row only
        return e

    changed = block(aux, embed_last_changed)
    assert not torch.allclose(changed[0], f[0], atol=ATOL)  # an earlier row sees a later one
    # teacher forcing: x_{p+2} enters only depth 3 (the Markov head's t_2)
    tokens2 = tokens.clone()
    tokens2[:, p + 2] = (tokens2[:, p + 2] + 1) % module.config.vocab_size
    with torch.no_grad():
        a, b = (module(aux, t, anchors, head, K).logits[0, 0] for t in (tokens, tokens2))
    assert torch.equal(a[:2], b[:2]) and not torch.allclose(a[2], b[2], atol=ATOL)


def test_target_aux_hidden_are_the_layer_outputs(drafted):
    hf, _, _, tokens, _, _ = drafted
    last = hf.config.num_hidden_layers - 1
    with torch.no_grad():
        states = hf(input_ids=tokens, output_hidden_states=True).hidden_states  # [embeddings, layer 0, ...]
    hidden = hf.config.hidden_size
    aux = target_aux_hidden(hf, tokens, [last - 1, 0])  # in the order asked (states[-1] is after the final norm)
    torch.testing.assert_close(aux[..., :hidden], states[last])
    torch.testing.assert_close(aux[..., hidden:], states[1])
    # the last layer's output is the final norm's input
    captured = {}
    hook = hf.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("h", i[0]))
    with torch.no_grad():
        hf(input_ids=tokens)
    hook.remove()
    torch.testing.assert_close(target_aux_hidden(hf, tokens, [last]), captured["h"])


def test_save_load_round_trip_with_the_contract_keys(drafted, tmp_path):
    hf, _, module, _, _, draft_dir = drafted
    cfg = module.config
    state = load_file(os.path.join(draft_dir, "model.safetensors"))
    layer_keys = {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                  "mlp.up_proj.weight", "mlp.down_proj.weight"} | {
        f"self_attn.{n}_proj.weight" for n in "qkvo"} | (
        {"self_attn.q_norm.weight", "self_attn.k_norm.weight"} if cfg.qk_norm else set())
    expected = {f"model.layers.{i}.{k}" for i in range(cfg.num_hidden_layers) for k in layer_keys} | {
        "model.fc.weight", "model.hidden_norm.weight", "model.markov_down.weight", "model.markov_up.weight",
        "model.confidence.weight", "model.confidence.bias"}
    assert set(state) == expected
    h = cfg.hidden_size
    assert state["model.fc.weight"].shape == (h, len(cfg.target_layer_ids) * h)
    assert state["model.markov_down.weight"].shape == (cfg.markov_rank, h)
    assert state["model.markov_up.weight"].shape == (h, cfg.markov_rank)
    assert state["model.confidence.weight"].shape == (1, h) and state["model.confidence.bias"].shape == (1,)
    assert cfg.target_layer_ids == [0, hf.config.num_hidden_layers - 1] and cfg.mask_token_id == cfg.vocab_size - 1
    # fp32 round trip is exact; bf16 saves are the rounded weights
    module.save_draft(str(tmp_path / "fp32"), torch.float32)
    back = DSparkTrainModule.load_draft(hf.config, str(tmp_path / "fp32"))
    assert back.config == cfg and all(torch.equal(a, b) for a, b in zip(module.parameters(), back.parameters()))
    module.save_draft(str(tmp_path / "bf16"))
    bf16 = DSparkTrainModule.load_draft(hf.config, str(tmp_path / "bf16"))
    assert torch.equal(bf16.model.fc.weight, module.model.fc.weight.to(torch.bfloat16).float())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["model_type"] == "dspark"


def test_markov_rank_zero_stores_no_markov_head(tmp_path):
    hf = build_hf_model("llama", seed=0)
    draft_dir = random_dspark_draft(hf.config, str(tmp_path), seed=0, markov_rank=0, block_size=3)
    assert not [k for k in load_file(os.path.join(draft_dir, "model.safetensors")) if "markov" in k]
    module = DSparkTrainModule.load_draft(hf.config, draft_dir)
    head, tokens = TargetHead(hf), torch.arange(10)[None]
    aux = target_aux_hidden(hf, tokens, module.config.target_layer_ids)
    tokens_out, _ = propose_greedy(module, head, aux[0], 5, 5, 2)
    assert len(tokens_out) == 2


def test_last_layer_init(drafted):
    hf = drafted[0]
    options = DSparkTrainOptions(num_hidden_layers=1, markov_rank=4, target_layer_ids=(1, 0))
    module = DSparkTrainModule(hf.config, options.draft_config(hf.config))
    ds.init_from_last_layers(module, hf)
    last = hf.model.layers[-1]
    assert all(torch.equal(v, last.state_dict()[k]) for k, v in module.model.layers[0].state_dict().items())
    h = hf.config.hidden_size
    fc = module.model.fc.weight
    assert torch.equal(fc[:, :h], torch.eye(h)) and torch.equal(fc[:, h:], torch.zeros(h, h))  # deepest: entry 0
    assert torch.equal(module.model.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(module.model.markov_up.weight, torch.zeros(h, 4)) and module.model.markov_down.weight.std() > 0
    assert not module.model.confidence.weight.any() and not module.model.confidence.bias.any()


def test_anchor_candidates_and_chunks():
    batch = collate([TrainSequence([10, 11, 12, 13, 14, 15], 3), TrainSequence([20, 21, 22], 1)], "cpu")
    cand = ds.anchor_candidates(batch.is_answer, batch.is_real)
    # p in the answer with x_{p+1} present
    assert cand.tolist() == [[False, False, False, True, True, False], [False, True, False, False, False, False]]
    chunks = list(ds.all_anchor_chunks(cand, 1))
    assert [(a.tolist(), v.tolist()) for a, v in chunks] == [([[3], [1]], [[True], [True]]),
                                                              ([[4], [0]], [[True], [False]])]
    torch.manual_seed(0)
    anchors, valid = ds.sample_anchors(cand, 4)
    assert sorted(anchors[0][valid[0]].tolist()) == [3, 4] and anchors[1][valid[1]].tolist() == [1]


def test_default_target_layers_and_mask_token():
    from unit_tests.tools.test_magpie_prompts import TINY_VOCAB_SIZE, tiny_tokenizer

    assert ds.default_target_layer_ids(30) == [6, 14, 21, 29] and ds.default_target_layer_ids(2) == [0, 1]
    tok = tiny_tokenizer()
    assert ds.default_mask_token_id(tok, TINY_VOCAB_SIZE) == TINY_VOCAB_SIZE - 1  # every special is in chat
    tok.add_tokens(["w250"], special_tokens=True)  # an existing word marked special: never in chat
    [unused] = tok.encode("w250", add_special_tokens=False)
    assert ds.default_mask_token_id(tok, TINY_VOCAB_SIZE) == unused
    assert ds.default_mask_token_id(tok, unused) == unused - 1  # outside the target's vocabulary


# ---- training (the tool's core with --mtp_mode dspark)

TRAIN_OPTIONS = DSparkTrainOptions(block_size=4, num_hidden_layers=1, markov_rank=8, anchors_per_seq=8)
# 32 training sequences / batch 8 = 4 steps an epoch: 80 steps (under a second), enough to learn them
TRAIN_CFG = TrainConfig(mtp_mode="dspark", dspark=TRAIN_OPTIONS, unroll=K, epochs=20, lr=1e-2, batch_size=8,
                        heldout_fraction=0.2, seed=0)


def greedy_sequences(hf, prompt_len: int, answer_len: int, n: int, seed: int):
    """The target's own greedy answers to random prompts (self-distillation data)."""
    tokens = torch.randint(0, hf.config.vocab_size, (n, prompt_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for _ in range(answer_len):
            tokens = torch.cat([tokens, hf(input_ids=tokens).logits[:, -1:].argmax(-1)], dim=1)
    return [TrainSequence(t.tolist(), prompt_len) for t in tokens]


def test_training_lowers_the_loss_and_raises_top1():
    hf = build_hf_model("llama", seed=0)
    seqs = greedy_sequences(hf, 6, 18, 20, seed=5) + greedy_sequences(hf, 9, 12, 20, seed=6)  # padded batches
    result = tool.train_draft(hf, seqs, TRAIN_CFG, "cpu", progress=False)
    first, last = result.loss_history[:4], result.loss_history[-4:]
    assert sum(last) < 0.5 * sum(first), result.loss_history
    assert len(result.heldout_after.top1_by_depth) == K and result.num_heldout_sequences == 8
    # on the sequences it trained on (every anchor: evaluation is deterministic), it beats its start clearly
    # (a random tiny target's answers do not generalise from 32 sequences: no held-out claim)
    train_seqs, _ = tool.split_heldout(seqs, TRAIN_CFG.heldout_fraction, TRAIN_CFG.seed)
    head = TargetHead(hf)
    torch.manual_seed(TRAIN_CFG.seed)  # the module training started from
    untrained = tool.new_draft_module(hf, TRAIN_CFG, None, "cpu")
    before = tool.evaluate(untrained, hf, head, train_seqs, TRAIN_CFG, "cpu")
    after = tool.evaluate(result.module, hf, head, train_seqs, TRAIN_CFG, "cpu")
    assert after == tool.evaluate(result.module, hf, head, train_seqs, TRAIN_CFG, "cpu")
    for d in range(K):
        assert after.top1_by_depth[d] > before.top1_by_depth[d] + 0.2, (before, after)
        assert after.loss_by_depth[d] < 0.5 * before.loss_by_depth[d], (before, after)
    assert after.accept_len_estimate > before.accept_len_estimate + 0.2


def test_train_config_checks_the_dspark_unroll():
    with pytest.raises(ValueError, match="block_size - 1"):
        dataclasses.replace(TRAIN_CFG, unroll=TRAIN_OPTIONS.block_size)
    with pytest.raises(ValueError, match="DSparkTrainOptions"):
        TrainConfig(mtp_mode="dspark")


def test_tool_flags_and_their_defaults():
    assert "--anchors_per_seq" in tool.make_parser().format_help()  # --help renders (no stray '%')
    a = tool.parse_args(["--out", "o", "--mtp_mode", "dspark", "--block_size", "5"])
    assert (a.unroll, a.draft_layers, a.markov_rank, a.anchors_per_seq) == (4, 2, 32, 16)
    assert tool.parse_args(["--out", "o"]).unroll == TrainConfig.unroll  # the other modes keep theirs
    assert "dspark" in tool.TRAIN_MODES


def test_tool_main_trains_a_loadable_dspark_draft(tmp_path):
    from unit_tests.models.tiny_checkpoints import tiny_model
    from unit_tests.tools.test_magpie_prompts import tiny_tokenizer
    from unit_tests.tools.test_train_mtp_draft import GSM8K_QUESTIONS, HELDOUT_ROWS, _write_jsonl

    model = tiny_model("llama", tmp_path)
    tiny_tokenizer().save_pretrained(model.model_dir)
    data = _write_jsonl(tmp_path / "train.jsonl", [{"question": q, "answer": "#### 1"} for q in GSM8K_QUESTIONS])
    heldout = _write_jsonl(tmp_path / "heldout.jsonl", HELDOUT_ROWS)
    out = tmp_path / "draft"
    tool.main(["--out", str(out), "--model_dir", model.model_dir, "--data", data, "--heldout", heldout,
               "--max_new_tokens", "6", "--epochs", "1", "--batch_size", "4", "--gen_batch_size", "8",
               "--device", "cpu", "--mtp_mode", "dspark", "--block_size", "3", "--draft_layers", "1",
               "--markov_rank", "4", "--anchors_per_seq", "4"])
    cfg = DSparkConfig.load(str(out))
    assert (cfg.block_size, cfg.num_hidden_layers, cfg.markov_rank) == (3, 1, 4)
    assert cfg.target_layer_ids == [0, 1] and cfg.mask_token_id == model.vocab_size - 1  # the defaults
    module = DSparkTrainModule.load_draft(model.hf.config, str(out))
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / "model.safetensors")).values())
    info = json.loads((out / tool.TRAINING_INFO_FILENAME).read_text())
    assert info["config"]["unroll"] == 2 and info["config"]["dspark"]["target_layer_ids"] == [0, 1]
    assert info["depth_index_note"] == ds.DEPTH_INDEX_NOTE
    assert all(len(m["top1_by_depth"]) == 2 for m in info["heldout_by_kind"].values())
    head = TargetHead(model.hf)
    tokens = torch.arange(3, 12)[None]
    aux = target_aux_hidden(model.hf, tokens, cfg.target_layer_ids)
    assert len(propose_greedy(module, head, aux[0], int(tokens[0, 5]), 5, 2)[0]) == 2


def test_init_from_a_draft_dir_must_fit_the_flags(drafted, tmp_path):
    hf, _, module, _, _, draft_dir = drafted
    cfg = module.config
    options = DSparkTrainOptions(block_size=cfg.block_size, num_hidden_layers=cfg.num_hidden_layers,
                                 markov_rank=cfg.markov_rank, target_layer_ids=tuple(cfg.target_layer_ids))
    train_cfg = dataclasses.replace(TRAIN_CFG, dspark=options, init_from=draft_dir)
    again = tool.new_draft_module(hf, train_cfg, None, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), again.parameters()))
    with pytest.raises(ValueError, match="does not fit"):
        tool.new_draft_module(hf, dataclasses.replace(train_cfg, dspark=dataclasses.replace(options, markov_rank=2)),
                              None, "cpu")


# ---- soft labels (--soft_label_weight with --mtp_mode dspark)

SOFT_SEQS = ((14, 4), (9, 3), (12, 8))  # (length, prompt_len): padded batch, anchors near both ends
SOFT_RTOL = 1e-4  # fp32 batched blocks against the one-anchor reference (ATOL on the logits)


@torch.no_grad()
def _loop_reference_ces(hf, head, module, seqs, target_offset=0):
    """Per depth d (block position d + 1): (hard CE, soft CE), float64 means over every anchor p of every
    sequence (x_p an answer token, x_{p+1} real) whose label x_{p+d+1} exists, one anchor at a time
    (``teacher_forced_logits``). The soft label is the target's transformers forward at p + d +
    target_offset (0: the position that predicts the label)."""
    hard, soft, n = [0.0] * K, [0.0] * K, [0] * K
    for seq in seqs:
        ids = torch.tensor([seq.token_ids])
        target_logits = hf(ids).logits[0].double()
        aux = target_aux_hidden(hf, ids, module.config.target_layer_ids)[0]
        length = len(seq.token_ids)
        for p in range(seq.prompt_len, length - 1):
            prev = (list(seq.token_ids[p: p + K]) + [tool.PAD_TOKEN_ID] * K)[:K]
            logits = teacher_forced_logits(module, head, aux, p, prev)[0].double()
            for d in range(K):
                if p + d + 1 >= length:
                    continue
                log_q = torch.log_softmax(logits[d], dim=-1)
                hard[d] -= float(log_q[seq.token_ids[p + d + 1]])
                soft[d] -= float((torch.softmax(target_logits[p + d + target_offset], dim=-1) * log_q).sum())
                n[d] += 1
    assert all(n)
    return [h / c for h, c in zip(hard, n)], [s / c for s, c in zip(soft, n)]


def test_soft_label_loss_matches_a_one_anchor_loop_reference(tmp_path):
    hf = build_hf_model("llama", seed=1)
    module = DSparkTrainModule.load_draft(hf.config, random_dspark_draft(hf.config, str(tmp_path), seed=3))
    head = TargetHead(hf)
    gen = torch.Generator().manual_seed(4)
    seqs = [TrainSequence(torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist(), p)
            for n, p in SOFT_SEQS]
    batch = collate(seqs, "cpu")
    options = DSparkTrainOptions(block_size=module.config.block_size, anchors_per_seq=5)  # 5: several chunks
    cfg = {w: dataclasses.replace(TRAIN_CFG, dspark=options, soft_label_weight=w) for w in (0.0, 0.5, 1.0)}
    outs = {w: ds.batch_outputs(module, hf, head, batch, c, sample=False) for w, c in cfg.items()}
    hard, soft = _loop_reference_ces(hf, head, module, seqs)
    for w, (out, _) in outs.items():
        assert [float(x.detach()) for x in out.ce_by_depth] == pytest.approx(hard, rel=SOFT_RTOL)  # reported: hard
        want = [(1 - w) * h + w * s for h, s in zip(hard, soft)]
        assert [float(x.detach()) for x in out.loss_by_depth] == pytest.approx(want, rel=SOFT_RTOL), w
    # the total: depth-weighted losses plus the confidence term, which the weight does not touch
    (out0, loss0), (out1, loss1) = outs[0.0], outs[1.0]
    assert float(out0.confidence_bce) == pytest.approx(float(out1.confidence_bce), rel=SOFT_RTOL)
    gap = sum(w * (s - h) for w, h, s in zip(TRAIN_CFG.depth_weights, hard, soft))
    assert float(loss1 - loss0) == pytest.approx(gap, rel=SOFT_RTOL, abs=1e-5)
    # the reference tells the positions apart, and soft from hard
    for offset in (-1, 1):
        shifted = _loop_reference_ces(hf, head, module, seqs, offset)[1]
        assert all(abs(a - b) > 10 * SOFT_RTOL * abs(b) for a, b in zip(shifted, soft)), (offset, shifted, soft)
    assert all(abs(a - b) > 10 * SOFT_RTOL * abs(b) for a, b in zip(hard, soft))
    # soft_labels=False (evaluation) is the hard loss exactly, whatever the weight
    hard_only = ds.batch_outputs(module, hf, head, batch, cfg[1.0], sample=False, soft_labels=False)[1]
    assert torch.equal(hard_only, loss0)
    # the soft label is a constant: gradients reach the draft
    loss1.backward()
    missing = [n for n, p in module.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing

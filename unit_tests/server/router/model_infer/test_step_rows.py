"""Short prefills run as decode rows (step_rows.py), on CPU with the eager path the CUDA
graphs capture: the token ladder (hand-computed), and the engine's greedy tokens against
transformers' own generation, with prompts on both sides of the rows limit and chunked."""
import pytest
import torch

from lightllm.server.router.model_infer.mtp_speculative.draft import UNKNOWN_TOKEN, tokens_ahead
from lightllm.server.router.model_infer.step_rows import (RowItem, RowsBatch, StepRows, max_sampled_rows, step_ladder,
                                                          token_ladder)
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import hf_greedy, make_engine

ROWS_LIMIT = 16  # prompts (chunks) up to this many tokens take the rows path
NEW_TOKENS = 6
BLOCK_LADDER_MAX = 4  # dspark's padded blocks over rows: 1, 2, 4


def test_token_ladder_is_powers_of_two_then_the_limit():
    assert token_ladder(512).sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert token_ladder(100).sizes == (1, 2, 4, 8, 16, 32, 64, 100)
    assert token_ladder(1).sizes == (1,)
    assert token_ladder(100).bucket_size(65) == 100 and token_ladder(100).bucket_size(101) is None


def test_step_ladder_grows_in_steps_past_the_split():
    # a mixed step of 256 decode rows and a 400-token chunk pads to 768 rows (not 1024)
    assert step_ladder(2048, 2304).sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536,
                                             1792, 2048, 2304)
    assert step_ladder(2048, 2304).bucket_size(656) == 768
    assert step_ladder(300, 300).sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)
    assert step_ladder(512, 640).sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 640)


def test_draft_rows_are_the_decode_rows_and_each_chunks_last_k_rows():
    # two decode items of 3 rows (K = 2), a 5-row chunk, a 1-row chunk: rows 0-5, 6-10, 11
    items = [RowItem(0, 7, 3), RowItem(1, 4, 3), RowItem(2, 0, 5, tokens=list(range(9))),
             RowItem(3, 2, 1, tokens=[5, 6, 7])]
    batch = RowsBatch(16, items, [0, 3, 6, 11], num_decode_rows=6, num_rows=12)
    assert batch.draft_rows(2) == [0, 1, 2, 3, 4, 5, 9, 10, 11]
    assert batch.draft_rows(3) == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]


def test_stage_lays_out_rows_hand_computed():
    """A decode item and two prompt chunks (K = 2), padded to 10 rows: every staged column."""
    from types import SimpleNamespace

    from lightllm.server.router.model_infer.step_rows import GATHER_INPUT, PAD_TOKEN_ID

    hold_req, hold_slot = 99, 999
    model = SimpleNamespace(req_manager=SimpleNamespace(HOLD_REQUEST_ID=hold_req),
                            mem_manager=SimpleNamespace(HOLD_SLOT=hold_slot), device=torch.device("cpu"))
    rows = StepRows(model, None, token_ladder(16), use_graphs=False, draft=SimpleNamespace(mtp_step=2),
                    max_logit_rows=12)
    items = [RowItem(5, 7, 3), RowItem(6, 1, 3, tokens=[10, 11, 12, 13, 14]), RowItem(8, 0, 2, tokens=[20, 21])]
    batch = rows.stage(items, torch.arange(100, 108), size=10)
    g, u, n = GATHER_INPUT, UNKNOWN_TOKEN, 10
    assert (batch.size, batch.num_rows, batch.num_decode_rows, batch.first_row) == (10, 8, 3, [0, 3, 6])
    assert rows.b_req_idx[:n].tolist() == [5, 5, 5, 6, 6, 6, 8, 8, hold_req, hold_req]
    assert rows.b_seq_len[:n].tolist() == [8, 9, 10, 2, 3, 4, 1, 2, 1, 1]
    assert rows.b_mtp_index[:n].tolist() == [0, 1, 2, 0, 0, 0, 0, 0, 0, 0]
    assert rows.staged_ids[:n].tolist() == [g, g, g, 11, 12, 13, 20, 21, PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert rows.mem_indexes[:n].tolist() == list(range(100, 108)) + [hold_slot] * 2
    assert rows.known[:, :n].tolist() == [[u, u, u, 12, 13, 14, 21, u, u, u],  # depth 0 takes x_{s+1}
                                          [u, u, u, 13, 14, u, u, u, u, u]]  # depth 1 takes x_{s+2}
    assert rows.logit_index[:n].tolist() == [0, 1, 2, 5, 7, 0, 0, 0, 0, 0]
    assert rows.draft_index[:n].tolist() == [0, 1, 2, 4, 5, 6, 7, n, n, n]
    assert rows.staged_seq_len_cpu.tolist() == [8, 9, 10, 2, 3, 4, 1, 2, 1, 1]


def test_tokens_ahead_hand_computed():
    u = UNKNOWN_TOKEN
    # positions 1..2 of [10, 11, 12]; positions 0..2 of [20, 21, 22, 23]; width 3 (offsets 0, 1, 2)
    assert tokens_ahead([10, 11, 12], 1, 2, 3).tolist() == [[11, 12, u], [12, u, u]]
    assert tokens_ahead([20, 21, 22, 23], 0, 3, 3).tolist() == [[20, 21, 22], [21, 22, 23], [22, 23, u]]
    assert tokens_ahead([20, 21, 22, 23], 3, 1, 1).tolist() == [[23]]
    assert tokens_ahead([], 0, 0, 3).shape == (0, 3)  # a DP rank with only padding items


def _with_rows(eng) -> list:
    """Give ``eng`` a rows path (CPU has none by default) and record the padded sizes it runs."""
    backend = eng.backend
    draft = backend.draft if backend.draft is not None and backend.draft.drafts_prefill_rows else None
    rows = StepRows(backend.model, backend.req_to_next_token_ids, token_ladder(ROWS_LIMIT), use_graphs=False,
                    draft=draft, max_logit_rows=max_sampled_rows(backend.args.running_max_req_size, backend.mtp_step),
                    context=backend.rows_context)
    if backend.rows_context is not None:  # dspark: the finished prompts' blocks padded as on CUDA (1, 2, 4)
        backend.draft.use_block_ladder(token_ladder(BLOCK_LADDER_MAX), False)
    sizes = []
    forward = rows.forward

    def spy(batch):
        sizes.append(batch.size)
        return forward(batch)

    rows.forward = spy
    backend.step_rows = rows
    return sizes


def _record_items(eng) -> list:
    """The number of items of every rows prefill step, in order."""
    rows, counts = eng.backend.step_rows, []
    stage = rows.stage

    def spy(items, slots, size=None):
        counts.append(len(items))
        return stage(items, slots, size)

    rows.stage = spy
    return counts


def _record_prefill_drafts(eng) -> list:
    """The proposals written after each finished prompt's first token, in order."""
    backend = eng.backend
    written = []
    write = backend._write_prefill_drafts

    def spy(req_idx, drafts, conf):
        written.extend(drafts.tolist())
        write(req_idx, drafts, conf)

    backend._write_prefill_drafts = spy
    return written


@pytest.mark.parametrize("running, batch_max_tokens, fusion", [(1, None, False), (1, 12, False), (4, 12, False),
                                                              (4, 12, True)])
def test_rows_prefill_drafts_equal_the_prefill_drafts(tmp_path, running, batch_max_tokens, fusion):
    """Eagle K = 2: the proposals after every prompt, drafted over rows, equal those drafted by
    ``propose_after_prefill`` over the prefill forward, and strict MTP still equals transformers.
    With 4 running requests and 12-token steps, one step holds several items, some over a cached prefix.
    ``fusion``: depth 0 reads fc of both target layers."""
    tiny = tiny_model("llama", tmp_path)
    draft = tiny.draft("draft", target_layer_ids=[1, 0] if fusion else ())
    prompts = random_prompts(tiny.vocab_size, 3, range(3, 11), seed=4) + random_prompts(tiny.vocab_size, 2, range(20, 30))
    written = {}
    for with_rows in (True, False):
        # prefill-only steps (mixed steps draft their prompts in the decode flow: test_mixed_steps.py)
        eng = make_engine(tiny.model_dir, running_max_req_size=running, max_req_total_len=64,
                          batch_max_tokens=batch_max_tokens, mtp_mode="eagle_with_att", mtp_step=2,
                          mtp_draft_model_dir=[draft], disable_mixed_steps=True)
        sizes = _with_rows(eng) if with_rows else None
        items = _record_items(eng) if with_rows else None
        written[with_rows] = _record_prefill_drafts(eng)
        res = eng.generate(prompts, [{"max_new_tokens": NEW_TOKENS, "ignore_eos": True}] * len(prompts))
        assert sizes is None or sizes
        if items is not None and running > 1:  # the case this parametrization is for
            assert max(items) > 1
        for prompt, r in zip(prompts, res):
            assert r.token_ids == hf_greedy(tiny.hf, prompt, NEW_TOKENS)
    assert len(written[True]) == len(prompts) and written[True] == written[False]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("batch_max_tokens", [None, 12])
def test_rows_prefill_matches_transformers(tmp_path, kind, batch_max_tokens):
    tiny = tiny_model(kind, tmp_path)
    # 3..10 tokens: rows; 20..29: the prefill forward, or chunks of at most 12 (rows, the second
    # over a cached prefix)
    prompts = random_prompts(tiny.hf.config.vocab_size, 3, range(3, 11), seed=1)
    prompts += random_prompts(tiny.hf.config.vocab_size, 3, range(20, 30), seed=2)
    # one request at a time: each prompt (or chunk) is its own prefill step
    eng = make_engine(tiny.model_dir, running_max_req_size=1, max_req_total_len=64, batch_max_tokens=batch_max_tokens)
    sizes = _with_rows(eng)
    res = eng.generate(prompts, [{"max_new_tokens": NEW_TOKENS, "ignore_eos": True}] * len(prompts))
    assert sizes and all(s in token_ladder(ROWS_LIMIT).sizes for s in sizes)
    for prompt, r in zip(prompts, res):
        assert r.token_ids == hf_greedy(tiny.hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("running", [1, 3])  # 3: a prefill step finishes up to 3 prompts (blocks padded to 4)
def test_rows_target_with_dspark_prefill_drafts(tmp_path, running):
    """dspark over rows: its context from the rows (write_context) and the finished prompts' blocks
    padded to a ladder (propose_mixed) give the proposals and confidences of ``propose_after_prefill``
    over the prefill forward; strict output = transformers."""
    from lightllm.models.dspark.train_module import random_dspark_draft

    tiny = tiny_model("llama", tmp_path)
    draft = random_dspark_draft(tiny.hf.config, str(tmp_path / "dspark"), seed=3, block_size=4)
    prompts = random_prompts(tiny.vocab_size, 3, range(3, 5), seed=5)  # three fit one step
    prompts += random_prompts(tiny.vocab_size, 2, range(20, 30))
    written = {}
    for with_rows in (True, False):
        eng = make_engine(tiny.model_dir, running_max_req_size=running, max_req_total_len=64, batch_max_tokens=12,
                          mtp_mode="dspark", mtp_step=3, mtp_draft_model_dir=[draft])
        sizes = _with_rows(eng) if with_rows else None
        assert with_rows is False or eng.backend.step_rows.draft is None  # dspark: no rows draft pass
        backend, calls = eng.backend, []
        write = backend._write_prefill_drafts

        def spy(req_idx, drafts, conf, write=write, calls=calls):
            calls.append((drafts.tolist(), conf.tolist()))
            write(req_idx, drafts, conf)

        backend._write_prefill_drafts = spy
        res = eng.generate(prompts, [{"max_new_tokens": NEW_TOKENS, "ignore_eos": True}] * len(prompts))
        assert sizes is None or sizes
        for prompt, r in zip(prompts, res):
            assert r.token_ids == hf_greedy(tiny.hf, prompt, NEW_TOKENS)
        written[with_rows] = calls
    assert len(written[True]) == len(written[False]) and written[True]
    if running == 1:
        assert len(written[True]) == len(prompts)
    else:
        assert any(len(d) == 3 for d, _ in written[True])  # one step finished 3 prompts (padded to 4)
    for (d_rows, c_rows), (d_fwd, c_fwd) in zip(written[True], written[False]):
        assert d_rows == d_fwd
        torch.testing.assert_close(torch.tensor(c_rows), torch.tensor(c_fwd), rtol=1e-5, atol=1e-6)


def test_rows_forward_equals_the_prefill_forward(tmp_path):
    """Two prompts in one prefill step: every token's hidden state and each prompt's last-token
    logits from the rows equal the prefill forward's (fp32, the same math)."""
    tiny = tiny_model("llama", tmp_path)
    # the same prompts twice: both prefills from token 0
    eng = make_engine(tiny.model_dir, running_max_req_size=4, max_req_total_len=64, disable_dynamic_prompt_cache=True)
    backend = eng.backend
    outs = []
    real_forward = backend.model.forward

    def record(model_input):
        out = real_forward(model_input)
        outs.append(out)
        return out

    backend.model.forward = record
    prompts = random_prompts(tiny.hf.config.vocab_size, 2, range(5, 9), seed=3)
    eng.generate(prompts, [{"max_new_tokens": 1}] * 2)  # the prefill forward
    reference = outs[0]
    backend.model.forward = real_forward
    _with_rows(eng)
    outs.clear()
    backend.model.forward = record
    eng.generate(prompts, [{"max_new_tokens": 1}] * 2)  # the same prefill as rows
    rows = outs[0]
    n = reference.hidden_states.shape[0]
    torch.testing.assert_close(rows.hidden_states[:n], reference.hidden_states, rtol=1e-5, atol=1e-5)
    # logits of the sampled rows only: each prompt's last row, in order, then row 0 as padding
    size = token_ladder(ROWS_LIMIT).bucket_size(n)
    assert rows.logits.shape[0] == min(size, max_sampled_rows(4, 0)) < size
    torch.testing.assert_close(rows.logits[:2], reference.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows.logits[2:], rows.logits[2:3].expand(rows.logits.shape[0] - 2, -1))

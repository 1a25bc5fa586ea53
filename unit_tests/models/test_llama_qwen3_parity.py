"""Our fp32 CPU forward against transformers' own model, on tiny random checkpoints.

Llama: tied embeddings, GQA 4/2, llama3 rope scaling, sharded checkpoint.
Qwen3: untied lm_head, GQA 4/1, head_dim 32 with hidden 64, q/k norms.
"""
import pytest
import torch

from unit_tests.devices import needs_triton_cpu

from lightllm.common.basemodel.basemodel import ModelKvArgs
from lightllm.models.registry import load_model
from unit_tests.models.model_driver import PAD_ROW, ModelDriver
from unit_tests.models.tiny_checkpoints import MODEL_KINDS, tiny_model

ATOL = 1e-4
RTOL = 1e-4
CUDA_FP32_ATOL = 1e-3
BF16_MAX_RELATIVE_ERROR = 5e-2  # ||ours - hf|| / ||hf|| over all compared logits
KV_SLOTS = 512
MAX_REQS = 8
MAX_SEQ_LEN = 128
PROMPT_LEN = 13
GENERATE_TOKENS = 20


@pytest.fixture(scope="module", params=MODEL_KINDS)
def hf_and_dir(request, tmp_path_factory):
    kind = request.param
    m = tiny_model(kind, root=tmp_path_factory.mktemp(kind), sharded=(kind == "llama"))
    return m.hf, m.model_dir


def _engine(model_dir: str, decode_attention_backend: str = "auto", data_type: str = "float32", device: str = "cpu"):
    kvargs = ModelKvArgs(
        model_dir=model_dir,
        max_total_token_num=KV_SLOTS,
        max_req_num=MAX_REQS,
        max_seq_length=MAX_SEQ_LEN,
        data_type=data_type,
        device=device,
        decode_attention_backend=decode_attention_backend,
    )
    return load_model(kvargs)


def _tokens(length: int, vocab: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


@torch.no_grad()
def _hf_logits(hf_model, tokens) -> torch.Tensor:
    """[len(tokens), vocab] fp32 logits of every position."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def test_prefill_matches_hf_at_every_position(hf_and_dir):
    hf_model, model_dir = hf_and_dir
    model = _engine(model_dir)
    driver = ModelDriver(model)
    tokens = _tokens(PROMPT_LEN, model.vocab_size, seed=1)
    out = driver.prefill([(driver.add_request(), tokens)])
    expected = _hf_logits(hf_model, tokens)
    assert out.logits.dtype == torch.float32
    assert out.logits.shape == (1, model.vocab_size)
    assert out.hidden_states.shape == (PROMPT_LEN, model.hidden_size)
    _close(out.logits[0], expected[-1])
    _close(model.compute_logits(out.hidden_states), expected)


def test_decode_step_by_step_matches_hf(hf_and_dir):
    hf_model, model_dir = hf_and_dir
    model = _engine(model_dir)
    driver = ModelDriver(model)
    tokens = _tokens(PROMPT_LEN + 8, model.vocab_size, seed=2)
    expected = _hf_logits(hf_model, tokens)
    req = driver.add_request()
    driver.prefill([(req, tokens[:PROMPT_LEN])])
    for pos in range(PROMPT_LEN, len(tokens)):
        out = driver.decode([(req, tokens[pos])])
        _close(out.logits[0], expected[pos])
        _close(model.compute_logits(out.hidden_states), expected[pos : pos + 1])


def test_chunked_prefill_matches_single_prefill(hf_and_dir):
    hf_model, model_dir = hf_and_dir
    model = _engine(model_dir)
    driver = ModelDriver(model)
    tokens = _tokens(PROMPT_LEN, model.vocab_size, seed=3)
    single = driver.prefill([(driver.add_request(), tokens)])
    expected = _hf_logits(hf_model, tokens)
    req = driver.add_request()
    bounds = [0, 5, 6, PROMPT_LEN]  # chunks of 5, 1 and 7 tokens
    for start, end in zip(bounds[:-1], bounds[1:]):
        out = driver.prefill([(req, tokens[start:end])])
        _close(model.compute_logits(out.hidden_states), expected[start:end])
    _close(out.logits, single.logits)
    _close(out.hidden_states, single.hidden_states[bounds[-2] :])


def test_batch_of_mixed_lengths_matches_hf(hf_and_dir):
    hf_model, model_dir = hf_and_dir
    model = _engine(model_dir)
    driver = ModelDriver(model)
    lengths = (7, 1, 11)
    prompts = [_tokens(n + 2, model.vocab_size, seed=10 + i) for i, n in enumerate(lengths)]
    reqs = [driver.add_request() for _ in prompts]
    # The third request's first chunk is already in the cache: the batch mixes chunked and fresh prefills.
    first_chunk = 4
    driver.prefill([(reqs[2], prompts[2][:first_chunk])])
    starts = (0, 0, first_chunk)
    out = driver.prefill([(r, p[s:n]) for r, p, s, n in zip(reqs, prompts, starts, lengths)])
    all_logits = model.compute_logits(out.hidden_states)
    row = 0
    for i, (p, s, n) in enumerate(zip(prompts, starts, lengths)):
        expected = _hf_logits(hf_model, p)
        _close(out.logits[i], expected[n - 1])
        _close(all_logits[row : row + n - s], expected[s:n])
        row += n - s
    # Two decode steps of the whole batch.
    for step in range(2):
        out = driver.decode([(r, p[n + step]) for r, p, n in zip(reqs, prompts, lengths)])
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            _close(out.logits[i], _hf_logits(hf_model, p)[n + step])


def test_mtp_decode_rows_match_single_steps(hf_and_dir):
    hf_model, model_dir = hf_and_dir
    model = _engine(model_dir)
    driver = ModelDriver(model)
    num_rows = 3  # K + 1 with K = 2 draft tokens
    tokens = _tokens(PROMPT_LEN + num_rows, model.vocab_size, seed=4)
    other = _tokens(6, model.vocab_size, seed=5)
    expected = _hf_logits(hf_model, tokens)
    req, other_req = driver.add_request(), driver.add_request()
    driver.prefill([(req, tokens[:PROMPT_LEN]), (other_req, other[:5])])
    rows = [(req, tokens[PROMPT_LEN + j]) for j in range(num_rows)] + [(other_req, other[5])]
    out = driver.decode(rows)
    for j in range(num_rows):
        _close(out.logits[j], expected[PROMPT_LEN + j])
    _close(out.logits[num_rows], _hf_logits(hf_model, other)[5])


@pytest.mark.parametrize("pad_seq_len", [1, 0])
def test_hold_padding_rows_do_not_change_real_rows(hf_and_dir, pad_seq_len):
    hf_model, model_dir = hf_and_dir
    model = _engine(model_dir)
    driver = ModelDriver(model)
    a = _tokens(PROMPT_LEN + 1, model.vocab_size, seed=6)
    b = _tokens(5, model.vocab_size, seed=7)
    req_a, req_b = driver.add_request(), driver.add_request()
    driver.prefill([(req_a, a[:PROMPT_LEN]), (req_b, b[:4])])
    out = driver.decode([PAD_ROW, (req_a, a[PROMPT_LEN]), PAD_ROW, (req_b, b[4]), PAD_ROW], pad_seq_len=pad_seq_len)
    _close(out.logits[1], _hf_logits(hf_model, a)[PROMPT_LEN])
    _close(out.logits[3], _hf_logits(hf_model, b)[4])
    assert torch.isfinite(out.logits).all()
    # The padding rows wrote only to HOLD_SLOT: the real requests keep decoding correctly.
    a_next = _tokens(1, model.vocab_size, seed=8)[0]
    out = driver.decode([(req_a, a_next)])
    _close(out.logits[0], _hf_logits(hf_model, a + [a_next])[PROMPT_LEN + 1])


def test_greedy_generation_matches_hf_generate(hf_and_dir):
    hf_model, model_dir = hf_and_dir
    model = _engine(model_dir)
    prompt = _tokens(PROMPT_LEN, model.vocab_size, seed=9)
    ours = ModelDriver(model).greedy_generate(prompt, GENERATE_TOKENS)
    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.int64),
            max_new_tokens=GENERATE_TOKENS,
            min_new_tokens=GENERATE_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )[0, PROMPT_LEN:].tolist()
    assert ours == theirs


@needs_triton_cpu
def test_triton_decode_backend_matches_hf(hf_and_dir):
    """The triton backend inside the model (interpreter on CPU): the decode kernel for decode rows, MTP
    and padding rows included, and once per new token for the prefill."""
    hf_model, model_dir = hf_and_dir
    model = _engine(model_dir, decode_attention_backend="triton")
    driver = ModelDriver(model)
    tokens = _tokens(PROMPT_LEN + 3, model.vocab_size, seed=11)
    expected = _hf_logits(hf_model, tokens)
    req = driver.add_request()
    driver.prefill([(req, tokens[:PROMPT_LEN])])
    out = driver.decode([(req, tokens[PROMPT_LEN])])
    _close(out.logits[0], expected[PROMPT_LEN])
    out = driver.decode([(req, tokens[PROMPT_LEN + 1]), (req, tokens[PROMPT_LEN + 2]), PAD_ROW])
    _close(out.logits[:2], expected[PROMPT_LEN + 1 :])


def test_kv_slots_are_returned_after_free(hf_and_dir):
    _, model_dir = hf_and_dir
    model = _engine(model_dir)
    driver = ModelDriver(model)
    driver.greedy_generate(_tokens(PROMPT_LEN, model.vocab_size, seed=12), max_new_tokens=3)
    assert model.mem_manager.can_use_mem_size == KV_SLOTS
    assert model.req_manager.can_alloc_num == MAX_REQS


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("data_type", ["float32", "bfloat16"])
def test_cuda_forward_matches_hf(hf_and_dir, data_type):
    """Prefill (one chunked item), decode with padding, MTP rows, with the CUDA default kernels
    (Triton decode attention, and the same kernel per new token for prefill). The decode
    forwards must not synchronize with the host."""
    hf_model, model_dir = hf_and_dir
    model = _engine(model_dir, data_type=data_type, device="cuda")
    driver = ModelDriver(model)
    n = PROMPT_LEN
    a = _tokens(n + 4, model.vocab_size, seed=20)
    b = _tokens(9, model.vocab_size, seed=21)
    ref_a, ref_b = _hf_logits(hf_model, a), _hf_logits(hf_model, b)
    req_a, req_b = driver.add_request(), driver.add_request()
    driver.prefill([(req_b, b[:3])])
    out = driver.prefill([(req_a, a[:n]), (req_b, b[3:6])])
    got, want = [out.logits[0], out.logits[1]], [ref_a[n - 1], ref_b[5]]
    mtp_rows = [(req_a, a[n + 1]), (req_a, a[n + 2]), (req_a, a[n + 3]), (req_b, b[7])]
    steps = [  # (rows, indexes of the real rows, expected logits of the real rows)
        ([(req_a, a[n]), PAD_ROW, (req_b, b[6])], [0, 2], [ref_a[n], ref_b[6]]),
        (mtp_rows, [0, 1, 2, 3], [*ref_a[n + 1 :], ref_b[7]]),
    ]
    for rows, real_rows, expected in steps:
        model_input = driver.decode_input(rows)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = model.forward(model_input)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got += [out.logits[i] for i in real_rows]
        want += expected
    got, want = torch.stack(got).cpu(), torch.stack(want)
    assert got.dtype == torch.float32
    if data_type == "float32":
        torch.testing.assert_close(got, want, atol=CUDA_FP32_ATOL, rtol=CUDA_FP32_ATOL)
    else:
        assert float((got - want).norm() / want.norm()) < BF16_MAX_RELATIVE_ERROR

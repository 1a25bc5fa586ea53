"""PromptEncoder (chunked, cached prompt tokenization) against the tokenizer's own ``encode``.

References: ``tokenizer.encode(text, add_special_tokens=...)`` of the same tokenizer, on random
texts built to hit every piece of the GPT-2 split (words, digits, runs of spaces and newlines,
contractions, punctuation, tabs and CR, non-ASCII, chat tokens) cut every few characters, and on
a long text of paragraphs resent with a suffix. Tokenizers: the embedded model's (byte-level, digits
split), the tiny byte-level one the server tests use, a copy of the embedded one whose special
tokens wrap the text, and tokenizers whose cuts would change the ids (they are encoded whole).
"""
import json
import random

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightllm.server.httpserver.prompt_encoder import CUT, PromptEncoder, cuts_are_exact, split_prompt

NUM_RANDOM_TEXTS = 400
SMALL_CHUNK_CHARS = (1, 2, 5)  # cut at (nearly) every cut point
PIECES = ["the", " quick", "brown", " ", "  ", "   ", "\n", "\n\n", " \n", "\t", "\r\n", "1", "23", " 456", ".", ",",
          "!?", " (x)", "'s", "'t", " don't", "I'm", "we'll", "\u00e9t\u00e9", " na\u00efve", "\u4f60\u597d", "\U0001f600",
          "\u00a0", "\u3000", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<", "|", ">", "im_start"]
LONG_TEXT_CHARS = 30000
RESEND_SUFFIX = "\n\nQuestion: what is 12 + 30? Answer in one line.<|im_end|>\n<|im_start|>assistant\n"
# Llama 3's split pattern: it joins punctuation and the newlines after it, so cuts at newlines change ids
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40)))


@pytest.fixture(scope="module")
def smollm2():
    try:
        from lightllm.utils.embedded_model import get_default_model_dir

        return AutoTokenizer.from_pretrained(get_default_model_dir())
    except Exception as e:  # the embedded model is not installed
        pytest.skip(f"embedded model unavailable: {e}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from unit_tests.server.http.tiny_tokenizer import write_tokenizer

    d = tmp_path_factory.mktemp("tiny_tok")
    write_tokenizer(str(d), 379)  # every merge of its letter pairs
    return AutoTokenizer.from_pretrained(str(d))


def _wrapped(tok):
    """A copy of ``tok`` whose special tokens put <|endoftext|> before a text and <|im_end|> after."""
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    ids = {t: backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
    backend.post_processor = TemplateProcessing(single="<|endoftext|> $A <|im_end|>",
                                                special_tokens=list(ids.items()))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _assert_same(enc: PromptEncoder, tok, texts):
    for text in texts:
        for special in (False, True):
            assert enc.encode(text, special) == tok.encode(text, add_special_tokens=special), repr(text)


def _random_texts(seed: int):
    rng = random.Random(seed)
    return [_random_text(rng) for _ in range(NUM_RANDOM_TEXTS)]


@pytest.mark.parametrize("chunk_chars", SMALL_CHUNK_CHARS)
def test_embedded_tokenizer_chunked_equals_whole(smollm2, chunk_chars):
    enc = PromptEncoder.of(smollm2, chunk_chars=chunk_chars)
    assert enc.chunked
    _assert_same(enc, smollm2, _random_texts(chunk_chars))
    assert enc.misses > NUM_RANDOM_TEXTS  # the texts were really cut


def test_tiny_and_wrapped_tokenizers_chunked_equal_whole(smollm2, tiny):
    for tok in (tiny, _wrapped(smollm2)):
        enc = PromptEncoder.of(tok, chunk_chars=2)
        assert enc.chunked
        _assert_same(enc, tok, _random_texts(7))
    wrapped = PromptEncoder.of(_wrapped(smollm2))
    assert wrapped.prefix == [smollm2.convert_tokens_to_ids("<|endoftext|>")]
    assert wrapped.suffix == [smollm2.convert_tokens_to_ids("<|im_end|>")]


def test_resent_long_prompt_encodes_only_its_new_chunks(smollm2):
    rng = random.Random(11)
    words = "the a of to in store sold apples each day how many dollars left after she bought".split()
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) + f" {rng.randint(0, 9999)}."
                 for _ in range(2000)]
    doc = "\n\n".join(" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5))[:LONG_TEXT_CHARS]
    enc = PromptEncoder.of(smollm2)
    first = enc.encode(doc)
    chunks = len(split_prompt(doc, enc.chunk_chars))
    assert enc.misses == chunks > 10
    again = enc.encode(doc + RESEND_SUFFIX)
    assert first == smollm2.encode(doc) and again == smollm2.encode(doc + RESEND_SUFFIX)
    assert enc.misses - chunks <= 2  # the last chunk of the document changed, and the new text
    assert enc.hits >= chunks - 1


def test_split_prompt_cuts_at_cut_points_and_keeps_common_starts():
    rng = random.Random(3)
    for _ in range(200):
        text = _random_text(rng) * rng.randint(1, 20)
        chunks = split_prompt(text, 4)
        assert "".join(chunks) == text and all(chunks[:-1])
        pos = 0
        for c in chunks[:-1]:
            pos += len(c)
            assert CUT.match(text, pos - 1)  # a printable ASCII character, then a space or newline
        other = text + _random_text(rng)
        shared = split_prompt(other, 4)
        assert shared[:len(chunks) - 1] == chunks[:-1]


def _byte_level(**kw) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(**kw)
    return tok


def _refused_tokenizers():
    meta = Tokenizer(models.BPE())
    meta.pre_tokenizer = pre_tokenizers.Metaspace()
    prefix_space = _byte_level(add_prefix_space=True)
    nfc = _byte_level(add_prefix_space=False)
    nfc.normalizer = normalizers.NFC()
    llama3 = Tokenizer(models.BPE())
    llama3.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    rstrip = _byte_level(add_prefix_space=False)
    rstrip.add_special_tokens([AddedToken("<eot>", rstrip=True)])
    spaced = _byte_level(add_prefix_space=False)
    spaced.add_tokens(["new york"])
    return {"metaspace": meta, "prefix_space": prefix_space, "normalizer": nfc, "llama3_split": llama3,
            "rstrip_token": rstrip, "spaced_token": spaced}


@pytest.mark.parametrize("name", sorted(_refused_tokenizers()))
def test_tokenizers_whose_cuts_change_ids_are_encoded_whole(name):
    backend = _refused_tokenizers()[name]
    ok, why = cuts_are_exact(json.loads(backend.to_str()))
    assert not ok and why
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    enc = PromptEncoder.of(tok, chunk_chars=1)
    assert not enc.chunked
    for text in ["a b\n\nc", "x. \ny", ""]:
        assert enc.encode(text, False) == tok.encode(text, add_special_tokens=False)


def test_the_probe_catches_a_cut_that_changes_ids(smollm2, monkeypatch):
    """Were the static check wrong, the start-up probe would see the difference and encode whole."""
    from lightllm.server.httpserver import prompt_encoder

    backend = Tokenizer.from_str(smollm2.backend_tokenizer.to_str())
    backend.add_tokens(["It's 2026"])  # holds a space: cuts inside it change the ids
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert not cuts_are_exact(json.loads(backend.to_str()))[0]
    forced = PromptEncoder(tok, True, chunk_chars=1)
    assert forced.encode("It's 2026", False) != tok.encode("It's 2026", add_special_tokens=False)
    monkeypatch.setattr(prompt_encoder, "cuts_are_exact", lambda _: (True, ""))
    assert not PromptEncoder.of(tok).chunked


def test_tokenizer_threads_share_one_encoder(smollm2):
    """The HTTP process encodes on several threads at once (TOKENIZER_THREADS): texts that share
    their starts, encoded concurrently, each equal the tokenizer's own ids."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(5)
    base = "".join(_random_text(rng) for _ in range(200))
    texts = [base + _random_text(rng) for _ in range(64)]
    enc = PromptEncoder.of(smollm2, chunk_chars=64)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(enc.encode, texts))
    assert got == [smollm2.encode(t) for t in texts]
    assert enc.hits > 0

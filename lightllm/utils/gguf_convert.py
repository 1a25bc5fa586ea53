"""Read a Llama-architecture GGUF file and convert it into a Hugging Face model dir.

The output holds config.json, generation_config.json, the tokenizer files (with the
chat template) and model.safetensors. The weights are GGUF's own dequantized values
(`gguf.quants.dequantize`), stored unrounded in fp32, so a model loaded from the
output dir and one loaded by transformers' GGUF loader are the same model.

Two llama.cpp conventions are undone here:
  - GGUF shapes are listed fastest-dimension first; the dequantized arrays are
    already in torch order, we only check them against the reversed GGUF shape.
  - llama.cpp permutes the rows of the q/k projections (rope pairs interleaved
    per head); we apply the inverse permutation, as transformers does.

`gguf` is imported inside the functions that read a file: machines that serve a
converted model dir need not install it. The cached, atomic conversion used at
start-up is lightllm/utils/embedded_model.py; the CLI is lightllm/tools/convert_gguf.py.
"""
import logging
import os
import re
import time
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)
HF_ARCHITECTURE = "LlamaForCausalLM"
SAFETENSORS_NAME = "model.safetensors"
GGUF_PIP_HINT = "pip install gguf (or the package's [tools] extra)"
MODEL_FILE_MODE = 0o644
# llama.cpp's llama_token_type: 3 is CONTROL (special tokens such as <|im_end|>)
CONTROL_TOKEN_TYPE = 3
# The only tokenizer model supported: byte-level BPE, which llama.cpp calls "gpt2"
BPE_TOKENIZER_MODEL = "gpt2"
# tokenizer.ggml.pre values we can rebuild; True means digits are split one by one
# before the GPT-2 regex (llama.cpp's "smollm" = the Digits + ByteLevel pipeline of
# SmolLM2's own tokenizer.json)
PRE_TOKENIZER_SPLITS_DIGITS = {"smollm": True, "gpt2": False}

# GGUF tensor name -> HF parameter name, outside the decoder layers
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF per-layer suffix (after "blk.{i}.") -> HF suffix (after "model.layers.{i}.")
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(?P<layer>\d+)\.(?P<suffix>.+)")
_OUTPUT_TENSOR = "output.weight"


@dataclass(frozen=True)
class LlamaGgufConfig:
    """Model hyper-parameters read from the `llama.*` GGUF metadata."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    vocab_size: int
    tie_word_embeddings: bool


@dataclass(frozen=True)
class GgufTokenizerMetadata:
    """The tokenizer a GGUF describes (`tokenizer.*` metadata)."""

    pre: str
    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    bos_id: int
    eos_id: int
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def open_gguf(gguf_path: str):
    """A GGUFReader for `gguf_path`, with clear errors for a missing or non-GGUF file."""
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ImportError(f"reading a GGUF file needs the gguf package: {GGUF_PIP_HINT}") from err

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path!r}")
    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError) as err:
        raise ValueError(f"{gguf_path!r} is not a readable GGUF file: {err}") from err


def _field(reader, key: str, default=None, required: bool = True):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _float32_value(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores f32: 1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def read_architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def read_llama_config(reader, vocab_size_fallback: int) -> LlamaGgufConfig:
    arch = read_architecture(reader)

    def key(name: str, **kwargs):
        return _field(reader, f"{arch}.{name}", **kwargs)

    rope_scaling = key("rope.scaling.type", required=False)
    if rope_scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {rope_scaling!r} is not supported")
    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", default=hidden_size // num_heads, required=False))
    rope_dim = int(key("rope.dimension_count", default=head_dim, required=False))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim}) is not supported")
    tensor_names = {t.name for t in reader.tensors}
    return LlamaGgufConfig(
        num_layers=int(key("block_count")),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", default=num_heads, required=False)),
        head_dim=head_dim,
        rope_theta=_float32_value(key("rope.freq_base")),
        rms_norm_eps=_float32_value(key("attention.layer_norm_rms_epsilon")),
        context_length=int(key("context_length")),
        vocab_size=int(key("vocab_size", default=vocab_size_fallback, required=False)),
        tie_word_embeddings=_OUTPUT_TENSOR not in tensor_names,
    )


def read_tokenizer_metadata(reader) -> GgufTokenizerMetadata:
    model = _field(reader, "tokenizer.ggml.model")
    if model != BPE_TOKENIZER_MODEL:
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported; supported: [{BPE_TOKENIZER_MODEL!r}]")
    pre = _field(reader, "tokenizer.ggml.pre", default=BPE_TOKENIZER_MODEL, required=False)
    if pre not in PRE_TOKENIZER_SPLITS_DIGITS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(PRE_TOKENIZER_SPLITS_DIGITS)}"
        )

    def optional_id(name: str) -> int | None:
        value = _field(reader, f"tokenizer.ggml.{name}", required=False)
        return None if value is None else int(value)

    return GgufTokenizerMetadata(
        pre=pre,
        tokens=list(_field(reader, "tokenizer.ggml.tokens")),
        merges=list(_field(reader, "tokenizer.ggml.merges")),
        token_types=[int(t) for t in _field(reader, "tokenizer.ggml.token_type")],
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        unk_id=optional_id("unknown_token_id"),
        pad_id=optional_id("padding_token_id"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", default=False, required=False)),
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", default=False, required=False)),
        add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", default=False, required=False)),
        chat_template=_field(reader, "tokenizer.chat_template", required=False),
    )


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match is None or match["suffix"] not in _LAYER_TENSORS:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a Llama GGUF")
    return f"model.layers.{match['layer']}.{_LAYER_TENSORS[match['suffix']]}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp stores each head's rows as [pair, half]-interleaved for its rope;
    HF keeps the two rotary halves contiguous. weight: [num_heads * head_dim, in].
    """
    half_dim = weight.shape[0] // num_heads // 2
    per_head = weight.reshape(num_heads, half_dim, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def read_weights(reader, config: LlamaGgufConfig) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32 (unrounded), renamed and un-permuted for HF."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    weights = {}
    # a progress bar on stderr: a first start spends most of its time here
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF tensors", unit="tensor", leave=False):
        name = _hf_tensor_name(tensor.name)
        torch_shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        # np.array copies: F32 tensors come back as read-only views of the mmapped file
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if values.size != int(np.prod(torch_shape)):
            raise ValueError(f"tensor {tensor.name!r}: {values.size} values for shape {torch_shape}")
        values = values.reshape(torch_shape)
        if tensor.name.endswith("attn_q.weight"):
            values = unpermute_rope_rows(values, config.num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            values = unpermute_rope_rows(values, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(values))

    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{s}" for i in range(config.num_layers) for s in _LAYER_TENSORS.values()}
    if not config.tie_word_embeddings:
        expected.add(_GLOBAL_TENSORS[_OUTPUT_TENSOR])
    missing = sorted(expected - weights.keys())
    if missing:
        raise ValueError(f"GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")
    extra = sorted(weights.keys() - expected)
    if extra:
        raise ValueError(f"GGUF has tensors beyond {config.num_layers} layers, e.g. {extra[:3]}")
    return weights


def build_hf_config(config: LlamaGgufConfig, tok: GgufTokenizerMetadata):
    from transformers import LlamaConfig

    hf_config = LlamaConfig(
        architectures=[HF_ARCHITECTURE],
        dtype=torch.float32,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.context_length,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    # Also the flat key: config readers that predate `rope_parameters` default it to 10000
    hf_config.rope_theta = config.rope_theta
    return hf_config


def build_generation_config(tok: GgufTokenizerMetadata):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)


def build_tokenizer(tok: GgufTokenizerMetadata, model_max_length: int):
    """A fast tokenizer rebuilt from the GGUF vocabulary, merges and token types.

    Built directly with `tokenizers` (not transformers' GGUF import, whose result
    depends on the transformers version): byte-level BPE, the pre-tokenizer named
    by `tokenizer.ggml.pre`, control tokens as special tokens, and every special
    token set from the GGUF ids.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # GGUF gpt2 vocabularies are spelled in the byte-level alphabet; respell any that is not
    byte_alphabet = bytes_to_unicode()
    alphabet = set(byte_alphabet.values())

    def spelled(token: str) -> str:
        if set(token) <= alphabet:
            return token
        return "".join(byte_alphabet[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(tok.tokens)}
    merges = [tuple(merge.split(" ")) for merge in tok.merges]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=tok.add_space_prefix, trim_offsets=True, use_regex=True)
    if PRE_TOKENIZER_SPLITS_DIGITS[tok.pre]:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tok.tokens, tok.token_types)
            if token_type == CONTROL_TOKEN_TYPE
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tok.token(tok.bos_id),
        eos_token=tok.token(tok.eos_id),
        unk_token=tok.token(tok.unk_id),
        pad_token=tok.token(tok.pad_id),
        add_bos_token=tok.add_bos,
        add_eos_token=tok.add_eos,
        add_prefix_space=tok.add_space_prefix,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=tok.chat_template,
    )


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> None:
    """Write a Hugging Face model dir for the Llama GGUF at `gguf_path` into `out_dir`.

    Not atomic by itself: use lightllm.utils.embedded_model.ensure_converted for a
    cached, crash-safe conversion.
    """
    from safetensors.torch import save_file

    start = time.monotonic()
    reader = open_gguf(gguf_path)
    read_architecture(reader)
    tok = read_tokenizer_metadata(reader)
    config = read_llama_config(reader, vocab_size_fallback=len(tok.tokens))
    weights = read_weights(reader, config)

    os.makedirs(out_dir, exist_ok=True)
    weights_path = os.path.join(out_dir, SAFETENSORS_NAME)
    save_file(weights, weights_path, metadata={"format": "pt"})
    os.chmod(weights_path, MODEL_FILE_MODE)  # safetensors writes it owner-only
    build_hf_config(config, tok).save_pretrained(out_dir)
    build_generation_config(tok).save_pretrained(out_dir)
    build_tokenizer(tok, config.context_length).save_pretrained(out_dir)
    logger.info("converted %s -> %s in %.1f s", gguf_path, out_dir, time.monotonic() - start)

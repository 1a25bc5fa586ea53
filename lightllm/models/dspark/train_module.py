"""A readable PyTorch DSpark block draft for training, and its reference greedy proposer.

The math is docs/dspark.md, "Checkpoint and math". The draft layers are transformers' own
decoder layers of the target's architecture (Hugging Face names), but their attention is
written here: its keys are the context K/V (computed from c(s) without input norm) followed
by the block's own K/V, non-causal inside the block. Saved dirs hold exactly the contract's keys.

``DSparkTrainModule.forward`` runs many anchors per sequence at once (one boolean attention
mask); ``propose_greedy`` runs one anchor with no mask and no batching, as the independent
reference of the engine's ``--mtp_mode dspark`` proposer. ``batch_outputs`` and
``new_train_module`` are what ``lightllm/tools/train_mtp_draft.py`` calls for ``--mtp_mode dspark``.
"""
import copy
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from lightllm.common.basemodel.basemodel import TransformerArch
from lightllm.models.draft_config import DRAFT_SAFETENSORS, layer_shape_of
from lightllm.models.dspark.config import DSPARK_MODEL_TYPE, DSparkConfig
from lightllm.models.llama_mtp.train_module import RMSNorm, _decoder_layer_class, _rotary_class

DSPARK = DSPARK_MODEL_TYPE  # the --mtp_mode name
STATE_PREFIX = "model."  # every stored key starts with it
DEFAULT_BLOCK_SIZE = 4
DEFAULT_DRAFT_LAYERS = 2
DEFAULT_MARKOV_RANK = 32
DEFAULT_NUM_TARGET_LAYERS = 4  # context layers by default: evenly spaced, the target's last included
DEFAULT_ANCHORS_PER_SEQ = 16  # training anchors sampled per sequence (evaluation: every anchor, in chunks this wide)
CONFIDENCE_LOSS_WEIGHT = 0.1  # its input is detached: the weight only scales the confidence head's own gradient
DEFAULT_INIT_STD = 0.02  # --init random when the target config has no initializer_range
RANDOM_NORM_STD = 0.2  # random_dspark_draft: norm weights are 1 + noise
# A conversation rendered with the chat template: the special ids it writes are never the mask token.
CHAT_PROBE = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
              {"role": "user", "content": "Bye"}]
DEPTH_INDEX_NOTE = "list index i is block position i+1 (predicts the token i+1 after the anchor)"


# --------------------------------------------------------------------------- the module


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[..., n, heads * head_dim] -> [..., heads, n, head_dim]."""
    return x.unflatten(-1, (-1, head_dim)).transpose(-3, -2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (transformers' rotate_half form); x [..., heads, n, head_dim], cos/sin [..., n, head_dim]."""
    from transformers.models.llama.modeling_llama import rotate_half

    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    return x * cos + rotate_half(x) * sin


class DSparkBackbone(nn.Module):
    """The stored parameters; its state_dict keys are the contract's, less STATE_PREFIX."""

    def __init__(self, layer_config, config: DSparkConfig):
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        layer_class = _decoder_layer_class(layer_config)
        self.layers = nn.ModuleList([layer_class(layer_config, i) for i in range(config.num_hidden_layers)])
        if config.markov_rank > 0:
            self.markov_down = nn.Linear(hidden, config.markov_rank, bias=False)
            self.markov_up = nn.Linear(config.markov_rank, hidden, bias=False)
        self.confidence = nn.Linear(hidden, 1)


@dataclass
class BlockOutput:
    logits: torch.Tensor  # [b, A, K, vocab] fp32: logits_i of block position i = 1..K
    confidence_logits: torch.Tensor  # [b, A, K]: confidence(rms(g_i, final_norm)) before the sigmoid


class DSparkTrainModule(nn.Module):
    """The DSpark draft over a target: context projection, block layers, Markov and confidence heads."""

    def __init__(self, target_config, dspark_config: DSparkConfig):
        super().__init__()
        cfg = copy.deepcopy(target_config)  # the layers' own config: never change the caller's
        cfg.num_hidden_layers = dspark_config.num_hidden_layers
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = ["full_attention"] * dspark_config.num_hidden_layers
        self.config = dspark_config
        self.model = DSparkBackbone(cfg, dspark_config)
        self.rotary = _rotary_class(cfg)(cfg)

    # ---- pieces of the math, shared by the batched forward and the one-anchor reference

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """a(s) [..., n_aux * hidden] -> c(s) = rms(fc(a(s)), hidden_norm) [..., hidden]."""
        return self.model.hidden_norm(self.model.fc(aux_hidden))

    def _qk_norm(self, attn: nn.Module, x: torch.Tensor, norm_name: str) -> torch.Tensor:
        """Qwen3's per-head q_norm / k_norm on [..., heads, n, head_dim] (identity for Llama)."""
        return getattr(attn, norm_name)(x) if self.config.qk_norm else x

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """positions [n] or [b, n] (transformers' rotary takes [b, n] only, in some versions)."""
        flat = positions.dim() == 1
        cos, sin = self.rotary(x, positions[None] if flat else positions)
        return _rotate(x, cos[0], sin[0]) if flat else _rotate(x, cos, sin)

    def context_kv(self, aux_hidden: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """aux [b, s, n_aux * hidden] -> per draft layer (k, v) [b, kv_heads, s, head_dim], k rotated at 0..s-1."""
        c = self.context(aux_hidden)
        b, s = c.shape[:2]
        positions = torch.arange(s, device=c.device).expand(b, s)
        kv = []
        for layer in self.model.layers:
            attn = layer.self_attn
            k = self._qk_norm(attn, _heads(attn.k_proj(c), self.config.head_dim), "k_norm")
            kv.append((self._rope(k, positions), _heads(attn.v_proj(c), self.config.head_dim)))
        return kv

    def proposal(self, f: torch.Tensor, prev_tokens: torch.Tensor, head) -> Tuple[torch.Tensor, torch.Tensor]:
        """Step 3 for block outputs f [..., hidden] and t_{i-1} [...]:
        (logits_i [..., vocab] fp32, the confidence logit [...], before the sigmoid)."""
        g = f
        if self.config.markov_rank > 0:
            g = g + self.model.markov_up(self.model.markov_down(head.embed(prev_tokens)))
        normed = head.norm(g)
        logits = head.lm_head(normed).float()
        return logits, self.model.confidence(normed.detach()).squeeze(-1)

    # ---- the batched training forward

    def block_hidden(self, ctx_kv, tokens: torch.Tensor, anchors: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """Step 2 for anchors [b, A] of sequences tokens [b, s]: f [b, A, block_size, hidden].

        Row (a, i) attends to context positions < anchors[:, a] and to the block_size rows of block a."""
        b, s = tokens.shape
        num_anchors, size = anchors.shape[1], self.config.block_size
        offsets = torch.arange(size, device=tokens.device)
        block_tokens = torch.full((b, num_anchors, size), self.config.mask_token_id, dtype=torch.long,
                                  device=tokens.device)
        block_tokens[:, :, 0] = tokens.gather(1, anchors)
        positions = (anchors[:, :, None] + offsets).flatten(1)  # [b, A * size]
        # mask [b, 1, A * size, s + A * size]: True = attend
        sees_ctx = torch.arange(s, device=tokens.device) < anchors[:, :, None, None]  # [b, A, 1, s]
        sees_ctx = sees_ctx.expand(b, num_anchors, size, s).flatten(1, 2)
        block_of = torch.arange(num_anchors, device=tokens.device).repeat_interleave(size)
        sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
        mask = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]
        h = embed(block_tokens).flatten(1, 2).float()  # [b, A * size, hidden]
        for layer, (ctx_k, ctx_v) in zip(self.model.layers, ctx_kv):
            h = self._layer(layer, h, positions, ctx_k, ctx_v, mask)
        return h.unflatten(1, (num_anchors, size))

    def _layer(self, layer, h, positions, ctx_k, ctx_v, mask):
        """One pre-norm draft layer over block rows h [b, n, hidden]; keys = context then block."""
        attn, head_dim = layer.self_attn, self.config.head_dim
        x = layer.input_layernorm(h)
        q = self._rope(self._qk_norm(attn, _heads(attn.q_proj(x), head_dim), "q_norm"), positions)
        k = self._rope(self._qk_norm(attn, _heads(attn.k_proj(x), head_dim), "k_norm"), positions)
        v = _heads(attn.v_proj(x), head_dim)
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        k = torch.cat([ctx_k, k], dim=-2).repeat_interleave(group, dim=1)
        v = torch.cat([ctx_v, v], dim=-2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=head_dim ** -0.5)
        h = h + attn.o_proj(out.transpose(1, 2).flatten(2))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(self, aux_hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor, head, k: int,
                ctx_kv=None) -> BlockOutput:
        """Teacher-forced steps 1-3 for anchors [b, A] (positions in tokens [b, s]); depths 1..k.

        t_{i-1} is the true token x_{p+i-1} (clamped to the sequence: past its end there is no label)."""
        if not 1 <= k <= self.config.max_mtp_step:
            raise ValueError(f"k must be in 1..{self.config.max_mtp_step}, got {k}")
        ctx_kv = self.context_kv(aux_hidden) if ctx_kv is None else ctx_kv
        f = self.block_hidden(ctx_kv, tokens, anchors, head.embed)[:, :, 1: k + 1]  # [b, A, k, hidden]
        prev_pos = (anchors[:, :, None] + torch.arange(k, device=tokens.device)).clamp(max=tokens.shape[1] - 1)
        prev = tokens.gather(1, prev_pos.flatten(1)).view_as(prev_pos)
        logits, conf = self.proposal(f, prev, head)
        return BlockOutput(logits, conf)

    # ---- checkpoints

    def save_draft(self, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
        """config.json + model.safetensors with the contract's key names."""
        self.config.save(out_dir)
        state = self.model.state_dict()
        tensors = {STATE_PREFIX + k: t.detach().to(dtype).contiguous().cpu() for k, t in state.items()}
        save_file(tensors, os.path.join(out_dir, DRAFT_SAFETENSORS))

    @classmethod
    def load_draft(cls, target_config, draft_dir: str) -> "DSparkTrainModule":
        """A saved draft dir as an fp32 module (every stored key must be used)."""
        module = cls(target_config, DSparkConfig.load(draft_dir))
        state = load_file(os.path.join(draft_dir, DRAFT_SAFETENSORS))
        if any(not key.startswith(STATE_PREFIX) for key in state):
            raise ValueError(f"{draft_dir}: every key must start with {STATE_PREFIX!r}")
        module.model.load_state_dict({key[len(STATE_PREFIX):]: t.float() for key, t in state.items()})
        return module


# --------------------------------------------------------------------------- the one-anchor reference


def _one_block(module: DSparkTrainModule, head, aux_hidden_ctx: torch.Tensor, anchor_token: int,
               p: int) -> torch.Tensor:
    """Steps 1-2 for one anchor at position p, context positions 0..p-1: f [block_size, hidden].

    Plain softmax attention over every key (context then block), no mask and no batch."""
    cfg = module.config
    device = aux_hidden_ctx.device
    c = module.context(aux_hidden_ctx[:p].float())  # [p, hidden]
    tokens = torch.tensor([anchor_token] + [cfg.mask_token_id] * (cfg.block_size - 1), device=device)
    ctx_pos = torch.arange(p, device=device)
    block_pos = p + torch.arange(cfg.block_size, device=device)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    h = head.embed(tokens).float()
    for layer in module.model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = module._rope(module._qk_norm(attn, _heads(attn.q_proj(x), cfg.head_dim), "q_norm"), block_pos)
        ctx_k = module._rope(module._qk_norm(attn, _heads(attn.k_proj(c), cfg.head_dim), "k_norm"), ctx_pos)
        blk_k = module._rope(module._qk_norm(attn, _heads(attn.k_proj(x), cfg.head_dim), "k_norm"), block_pos)
        k = torch.cat([ctx_k, blk_k], dim=1).repeat_interleave(group, dim=0)  # [heads, p + block_size, head_dim]
        v = torch.cat([_heads(attn.v_proj(c), cfg.head_dim), _heads(attn.v_proj(x), cfg.head_dim)], dim=1)
        v = v.repeat_interleave(group, dim=0)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim), dim=-1)
        h = h + attn.o_proj((weights @ v).transpose(0, 1).flatten(1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


@torch.no_grad()
def propose_greedy(module: DSparkTrainModule, head, aux_hidden_ctx: torch.Tensor, anchor_token: int, p: int,
                   k: int) -> Tuple[List[int], List[float]]:
    """Greedy proposals for ONE anchor x_p at position p, context a(0..p-1) = aux_hidden_ctx[:p]:
    k tokens (for positions p+1..p+k) and their confidences; t_{i-1} is the previous argmax.

    ``head``: the target's fp32 embed / norm / lm_head (``TargetHead`` of train_mtp_draft)."""
    if not 1 <= k <= module.config.max_mtp_step:
        raise ValueError(f"k must be in 1..{module.config.max_mtp_step}, got {k}")
    f = _one_block(module, head, aux_hidden_ctx, anchor_token, p)
    prev, tokens, confidences = anchor_token, [], []
    for i in range(1, k + 1):
        logits, conf = module.proposal(f[i], torch.tensor(prev, device=f.device), head)
        prev = int(logits.argmax())
        tokens.append(prev)
        confidences.append(float(torch.sigmoid(conf)))
    return tokens, confidences


@torch.no_grad()
def teacher_forced_logits(module: DSparkTrainModule, head, aux_hidden_ctx: torch.Tensor, p: int,
                          prev_tokens: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """One anchor as training sees it: t_{i-1} = prev_tokens[i-1] (prev_tokens[0] = x_p is the anchor),
    k = len(prev_tokens). Returns logits [k, vocab] and confidence logits [k] of positions p+1..p+k."""
    f = _one_block(module, head, aux_hidden_ctx, prev_tokens[0], p)
    rows = [module.proposal(f[i], torch.tensor(t, device=f.device), head) for i, t in enumerate(prev_tokens, 1)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


# --------------------------------------------------------------------------- the target's hidden states


@torch.no_grad()
def target_aux_hidden(target: nn.Module, tokens: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """tokens [b, s] -> a [b, s, len(layer_ids) * hidden] fp32: the outputs of target decoder layers
    ``layer_ids`` (the residual stream; the last layer's is before the final norm). Right padding
    needs no attention mask: causal attention never lets a real position see the padding after it."""
    captured: Dict[int, torch.Tensor] = {}

    def hook(j):
        def save(mod, args, out):
            captured[j] = out[0] if isinstance(out, tuple) else out
        return save

    hooks = [target.model.layers[j].register_forward_hook(hook(j)) for j in set(layer_ids)]
    try:
        target.model(input_ids=tokens, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([captured[j].float() for j in layer_ids], dim=-1)


@torch.no_grad()
def target_hidden(target: nn.Module, tokens: torch.Tensor,
                  layer_ids: Sequence[int] = ()) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """tokens: [batch, seq] -> (h^{(0)} [batch, seq, hidden] fp32, the input of the target's final norm;
    the outputs of decoder layers ``layer_ids`` side by side [batch, seq, len * hidden] fp32, or None
    without layer_ids), from one forward. Right padding needs no attention mask: causal attention
    never lets a real position see the padding after it."""
    last = target.config.num_hidden_layers - 1  # its output is the final norm's input
    states = target_aux_hidden(target, tokens, [*layer_ids, last])
    hidden = states.shape[-1] // (len(layer_ids) + 1)
    return states[..., -hidden:], (states[..., :-hidden] if layer_ids else None)


def mix_soft_labels(ce: torch.Tensor, logits: torch.Tensor, target_probs: torch.Tensor, weight: float) -> torch.Tensor:
    """(1 - weight) * ``ce`` + weight * the cross-entropy of ``logits`` [n, vocab] against the target's
    distribution ``target_probs`` [n, vocab] (``--soft_label_weight``; the drafts of every mode)."""
    soft_ce = -(target_probs * F.log_softmax(logits, dim=-1)).sum(-1).mean()
    return (1 - weight) * ce + weight * soft_ce


# --------------------------------------------------------------------------- configs and initialisation


def default_target_layer_ids(num_target_layers: int, count: int = DEFAULT_NUM_TARGET_LAYERS) -> List[int]:
    """``count`` layers evenly spaced over the target, its last layer included (e.g. 30 -> 6, 14, 21, 29)."""
    count = min(count, num_target_layers)
    return [num_target_layers * (i + 1) // count - 1 for i in range(count)]


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The largest special id below ``vocab_size`` that is not bos/eos/pad/unk and that the chat template
    never writes; ``vocab_size - 1`` when there is none."""
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)
    named = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    used = set()
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(CHAT_PROBE, tokenize=False, add_generation_prompt=True)
        used = set(tokenizer.encode(text, add_special_tokens=False))
    free = {i for i in special - named - used if i < vocab_size}
    return max(free) if free else vocab_size - 1


@dataclass(frozen=True)
class DSparkTrainOptions:
    """The tool's --mtp_mode dspark flags (None: resolved against the target by ``draft_config``)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_hidden_layers: int = DEFAULT_DRAFT_LAYERS
    markov_rank: int = DEFAULT_MARKOV_RANK
    target_layer_ids: Optional[Tuple[int, ...]] = None  # None: default_target_layer_ids
    mask_token_id: Optional[int] = None  # None: vocab_size - 1
    anchors_per_seq: int = DEFAULT_ANCHORS_PER_SEQ

    def draft_config(self, target_config) -> DSparkConfig:
        arch = TransformerArch.from_hf_config(target_config)
        layer_ids = self.target_layer_ids or default_target_layer_ids(arch.num_layers)
        if not all(0 <= j < arch.num_layers for j in layer_ids):
            raise ValueError(f"target_layer_ids {list(layer_ids)}: the target has {arch.num_layers} layers")
        return DSparkConfig(
            **layer_shape_of(target_config), num_hidden_layers=self.num_hidden_layers,
            block_size=self.block_size, markov_rank=self.markov_rank, target_layer_ids=list(layer_ids),
            mask_token_id=arch.vocab_size - 1 if self.mask_token_id is None else self.mask_token_id,
            qk_norm=target_config.model_type == "qwen3")


def source_layer(num_target_layers: int, num_draft_layers: int, i: int) -> int:
    """The target layer draft layer i starts from: the target's last layers, in order."""
    return max(0, num_target_layers - num_draft_layers + i)


@torch.no_grad()
def init_from_last_layers(module: DSparkTrainModule, target: nn.Module) -> None:
    """Draft layer i = target layer source_layer(...); fc = [0 .. I] (identity on the deepest context
    layer), hidden_norm = draft layer 0's input_layernorm, so c(s) = that layer's input norm of the
    target's deepest hidden state: the K/V input the copied layers were trained on. (c is RMS-normalised,
    so fc needs no hidden-state scale.) markov_down ~ N(0, initializer_range), markov_up = 0 (the
    Markov term starts at 0 and still gets gradients), confidence = 0 (sigmoid 1/2)."""
    cfg = module.config
    for i, layer in enumerate(module.model.layers):
        src = target.model.layers[source_layer(len(target.model.layers), cfg.num_hidden_layers, i)].state_dict()
        layer.load_state_dict({k: v.float() for k, v in src.items()})
    hidden = cfg.hidden_size
    deepest = max(range(len(cfg.target_layer_ids)), key=lambda e: cfg.target_layer_ids[e])
    module.model.fc.weight.zero_()
    module.model.fc.weight[:, deepest * hidden: (deepest + 1) * hidden].copy_(torch.eye(hidden))
    module.model.hidden_norm.weight.copy_(module.model.layers[0].input_layernorm.weight)
    if cfg.markov_rank > 0:
        module.model.markov_down.weight.normal_(0.0, _init_std(target))
        module.model.markov_up.weight.zero_()
    module.model.confidence.weight.zero_()
    module.model.confidence.bias.zero_()


@torch.no_grad()
def init_random(module: DSparkTrainModule, target: nn.Module) -> None:
    """Every weight ~ N(0, initializer_range), every norm weight = 1, the confidence bias = 0."""
    for name, p in module.model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, _init_std(target))


def _init_std(target: nn.Module) -> float:
    return getattr(target.config, "initializer_range", None) or DEFAULT_INIT_STD


INIT_SCHEMES = {"last_layer": init_from_last_layers, "random": init_random}  # the tool's --init names


def new_train_module(target: nn.Module, options: DSparkTrainOptions, init: str, init_from: Optional[str],
                     device) -> DSparkTrainModule:
    """A fresh module (``init``) or the draft dir ``init_from``, fp32 on ``device``."""
    config = options.draft_config(target.config)
    if init_from is not None:
        module = DSparkTrainModule.load_draft(target.config, init_from)
        if module.config != config:
            raise ValueError(f"--init_from {init_from}: its draft {module.config} does not fit the flags ({config})")
    else:
        module = DSparkTrainModule(target.config, config)
        INIT_SCHEMES[init](module, target)
    return module.float().to(device)


def random_dspark_draft(target_config, out_dir: str, seed: int, block_size: int = DEFAULT_BLOCK_SIZE,
                        num_hidden_layers: int = 2, markov_rank: int = 8,
                        target_layer_ids: Optional[Sequence[int]] = None, mask_token_id: Optional[int] = None,
                        std: float = 0.15, dtype: torch.dtype = torch.float32) -> str:
    """A random draft dir for tests: every weight ~ N(0, std) (the Markov and confidence heads too),
    norm weights 1 + RANDOM_NORM_STD * noise; target_layer_ids default [0, last]."""
    last = target_config.num_hidden_layers - 1
    options = DSparkTrainOptions(block_size=block_size, num_hidden_layers=num_hidden_layers, markov_rank=markov_rank,
                                 target_layer_ids=tuple(target_layer_ids or sorted({0, last})),
                                 mask_token_id=mask_token_id)
    torch.manual_seed(seed)
    module = DSparkTrainModule(target_config, options.draft_config(target_config))
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + RANDOM_NORM_STD * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    module.save_draft(out_dir, dtype)
    return out_dir


# --------------------------------------------------------------------------- losses (the tool's train step)


@dataclass
class DSparkOutput:
    """Per depth (block position i = 1..K, list index i-1) over anchors, like the tool's UnrollOutput."""

    ce_by_depth: List[torch.Tensor]  # scalar CE per depth (0 where a depth has no label)
    correct_by_depth: List[torch.Tensor]  # [b, A] bool: top-1 == label (False where no label)
    valid_by_depth: List[torch.Tensor]  # [b, A] bool: the anchor is real and the depth has a label
    confidence_bce: torch.Tensor  # scalar: BCE of conf_i against correct_i over every label
    # scalar per depth: what training minimizes, (1 - w) CE + w * CE against the target's distribution
    # (w = --soft_label_weight; the hard CE itself where w = 0)
    loss_by_depth: List[torch.Tensor]


def anchor_candidates(is_answer: torch.Tensor, is_real: torch.Tensor) -> torch.Tensor:
    """[b, s] bool: p may anchor a block: x_p is an answer token (prompt_len <= p) and x_{p+1} exists."""
    has_next = torch.zeros_like(is_real)
    has_next[:, :-1] = is_real[:, 1:]
    return is_answer & has_next


def sample_anchors(candidates: torch.Tensor, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` distinct random candidates per row (the global torch RNG): anchors, valid [b, count']."""
    scores = torch.rand(candidates.shape, device=candidates.device).masked_fill(~candidates, -1.0)
    top = scores.topk(min(count, candidates.shape[1]), dim=1)
    return top.indices, top.values >= 0


def all_anchor_chunks(candidates: torch.Tensor, width: int):
    """Every candidate, in position order, as (anchors, valid) chunks [b, <= width]."""
    order = torch.sort((~candidates).long(), dim=1, stable=True).indices  # candidates first
    count = int(candidates.sum(1).max()) if candidates.any() else 0
    for start in range(0, count, width):
        anchors = order[:, start: start + width]
        yield anchors, candidates.gather(1, anchors)


def anchor_outputs(module: DSparkTrainModule, head, ctx_kv, tokens: torch.Tensor, is_answer: torch.Tensor,
                   anchors: torch.Tensor, valid: torch.Tensor, k: int, target_h: Optional[torch.Tensor] = None,
                   soft_weight: float = 0.0) -> DSparkOutput:
    """Teacher-forced CE, top-1 and confidence BCE at depths 1..k for anchors [b, A] (valid [b, A]).

    ``soft_weight`` > 0 mixes into each depth's loss the CE against the target's own distribution at the
    position before the label (``target_h`` [b, s, hidden]: the input of the target's final norm)."""
    out = module(None, tokens, anchors, head, k, ctx_kv=ctx_kv)
    s = tokens.shape[1]
    result = DSparkOutput([], [], [], out.confidence_logits.sum() * 0.0, [])
    bce_terms = []
    for d in range(k):
        label_pos = anchors + d + 1
        has_label = valid & (label_pos < s) & is_answer.gather(1, label_pos.clamp(max=s - 1))
        labels = tokens.gather(1, label_pos.clamp(max=s - 1))
        correct = torch.zeros_like(has_label)
        if has_label.any():
            logits = out.logits[:, :, d][has_label]
            ce = F.cross_entropy(logits, labels[has_label])
            result.ce_by_depth.append(ce)
            if soft_weight > 0:
                ce = mix_soft_labels(ce, logits, _target_probs(head, target_h, has_label, label_pos - 1), soft_weight)
            result.loss_by_depth.append(ce)
            correct[has_label] = logits.argmax(-1) == labels[has_label]
            bce_terms.append(F.binary_cross_entropy_with_logits(
                out.confidence_logits[:, :, d][has_label], correct[has_label].float(), reduction="sum"))
        else:
            result.ce_by_depth.append(out.logits.sum() * 0.0)
            result.loss_by_depth.append(result.ce_by_depth[-1])
        result.correct_by_depth.append(correct)
        result.valid_by_depth.append(has_label)
    num_labels = sum(int(v.sum()) for v in result.valid_by_depth)
    if bce_terms:
        result.confidence_bce = sum(bce_terms) / num_labels
    return result


@torch.no_grad()
def _target_probs(head, target_h: torch.Tensor, where: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution [n, vocab] fp32 at ``positions`` [b, A] where ``where`` [b, A]."""
    rows = where.nonzero(as_tuple=True)[0]
    return torch.softmax(head.logits(target_h[rows, positions[where]]), dim=-1)


def _merge(outs: List[DSparkOutput]) -> DSparkOutput:
    """Chunks of anchors as one output: label-weighted means, anchors concatenated."""
    depths = range(len(outs[0].ce_by_depth))
    counts = [[int(o.valid_by_depth[d].sum()) for d in depths] for o in outs]
    labels = [sum(c) for c in counts]

    def mean(values, weights):
        return sum(v * w for v, w in zip(values, weights)) / max(sum(weights), 1)

    return DSparkOutput(
        ce_by_depth=[mean([o.ce_by_depth[d] for o in outs], [c[d] for c in counts]) for d in depths],
        correct_by_depth=[torch.cat([o.correct_by_depth[d] for o in outs], 1) for d in depths],
        valid_by_depth=[torch.cat([o.valid_by_depth[d] for o in outs], 1) for d in depths],
        confidence_bce=mean([o.confidence_bce for o in outs], labels),
        loss_by_depth=[mean([o.loss_by_depth[d] for o in outs], [c[d] for c in counts]) for d in depths])


def batch_outputs(module: DSparkTrainModule, target: nn.Module, head, batch, cfg,
                  sample: bool, soft_labels: bool = True) -> Tuple[DSparkOutput, torch.Tensor]:
    """The tool's per-batch step: (outputs, loss = sum_d w_d loss_d + CONFIDENCE_LOSS_WEIGHT * BCE).

    ``batch``: the tool's Batch (tokens, is_answer, is_real); ``cfg``: its TrainConfig (unroll,
    depth_weights, soft_label_weight, dspark). ``sample``: cfg.dspark.anchors_per_seq random anchors per
    sequence (training), else every anchor in chunks of that width (evaluation). ``soft_labels`` False
    drops the soft-label term (the loss is then the hard one, as evaluation reports it)."""
    soft_weight = cfg.soft_label_weight if soft_labels else 0.0
    layer_ids = module.config.target_layer_ids
    target_h = None  # the final norm's input: the soft labels' only need
    if soft_weight > 0:
        target_h, aux = target_hidden(target, batch.tokens, layer_ids)
    else:
        aux = target_aux_hidden(target, batch.tokens, layer_ids)
    ctx_kv = module.context_kv(aux)
    candidates = anchor_candidates(batch.is_answer, batch.is_real)
    width = cfg.dspark.anchors_per_seq
    chunks = [] if sample else list(all_anchor_chunks(candidates, width))
    if not chunks:  # training, or no candidate at all (then every anchor is invalid: zero losses)
        chunks = [sample_anchors(candidates, width)]
    outs = [anchor_outputs(module, head, ctx_kv, batch.tokens, batch.is_answer, a, v, cfg.unroll, target_h,
                           soft_weight) for a, v in chunks]
    out = outs[0] if len(outs) == 1 else _merge(outs)
    loss = sum(w * x for w, x in zip(cfg.depth_weights, out.loss_by_depth))
    return out, loss + CONFIDENCE_LOSS_WEIGHT * out.confidence_bce


def check_train_config(cfg) -> None:
    """The tool's TrainConfig check: with --mtp_mode dspark, options and 1 <= unroll <= block_size - 1."""
    if cfg.mtp_mode != DSPARK:
        return
    options = cfg.dspark
    if options is None:
        raise ValueError("--mtp_mode dspark needs its DSparkTrainOptions")
    if not 1 <= cfg.unroll <= options.block_size - 1:
        raise ValueError(f"unroll must be in 1..block_size - 1 = {options.block_size - 1}, got {cfg.unroll}")
    if options.anchors_per_seq < 1:
        raise ValueError(f"anchors_per_seq must be >= 1, got {options.anchors_per_seq}")


# --------------------------------------------------------------------------- the tool's flags


def add_cli_flags(p) -> None:
    """train_mtp_draft's --mtp_mode dspark flags (--target_layer_ids is the tool's own, shared)."""
    d = DSparkTrainOptions()
    g = p.add_argument_group("--mtp_mode dspark")
    g.add_argument("--block_size", type=int, default=d.block_size, help="anchor + mask positions of a block")
    g.add_argument("--draft_layers", type=int, default=d.num_hidden_layers, help="draft decoder layers")
    g.add_argument("--markov_rank", type=int, default=d.markov_rank, help="rank of the Markov head (0: none)")
    g.add_argument("--mask_token_id", type=int, default=None,
                   help="default: a special id the chat template never writes, else vocab_size - 1")
    g.add_argument("--anchors_per_seq", type=int, default=d.anchors_per_seq, help="training blocks per sequence")


def options_from_args(a, tokenizer, model_dir: str) -> DSparkTrainOptions:
    """The flags with their defaults resolved against the target (so training_info.json records them)."""
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(model_dir)
    layer_ids = a.target_layer_ids or default_target_layer_ids(target_config.num_hidden_layers)
    mask = a.mask_token_id
    if mask is None:
        mask = default_mask_token_id(tokenizer, target_config.vocab_size)
    return DSparkTrainOptions(block_size=a.block_size, num_hidden_layers=a.draft_layers, markov_rank=a.markov_rank,
                              target_layer_ids=tuple(layer_ids), mask_token_id=mask,
                              anchors_per_seq=a.anchors_per_seq)

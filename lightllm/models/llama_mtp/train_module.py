"""A readable PyTorch MTP draft module for training (dense sequences, causal attention).

It reuses transformers' own decoder layer of the target's architecture, so the
engine's inference path (``model.py``) is checked against an independent
implementation. Saved dirs load with ``LlamaMTPDraftModel``.
"""
import os
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from lightllm.models.draft_config import DRAFT_SAFETENSORS, layer_shape_of
from lightllm.models.llama_mtp.model import FC_WEIGHT, MTPDraftConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class MLPOnlyLayer(nn.Module):
    """The MLP half of a decoder layer (``*_no_att`` modes), Hugging Face names."""

    def __init__(self, hidden: int, intermediate: int, eps: float):
        super().__init__()
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x, **_):
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class MTPModule(nn.Module):
    def __init__(self, target_config, with_attention: bool, layer_idx: int):
        super().__init__()
        hidden, eps = target_config.hidden_size, target_config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        if with_attention:
            self.layer = _decoder_layer_class(target_config)(target_config, layer_idx)
        else:
            self.layer = MLPOnlyLayer(hidden, target_config.intermediate_size, eps)
        self.with_attention = with_attention

    def forward(self, hidden, token_emb, position_embeddings, attention_mask):
        """hidden, token_emb: [batch, seq, hidden] -> [batch, seq, hidden]."""
        x = self.eh_proj(torch.cat([self.enorm(token_emb), self.hnorm(hidden)], dim=-1))
        if not self.with_attention:
            return self.layer(x)
        out = self.layer(x, attention_mask=attention_mask, position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out


def _decoder_layer_class(config):
    if config.model_type == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        return Qwen3DecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _rotary_class(config):
    if config.model_type == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        return Qwen3RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding


class MTPDraftTrainModule(nn.Module):
    """``num_modules`` MTP modules; depth d uses module d (vanilla) or module 0 (eagle). With
    ``target_layer_ids``, depth 0's hidden input is ``fc`` of those target layers' outputs."""

    def __init__(self, target_config, with_attention: bool, num_modules: int = 1,
                 target_layer_ids: Sequence[int] = ()):
        super().__init__()
        cfg = target_config
        if getattr(cfg, "_attn_implementation", None) is None or cfg._attn_implementation not in ("eager", "sdpa"):
            cfg._attn_implementation = "sdpa"
        self.target_config = cfg
        self.mtp = nn.ModuleList([MTPModule(cfg, with_attention, i) for i in range(num_modules)])
        self.rotary = _rotary_class(cfg)(cfg)
        self.with_attention = with_attention
        self.set_target_layers(target_layer_ids)

    def set_target_layers(self, target_layer_ids: Sequence[int]) -> None:
        """Depth 0 reads fc of these target layers (a new, untrained fc); empty: the last layer, no fc."""
        self.target_layer_ids = list(target_layer_ids)
        hidden = self.target_config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False) if self.target_layer_ids else None

    def features(self, last_hidden: torch.Tensor, aux_hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """Depth 0's hidden input [..., hidden]: the target's last layer output, or ``fc(aux_hidden)``
        (aux_hidden: [..., len(target_layer_ids) * hidden], the layers' outputs side by side)."""
        return last_hidden if self.fc is None else self.fc(aux_hidden)

    def module_for_depth(self, depth: int) -> MTPModule:
        return self.mtp[min(depth, len(self.mtp) - 1)]

    def step(self, depth: int, hidden, tokens, embed: nn.Embedding, positions=None):
        """One depth over dense sequences: hidden [b, s, h], tokens [b, s] (x_{t+depth+1})."""
        b, s = tokens.shape
        if positions is None:
            positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        pos_emb = self.rotary(hidden, positions)
        causal = torch.full((s, s), float("-inf"), device=hidden.device, dtype=hidden.dtype).triu(1)
        return self.module_for_depth(depth)(hidden, embed(tokens), pos_emb, causal[None, None])

    def draft_config(self) -> MTPDraftConfig:
        c = self.target_config
        return MTPDraftConfig(
            **layer_shape_of(c),
            with_attention=self.with_attention,
            num_modules=len(self.mtp),
            qk_norm=c.model_type == "qwen3",
            target_layer_ids=list(self.target_layer_ids),
        )

    def save_draft(self, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write config.json + model.safetensors with the engine's key names."""
        self.draft_config().save(out_dir)
        tensors = {}
        for m, mod in enumerate(self.mtp):
            for name, t in mod.state_dict().items():
                key = name.replace("layer.", "", 1) if name.startswith("layer.") else name
                tensors[f"model.layers.{m}.{key}"] = t.detach().to(dtype).contiguous().cpu()
        if self.fc is not None:
            tensors[FC_WEIGHT] = self.fc.weight.detach().to(dtype).contiguous().cpu()
        save_file(tensors, os.path.join(out_dir, DRAFT_SAFETENSORS))

    @classmethod
    def load_draft(cls, target_config, draft_dir: str) -> "MTPDraftTrainModule":
        from safetensors.torch import load_file

        cfg = MTPDraftConfig.load(draft_dir)
        mod = cls(target_config, cfg.with_attention, cfg.num_modules, cfg.target_layer_ids)
        state = load_file(os.path.join(draft_dir, DRAFT_SAFETENSORS))
        mapped = {}
        if FC_WEIGHT in state:
            mapped["fc.weight"] = state.pop(FC_WEIGHT).float()
        for k, v in state.items():
            _, _, m, rest = k.split(".", 3)
            own = rest if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj") else "layer." + rest
            mapped[f"mtp.{m}.{own}"] = v.float()
        missing, unexpected = mod.load_state_dict(mapped, strict=False)
        assert not unexpected and all(k.startswith("rotary") for k in missing), (missing, unexpected)
        return mod


def random_draft(target_config, out_dir: str, with_attention: bool, num_modules: int, seed: int,
                 std: float = 0.15, dtype: torch.dtype = torch.float32, target_layer_ids: Sequence[int] = ()) -> str:
    """A random draft dir for tests (fp32 so the engine and the module agree tightly)."""
    torch.manual_seed(seed)
    mod = MTPDraftTrainModule(target_config, with_attention, num_modules, target_layer_ids)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    mod.save_draft(out_dir, dtype)
    return out_dir

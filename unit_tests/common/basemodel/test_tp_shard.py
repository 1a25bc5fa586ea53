"""Tensor parallel weight splits: the ranks' parts recombine to the whole layer (one process)."""
import pytest
import torch
import torch.nn.functional as F

from lightllm.common.basemodel.layer_infer.basic_ops import silu_and_mul
from lightllm.common.basemodel.layer_weights.pre_and_post_layer_weight import PreAndPostLayerWeight
from lightllm.common.basemodel.layer_weights.transformer_layer_weight import (
    TpShard,
    TransformerLayerWeight,
    split_sizes,
)

Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 4, 2, 8, 24, 91  # 91: an uneven MLP split


def _layer(gen) -> TransformerLayerWeight:
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    qkv = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    return TransformerLayerWeight(
        input_norm=r(HIDDEN), qkv_proj=r(qkv, HIDDEN), qkv_bias=r(qkv), o_proj=r(HIDDEN, Q_HEADS * HEAD_DIM),
        o_bias=r(HIDDEN), post_attention_norm=r(HIDDEN), gate_up_proj=r(2 * INTER, HIDDEN), down_proj=r(HIDDEN, INTER),
    )


def _split_qkv(t, q_heads, kv_heads):
    return t.split([q_heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=0)


@pytest.mark.parametrize("attn_size,mlp_size", [(2, 2), (1, 2), (2, 4)])
def test_layer_parts_recombine(attn_size, mlp_size):
    gen = torch.Generator().manual_seed(0)
    w = _layer(gen)
    x = torch.randn(5, HIDDEN, generator=gen, dtype=torch.float64)
    mlp_sum, q_parts, k_parts, v_parts = 0, [], [], []
    for mlp_rank in range(mlp_size):
        attn_rank = mlp_rank % attn_size  # a DP group's ranks hold consecutive head parts
        s = w.tp_shard(TpShard(Q_HEADS, KV_HEADS, HEAD_DIM, attn_size, attn_rank, mlp_size, mlp_rank))
        mlp_sum = mlp_sum + F.linear(silu_and_mul(F.linear(x, s.gate_up_proj)), s.down_proj)
        if mlp_rank < attn_size:
            q, k, v = _split_qkv(s.qkv_proj, Q_HEADS // attn_size, KV_HEADS // attn_size)
            bq, bk, bv = _split_qkv(s.qkv_bias, Q_HEADS // attn_size, KV_HEADS // attn_size)
            q_parts.append((q, bq, s.o_proj))
            k_parts.append((k, bk))
            v_parts.append((v, bv))
            assert s.o_bias is w.o_bias and s.input_norm is w.input_norm  # whole on every rank
    full_mlp = F.linear(silu_and_mul(F.linear(x, w.gate_up_proj)), w.down_proj)
    assert torch.allclose(mlp_sum, full_mlp, atol=1e-10)
    q, k, v = _split_qkv(w.qkv_proj, Q_HEADS, KV_HEADS)
    bq, bk, bv = _split_qkv(w.qkv_bias, Q_HEADS, KV_HEADS)
    assert torch.equal(torch.cat([p[0] for p in q_parts]), q) and torch.equal(torch.cat([p[1] for p in q_parts]), bq)
    assert torch.equal(torch.cat([p[0] for p in k_parts]), k) and torch.equal(torch.cat([p[1] for p in k_parts]), bk)
    assert torch.equal(torch.cat([p[0] for p in v_parts]), v) and torch.equal(torch.cat([p[1] for p in v_parts]), bv)
    # row-parallel o_proj: the per-rank products of its heads sum to the whole
    heads = torch.randn(5, Q_HEADS * HEAD_DIM, generator=gen, dtype=torch.float64)
    part = Q_HEADS * HEAD_DIM // attn_size
    o_sum = sum(F.linear(heads[:, i * part:(i + 1) * part], p[2]) for i, p in enumerate(q_parts))
    assert torch.allclose(o_sum, F.linear(heads, w.o_proj), atol=1e-10)


def test_heads_must_divide():
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) must be divisible by the attention TP size"):
        TpShard(4, 2, HEAD_DIM, attn_size=4).check("model")


def test_vocab_parts_are_padded_to_equal_size_and_recombine():
    vocab = 11
    embed = torch.randn(vocab, HIDDEN)
    tied = PreAndPostLayerWeight(embed_tokens=embed, final_norm=torch.ones(HIDDEN), lm_head=embed)
    parts = [tied.vocab_shard(3, i) for i in range(3)]
    assert [p.embed_tokens.shape[0] for p in parts] == [4, 4, 4]
    assert [(p.vocab_start, p.vocab_len) for p in parts] == [(0, 4), (4, 4), (8, 3)]
    assert all(p.lm_head is p.embed_tokens for p in parts)  # tied stays tied
    assert torch.equal(torch.cat([p.embed_tokens for p in parts])[:vocab], embed)
    assert not parts[2].embed_tokens[3].any()  # padding row
    assert tied.vocab_shard(1, 0) is tied and tied.vocab_len == -1


def test_split_sizes():
    assert split_sizes(91, 2) == [46, 45] and split_sizes(8, 4) == [2, 2, 2, 2] and sum(split_sizes(7, 3)) == 7

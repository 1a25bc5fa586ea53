"""Reference attention over the slot-indexed KV cache, in PyTorch.

Items are padded to a [batch, max_new_len] query grid and a [batch, max_len]
key grid gathered through ``req_to_token_indexs``; masks keep every query to
positions 0..its own position of its request. Works for prefill (chunked or
not), decode and MTP decode rows alike.
"""
import torch
import torch.nn.functional as F

from lightllm.common.basemodel.infer_struct import InferStateInfo

# Key column every padded query may see, so no softmax row is empty (no NaN).
ALWAYS_VISIBLE_KEY = 0


def paged_attention_torch(
    q: torch.Tensor,  # [num_new_tokens, q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    infer_state: InferStateInfo,
    sm_scale: float,
) -> torch.Tensor:  # [num_new_tokens, q_heads, head_dim]
    batch, max_new, max_len = infer_state.batch_size, infer_state.max_new_len, infer_state.max_len_in_batch
    _, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[1]
    device = q.device

    key_pos = torch.arange(max_len, device=device)  # [max_len]
    key_in_seq = key_pos[None, :] < infer_state.b_seq_len[:, None]  # [batch, max_len]
    table = infer_state.req_manager.req_to_token_indexs[infer_state.b_req_idx, :max_len]  # [batch, max_len]
    slots = torch.where(key_in_seq, table, infer_state.mem_manager.HOLD_SLOT)  # [batch, max_len]
    # [batch, q_heads, max_len, head_dim]
    k = k_cache[slots].transpose(1, 2).repeat_interleave(group, dim=1)
    v = v_cache[slots].transpose(1, 2).repeat_interleave(group, dim=1)

    q_pos = infer_state.b_q_start_pos[:, None] + torch.arange(max_new, device=device)[None, :]  # [batch, max_new]
    visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & key_in_seq[:, None, :]  # [batch, max_new, max_len]
    visible[:, :, ALWAYS_VISIBLE_KEY] = True

    q_grid = q.new_zeros(batch, max_new, q_heads, head_dim)
    q_grid[infer_state.token_item, infer_state.token_offset] = q
    # [batch, q_heads, max_new, head_dim]
    out = F.scaled_dot_product_attention(q_grid.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=sm_scale)
    return out.transpose(1, 2)[infer_state.token_item, infer_state.token_offset]

"""Read a Hugging Face safetensors checkpoint (single file or sharded) into a flat dict."""
import json
import os
from typing import Dict, List, Optional

import torch
from safetensors import safe_open

SINGLE_FILE_NAME = "model.safetensors"
SHARD_INDEX_NAME = "model.safetensors.index.json"
# A safetensors file starts with its JSON header's length (little-endian u64), then the header
HEADER_LEN_BYTES = 8
# What a Git LFS pointer (a clone without `git lfs pull`) starts with
LFS_POINTER_PREFIX = b"version https://git-lfs"
# Checkpoint files of other formats that a start-up error names (at most NAMED_FILES of them, as for missing shards)
OTHER_CHECKPOINT_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")
NAMED_FILES = 3


def list_safetensors_files(model_dir: str) -> List[str]:
    """Paths of the checkpoint files: the shards named by the index, or the single file."""
    index_path = os.path.join(model_dir, SHARD_INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: Dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single_path = os.path.join(model_dir, SINGLE_FILE_NAME)
    if os.path.isfile(single_path):
        return [single_path]
    raise FileNotFoundError(f"no {SINGLE_FILE_NAME} or {SHARD_INDEX_NAME} in {model_dir}")


def missing_weights(model_dir: str) -> Optional[str]:
    """Why ``model_dir`` holds no loadable checkpoint, or None when every file it needs is there."""
    try:
        paths = list_safetensors_files(model_dir)
    except FileNotFoundError:
        other = sorted(n for n in os.listdir(model_dir) if n.endswith(OTHER_CHECKPOINT_SUFFIXES))
        hint = f" (it has {', '.join(other[:NAMED_FILES])}: only safetensors checkpoints load)" if other else ""
        return f"holds no {SINGLE_FILE_NAME} or {SHARD_INDEX_NAME}{hint}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {SHARD_INDEX_NAME}: {type(e).__name__}: {e}"
    absent = [os.path.basename(p) for p in paths if not os.path.isfile(p)]
    if absent:
        return f"{SHARD_INDEX_NAME} names missing files: {', '.join(absent[:NAMED_FILES])}"
    for path in paths:
        why = _header_problem(path)
        if why is not None:
            return f"{os.path.basename(path)} {why}"
    return None


def _header_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a safetensors file (its first bytes only), or None."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(max(HEADER_LEN_BYTES + 1, len(LFS_POINTER_PREFIX)))
    if head.startswith(LFS_POINTER_PREFIX):
        return "is a Git LFS pointer, not the weights (fetch them: git lfs pull)"
    if len(head) <= HEADER_LEN_BYTES:
        return f"is not a safetensors file ({size} bytes)"
    header_len = int.from_bytes(head[:HEADER_LEN_BYTES], "little")
    if head[HEADER_LEN_BYTES:HEADER_LEN_BYTES + 1] != b"{" or HEADER_LEN_BYTES + header_len > size:
        return f"is not a safetensors file (no header in its first bytes; {size} bytes)"
    return None


def load_hf_state_dict(model_dir: str, dtype: torch.dtype, device: torch.device) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint on ``device``; floating tensors cast to ``dtype``."""
    state: Dict[str, torch.Tensor] = {}
    for path in list_safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
                state[name] = tensor.to(device=device, dtype=target_dtype).contiguous()
    return state


def take_weight(state: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Removes and returns a required weight, with an error that names it."""
    if name not in state:
        raise KeyError(f"checkpoint lacks weight {name!r}")
    return state.pop(name)

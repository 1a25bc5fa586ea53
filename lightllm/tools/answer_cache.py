"""The target's generated answers kept on disk, so that several draft recipes train on the same data.

``train_mtp_draft --answers_cache PATH``: the first run generates the answers to the training and
held-out prompts and writes them to PATH; a later run with the same target, prompts, held-out
prompts and ``--max_new_tokens`` reads them instead of generating (a different key is an error, not
a silent reuse). Answers cut by a generation budget are kept as they were cut.
"""
import hashlib
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

FORMAT_VERSION = 1


@dataclass(frozen=True)
class AnswerKey:
    """What the answers depend on."""

    model_dir: str  # the target (absolute path)
    max_new_tokens: int
    prompts_sha256: str  # the training prompts' token ids
    heldout_sha256: str  # the held-out prompts' token ids


def ids_digest(prompts: Sequence[Sequence[int]]) -> str:
    """sha256 over the prompts' token ids, in order (lengths included: [1, 2] + [3] differs from [1] + [2, 3])."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(np.asarray(p, dtype=np.int64).tobytes())
    return h.hexdigest()


def make_key(model_dir: str, max_new_tokens: int, prompts: Sequence[Sequence[int]],
             heldout_prompts: Sequence[Sequence[int]]) -> AnswerKey:
    return AnswerKey(os.path.abspath(model_dir), max_new_tokens, ids_digest(prompts), ids_digest(heldout_prompts))


def _pack(seqs: Sequence) -> Dict[str, torch.Tensor]:
    """TrainSequences as one flat int32 tensor, their lengths and prompt lengths."""
    return {"tokens": torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int32),
            "lengths": torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.int64),
            "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int64)}


def _unpack(packed: Dict[str, torch.Tensor], make_seq) -> List:
    pieces = torch.split(packed["tokens"], packed["lengths"].tolist())
    return [make_seq(p.tolist(), int(n)) for p, n in zip(pieces, packed["prompt_lens"])]


def save(path: str, key: AnswerKey, seqs: Sequence, heldout: Dict[str, Sequence]) -> None:
    """The training answers and the held-out ones by kind (TrainSequence-like: token_ids, prompt_len)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    data = {"version": FORMAT_VERSION, "key": asdict(key), "train": _pack(seqs),
            "heldout": {kind: _pack(group) for kind, group in heldout.items()}}
    tmp = path + ".tmp"
    torch.save(data, tmp)
    os.replace(tmp, path)  # a run killed while writing leaves no half file under PATH


def load(path: str, key: AnswerKey, make_seq) -> Tuple[List, Dict[str, List]]:
    """(training answers, held-out answers by kind) of ``path``; ValueError when its key is not ``key``.
    ``make_seq(token_ids, prompt_len)`` builds one sequence."""
    data = torch.load(path, weights_only=True)
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"--answers_cache {path}: format {data.get('version')}, this tool writes {FORMAT_VERSION}")
    stored = AnswerKey(**data["key"])
    if stored != key:
        diff = [f"{k} {getattr(stored, k)!r} (now {getattr(key, k)!r})" for k in asdict(key)
                if getattr(stored, k) != getattr(key, k)]
        raise ValueError(f"--answers_cache {path} holds other answers: {'; '.join(diff)}")
    return (_unpack(data["train"], make_seq),
            {kind: _unpack(packed, make_seq) for kind, packed in data["heldout"].items()})

"""Train an MTP draft for a target model by self-distillation.

The target answers chat prompts greedily (OfflineEngine); training sequences are
prompt + the target's own answer, so the draft learns to predict what the target
will actually say. The draft (``MTPDraftTrainModule``) is unrolled over K depths
per batch:

    depth d (0-based) at position s: in (h^{(d)}_s, x_{s+d+1}) -> h^{(d+1)}_s,
    logits = target final norm + lm_head, label x_{s+d+2}

h^{(0)} is the target's last-layer output before its final norm, or, with
``--target_layer_ids``, fc of those target layers' outputs side by side (EAGLE-3's
feature fusion; fc starts as the identity on the last layer when the module starts
from it); deeper depths take the module's own output (gradients flow through the
chain) and the ground-truth token. Loss = sum_d DEPTH_LOSS_DECAY**d * CE_d over answer labels, with
CE_d = (1 - w) * CE(label) + w * CE(the target's own distribution there), w = ``--soft_label_weight``.

Initialisation (``--init``, ``INIT_SCHEMES``): ``last_layer`` (default; at step 0 the module
re-applies the target's last layer to its own state, the token half starts at 0) or ``random``.
Measured on SmolLM2-135M (CPU, 192 self-distilled GSM8K answers, batch 8, K = 3,
held-out top-1 by depth on 64 other answers):
  48 steps, lr 5e-4:  random 0.39 / 0.39 / 0.38   last_layer 0.26 / 0.20 / 0.19
  96 steps, lr 1e-3:  random 0.43 / 0.39 / 0.39   last_layer 0.44 / 0.36 / 0.33
                      (depth-1 loss: random 3.80, last_layer 2.94; accept-length
                      estimate 1.76 for both)
random starts faster (the identity init's 31-RMS hidden path drowns the token half
until Adam grows it), last_layer catches up and is better calibrated at depth 1.
The shipped draft (lightllm/drafts/...) was trained with last_layer on an H200
(all 7473 train questions, 904 steps of 64): held-out top-1 0.68 / 0.62 / 0.60 / 0.57
(its training_info.json).

Prompts (``--prompt_source``): ``gsm8k`` (the GSM8K train questions, in file order),
``magpie`` (user turns the target writes itself, lightllm/tools/magpie_prompts.py), ``mix``
(both, ``--gsm8k_fraction`` of them GSM8K, seeded shuffle) or ``file`` (a prompt set written
by an earlier run, replayed exactly). The set used is always written (``--prompt_set_out``);
a prompt of the held-out set (``--heldout``) refuses the run. ``--max_gen_seconds`` covers
both generation phases: sampling user turns gets at most MAGPIE_TIME_SHARE of it, the
answers the rest. ``--magpie_domains`` (names in magpie_prompts.MAGPIE_DOMAINS) splits the Magpie
prompts into equal shares, each sampled under its domain's system prompt (``default``: the
template's own).

    python -m lightllm.tools.train_mtp_draft --out DIR [--prompt_source mix --magpie_count N \\
        --magpie_domains default,code,writing,advice,explanation --gsm8k_fraction F] [--data train.jsonl] \\
        [--model_dir DIR] [--unroll 4] ...

The output dir holds config.json + model.safetensors (bf16, loadable with
``--mtp_draft_model_dir``), training_info.json (the recipe, prompt counts, Magpie stats,
held-out top-1 per depth by prompt kind; paths relative to the repo or as $ENV_VAR/...)
and the prompt set.
"""
import argparse
import copy
import logging
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from lightllm.models.dspark import train_module as dspark_train
from lightllm.models.dspark.train_module import mix_soft_labels, target_hidden
from lightllm.models.draft_config import DRAFT_SAFETENSORS
from lightllm.models.llama_mtp.model import MTPDraftConfig
from lightllm.models.llama_mtp.train_module import MTPDraftTrainModule
from lightllm.server.core.objs.start_args_type import MTP_MODES
from lightllm.tools import answer_cache
from lightllm.tools import magpie_prompts as magpie
from lightllm.tools.client import generate_offline, model_dir_or_embedded
from lightllm.tools.magpie_prompts import KIND_MATH, SOURCE_GSM8K, PromptRecord, abort_all_after, as_records
from lightllm.tools.prompts import (GSM8K_BESIDE_CHECKOUT, GSM8K_DIR_ENV, REPO, chat_prompt_ids, gsm8k_path, load_gsm8k,
                                    run_tool)
from lightllm.tools.report import write_json
from lightllm.utils.embedded_model import CACHE_DIR_ENV, get_cache_dir

logger = logging.getLogger(__name__)

DEPTH_LOSS_DECAY = 0.8  # w_d = DEPTH_LOSS_DECAY ** d: near depths matter most (they gate the later ones)
IGNORE_INDEX = -100  # label of positions without a loss (prompt, padding, past the sequence end)
PAD_TOKEN_ID = 0  # any valid id; padded positions are masked out and causal attention never sees them
WARMUP_FRACTION = 0.05  # of all optimiser steps, linear warm-up
MIN_LR_FRACTION = 0.1  # the LR decays to this share of --lr
MAX_HELDOUT_SEQUENCES = 256
HELDOUT_FRACTION = 0.05
GEN_RUNNING_MAX_REQ_SIZE = 256  # default requests decoded together while generating the answers
GEN_BATCH_MAX_TOKENS = 8192  # prompt tokens per prefill step while generating (many prompts per step)
TRAINING_INFO_FILENAME = "training_info.json"
DRAFT_FILE_MODE = 0o644  # the draft may ship as package data: readable by everyone
LR_SCHEDULES = ("cosine", "linear")
DEFAULT_INIT_STD = 0.02  # when the target config has no initializer_range
PROMPT_SOURCES = ("gsm8k", "magpie", "mix", "file")
PROMPT_SET_FILENAME = "prompt_set.jsonl"  # in --out unless --prompt_set_out
DEFAULT_GSM8K_FRACTION = 0.3  # --prompt_source mix: the share of GSM8K questions
MAGPIE_TIME_SHARE = 0.4  # of --max_gen_seconds at most for sampling user turns; the answers get the rest
NON_MATH = "non_math"  # the held-out metrics over every kind but math together
# The data folder beside the checkout (``../shared/data``), recorded relative to the repository.
DATA_BESIDE_CHECKOUT = os.path.dirname(os.path.abspath(GSM8K_BESIDE_CHECKOUT))
OUTSIDE_REPO = "<outside the repo>"  # training_info.json's stand-in for a machine's folder
PATH_FLAGS = ("data", "out", "model_dir", "prompt_set", "prompt_set_out", "heldout", "init_from",
              "answers_cache")  # recorded portably
TRAIN_MODES = MTP_MODES if dspark_train.DSPARK in MTP_MODES else MTP_MODES + (dspark_train.DSPARK,)


# --------------------------------------------------------------------------- config and data


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of the training core (validated once)."""

    mtp_mode: str = "eagle_with_att"
    init: str = "last_layer"  # a name in INIT_SCHEMES
    init_from: Optional[str] = None  # a draft dir to fine-tune instead (overrides init)
    unroll: int = 4  # K: depths trained per batch
    epochs: int = 1
    lr: float = 1e-3
    lr_schedule: str = "cosine"
    batch_size: int = 64
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    heldout_fraction: float = HELDOUT_FRACTION
    max_train_seconds: Optional[float] = None  # time budget: the LR decays by steps or time, then stop
    soft_label_weight: float = 0.0  # share of each depth's loss against the target's distribution (0: hard only)
    # MTP modes: target layers depth 0 reads through fc (EAGLE-3's fusion); empty: the last layer alone
    target_layer_ids: Tuple[int, ...] = ()
    dspark: Optional[dspark_train.DSparkTrainOptions] = None  # --mtp_mode dspark only

    def __post_init__(self):
        for name, valid in (("mtp_mode", TRAIN_MODES), ("init", INIT_SCHEMES), ("lr_schedule", LR_SCHEDULES)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} {getattr(self, name)!r}; valid names: {', '.join(valid)}")
        dspark_train.check_train_config(self)
        for name in ("unroll", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and 0 <= self.heldout_fraction < 1):
            raise ValueError("lr must be > 0 and heldout_fraction in [0, 1)")
        if not 0 <= self.soft_label_weight <= 1:
            raise ValueError(f"soft_label_weight must be in [0, 1], got {self.soft_label_weight}")
        if self.target_layer_ids and self.mtp_mode == dspark_train.DSPARK:
            raise ValueError("dspark's target layers are its DSparkTrainOptions' (set from --target_layer_ids)")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids) or min(self.target_layer_ids, default=0) < 0:
            raise ValueError(f"target_layer_ids must be distinct layer indices, got {list(self.target_layer_ids)}")

    @property
    def with_attention(self) -> bool:
        return self.mtp_mode.endswith("_with_att")

    @property
    def num_modules(self) -> int:
        return 1 if self.mtp_mode.startswith("eagle") else self.unroll

    @property
    def depth_weights(self) -> List[float]:
        return [DEPTH_LOSS_DECAY ** d for d in range(self.unroll)]


@dataclass(frozen=True)
class TrainSequence:
    token_ids: List[int]  # prompt + answer
    prompt_len: int  # labels are the answer tokens token_ids[prompt_len:]


@dataclass
class Batch:
    tokens: torch.Tensor  # [batch, seq] int64, right-padded with PAD_TOKEN_ID
    is_answer: torch.Tensor  # [batch, seq] bool: an answer token (a label for some depth)
    is_real: torch.Tensor  # [batch, seq] bool: not padding


@dataclass
class DepthMetrics:
    """Per-depth results on a set of sequences; index i is depth i+1 (predicts x_{s+i+2})."""

    loss_by_depth: List[float]
    top1_by_depth: List[float]
    # teacher-forced estimate of the engine's mean accept length with K = unroll:
    # 1 + the number of leading depths whose top-1 is right, averaged over positions
    accept_len_estimate: float


@dataclass
class TrainResult:
    module: MTPDraftTrainModule
    steps: int
    final_train_loss: float  # mean of the last epoch's (or run's) steps
    heldout_before: Optional[DepthMetrics]  # None without a held-out slice
    heldout_after: Optional[DepthMetrics]
    num_train_sequences: int
    num_heldout_sequences: int
    stopped_early: bool
    seconds: float
    loss_history: List[float] = field(default_factory=list)


def collate(seqs: Sequence[TrainSequence], device) -> Batch:
    longest = max(len(s.token_ids) for s in seqs)
    tokens = torch.tensor([list(s.token_ids) + [PAD_TOKEN_ID] * (longest - len(s.token_ids)) for s in seqs])
    position = torch.arange(longest)
    is_real = position < torch.tensor([len(s.token_ids) for s in seqs])[:, None]
    is_answer = is_real & (position >= torch.tensor([s.prompt_len for s in seqs])[:, None])
    return Batch(tokens.to(device), is_answer.to(device), is_real.to(device))


def shift_left(x: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    """x: [batch, seq] -> y with y[:, s] = x[:, s + n], ``fill`` past the end."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def depth_inputs(batch: Batch, depth: int):
    """Depth d's input tokens x_{s+d+1} and labels x_{s+d+2} (IGNORE_INDEX off the answer), both [batch, seq]."""
    tokens_in = shift_left(batch.tokens, depth + 1, PAD_TOKEN_ID)
    labels = torch.where(batch.is_answer, batch.tokens, torch.full_like(batch.tokens, IGNORE_INDEX))
    return tokens_in, shift_left(labels, depth + 2, IGNORE_INDEX)


def split_heldout(seqs: Sequence[TrainSequence], fraction: float, seed: int):
    """A seeded shuffle, then the last slice is held out (at least 1 when there are >= 2 sequences)."""
    order = list(seqs)
    random.Random(seed).shuffle(order)
    n = 0 if fraction == 0 or len(order) < 2 else min(MAX_HELDOUT_SEQUENCES, max(1, round(fraction * len(order))))
    return order[: len(order) - n], order[len(order) - n:]


# --------------------------------------------------------------------------- the target's frozen parts and the module


def _fp32(module: nn.Module) -> nn.Module:
    """The module itself when already fp32, else an fp32 copy (frozen either way)."""
    if any(p.dtype != torch.float32 for p in module.parameters()):
        module = copy.deepcopy(module).float()
    return module.requires_grad_(False)


class TargetHead(nn.Module):
    """The target's embedding, final norm and lm_head in fp32: shared by every depth, never trained."""

    def __init__(self, target: nn.Module):
        super().__init__()
        self.embed = _fp32(target.get_input_embeddings())
        self.norm = _fp32(target.model.norm)
        self.lm_head = _fp32(target.get_output_embeddings())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> [n, vocab] fp32."""
        return self.lm_head(self.norm(hidden)).float()


@torch.no_grad()
def measure_hidden_scale(target: nn.Module, batch: Batch) -> float:
    """Median per-token RMS of the target's h^{(0)} over the real (unpadded) tokens of ``batch``."""
    h = target_hidden(target, batch.tokens)[0]  # [batch, seq, hidden]
    return float(h.pow(2).mean(-1).sqrt()[batch.is_real].median())


@torch.no_grad()
def init_random(module: MTPDraftTrainModule, target: nn.Module, batch: Batch) -> None:
    """Every Linear ~ N(0, initializer_range) (as transformers initialises Llama), every norm weight = 1
    (the global torch RNG)."""
    std = getattr(target.config, "initializer_range", None) or DEFAULT_INIT_STD
    for name, p in module.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std)


@torch.no_grad()
def init_from_last_layer(module: MTPDraftTrainModule, target: nn.Module, batch: Batch) -> None:
    """Every MTP module: decoder layer (or its MLP half) = the target's last layer, enorm = hnorm = 1,
    eh_proj = [0 | c * I] (token half | hidden half) with c the median RMS of the target's hidden
    states over ``batch`` (~31 for SmolLM2)."""
    hidden_scale = measure_hidden_scale(target, batch)
    last = target.model.layers[-1].state_dict()
    for mod in module.mtp:
        own = mod.layer.state_dict()
        missing = [k for k in own if k not in last]
        if missing:
            raise ValueError(f"the target's last layer has no {missing}")
        mod.layer.load_state_dict({k: last[k].float() for k in own})
        mod.enorm.weight.fill_(1.0)
        mod.hnorm.weight.fill_(1.0)
        hidden = mod.eh_proj.weight.shape[0]
        mod.eh_proj.weight.zero_()
        mod.eh_proj.weight[:, hidden:].copy_(hidden_scale * torch.eye(hidden))


INIT_SCHEMES = {"last_layer": init_from_last_layer, "random": init_random}


@torch.no_grad()
def fc_reads_last_layer(module: MTPDraftTrainModule, num_target_layers: int) -> None:
    """fc = the identity on the last target layer's block, zeros elsewhere: depth 0 reads exactly what a
    draft without fusion reads, and training learns what the other layers add."""
    last = num_target_layers - 1
    if last not in module.target_layer_ids:
        raise ValueError(f"--target_layer_ids {module.target_layer_ids} must include the target's last layer "
                         f"{last} to start from the last layer's output (or use --init random)")
    hidden = module.target_config.hidden_size
    j = module.target_layer_ids.index(last)
    module.fc.weight.zero_()
    module.fc.weight[:, j * hidden:(j + 1) * hidden].copy_(torch.eye(hidden))


def new_draft_module(target: nn.Module, cfg: TrainConfig, first_batch: Batch, device) -> MTPDraftTrainModule:
    """A fresh module for ``cfg.mtp_mode`` on ``device``, initialised with ``cfg.init``; or ``cfg.init_from``,
    given an fc that reads the last layer when ``cfg.target_layer_ids`` asks for fusion and it has none."""
    if cfg.mtp_mode == dspark_train.DSPARK:
        return dspark_train.new_train_module(target, cfg.dspark, cfg.init, cfg.init_from, device)
    num_layers = target.config.num_hidden_layers
    if cfg.init_from is not None:
        module = MTPDraftTrainModule.load_draft(copy.deepcopy(target.config), cfg.init_from).float().to(device)
        if module.with_attention != cfg.with_attention or len(module.mtp) != cfg.num_modules:
            raise ValueError(f"--init_from {cfg.init_from}: its draft does not fit --mtp_mode {cfg.mtp_mode}")
        if cfg.target_layer_ids and not module.target_layer_ids:
            module.set_target_layers(cfg.target_layer_ids)
            module.fc.to(device)
            fc_reads_last_layer(module, num_layers)
        elif module.target_layer_ids != list(cfg.target_layer_ids):
            raise ValueError(f"--init_from {cfg.init_from} reads target layers {module.target_layer_ids}, "
                             f"not --target_layer_ids {list(cfg.target_layer_ids)}")
        return module
    module = MTPDraftTrainModule(copy.deepcopy(target.config), cfg.with_attention, cfg.num_modules,
                                 cfg.target_layer_ids).to(device)
    INIT_SCHEMES[cfg.init](module, target, first_batch)
    if module.fc is not None and cfg.init == "last_layer":
        fc_reads_last_layer(module, num_layers)
    return module


@dataclass
class UnrollOutput:
    ce_by_depth: List[torch.Tensor]  # scalar hard-label CE per depth (0 where a depth has no label)
    correct_by_depth: List[torch.Tensor]  # [batch, seq] bool: top-1 == label (False where no label)
    valid_by_depth: List[torch.Tensor]  # [batch, seq] bool: the depth has a label here
    # scalar training loss per depth: (1 - w) * hard CE + w * soft CE (the hard CE itself when w == 0)
    loss_by_depth: List[torch.Tensor] = field(default_factory=list)


@torch.no_grad()
def target_probs(head: TargetHead, h0: torch.Tensor, valid: torch.Tensor, depth: int) -> torch.Tensor:
    """The target's next-token distribution [n, vocab] fp32 for depth ``depth`` at the ``valid`` positions s:
    its prediction at s + depth + 1, the position whose greedy token is the label x_{s+depth+2}."""
    rows, cols = valid.nonzero(as_tuple=True)
    return torch.softmax(head.logits(h0[rows, cols + depth + 1]), dim=-1)


def draft_outputs(module: nn.Module, target: nn.Module, head: TargetHead, batch: Batch, cfg: TrainConfig,
                  soft_labels: bool = True):
    """(per-depth outputs, the training loss) of one batch: dspark blocks, or depths 0..K-1 unrolled
    with ground-truth input tokens and the module's own hidden chain. ``soft_labels`` False skips the
    soft-label term (the loss is then the hard one, as ``evaluate`` reports it)."""
    if cfg.mtp_mode == dspark_train.DSPARK:
        return dspark_train.batch_outputs(module, target, head, batch, cfg, sample=module.training,
                                          soft_labels=soft_labels)
    h0, aux = target_hidden(target, batch.tokens, module.target_layer_ids)  # [batch, seq, hidden], fusion input
    soft_weight = cfg.soft_label_weight if soft_labels else 0.0
    hidden = module.features(h0, aux)
    out = UnrollOutput([], [], [])
    for depth in range(cfg.unroll):
        tokens_in, labels = depth_inputs(batch, depth)
        hidden = module.step(depth, hidden, tokens_in, head.embed)
        valid = labels != IGNORE_INDEX
        logits = head.logits(hidden[valid])  # [n, vocab], only where a label exists
        has_labels = bool(valid.any())
        ce = F.cross_entropy(logits, labels[valid]) if has_labels else hidden.sum() * 0.0
        out.ce_by_depth.append(ce)
        if soft_weight > 0 and has_labels:
            ce = mix_soft_labels(ce, logits, target_probs(head, h0, valid, depth), soft_weight)
        out.loss_by_depth.append(ce)
        correct = torch.zeros_like(valid)
        correct[valid] = logits.argmax(-1) == labels[valid]
        out.correct_by_depth.append(correct)
        out.valid_by_depth.append(valid)
    return out, sum(w * loss for w, loss in zip(cfg.depth_weights, out.loss_by_depth))


@torch.no_grad()
def evaluate(module: MTPDraftTrainModule, target: nn.Module, head: TargetHead, seqs: Sequence[TrainSequence],
             cfg: TrainConfig, device) -> DepthMetrics:
    k = cfg.unroll
    was_training = module.training
    module.eval()
    ce_sum, correct, count = [0.0] * k, [0] * k, [0] * k
    chain_sum, chain_n = 0, 0
    for i in range(0, len(seqs), cfg.batch_size):
        batch = collate(seqs[i: i + cfg.batch_size], device)
        out = draft_outputs(module, target, head, batch, cfg, soft_labels=False)[0]  # hard-label metrics
        for d in range(k):
            n = int(out.valid_by_depth[d].sum())
            ce_sum[d] += float(out.ce_by_depth[d]) * n
            correct[d] += int(out.correct_by_depth[d].sum())
            count[d] += n
        # per position with a depth-0 label: how many depths from the first are all right
        lead = torch.stack(out.correct_by_depth).long().cumprod(0).sum(0)[out.valid_by_depth[0]]
        chain_sum += int(lead.sum())
        chain_n += lead.numel()
    module.train(was_training)
    return DepthMetrics(
        loss_by_depth=[ce_sum[d] / max(count[d], 1) for d in range(k)],
        top1_by_depth=[correct[d] / max(count[d], 1) for d in range(k)],
        accept_len_estimate=1.0 + chain_sum / max(chain_n, 1),
    )


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up, then cosine or linear decay to MIN_LR_FRACTION * lr.

    Progress is the larger of step / total_steps and elapsed / max_seconds, so a
    time budget compresses the decay (training ends at the low LR) instead of
    cutting the run off at a high LR."""

    lr: float
    total_steps: int
    kind: str
    max_seconds: Optional[float] = None

    def progress(self, step: int, elapsed: float) -> float:
        p = step / self.total_steps
        if self.max_seconds is not None:
            p = max(p, elapsed / self.max_seconds)
        return min(p, 1.0)

    def lr_at(self, step: int, elapsed: float) -> float:
        warmup = max(1, round(WARMUP_FRACTION * self.total_steps))
        if step < warmup:
            return self.lr * (step + 1) / warmup
        p = self.progress(step, elapsed)
        decay = 0.5 * (1 + math.cos(math.pi * p)) if self.kind == "cosine" else 1.0 - p
        return self.lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * decay)


# --------------------------------------------------------------------------- the training core


def train_draft(target: nn.Module, sequences: Sequence[TrainSequence], cfg: TrainConfig,
                device, progress: bool = True) -> TrainResult:
    """Train a draft on token sequences (no tokenizer needed); ``target`` is a transformers CausalLM."""
    start = time.monotonic()
    torch.manual_seed(cfg.seed)
    target.requires_grad_(False).eval()
    train_seqs, heldout = split_heldout(sequences, cfg.heldout_fraction, cfg.seed)
    if not train_seqs:
        raise ValueError("no training sequences")
    head = TargetHead(target)
    module = new_draft_module(target, cfg, collate(train_seqs[: cfg.batch_size], device), device)

    def heldout_metrics(when: str) -> Optional[DepthMetrics]:
        if not heldout:
            return None
        m = evaluate(module, target, head, heldout, cfg, device)
        logger.info("held-out %s: top1 by depth [%s]  loss by depth [%s]  accept_len~%.2f", when,
                    " ".join(f"{x:.3f}" for x in m.top1_by_depth), " ".join(f"{x:.3f}" for x in m.loss_by_depth),
                    m.accept_len_estimate)
        return m

    before = heldout_metrics("before training")

    steps_per_epoch = math.ceil(len(train_seqs) / cfg.batch_size)
    schedule = LRSchedule(cfg.lr, steps_per_epoch * cfg.epochs, cfg.lr_schedule, cfg.max_train_seconds)
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = []  # (epoch, sequences) over cfg.epochs seeded shuffles
    rng = random.Random(cfg.seed + 1)
    for epoch in range(cfg.epochs):
        order = list(train_seqs)
        rng.shuffle(order)
        batches += [(epoch, order[i: i + cfg.batch_size]) for i in range(0, len(order), cfg.batch_size)]
    losses = []
    bar = tqdm(total=schedule.total_steps, disable=not progress, desc="train draft")
    module.train()
    for epoch, chunk in batches:
        if schedule.progress(len(losses), time.monotonic() - start) >= 1.0:
            break
        if epoch > 0 and len(losses) == epoch * steps_per_epoch:
            heldout_metrics(f"after epoch {epoch}")
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(len(losses), time.monotonic() - start)
        out, loss = draft_outputs(module, target, head, collate(chunk, device), cfg)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        bar.update(1)
        acc1 = float(out.correct_by_depth[0].sum()) / max(1, int(out.valid_by_depth[0].sum()))
        bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}", acc1=f"{acc1:.2f}")
    stopped_early = len(losses) < schedule.total_steps
    if stopped_early:
        logger.warning("time budget: stopped after %d of %d steps (--max_train_seconds %s)", len(losses),
                       schedule.total_steps, cfg.max_train_seconds)
    bar.close()
    after = heldout_metrics("after training")
    tail = losses[-steps_per_epoch:]
    final_loss = sum(tail) / len(tail) if tail else math.nan
    return TrainResult(module=module.eval(), steps=len(losses), final_train_loss=final_loss,
                       heldout_before=before, heldout_after=after, num_train_sequences=len(train_seqs),
                       num_heldout_sequences=len(heldout), stopped_early=stopped_early,
                       seconds=time.monotonic() - start, loss_history=losses)


# --------------------------------------------------------------------------- answers, outputs, prompt sets


def generate_answers(model_dir: str, prompts: Sequence[List[int]], max_new_tokens: int,
                     eos_token_ids: Optional[Sequence[int]] = None, device: Optional[str] = None,
                     dtype: Optional[str] = None, progress: bool = True,
                     running_max_req_size: int = GEN_RUNNING_MAX_REQ_SIZE,
                     max_seconds: Optional[float] = None) -> List[TrainSequence]:
    """The target's greedy answers (OfflineEngine, no MTP): prompt + answer per sequence.

    ``eos_token_ids`` None: the model dir's own (needs its tokenizer). ``max_seconds``:
    past it every unfinished request is aborted; a partial answer is still the target's
    own greedy text, so it is kept; prompts without a single answer token are dropped."""
    from lightllm.server.core.objs.start_args_type import StartArgs

    max_len = max(len(p) for p in prompts) + max_new_tokens
    args = StartArgs(model_dir=model_dir, running_max_req_size=running_max_req_size, max_req_total_len=max_len,
                     batch_max_tokens=max(GEN_BATCH_MAX_TOKENS, max_len))
    params = [{"max_new_tokens": max_new_tokens, "ignore_eos": False}] * len(prompts)
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    results, _ = generate_offline(args, prompts, params, device=device, dtype=dtype, eos_token_ids=eos_token_ids,
                                  progress=progress, on_step=abort_all_after(deadline))
    seqs = [TrainSequence(list(p) + list(r.token_ids), len(p)) for p, r in zip(prompts, results) if r.token_ids]
    if len(seqs) < len(prompts):
        logger.warning("time budget: %d of %d prompts got no answer and are dropped", len(prompts) - len(seqs),
                       len(prompts))
    return seqs


def save_outputs(result: TrainResult, out_dir: str, info: Dict) -> None:
    """The draft dir (bf16 config.json + model.safetensors) and training_info.json."""
    os.makedirs(out_dir, exist_ok=True)
    result.module.save_draft(out_dir, torch.bfloat16)
    os.chmod(os.path.join(out_dir, DRAFT_SAFETENSORS), DRAFT_FILE_MODE)  # safetensors writes it owner-only
    write_json(os.path.join(out_dir, TRAINING_INFO_FILENAME), info)


def training_info(result: TrainResult, cfg: TrainConfig, extra: Dict) -> Dict:
    counts = ("steps", "stopped_early", "num_train_sequences", "num_heldout_sequences", "final_train_loss")
    return {
        **extra,
        "config": dict(asdict(cfg), init_from=portable_path(cfg.init_from)),
        "depth_loss_weights": cfg.depth_weights,
        **{k: getattr(result, k) for k in counts},
        "heldout_before": asdict(result.heldout_before) if result.heldout_before else None,
        "heldout_after": asdict(result.heldout_after) if result.heldout_after else None,
        "depth_index_note": dspark_train.DEPTH_INDEX_NOTE if cfg.dspark else
        "list index i is depth i+1 (predicts the token i+2 ahead of the hidden state)",
    }


class HeldoutOverlapError(ValueError):
    """A training prompt is in the held-out set: the run is refused."""


def portable_path(path: Optional[str]) -> Optional[str]:
    """``path`` as training_info.json records it, never absolute: under $LIGHTLLM_GSM8K_DIR or the
    model cache as ``$VAR/rest``, in the checkout or the data folder beside it relative to the
    repository, else OUTSIDE_REPO/its name."""
    if not path:
        return path
    full = os.path.abspath(path)
    roots = ((GSM8K_DIR_ENV, os.environ.get(GSM8K_DIR_ENV)), (CACHE_DIR_ENV, get_cache_dir()),
             (None, REPO), (None, DATA_BESIDE_CHECKOUT))
    for var, root in roots:
        root = root and os.path.abspath(root)
        if root and os.path.commonpath([full, root]) == root:
            rel = os.path.relpath(full, root)
            return os.path.join("$" + var, rel) if var else os.path.relpath(full, REPO)
    return os.path.join(OUTSIDE_REPO, os.path.basename(full))


def magpie_config(a: argparse.Namespace, max_seconds: Optional[float]) -> "magpie.MagpieConfig":
    return magpie.MagpieConfig(count=a.magpie_count, temperature=a.magpie_temperature, top_p=a.magpie_top_p,
                               max_new_tokens=a.magpie_max_new_tokens, seed=a.seed, seed_mode=a.magpie_seed_mode,
                               domains=a.magpie_domains, gen_batch_size=a.gen_batch_size, max_seconds=max_seconds)


def build_prompt_set(a: argparse.Namespace, model_dir: str, device: str,
                     magpie_seconds: Optional[float]) -> Tuple[List[PromptRecord], Optional["magpie.MagpieResult"]]:
    """The training prompts of ``--prompt_source`` (at most --num_prompts) and the Magpie result, if sampled."""
    if a.prompt_source == "file":
        return magpie.read_prompt_set(a.prompt_set)[: a.num_prompts], None
    gsm8k = []
    if a.prompt_source in ("gsm8k", "mix"):
        questions = load_gsm8k(gsm8k_path("train", a.data), a.num_questions)
        gsm8k = as_records([q.question for q in questions], KIND_MATH, SOURCE_GSM8K)
    if a.prompt_source == "gsm8k":
        return gsm8k[: a.num_prompts], None
    sampled = magpie.generate_magpie_prompts(model_dir, magpie_config(a, magpie_seconds), device=device,
                                             progress=True)
    general = sampled.records()
    if a.prompt_source == "magpie":
        return general[: a.num_prompts], sampled
    return magpie.mix_prompts(general, gsm8k, a.gsm8k_fraction, a.num_prompts, a.seed), sampled


# --------------------------------------------------------------------------- CLI


def domains_arg(text: str) -> Tuple[str, ...]:
    """--magpie_domains: comma-separated names in MAGPIE_DOMAINS (an argparse error names the valid ones)."""
    try:
        return magpie.parse_domains(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def check_target_layer_ids(a: argparse.Namespace, num_layers: int) -> None:
    """--target_layer_ids against the target and the initialisation, before any generation (ValueError)."""
    ids = a.target_layer_ids or []
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"--target_layer_ids {bad} are not layers of the target (0..{num_layers - 1})")
    if a.mtp_mode == dspark_train.DSPARK:
        return
    init_ids = MTPDraftConfig.load(a.init_from).target_layer_ids if a.init_from else []
    if init_ids and init_ids != ids:  # new_draft_module's check, before the generation rather than after
        raise ValueError(f"--init_from {a.init_from} reads target layers {init_ids}, not --target_layer_ids {ids}")
    starts_from_last = not init_ids and (a.init_from or a.init == "last_layer")
    if ids and starts_from_last and num_layers - 1 not in ids:
        raise ValueError(f"--target_layer_ids {ids} must include the target's last layer {num_layers - 1}: fc "
                         "starts as the identity on it (or use --init random)")


def make_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    m = magpie.MagpieConfig()
    p = argparse.ArgumentParser(description="Train an MTP draft for a target model by self-distillation.")
    p.add_argument("--out", required=True, help="output draft dir")
    p.add_argument("--prompt_source", default="gsm8k", choices=PROMPT_SOURCES)
    p.add_argument("--data", default=None, help="GSM8K train jsonl (default: $LIGHTLLM_GSM8K_DIR/train.jsonl or "
                                                "../shared/data/gsm8k beside the checkout)")
    p.add_argument("--num_questions", type=int, default=None, help="the first N GSM8K questions (default: all)")
    p.add_argument("--num_prompts", type=int, default=None,
                   help="training prompts in all (default: every prompt of the source; mix: as many as the pools "
                        "allow at --gsm8k_fraction)")
    p.add_argument("--gsm8k_fraction", type=float, default=DEFAULT_GSM8K_FRACTION, help="mix: share of GSM8K")
    p.add_argument("--magpie_count", type=int, default=m.count, help="user turns kept after filtering")
    p.add_argument("--magpie_temperature", type=float, default=m.temperature)
    p.add_argument("--magpie_top_p", type=float, default=m.top_p)
    p.add_argument("--magpie_max_new_tokens", type=int, default=m.max_new_tokens, help="longer user turns are dropped")
    p.add_argument("--magpie_seed_mode", default="batch", choices=magpie.SEED_MODES,
                   help="batch: seed once per round (fast at large batches); request: a seed per request")
    p.add_argument("--magpie_domains", type=domains_arg, default=magpie.DEFAULT_DOMAIN,
                   help="comma-separated Magpie domains, --magpie_count split equally over them, each sampled "
                        f"under its system prompt (valid: {', '.join(magpie.MAGPIE_DOMAINS)}; "
                        f"{magpie.DEFAULT_DOMAIN}: the template's own)")
    p.add_argument("--prompt_set", default=None, help="--prompt_source file: a prompt set to replay")
    p.add_argument("--prompt_set_out", default=None, help=f"where the prompt set used is written "
                                                          f"(default: OUT/{PROMPT_SET_FILENAME})")
    p.add_argument("--heldout", default=magpie.DEFAULT_HELDOUT_PATH,
                   help="held-out prompts: refuse to train on them, report top-1 by kind on them ('' for none)")
    p.add_argument("--drop_heldout", action="store_true",
                   help="drop training prompts found in the held-out set (a fresh Magpie sample) instead of "
                        "refusing the run")
    p.add_argument("--model_dir", default=None, help="target HF model dir (default: the embedded SmolLM2)")
    p.add_argument("--mtp_mode", default=d.mtp_mode, choices=TRAIN_MODES)
    p.add_argument("--init", default=d.init, choices=list(INIT_SCHEMES), help="initialisation of the draft module")
    p.add_argument("--init_from", default=None, help="fine-tune this draft dir instead of a fresh module")
    p.add_argument("--unroll", type=int, help=f"K: depths trained per batch (default {d.unroll}; dspark: block_size-1)")
    p.add_argument("--max_new_tokens", type=int, default=256, help="length limit of the target's answers")
    p.add_argument("--gen_batch_size", type=int, default=GEN_RUNNING_MAX_REQ_SIZE,
                   help="requests the engine decodes together while generating")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--lr_schedule", default=d.lr_schedule, choices=LR_SCHEDULES)
    p.add_argument("--batch_size", type=int, default=d.batch_size, help="sequences per optimiser step")
    p.add_argument("--seed", type=int, default=d.seed, help="training, Magpie sampling and mixing")
    p.add_argument("--max_gen_seconds", type=float, default=None,
                   help="time budget of both generation phases (Magpie at most "
                        f"{MAGPIE_TIME_SHARE:.0%}%); unfinished answers are cut, partial answers kept")
    p.add_argument("--soft_label_weight", type=float, default=d.soft_label_weight,
                   help="share of each depth's loss that is the cross-entropy against the target's full "
                        "distribution at the label's position, softmax(lm_head(norm(h0))) with h0 the target's "
                        "last hidden state; 0 = hard labels only, 1 = soft labels only (held-out metrics stay "
                        "hard-label)")
    p.add_argument("--max_train_seconds", type=float, default=None,
                   help="training time budget in seconds: the LR schedule decays by steps or time, whichever is "
                        "further along, and training stops (and saves) when it ends")
    p.add_argument("--target_layer_ids", type=int, nargs="+", default=None,
                   help="target decoder layers the draft reads. MTP modes: depth 0 reads fc of their outputs "
                        "side by side (EAGLE-3's fusion; with --init last_layer or an --init_from draft without "
                        "fusion, fc starts as the identity on the last layer, which must be listed); default: "
                        "the last layer's output alone. dspark: its context (default: "
                        f"{dspark_train.DEFAULT_NUM_TARGET_LAYERS} evenly spaced, the last included)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--answers_cache", default=None,
                   help="a file of the target's answers: read when it exists (same target, prompts, held-out "
                        "prompts and --max_new_tokens, else an error), else written after generating, so that "
                        "several recipes train on the same answers")
    dspark_train.add_cli_flags(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = make_parser()
    a = p.parse_args(argv)
    if (a.prompt_source == "file") != (a.prompt_set is not None):
        p.error("--prompt_set goes with --prompt_source file, and file needs it")
    if a.prompt_set_out is None:
        a.prompt_set_out = os.path.join(a.out, PROMPT_SET_FILENAME)
    if a.unroll is None:
        a.unroll = a.block_size - 1 if a.mtp_mode == dspark_train.DSPARK else TrainConfig.unroll
    return a


def generate_all(a: argparse.Namespace, model_dir: str, device: str, prompts: List[List[int]],
                 heldout_ids: List[List[int]], heldout_kinds: List[str], answer_budget: Optional[float],
                 seconds: Dict[str, float]) -> Tuple[List[TrainSequence], Dict[str, List[TrainSequence]]]:
    """The target's answers to the training prompts (within ``answer_budget`` s) and to the held-out ones,
    grouped by kind; their seconds go into ``seconds``."""
    logger.info("generating the target's answers (max_new_tokens %d, budget %s s)", a.max_new_tokens, answer_budget)
    t = time.monotonic()
    seqs = generate_answers(model_dir, prompts, a.max_new_tokens, device=device,
                            running_max_req_size=a.gen_batch_size, max_seconds=answer_budget)
    seconds["generate"] = time.monotonic() - t
    logger.info("generated %d answer tokens for %d prompts in %.1f s",
                sum(len(s.token_ids) - s.prompt_len for s in seqs), len(seqs), seconds["generate"])
    heldout_seqs: Dict[str, List[TrainSequence]] = {}  # the target's answers to the held-out prompts, by kind
    if heldout_ids:
        t = time.monotonic()
        heldout_kind = {tuple(p): kind for p, kind in zip(heldout_ids, heldout_kinds)}
        for s in generate_answers(model_dir, heldout_ids, a.max_new_tokens, device=device,
                                  running_max_req_size=min(a.gen_batch_size, len(heldout_ids))):
            heldout_seqs.setdefault(heldout_kind[tuple(s.token_ids[: s.prompt_len])], []).append(s)
        seconds["heldout_generate"] = time.monotonic() - t
        logger.info("held-out answers in %.1f s", seconds["heldout_generate"])
    return seqs, heldout_seqs


def main(argv: Optional[Sequence[str]] = None) -> TrainResult:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    a = parse_args(argv)
    model_dir = a.model_dir or model_dir_or_embedded(None)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    is_dspark = a.mtp_mode == dspark_train.DSPARK
    try:
        check_target_layer_ids(a, AutoConfig.from_pretrained(model_dir).num_hidden_layers)
        dspark = dspark_train.options_from_args(a, tokenizer, model_dir) if is_dspark else None
        cfg = TrainConfig(mtp_mode=a.mtp_mode, init=a.init, init_from=a.init_from, unroll=a.unroll, epochs=a.epochs,
                          lr=a.lr, lr_schedule=a.lr_schedule, batch_size=a.batch_size, seed=a.seed,
                          max_train_seconds=a.max_train_seconds, soft_label_weight=a.soft_label_weight,
                          target_layer_ids=() if is_dspark else tuple(a.target_layer_ids or ()), dspark=dspark)
    except ValueError as e:  # a bad flag value: a usage error at start-up, not a traceback
        make_parser().error(str(e))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 draft
    t0 = time.monotonic()
    seconds = {}
    gen_budget = a.max_gen_seconds
    magpie_budget = None if gen_budget is None else MAGPIE_TIME_SHARE * gen_budget
    records, sampled = build_prompt_set(a, model_dir, device, magpie_budget)
    seconds["prompts"] = time.monotonic() - t0
    heldout_rows = magpie.load_heldout(a.heldout) if a.heldout else []
    hits = magpie.heldout_overlap([r.prompt for r in records], [h["prompt"] for h in heldout_rows])
    if hits and a.drop_heldout:
        logger.warning("dropped %d training prompt(s) found in the held-out set %s", len(hits), a.heldout)
        hit_set = set(hits)
        records, hits = [r for i, r in enumerate(records) if i not in hit_set], []
    magpie.write_prompt_set(a.prompt_set_out, records)  # also when refused below, for inspection
    logger.info("prompt set: %d prompts (%s) in %.1f s, written to %s", len(records),
                dict(Counter(r.source for r in records)), seconds["prompts"], a.prompt_set_out)
    if hits:
        raise HeldoutOverlapError(
            f"refusing to train: {len(hits)} training prompt(s) are in the held-out set {a.heldout}, e.g. "
            f"{records[hits[0]].prompt[:120]!r} (a {records[hits[0]].source} prompt); drop them from the prompt set")

    # the answers get what the user turns left of the generation budget (their engine's start included)
    answer_budget = None if gen_budget is None else max(0.0, gen_budget - (seconds["prompts"] if sampled else 0.0))
    prompts = chat_prompt_ids(tokenizer, [r.prompt for r in records])
    kind_of = {tuple(p): r.kind for p, r in reversed(list(zip(prompts, records)))}  # a repeated prompt: its first kind
    heldout_ids = chat_prompt_ids(tokenizer, [r["prompt"] for r in heldout_rows]) if heldout_rows else []
    key = answer_cache.make_key(model_dir, a.max_new_tokens, prompts, heldout_ids)
    if a.answers_cache and os.path.exists(a.answers_cache):
        t = time.monotonic()
        try:
            seqs, heldout_seqs = answer_cache.load(a.answers_cache, key, TrainSequence)
        except ValueError as e:
            make_parser().error(str(e))
        seconds["answers_cache"] = time.monotonic() - t
        logger.info("read %d answers and %d held-out ones from %s in %.1f s", len(seqs),
                    sum(map(len, heldout_seqs.values())), a.answers_cache, seconds["answers_cache"])
    else:
        seqs, heldout_seqs = generate_all(a, model_dir, device, prompts, heldout_ids,
                                          [r["kind"] for r in heldout_rows], answer_budget, seconds)
        if a.answers_cache:
            answer_cache.save(a.answers_cache, key, seqs, heldout_seqs)
            logger.info("answers written to %s", a.answers_cache)
    answer_tokens = sum(len(s.token_ids) - s.prompt_len for s in seqs)

    # bf16 on CUDA (as the engine serves it), fp32 on CPU
    target_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=target_dtype).to(device).eval()
    result = train_draft(target, seqs, cfg, device)
    seconds["train"] = result.seconds
    by_kind = None  # per kind (and NON_MATH): sequences and teacher-forced top-1 / loss per depth
    if heldout_seqs:
        t = time.monotonic()
        head = TargetHead(target)
        groups = dict(sorted(heldout_seqs.items()))
        groups[NON_MATH] = [s for kind, group in groups.items() if kind != KIND_MATH for s in group]
        by_kind = {kind: {"sequences": len(group), **asdict(evaluate(result.module, target, head, group, cfg, device))}
                   for kind, group in groups.items() if group}
        seconds["heldout_eval"] = time.monotonic() - t
        for kind, m in by_kind.items():
            logger.info("held-out %-12s top1 by depth [%s]", kind, " ".join(f"{x:.3f}" for x in m["top1_by_depth"]))
    seconds["total"] = time.monotonic() - t0
    info = training_info(result, cfg, {
        "recipe": {k: portable_path(v) if k in PATH_FLAGS else v for k, v in vars(a).items()},
        "prompt_source": a.prompt_source,
        "data_path": portable_path(gsm8k_path("train", a.data)) if a.prompt_source in ("gsm8k", "mix") else None,
        "model_dir": portable_path(model_dir), "prompt_set": portable_path(a.prompt_set_out),
        "num_prompts": len(records), "prompts_by_kind": dict(Counter(r.kind for r in records)),
        "prompts_by_source": dict(Counter(r.source for r in records)),
        "prompts_by_domain": dict(Counter(r.domain for r in records if r.domain is not None)),
        "answered_by_kind": dict(Counter(kind_of[tuple(s.token_ids[: s.prompt_len])] for s in seqs)),
        "num_answered": len(seqs),
        "magpie": {**asdict(magpie_config(a, magpie_budget)), **sampled.stats()} if sampled else None,
        "gen_batch_size": a.gen_batch_size, "max_new_tokens": a.max_new_tokens, "answer_tokens": answer_tokens,
        "prompt_tokens": sum(s.prompt_len for s in seqs), "device": device, "seconds": seconds,
        "heldout_path": portable_path(a.heldout) if a.heldout else None, "heldout_by_kind": by_kind,
    })
    save_outputs(result, a.out, info)
    logger.info("saved the draft to %s (%.1f s in all: %s)", a.out, seconds["total"],
                ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    return result


if __name__ == "__main__":
    run_tool(main)

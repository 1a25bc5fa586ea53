"""Chunked-prefill backend: each step runs every running request's decode rows and, while prompts
wait, chunks of them in the same forward (a mixed step, step_rows.py); a step with nothing to decode
prefills alone, one with nothing to prefill decodes alone (CUDA graphs, overlap).

Mixed steps take at most ``mixed_budget`` prompt tokens: --mixed_max_prefill_tokens and --batch_max_tokens,
and on CUDA with graphs at most --graph_max_prefill_tokens, so that every mixed step is one graph replay for the target and
one for the draft (dspark: one for its context, one for its blocks, padded to the decode ladder). With
--mixed_prefill_pace_steps N a mixed step takes about 1 / N of the prompt tokens left instead (``paced_budget``).
--disable_mixed_steps alternates prefill and decode steps instead.

Overlap (one rank, unless ``--disable_overlap_schedule``; with MTP, decode-only steps): a decode step is left in flight,
and the next call launches the next step of the same requests before it reads and commits
the one in flight, so the host's commit, stop checks and the router's work run while the GPU
decodes. Outputs stay those of the plain schedule: a step is only launched ahead for requests
whose next step does not depend on the host (no seeds, no penalties, no grammar), and when a request
finishes, the step already launched for it is undone and run again without it unless the
batch keeps its padded shape (docs/decode_step.md, "What overlaps").

A mixed step after a decode step in flight is staged while that step runs, launched before its commit (or,
when a decoding request depends on the host, right after it), kept when the commit left it the plain schedule's
step, and left in flight: the router's work runs while the GPU runs it, and the next call commits it. A mixed step
with nothing in flight before it is launched and left in flight the same way. The mixed step after a mixed
step is staged and launched while that one runs, before its commit, so the GPU goes on while the host commits;
the commit keeps it when it is still the plain schedule's next step (a request that finished at the commit
only leaves padding rows, when the padded shape stays the same), else takes it back (``_undo_mixed``). So is
the decode step after a mixed step that finishes the last prompts (``_stage_decode_under_mixed``).
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple, Union

from lightllm.server.router.model_infer.decode_step import DecodeRows, HostStepResult, PendingResult
from lightllm.server.router.model_infer.infer_batch import InferReq
from lightllm.server.router.model_infer.mode_backend.base_backend import (
    MixedStep, ModeBackend, ReqStepUpdate, StepResult,
)
from lightllm.server.router.model_infer.step_rows import StepRows


# A paced mixed step takes at least this many prompt tokens (a short prompt whole; the serving mix measured 2.29x
# p99 / p50 inter-token latency at a fixed 256-token budget against 3.91x at 2048, docs/decode_step.md)
PACED_MIN_PREFILL_TOKENS = 256


@dataclass
class InFlightStep:
    """A launched decode step whose result the host has not read yet."""

    rows: DecodeRows
    pending: PendingResult


@dataclass
class InFlightMixed:
    """A launched mixed step whose result the host has not read yet."""

    step: MixedStep

    @property
    def rows(self) -> DecodeRows:
        return self.step.rows


class ChunkedPrefillBackend(ModeBackend):
    def __init__(self, args, device, dtype, parallel=None):
        super().__init__(args, device, dtype, parallel)
        self.batch_max_tokens = args.batch_max_tokens
        self.last_step_prefilled = False  # what run_step did last: prefill chunks or a decode step
        # Mixed steps: the rows' owner (the graph rows on CUDA, else unpadded items) and its token budget.
        self.mixed_rows: Optional[StepRows] = None
        self.mixed_budget = 0
        if self.mixed_steps_enabled():
            self.mixed_rows = self.step_rows
            self.mixed_budget = min(self.batch_max_tokens, args.mixed_max_prefill_tokens or self.batch_max_tokens)
            if self.mixed_rows is not None:
                self.mixed_budget = min(self.mixed_budget, args.graph_max_prefill_tokens)
            else:
                self.mixed_rows = StepRows(self.model, self.req_to_next_token_ids, None, False, self.rows_draft,
                                           max_rows=self.batch_max_tokens, context=self.rows_context)
        self.pace_steps = args.mixed_prefill_pace_steps  # mixed steps' prompt tokens: paced_budget
        self.pace_min_tokens = PACED_MIN_PREFILL_TOKENS
        self.overlap_schedule = not args.disable_overlap_schedule and self.parallel.world_size == 1
        self._inflight: Optional[Union[InFlightStep, InFlightMixed]] = None
        self.steps_ahead = 0  # decode steps launched before the previous one was committed
        self.discarded_steps = 0  # of those, steps undone because a request finished (tests, logs)
        self.mixed_staged = 0  # mixed steps staged under a decode step in flight and kept after its commit
        self.mixed_ahead = 0  # mixed steps launched right after a mixed step's commit (the next chunk)
        self.mixed_left = 0  # mixed steps launched with nothing in flight, left in flight for the next call
        self.mixed_dropped = 0  # mixed steps staged so and dropped (the commit changed the step)
        self.mixed_early = 0  # mixed steps launched under the step before them, before its commit
        self.mixed_undone = 0  # of those after a mixed step, taken back at its commit (the plain schedule differs)
        self.mixed_kept_past_finish = 0  # of those, kept with the rows of requests that finished at it as padding
        self.decode_after_mixed = 0  # decode steps launched right after a mixed step's commit (or under it, kept)
        self.decode_early = 0  # of those, launched under the mixed step before its commit
        self.decode_kept_past_finish = 0  # of those, kept with the rows of requests that finished at it as padding
        self.successors_without_last = 0  # decode steps launched ahead without the requests finishing before them
        self.left_idle = 0  # calls that returned with no step in flight while requests run (the GPU idles on the host)

    def mixed_steps_enabled(self) -> bool:
        return not self.args.disable_mixed_steps

    def run_step(self, running: List[InferReq], may_admit: bool = False) -> StepResult:
        """One engine step: decode rows and prompt chunks together (mixed), or whichever has work.
        Without mixed steps prefill and decode alternate while both have work, so a stream of long
        prompts never starves running decodes. ``may_admit``: requests are waiting (a finish may let
        one in, which the plain schedule prefills next)."""
        result = self._run_step(running, may_admit)
        if self._inflight is None and any(r.finish_reason is None for r in running):
            self.left_idle += 1
        return result

    def _run_step(self, running: List[InferReq], may_admit: bool) -> StepResult:
        prefilling = [r for r in running if r.in_prefill]
        decoding = [r for r in running if not r.in_prefill and r.finish_reason is None]
        if isinstance(self._inflight, InFlightMixed):
            return self._after_mixed(running, may_admit)
        if self._inflight is not None:
            self.last_step_prefilled = False
            if prefilling and self.mixed_rows is not None and self.mtp_step == 0:  # plain: one token a step
                return self._mix_after(decoding, prefilling, may_admit)
            return self._advance(decoding, prefilling, may_admit)
        if prefilling and decoding and self.mixed_rows is not None:
            self.last_step_prefilled = True
            if self._host_free(decoding):  # left in flight: the router's work runs under it
                self._leave_mixed(decoding, *self.mixed_chunk_plan(prefilling))
                self.mixed_left += 1
                return StepResult([], prefilled=True, steps=0)  # counted at its commit
            reqs, lens = self.mixed_chunk_plan(prefilling)
            return StepResult(self.mixed(self.mixed_rows, decoding, reqs, lens), prefilled=True,
                              decode_reqs=len(decoding))
        if prefilling and (not decoding or not self.last_step_prefilled):
            self.last_step_prefilled = True
            return StepResult(self.prefill_chunks(prefilling), prefilled=True)
        self.last_step_prefilled = False
        if not decoding:
            return StepResult([])
        if not self._may_leave(decoding):
            return StepResult(self.decode(decoding), decode_reqs=len(decoding))
        rows = self.prepare_decode_rows(decoding)
        self._inflight = InFlightStep(rows, self.launch_verify_draft(rows, self.decode_forward(rows)))
        return StepResult([], decode_reqs=len(decoding))

    def _after_mixed(self, running: List[InferReq], may_admit: bool) -> StepResult:
        """Commit the mixed step in flight. The mixed step after it, staged under it, is launched first (the GPU
        runs it while the host commits) and kept if it is still the plain schedule's next step, else taken back;
        without one, the plain schedule's next step is launched after the commit (``_launch_after_mixed``). With
        MTP the next step's decode rows wait for the mixed step's accept lengths: it is staged after the wait for
        its result, still before its commit."""
        self.last_step_prefilled = True
        step = self._inflight.step
        self._inflight = None
        decoded = sum(r.finish_reason is None for r in step.decoding)  # a kept step's finished rows: padding
        host = self.decode_step.wait(step.pending) if self.mtp_step != 0 and not may_admit else None
        nxt = self._stage_under_mixed(step, running, host) if not may_admit else None
        if nxt is not None:
            self._launch_early(nxt)
        elif not may_admit:
            rows = self._stage_decode_under_mixed(step, running, host)
            if rows is not None:  # the step's prompts were the last: the decode step after it, launched now
                self.decode_step.snapshot(rows)  # after the mixed step's writes, before its own
                dec = InFlightStep(rows, self.launch_verify_draft(rows, self.decode_forward(rows)))
                updates = self.commit_mixed(step, host)
                return StepResult(updates, prefilled=True, decode_reqs=decoded,
                                  launched_decode_reqs=self._keep_decode_after_mixed(dec, running))
        updates = self.commit_mixed(step, host)
        launched = 0
        if nxt is not None and self._keeps(nxt, running):
            self._inflight = InFlightMixed(nxt)
            self.mixed_ahead += 1
        else:
            if nxt is not None:
                self._undo_mixed(nxt)
                self.mixed_undone += 1
            launched = self._launch_after_mixed(running) if not may_admit else 0
        return StepResult(updates, prefilled=True, decode_reqs=decoded, launched_decode_reqs=launched)

    def _advance(self, decoding: List[InferReq], prefilling: List[InferReq], may_admit: bool) -> StepResult:
        """With a step in flight: launch the next step of the same requests and commit the one in
        flight, or (anything else to do first) only commit it; with prompts to prefill and no request
        waiting, the mixed step after that commit is then launched and left in flight (``_mix_after_commit``)."""
        cur = self._inflight
        same = not prefilling and _same_reqs(decoding, cur.rows.reqs)
        k1 = self.mtp_step + 1
        # the requests the committed step decodes (a kept step's finished rows are padding)
        decoded = sum(r.finish_reason is None for r in cur.rows.reqs)
        last, going_on = self._split_last(decoding)
        if not (same and going_on and self._may_run_ahead(going_on)
                and (not last or not may_admit)
                and self.mem_manager.available_size >= len(going_on) * k1):
            if prefilling and not may_admit and self.mixed_rows is not None:  # MTP (plain: ``_mix_after``)
                return StepResult(self._mix_over_commit(cur, decoding, prefilling), decode_reqs=decoded, steps=0)
            return StepResult(self.flush_decode(), decode_reqs=decoded, steps=0)
        if last:  # the plain schedule's next step leaves them out: stage it afresh, each request one token on
            rows = self.decode_step.prepare(going_on, kv_ahead=1)
            self.decode_step.snapshot(rows)  # after cur's writes, before the next step's
            self.successors_without_last += 1
        else:
            self.decode_step.snapshot(cur.rows)  # after cur's writes, before the next step's
            rows = self.decode_step.prepare_successor(cur.rows, cur.pending)
        nxt = InFlightStep(rows, self.launch_verify_draft(rows, self.decode_forward(rows)))
        self.steps_ahead += 1
        updates = self.commit_decode(cur.rows, self.decode_step.wait(cur.pending))
        self._inflight = nxt
        finished = sum(r.finish_reason is not None for r in rows.reqs)
        if any(r.finish_reason is None for r in last) or finished and (
                may_admit or finished == len(rows.reqs) or
                self.decode_step.padded_rows(len(rows.reqs) - finished) != rows.num_rows):
            self._undo(nxt)  # the plain schedule's next step differs: a new prefill or another shape
            return StepResult(updates, decode_reqs=decoded, steps=0)  # the re-run is counted when it runs
        if last:  # counted as the plain schedule's next call counts it, once the finished requests have left
            return StepResult(updates, decode_reqs=decoded, steps=0, launched_decode_reqs=len(rows.reqs) - finished)
        return StepResult(updates, decode_reqs=decoded)

    def _mix_after(self, decoding: List[InferReq], prefilling: List[InferReq], may_admit: bool) -> StepResult:
        """With a decode step in flight and prompts to prefill: stage the mixed step the plain schedule runs
        next while the GPU decodes (each decoding request one token further; one that reaches max_new_tokens in
        the step in flight left out), commit the step in flight, then launch the mixed step and leave it in
        flight, unless the commit changed it (another request finished, or one is waiting to join: the plain
        schedule lays out another step, so the staging is dropped). When no decoding request depends on the host
        (``_host_free``) the mixed step is launched before the commit instead, then kept or taken back as in
        ``_after_mixed``."""
        cur = self._inflight
        decoded = sum(r.finish_reason is None for r in cur.rows.reqs)
        if not _same_reqs(decoding, cur.rows.reqs) or may_admit:
            return StepResult(self.flush_decode(), decode_reqs=decoded, steps=0)
        last, going_on = self._split_last(decoding)
        if not going_on:  # the plain schedule's next step prefills alone
            return StepResult(self.flush_decode(), decode_reqs=decoded, steps=0)
        reqs, lens = self.mixed_chunk_plan(prefilling)
        step = self.stage_mixed(self.mixed_rows, going_on, reqs, lens, kv_ahead={r.req_idx: 1 for r in going_on})
        if self._host_free(going_on):  # launched now: the GPU runs it while the host commits
            self._launch_early(step)
            updates = self.flush_decode()
            if self._keeps(step, decoding + prefilling):
                self._inflight = InFlightMixed(step)
                self.mixed_staged += 1
            else:
                self._undo_mixed(step)
                self.mixed_dropped += 1
            return StepResult(updates, decode_reqs=decoded, steps=0)
        updates = self.flush_decode()
        if any(r.finish_reason is not None for r in going_on) or any(r.finish_reason is None for r in last):
            self.drop_mixed(step)
            self.mixed_dropped += 1
            return StepResult(updates, decode_reqs=decoded, steps=0)
        self.launch_mixed(step)
        self._inflight = InFlightMixed(step)
        self.mixed_staged += 1
        return StepResult(updates, decode_reqs=decoded, steps=0)

    def _split_last(self, decoding: List[InferReq]) -> Tuple[List[InferReq], List[InferReq]]:
        """(the requests whose last token comes in the step in flight, decode or mixed, the others), in order. Their
        finish (max_new_tokens, plain decoding: one token a step) is known now, so the plain schedule's next step,
        known too, leaves them out."""
        if self.mtp_step != 0:
            return [], list(decoding)
        last, going_on = [], []
        for r in decoding:
            (last if len(r.output_ids) + 1 >= r.params.max_new_tokens else going_on).append(r)
        return last, going_on

    def _launch_early(self, step: MixedStep) -> None:
        """Launch a staged mixed step before the commit of the step in flight, saving first what its decode flow
        changes per request (``_undo_mixed`` restores it)."""
        k1 = self.mtp_step + 1
        self.decode_step.snapshot_reqs(step.rows_owner.b_req_idx[:len(step.decoding) * k1:k1].long())
        self.launch_mixed(step)
        self.mixed_early += 1

    @staticmethod
    def _gains(cur: MixedStep, host: Optional[HostStepResult] = None) -> Tuple[Dict[int, int], Set[int]]:
        """By req_idx, the KV positions each request of ``cur`` gains at its commit (1 a decode request, or with
        MTP its accept length from ``host``, its chunk a prompt), and the req_idx of the prompts ``cur`` finishes."""
        accepted = [1] * len(cur.decoding) if host is None else host.accept_len
        ahead = {r.req_idx: n for r, n in zip(cur.decoding, accepted)}
        ahead.update({r.req_idx: n for r, n in zip(cur.reqs, cur.chunk_lens)})
        return ahead, {cur.reqs[i - len(cur.decoding)].req_idx for i in cur.done_items}

    @staticmethod
    def _ends_by_length(reqs: List[InferReq], gains: Dict[int, int]) -> bool:
        """MTP: whether one of ``reqs`` reaches max_new_tokens at the commit that adds ``gains`` (by req_idx, its
        accept length, read from the step's result); the step after it is then laid out after that commit (plain
        decoding: ``_split_last``)."""
        return any(len(r.output_ids) + gains.get(r.req_idx, 0) >= r.params.max_new_tokens for r in reqs)

    def _slots_for_mixed(self, num_decoding: int, chunk_lens: List[int]) -> bool:
        """Whether the pool can give a mixed step its slots: K + 1 per decoding request and its chunks' tokens."""
        return self.mem_manager.available_size >= num_decoding * (self.mtp_step + 1) + sum(chunk_lens)

    def _stage_under_mixed(self, cur: MixedStep, running: List[InferReq],
                           host: Optional[HostStepResult] = None) -> Optional[MixedStep]:
        """While ``cur`` runs: stage the mixed step the plain schedule runs after it, should its commit finish no
        request but those whose last token (max_new_tokens) it brings, known now. Its decode rows are ``cur``'s
        (one token further; with MTP, its accept lengths further, read from its result ``host`` after the wait) and
        the prompts ``cur`` finishes (their first token), less those; its chunks follow ``cur``'s. None: no prompt
        is left for it, or it may not run ahead."""
        if self.mtp_step != 0 and host is None:
            return None
        ahead, done = self._gains(cur, host)
        if self.mtp_step != 0 and self._ends_by_length(cur.decoding, ahead):
            return None
        decoding = [r for r in running if (not r.in_prefill or r.req_idx in done) and r.finish_reason is None]
        prefilling = [r for r in running if r.in_prefill and r.req_idx not in done]
        if any(r.finish_reason is not None for r in running):
            return None
        _, decoding = self._split_last(decoding)  # their last token comes in ``cur``: the plain step leaves them out
        if not prefilling or not decoding:
            return None
        if not self._host_free(decoding):
            return None
        left = [r.prompt_len - r.kv_len - ahead.get(r.req_idx, 0) for r in prefilling]
        plan = plan_chunks(left, paced_budget(left, self.pace_steps, self.mixed_budget, self.pace_min_tokens))
        reqs, lens = [prefilling[i] for i, _ in plan], [n for _, n in plan]
        if not self._slots_for_mixed(len(decoding), lens):
            return None
        return self.stage_mixed(self.mixed_rows, decoding, reqs, lens, kv_ahead=ahead)

    def _keeps(self, nxt: MixedStep, running: List[InferReq]) -> bool:
        """Whether ``nxt``, launched before the commit of the mixed step before it, is the step the plain schedule
        runs after that commit: the same chunks and the same decode rows, but for requests that finished at the
        commit, whose rows are then padding (their commit keeps nothing) when the padded shape is the one the
        plain step has, as a kept decode step's (the unpadded layout keeps no such rows). The other rows then sit
        at other places than in the plain step: outputs equal up to rounding where a kernel's result depends on
        a row's place (CPU attention), exactly with batch-invariant kernels."""
        decoding = [r for r in running if not r.in_prefill and r.finish_reason is None]
        prefilling = [r for r in running if r.in_prefill]
        if not decoding or not prefilling or not self._host_free(decoding):
            return False
        reqs, lens = self.mixed_chunk_plan(prefilling)
        going = [r for r in nxt.decoding if r.finish_reason is None]
        if not (_same_reqs(nxt.reqs, reqs) and nxt.chunk_lens == lens and _same_reqs(going, decoding)):
            return False
        if len(going) == len(nxt.decoding):
            return True
        size = nxt.batch.size
        if size is None or self.mixed_rows.bucket_size(len(going) * (self.mtp_step + 1) + sum(lens)) != size:
            return False
        self.mixed_kept_past_finish += 1
        return True

    def _stage_decode_under_mixed(self, cur: MixedStep, running: List[InferReq],
                                  host: Optional[HostStepResult] = None) -> Optional[DecodeRows]:
        """While ``cur`` runs, when it finishes every prompt left: the decode step the plain schedule runs after
        it, staged (each decoding request one token further, or with MTP its accept length from ``host``, each
        prompt ``cur`` finishes at its end, with its first token; less those whose last token ``cur`` brings),
        should its commit finish no other request. None: prompts remain, or it may not run ahead."""
        if self.mtp_step != 0 and host is None or any(r.finish_reason is not None for r in running):
            return None
        ahead, done = self._gains(cur, host)
        if self.mtp_step != 0 and self._ends_by_length(cur.decoding, ahead):
            return None
        if any(r.in_prefill and r.req_idx not in done for r in running):
            return None
        _, going_on = self._split_last(running)  # their last token comes in ``cur``: the plain step leaves them out
        if not going_on or not self._host_free(going_on):
            return None
        if self.mem_manager.available_size < len(going_on) * (self.mtp_step + 1):
            return None
        return self.decode_step.prepare(going_on, kv_ahead=ahead)

    def _keep_decode_after_mixed(self, dec: InFlightStep, running: List[InferReq]) -> int:
        """After the commit of the mixed step ``dec`` was launched under: keep ``dec`` in flight when it is the
        plain schedule's next step (requests that finished at that commit: padding rows, when the padded shape is
        the plain step's, as ``_advance`` keeps them), else take it back and launch the plain schedule's step as
        without it. Returns the requests of the decode step left in flight (0: none)."""
        rows = dec.rows
        going = [r for r in rows.reqs if r.finish_reason is None]
        decoding = [r for r in running if not r.in_prefill and r.finish_reason is None]
        keep = bool(going) and _same_reqs(going, decoding) and self._host_free(decoding)
        if keep and len(going) < len(rows.reqs):
            keep = self.decode_step.padded_rows(len(going)) == rows.num_rows
            self.decode_kept_past_finish += keep
        if not keep:
            self._undo(dec)
            return self._launch_after_mixed(running)
        self._inflight = dec
        self.last_step_prefilled = False
        self.decode_early += 1
        self.decode_after_mixed += 1
        return len(going)

    def _undo_mixed(self, step: MixedStep) -> None:
        """Take back a mixed step launched before the commit of the one before it: wait for it, restore what its
        decode flow changed per request (``snapshot_reqs`` before its launch), and free its slots."""
        self.decode_step.wait(step.pending)  # its host buffers and inputs are reused later
        self.decode_step.restore(step.rows)
        self.drop_mixed(step)

    def _launch_after_mixed(self, running: List[InferReq]) -> int:
        """Right after a mixed step's commit, when it finished no request: launch the step the plain schedule's
        next call runs (the router's work between the two changes nothing) and leave it in flight, so the GPU
        runs it under the router's work: the next mixed step while prompts still wait for chunks, else the
        decode step. Returns the requests of a decode step so launched (0: none)."""
        prefilling = [r for r in running if r.in_prefill]
        decoding = [r for r in running if not r.in_prefill]
        if any(r.finish_reason is not None for r in running) or not decoding or not self._host_free(decoding):
            return 0
        if prefilling:
            self._leave_mixed(decoding, *self.mixed_chunk_plan(prefilling))
            self.mixed_ahead += 1
            return 0
        if not self._may_leave(decoding):  # MTP: a request may finish by length in it
            return 0
        rows = self.prepare_decode_rows(decoding)
        self._inflight = InFlightStep(rows, self.launch_verify_draft(rows, self.decode_forward(rows)))
        self.last_step_prefilled = False
        self.decode_after_mixed += 1
        return len(decoding)

    def _mix_over_commit(self, cur: InFlightStep, decoding: List[InferReq],
                         prefilling: List[InferReq]) -> List[ReqStepUpdate]:
        """MTP, prompts to prefill, no request waiting: wait for the decode step in flight, then, with its accept
        lengths on the host, stage the mixed step the plain schedule's next call runs and launch it, and commit
        the decode step while the GPU runs it. The commit keeps that step when it left it the plain one (a request
        that ended at the commit rides as padding when the padded size holds, ``_keeps``), else takes it back and
        launches the plain one (``_mix_after_commit``). A request that ends by length at this commit (known from
        the accept lengths) is not staged around: the plain one then follows the commit."""
        self._inflight = None
        host = self.decode_step.wait(cur.pending)
        gains = {r.req_idx: n for r, n in zip(cur.rows.reqs, host.accept_len)}
        step = None
        if not self._ends_by_length(decoding, gains) and self._host_free(decoding):
            reqs, lens = self.mixed_chunk_plan(prefilling)
            if self._slots_for_mixed(len(decoding), lens):
                step = self.stage_mixed(self.mixed_rows, decoding, reqs, lens, kv_ahead=gains)
                self._launch_early(step)
        updates = self.commit_decode(cur.rows, host)
        if step is not None and self._keeps(step, decoding + prefilling):
            self._inflight = InFlightMixed(step)
            self.last_step_prefilled = True
            self.mixed_staged += 1
            return updates
        if step is not None:
            self._undo_mixed(step)
            self.mixed_undone += 1
        self._mix_after_commit(decoding, prefilling)
        return updates

    def _mix_after_commit(self, decoding: List[InferReq], prefilling: List[InferReq]) -> None:
        """Right after the commit of a decode step (no request waits to join): launch the mixed step the plain
        schedule's next call runs, of the requests that commit left decoding and the prompts' next chunks, and
        leave it in flight, so the router's work runs under it. This is how MTP reaches a mixed step, whose
        rows cannot be staged under the decode step in flight (``_mix_after``: their KV lengths wait for its
        accept lengths). Nothing is launched when a request depends on the host or the slots are short (the
        next call then runs the step as before)."""
        going = [r for r in decoding if r.finish_reason is None]
        if not going or self.mixed_rows is None or not self._host_free(going):
            return
        reqs, lens = self.mixed_chunk_plan(prefilling)
        if not self._slots_for_mixed(len(going), lens):
            return
        self._leave_mixed(going, reqs, lens)
        self.last_step_prefilled = True
        self.mixed_left += 1

    def _leave_mixed(self, decoding: List[InferReq], reqs: List[InferReq], lens: List[int]) -> None:
        """Lay out and launch the mixed step the plain schedule runs now (``reqs``' chunks of ``lens`` tokens, the
        chunk plan), and leave it in flight."""
        step = self.stage_mixed(self.mixed_rows, decoding, reqs, lens)
        self.launch_mixed(step)
        self._inflight = InFlightMixed(step)

    def _undo(self, step: InFlightStep) -> None:
        """Take back a launched step: the batch it ran is not the one the plain schedule runs."""
        self.decode_step.wait(step.pending)  # its host buffers and inputs are reused later
        self.decode_step.restore(step.rows)
        self.mem_manager.free(step.rows.mem_indexes_cpu.tolist())
        self._inflight = None
        self.discarded_steps += 1

    def _host_free(self, reqs: List[InferReq]) -> bool:
        """Whether a step of ``reqs`` may run before the host commits the step before it: its inputs do not depend
        on that commit (per-position seeds, penalty counts, a grammar's mask, a verify observer). A mixed step
        needs only this: a request whose last token (max_new_tokens) it brings finishes at its commit, known in
        advance, and the step after it leaves that request out (``_split_last``)."""
        return self.overlap_schedule and self.verify_observer is None and all(
            r.params.seed is None and not r.has_penalty and r.grammar is None for r in reqs)

    def _may_leave(self, reqs: List[InferReq]) -> bool:
        """Whether a decode step of ``reqs`` launched with nothing in flight may be left in flight: with plain
        decoding when its inputs are commit-free (a request whose last token it brings is left out of the step
        after it, ``_split_last``); with MTP, when no request can finish in it by length either."""
        return self._host_free(reqs) if self.mtp_step == 0 else self._may_run_ahead(reqs)

    def _may_run_ahead(self, reqs: List[InferReq]) -> bool:
        """Whether the next step of ``reqs`` may be launched before the current one is committed:
        its inputs must not depend on the host's commit (``_host_free``), and no request may reach max_new_tokens
        in the current step (that finish is known in advance: no step is launched for nothing; a request still in
        prefill commits its first token before then)."""
        k1 = self.mtp_step + 1
        return self._host_free(reqs) and all(
            len(r.output_ids) + (1 if r.in_prefill else 0) + k1 < r.params.max_new_tokens for r in reqs)

    def flush_decode(self) -> List[ReqStepUpdate]:
        if self._inflight is None:
            return []
        cur, self._inflight = self._inflight, None
        if isinstance(cur, InFlightMixed):
            return self.commit_mixed(cur.step)
        return self.commit_decode(cur.rows, self.decode_step.wait(cur.pending))

    def drop_inflight(self) -> None:
        self._inflight = None

    def prefill_chunks(self, reqs: List[InferReq]) -> List[ReqStepUpdate]:
        return self.prefill(*self.chunk_plan(reqs))

    def mixed_chunk_plan(self, reqs: List[InferReq]) -> Tuple[List[InferReq], List[int]]:
        """``chunk_plan`` of a mixed step: within ``mixed_budget``, paced by --mixed_prefill_pace_steps."""
        left = [r.prompt_len - r.kv_len for r in reqs]
        return self.chunk_plan(reqs, paced_budget(left, self.pace_steps, self.mixed_budget, self.pace_min_tokens))

    def chunk_plan(self, reqs: List[InferReq], budget: Optional[int] = None) -> Tuple[List[InferReq], List[int]]:
        """The requests to prefill this step, in order, and their chunk lengths (within ``budget``
        prompt tokens, default --batch_max_tokens; plan_chunks)."""
        budget = self.batch_max_tokens if budget is None else budget
        plan = plan_chunks([req.prompt_len - req.kv_len for req in reqs], budget)
        return [reqs[i] for i, _ in plan], [n for _, n in plan]


def _same_reqs(a: List[InferReq], b: List[InferReq]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def paced_budget(remaining: List[int], pace_steps: int, budget: int, floor: int = PACED_MIN_PREFILL_TOKENS) -> int:
    """Prompt tokens of a mixed step: ``budget``, or with ``pace_steps`` N > 0 about 1 / N of the tokens left to
    prefill (``remaining``), at least ``floor`` and at most ``budget``: the prompts' tokens then spread over the
    steps that follow at about the rate they arrive, so a long prompt no longer makes a few steps that every
    decoding stream waits for."""
    if pace_steps <= 0:
        return budget
    return min(budget, max(floor, -(-sum(remaining) // pace_steps)))


def plan_chunks(remaining: List[int], budget: int) -> List[Tuple[int, int]]:
    """(index, tokens) of the prompts one step prefills, in arrival order, within ``budget`` tokens.

    Prompts whose rest fits whole in what is left of the budget go first (arrival order); then the oldest
    prompt left takes a partial chunk of the remainder. So a long prompt's chunks never hold a short prompt's
    first token back by a step, and a long prompt still gets every token a step's short prompts leave over
    (they arrive only at admissions, every --router_max_wait_tokens steps at most).
    """
    take = [0] * len(remaining)
    left = budget
    for i, n in enumerate(remaining):
        if n <= left:
            take[i], left = n, left - n
    # a prompt skipped above needs more than is left now: the oldest takes all of it
    oldest = next((i for i, t in enumerate(take) if t == 0), None)
    if oldest is not None and left > 0:
        take[oldest] = left
    return [(i, n) for i, n in enumerate(take) if n > 0]

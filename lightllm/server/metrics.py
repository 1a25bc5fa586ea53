"""Prometheus metrics of the HTTP server (one registry per server), and the periodic throughput
line of the log (``ThroughputLog``)."""
import itertools
import math
import os
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import List, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from lightllm.common.constants import MTP_TABLE_WIDTH

# Seconds between two throughput lines while the server is busy (vLLM: 10, LightLLM: a few)
THROUGHPUT_LOG_INTERVAL_S = 5.0
# Seconds between two writes of an HTTP process's /metrics page for the others (--httpserver_workers)
METRICS_PUBLISH_S = 0.5
PAGE_SUFFIX = ".prom"
# accept_len of one request in one verify step is 1..MTP_TABLE_WIDTH (drafts + 1)
ACCEPT_LEN_BUCKETS = tuple(range(1, MTP_TABLE_WIDTH + 1))
LATENCY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# The serving latency histograms take vLLM's buckets (vllm/v1/metrics/loggers.py), with finer
# ones where an H200 lands below vLLM's smallest (a decode step of a few ms; an idle queue).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.0075, 0.01, 0.015,
                                 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                                 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_TIME_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2) + REQUEST_LATENCY_BUCKETS_S
# A step's updates on their way to the HTTP process's event loop: sub-millisecond when nothing waits,
# a GIL switch interval (5 ms by default) when a thread waits for a busy one
UPDATE_DELIVERY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                             0.1, 0.25, 1.0)
# Label of the decode clock by batch size: the CUDA graph ladder size the step's decoded requests
# pad to (their exact count on CPU, or above the ladder), so at most the ladder's sizes or
# --running_max_req_size values.
DECODE_BATCH_LABEL = "batch"
# Draft depth (1..K) of a proposal, for drafts that report a confidence per proposal (dspark).
DEPTH_LABEL = "depth"
CONFIDENCE_BUCKETS = tuple(i / 10 for i in range(1, 11))


@dataclass(frozen=True)
class PromptCacheTotals:
    """The cumulative totals of one ``PromptCacheStats`` (all 0 before the first)."""

    hit: int = 0
    computed: int = 0
    evicted: int = 0

    @classmethod
    def of(cls, cache) -> "PromptCacheTotals":
        return cls(cache.hit_tokens_total, cache.computed_tokens_total, cache.evicted_tokens_total)


def increase(last: int, total: int) -> int:
    """How much a worker's cumulative ``total`` grew since ``last``. A total below the last one
    means the worker started counting again (a reset): all of it is new, as Prometheus' rate()
    treats a counter reset, so a counter fed with this never goes backwards (nor raises on a
    nonsensical negative total)."""
    return total - last if total >= last else max(total, 0)


class LoopHistogram:
    """A histogram without labels that one thread observes (the HTTP process's event loop, once per
    update of every request): plain counts, exposed at each scrape as prometheus_client exposes a
    ``Histogram`` of these buckets (``_bucket``, ``_count``, ``_sum``; no ``_created``). Its
    ``Histogram.observe`` takes a lock and checks its arguments, about 10 us per update of the
    loop's time under load."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self._bounds = tuple(float(b) for b in buckets) + (math.inf,)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # the first bucket whose bound is >= value
        self._sum += value

    def describe(self) -> List[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> List[HistogramMetricFamily]:
        counts, total = list(self._counts), self._sum
        buckets = [(floatToGoString(b), n) for b, n in zip(self._bounds, itertools.accumulate(counts))]
        return [HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)]


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lightllm_request_count", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.bad_requests = Counter("lightllm_bad_request_count", "Requests refused with HTTP 400", registry=r)
        self.prompt_tokens = Counter("lightllm_prompt_tokens", "Prompt tokens of finished requests (not of requests "
                                     "whose client went away)", registry=r)
        self.generation_tokens = Counter("lightllm_generation_tokens", "Generated tokens of finished requests (not of "
                                         "requests whose client went away)", registry=r)
        self.mtp_accepted = Counter("lightllm_mtp_accepted_tokens", "Draft tokens accepted by MTP verification", registry=r)
        self.mtp_accept_len = LoopHistogram(
            "lightllm_mtp_accept_len", "Committed tokens per request per decode step (MTP's verify step; 1 without MTP)",
            buckets=ACCEPT_LEN_BUCKETS, registry=r
        )
        self.mtp_mean_tokens_per_step = Gauge(
            "lightllm_mtp_mean_tokens_per_step", "Mean committed tokens per request per decode step", registry=r
        )
        self.mtp_mean_tokens_per_step.set_function(lambda: self._step_tokens / self._steps if self._steps else 0.0)
        self.asd_relaxed = Counter("lightllm_asd_relaxed_tokens", "Draft tokens committed by ASD despite a mismatch", registry=r)
        self.asd_regret = Counter("lightllm_asd_regret_spent", "ASD regret spent by finished requests", registry=r)
        # Serving latencies of each request (RequestClock feeds them; README "HTTP API" says what each measures)
        self.ttft = LoopHistogram(
            "lightllm_time_to_first_token_seconds",
            "Time from the request's receipt by the HTTP server to its first output token arriving from the router",
            buckets=TTFT_BUCKETS_S, registry=r
        )
        self.inter_token_latency = LoopHistogram(
            "lightllm_inter_token_latency_seconds",
            "Router time between two consecutive output-token updates of one request (one observation per "
            "update: an MTP step's several tokens count once, as vLLM counts a step)",
            buckets=INTER_TOKEN_LATENCY_BUCKETS_S, registry=r
        )
        self.queue_time = LoopHistogram(
            "lightllm_request_queue_time_seconds",
            "Time from the router receiving a request to its admission into the running batch",
            buckets=QUEUE_TIME_BUCKETS_S, registry=r
        )
        self.update_delivery = LoopHistogram(
            "lightllm_update_delivery_seconds",
            "Time from the router sending a step's updates to the HTTP process's event loop handling them "
            "(one observation per message; both on this host's monotonic clock)",
            buckets=UPDATE_DELIVERY_BUCKETS_S, registry=r
        )
        self.e2e_latency = LoopHistogram(
            "lightllm_e2e_request_latency_seconds",
            "Time from the request's receipt by the HTTP server to its last output (finished requests)",
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=r
        )
        self.request_latency = LoopHistogram(
            "lightllm_request_duration_seconds",
            "End-to-end request latency (the same observations as lightllm_e2e_request_latency_seconds, "
            "in coarser buckets; kept for existing dashboards)", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.kv_used_tokens = Gauge("lightllm_kv_used_tokens", "KV cache slots in use", registry=r)
        self.running_reqs = Gauge("lightllm_running_requests", "Requests being served", registry=r)
        self.waiting_reqs = Gauge("lightllm_waiting_requests", "Requests waiting for admission", registry=r)
        self.batch_step_seconds = Counter(
            "lightllm_batch_step_seconds", "Router wall time inside batch steps (the engine's busy time)", registry=r
        )
        self.batch_steps = Counter("lightllm_batch_steps", "Batch steps the router ran", registry=r)
        self.batch_step_requests = Counter(
            "lightllm_batch_step_requests", "Running requests summed over batch steps (mean batch = this / steps)", registry=r
        )
        self.decode_step_seconds = Counter(
            "lightllm_decode_step_seconds", "Router wall time inside decode steps (no prefill in them)", registry=r
        )
        self.decode_steps = Counter("lightllm_decode_steps", "Decode steps the router ran", registry=r)
        self.decode_step_requests = Counter(
            "lightllm_decode_step_requests", "Running requests summed over decode steps", registry=r
        )
        # the decode clock by decode batch size, so that two runs compare at equal batch
        self.decode_step_seconds_by_batch = Counter(
            "lightllm_decode_step_seconds_by_batch", "Router wall time inside decode steps, by decode batch size",
            [DECODE_BATCH_LABEL], registry=r
        )
        self.decode_steps_by_batch = Counter(
            "lightllm_decode_steps_by_batch", "Decode steps, by decode batch size", [DECODE_BATCH_LABEL], registry=r
        )
        self.decode_step_requests_by_batch = Counter(
            "lightllm_decode_step_requests_by_batch", "Decoded requests summed over decode steps, by decode batch size",
            [DECODE_BATCH_LABEL], registry=r
        )
        # mixed steps: every running request's decode rows and prompt chunks in one forward
        self.mixed_step_seconds = Counter(
            "lightllm_mixed_step_seconds", "Router wall time inside mixed steps (decode rows beside prompt chunks)",
            registry=r
        )
        self.mixed_steps = Counter("lightllm_mixed_steps", "Mixed steps the router ran", registry=r)
        self.mixed_step_decode_requests = Counter(
            "lightllm_mixed_step_decode_requests", "Decoded requests summed over mixed steps", registry=r
        )
        # confidence of each verified draft by depth, next to how many were committed
        self.draft_confidence = Histogram(
            "lightllm_mtp_draft_confidence", "Confidence of each verified draft token, by depth", [DEPTH_LABEL],
            buckets=CONFIDENCE_BUCKETS, registry=r
        )
        self.draft_depth_accepted = Counter(
            "lightllm_mtp_draft_depth_accepted", "Verified draft tokens that were committed, by depth "
            "(acceptance = this / lightllm_mtp_draft_confidence_count)", [DEPTH_LABEL], registry=r
        )
        # The prompt cache (radix tree) of the driver rank. Registered whatever the flags, as the MTP
        # and ASD series are: the page has the same names on every server (dashboards, the client's
        # name table); with --disable_dynamic_prompt_cache they stay 0.
        self.prompt_cache_tokens = Gauge("lightllm_prompt_cache_tokens", "Tokens the prompt cache holds", registry=r)
        self.prompt_cache_hit_tokens = Counter(
            "lightllm_prompt_cache_hit_tokens", "Prompt tokens taken from the prompt cache", registry=r
        )
        self.prompt_tokens_computed = Counter(
            "lightllm_prompt_tokens_computed", "Prompt tokens prefilled (not found in the prompt cache)", registry=r
        )
        self.prompt_cache_evicted_tokens = Counter(
            "lightllm_prompt_cache_evicted_tokens", "Tokens evicted from the prompt cache", registry=r
        )
        self.prompt_cache_hit_rate = Gauge(
            "lightllm_prompt_cache_hit_rate", "Share of admitted prompt tokens taken from the prompt cache "
            "(the worker's, since its start)", registry=r
        )
        # the worker's cumulative totals at its last stats message: the counters advance by the increase
        self._cache_totals = PromptCacheTotals()
        self._steps = 0
        self._step_tokens = 0

    def observe_step(self, accept_len: int, draft_confidence: Optional[Sequence[float]] = None) -> None:
        """One request's verify step; ``draft_confidence``: its K drafts' confidences, if reported."""
        for depth, conf in enumerate(draft_confidence or (), start=1):
            self.draft_confidence.labels(str(depth)).observe(conf)
            if accept_len > depth:
                self.draft_depth_accepted.labels(str(depth)).inc()
        self.mtp_accept_len.observe(accept_len)
        self._steps += 1
        self._step_tokens += accept_len

    def observe_worker(self, stats) -> None:
        self.kv_used_tokens.set(stats.kv_used_tokens)
        self.running_reqs.set(stats.running_reqs)
        self.waiting_reqs.set(stats.waiting_reqs)
        self.batch_step_seconds.inc(stats.timing.seconds)
        self.batch_steps.inc(stats.timing.steps)
        self.batch_step_requests.inc(stats.timing.batch_reqs)
        self.decode_step_seconds.inc(stats.timing.decode_seconds)
        self.decode_steps.inc(stats.timing.decode_steps)
        self.decode_step_requests.inc(stats.timing.decode_batch_reqs)
        for batch, clock in stats.timing.decode_by_batch.items():
            label = {DECODE_BATCH_LABEL: str(batch)}
            self.decode_step_seconds_by_batch.labels(**label).inc(clock.seconds)
            self.decode_steps_by_batch.labels(**label).inc(clock.steps)
            self.decode_step_requests_by_batch.labels(**label).inc(clock.reqs)
        self.mixed_step_seconds.inc(stats.timing.mixed_seconds)
        self.mixed_steps.inc(stats.timing.mixed_steps)
        self.mixed_step_decode_requests.inc(stats.timing.mixed_decode_reqs)
        if stats.prompt_cache is not None:  # None: the cache is off, its series stay 0
            self.observe_prompt_cache(stats.prompt_cache)

    def observe_prompt_cache(self, cache) -> None:
        """One ``PromptCacheStats``: the gauges take its values, the counters its totals' increase."""
        self.prompt_cache_tokens.set(cache.cached_tokens)
        self.prompt_cache_hit_rate.set(cache.hit_rate)
        last, self._cache_totals = self._cache_totals, PromptCacheTotals.of(cache)
        self.prompt_cache_hit_tokens.inc(increase(last.hit, self._cache_totals.hit))
        self.prompt_tokens_computed.inc(increase(last.computed, self._cache_totals.computed))
        self.prompt_cache_evicted_tokens.inc(increase(last.evicted, self._cache_totals.evicted))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MergedPage:
    """A collector that yields already merged metric families (``merge_metric_pages``)."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge_metric_pages(pages: Sequence[str]) -> bytes:
    """One /metrics page of several HTTP processes' pages (--httpserver_workers), each sample the
    sum of its values: every process counts its own requests, and only process 0 sets the worker's
    series (gauges included), which the others leave at 0. ``_created`` takes the earliest, and the
    mean committed tokens per step is the merged accept-length histogram's sum over its count."""
    merged = {}  # family name -> (family, {(sample name, labels): value})
    for page in pages:
        for fam in text_string_to_metric_families(page):
            _, values = merged.setdefault(fam.name, (fam, {}))
            for sample in fam.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = values.get(key)
                if old is None:
                    values[key] = sample.value
                else:
                    values[key] = min(old, sample.value) if sample.name.endswith("_created") else old + sample.value
    accept = merged.get("lightllm_mtp_accept_len")
    if accept is not None and "lightllm_mtp_mean_tokens_per_step" in merged:
        count = accept[1].get(("lightllm_mtp_accept_len_count", ()), 0.0)
        total = accept[1].get(("lightllm_mtp_accept_len_sum", ()), 0.0)
        merged["lightllm_mtp_mean_tokens_per_step"][1][("lightllm_mtp_mean_tokens_per_step", ())] = (
            total / count if count else 0.0)
    families = []
    for fam, values in merged.values():
        out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        out.samples = [Sample(name, dict(labels), value) for (name, labels), value in values.items()]
        families.append(out)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedPage(families))
    return generate_latest(registry)


class SharedMetricsPage:
    """/metrics of several HTTP processes (--httpserver_workers): each writes its own page into a
    directory they share (``publish``, every METRICS_PUBLISH_S and at exit), and any process
    answers a scrape with its own page now merged with the others' last ones, so a page is at most
    METRICS_PUBLISH_S behind for the other processes' requests (prometheus_client's multiprocess
    mode shares values the same way, through files)."""

    def __init__(self, metrics: "ServerMetrics", directory: str, index: int):
        self.metrics = metrics
        self.directory = directory
        self.path = os.path.join(directory, f"http_{index}{PAGE_SUFFIX}")

    def publish(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(self.metrics.render())
        os.replace(tmp, self.path)  # readers see a whole page, old or new

    def render(self) -> bytes:
        pages = [self.metrics.render().decode()]
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if name.endswith(PAGE_SUFFIX) and path != self.path:
                try:
                    with open(path) as f:
                        pages.append(f.read())
                except FileNotFoundError:  # replaced between listing and reading
                    continue
        return merge_metric_pages(pages)


class RequestClock:
    """The serving latencies of one request, measured as vLLM v1 measures them (its
    ``IterationStats``), each against one clock only:

    - time to first token: HTTP receipt (``arrival``) to the HTTP process reading the update with
      the first token off the worker queue, both on the HTTP process's ``time.monotonic()``;
    - inter-token latency: between two consecutive updates of the request that carry tokens, the
      router's send timestamps (``WorkerStats.sent_at``, the router's clock; vLLM: the engine
      core's timestamp of the outputs). One observation per update, however many tokens it
      carries: an MTP step that commits 3 tokens is one gap, as vLLM observes one gap per
      iteration of a speculative step. Without MTP that is one per output token after the first
      (count = generation tokens - requests); with MTP, (generation tokens - requests) / count is
      the mean tokens a decode step gave one request;
    - queue time: the router's own measure (``ReqStepUpdate.queue_time_s``), once per request;
    - end to end: HTTP receipt to the finished result (``finished``), on the HTTP clock.
    """

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self._queued = False  # queue time observed
        self._last_sent_at: Optional[float] = None  # router timestamp of the last update with tokens

    def on_update(self, u, sent_at: float, received: float) -> None:
        """One of the request's updates: sent by the router at ``sent_at`` (its clock), read by the
        HTTP process at ``received`` (this clock)."""
        if u.queue_time_s is not None and not self._queued:
            self._queued = True
            self.metrics.queue_time.observe(max(u.queue_time_s, 0.0))
        if not u.token_ids:
            return
        if self._last_sent_at is None:
            self.metrics.ttft.observe(max(received - self.arrival, 0.0))
        else:
            self.metrics.inter_token_latency.observe(max(sent_at - self._last_sent_at, 0.0))
        self._last_sent_at = sent_at

    def finished(self, now: float) -> float:
        """The request finished (any finish reason) at ``now`` (this clock); returns its latency."""
        latency = max(now - self.arrival, 0.0)
        self.metrics.e2e_latency.observe(latency)
        self.metrics.request_latency.observe(latency)
        return latency


class ThroughputLog:
    """What the periodic throughput line reports: tokens per second since the last line, the
    running and waiting requests and the KV in use (the latest worker stats), and MTP's committed
    tokens per request per decode step. Fed by the HTTP server's worker reader (``observe``,
    ``add_prompt``); ``line()`` is None while idle (nothing happened since the last line)."""

    def __init__(self, kv_capacity_tokens: int, mtp: bool = False, clock=time.monotonic, source: str = ""):
        self.kv_capacity_tokens = kv_capacity_tokens
        self.mtp = mtp  # report MTP tokens/step (a server with --mtp_mode)
        self.source = source  # whose requests the tokens are ("": all; --httpserver_workers: one process's)
        self._clock = clock
        self._since = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._verify_steps = 0  # request decode steps that verified drafts (accept_len > 0)
        self._verify_tokens = 0
        self._running = self._waiting = self._kv_used = 0

    def add_prompt(self, tokens: int) -> None:
        self._prompt_tokens += tokens

    def observe(self, updates, stats) -> None:
        for u in updates:
            self._generation_tokens += len(u.token_ids)
            if u.accept_len:
                self._verify_steps += 1
                self._verify_tokens += u.accept_len
        self._running, self._waiting, self._kv_used = stats.running_reqs, stats.waiting_reqs, stats.kv_used_tokens

    def line(self) -> Optional[str]:
        """The line for the time since the previous one (and start a new period); None when idle."""
        now = self._clock()
        elapsed = max(now - self._since, 1e-9)
        busy = self._prompt_tokens or self._generation_tokens or self._running or self._waiting
        if not busy:
            self._since = now
            return None
        kv_share = 100.0 * self._kv_used / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0
        text = (f"throughput{' of ' + self.source if self.source else ''}: prompt {self._prompt_tokens / elapsed:.1f} tokens/s, "
                f"generation {self._generation_tokens / elapsed:.1f} tokens/s, running {self._running} reqs, "
                f"waiting {self._waiting} reqs, KV {self._kv_used}/{self.kv_capacity_tokens} tokens "
                f"({kv_share:.1f}%)")
        if self.mtp and self._verify_steps:
            text += f", MTP {self._verify_tokens / self._verify_steps:.2f} tokens/step"
        self._since = now
        self._prompt_tokens = self._generation_tokens = self._verify_steps = self._verify_tokens = 0
        return text

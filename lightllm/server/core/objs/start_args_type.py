"""Server start-up arguments (LightLLM's StartArgs), parsed once and never mutated after validation."""
from dataclasses import dataclass, field
from typing import List, Optional

# "dspark": one block draft pass (docs/dspark.md); the others: DeepSeek-V3-style MTP depths
MTP_MODES = ("vanilla_with_att", "eagle_with_att", "vanilla_no_att", "eagle_no_att", "dspark")
# Prompt tokens one step prefills by default: short steps, so a long prompt never holds the others
# for long (vLLM's max_num_batched_tokens and SGLang's chunked_prefill_size for online serving).
DEFAULT_BATCH_MAX_TOKENS = 2048



@dataclass
class StartArgs:
    model_dir: Optional[str] = None  # None: the embedded SmolLM2-135M-Instruct
    model_name: Optional[str] = None  # OpenAI's ``model`` this server answers to; None: model_dir's basename
    host: str = "127.0.0.1"
    port: int = 8000
    max_total_token_num: Optional[int] = None  # KV pool size in tokens; None: sized from free memory
    running_max_req_size: int = 64
    max_req_total_len: int = 4096  # prompt + new tokens of one request
    batch_max_tokens: Optional[int] = DEFAULT_BATCH_MAX_TOKENS  # prompt tokens per step (chunked prefill); None: max_req_total_len
    # of those, in a step that also decodes; None: batch_max_tokens (512 measured on the H200: ITL p99 / p50 3.9x
    # against 4.9-5.8x, but 0.77-0.87x tok/s; docs/decode_step.md, "Mixed steps")
    mixed_max_prefill_tokens: Optional[int] = None
    # > 0: a mixed step takes about 1 / N of the prompt tokens left to prefill (at least PACED_MIN_PREFILL_TOKENS, at
    # most the budget above), so a long prompt's chunks spread over N steps instead of a few full ones (0: off)
    mixed_prefill_pace_steps: int = 0
    # while requests decode, admit waiting ones after this many decode steps (docs/decode_step.md, "Grouped admission";
    # 1 since the forty-first session's sweep: mixed MTP steps left in flight made each admission cheap)
    router_max_wait_tokens: int = 1
    # waiting requests join the step after the one launched ahead of the commit, so a finish never leaves the GPU
    # idle through admission (docs/decode_step.md, "Admission behind the step in flight")
    router_admit_behind_step: bool = False
    data_type: Optional[str] = None  # None: bfloat16 on CUDA, float32 on CPU
    # MTP speculative decoding
    mtp_mode: Optional[str] = None
    mtp_step: int = 0
    mtp_draft_model_dir: Optional[List[str]] = None
    # ASD: approximate acceptance for greedy MTP verification
    mtp_asd_regret_budget: Optional[float] = None
    mtp_asd_local_regret_ratio: Optional[float] = None
    mtp_asd_block_max_mismatch: Optional[int] = None
    # Several GPUs / processes (docs/parallel.md)
    tp: int = 1  # tensor parallel ranks in all (one process each; one GPU each on CUDA)
    dp: int = 1  # data parallel groups; divides tp; attention is tensor parallel over tp / dp ranks
    enable_decode_microbatch_overlap: bool = False  # two decode micro-batches, interleaved forwards
    nnodes: int = 1  # hosts the tp ranks are spread over (tp / nnodes each)
    node_rank: int = 0  # this host's index; node 0 serves HTTP and hosts rank 0
    nccl_host: str = "127.0.0.1"  # address of node 0, where the ranks meet
    nccl_port: int = 28765  # port on nccl_host for the process-group rendezvous
    # CUDA graph decode (LightLLM's flags): the ladder of captured batch sizes, in requests
    graph_max_batch_size: int = 256  # largest captured batch (capped at running_max_req_size)
    graph_split_batch_size: int = 32  # powers of two below it, then steps of graph_grow_step_size
    graph_grow_step_size: int = 16
    disable_cudagraph: bool = False  # eager decode (same padding, the bit-exact reference)
    enable_tp_cudagraph: bool = False  # graphs with --tp > 1 (NCCL collectives captured; DP: decode only); not yet run on GPUs
    disable_mixed_steps: bool = False  # alternate prefill and decode steps instead of mixing them
    disable_dynamic_prompt_cache: bool = False  # prefill every prompt from token 0 (no radix prompt cache)
    graph_max_prefill_tokens: int = DEFAULT_BATCH_MAX_TOKENS  # CUDA: chunks up to this many tokens run as graph rows
    disable_overlap_schedule: bool = False  # one rank: commit each decode step before launching the next
    enable_deterministic_inference: bool = False  # batch-invariant kernels (CUDA): same tokens in any batch
    load_format: str = "auto"  # one of lightllm.common.constants.LOAD_FORMATS
    # HTTP connections (uvicorn; docs/limits.md, "Connections")
    timeout_keep_alive: float = 5.0  # s an idle kept-alive connection waits for its next request (uvicorn's)
    timeout_request_header: float = 30.0  # s to send a request's headers, from connecting or the last response
    timeout_request_body: float = 60.0  # s from a request's headers to the end of its body, else 408
    timeout_graceful_shutdown: float = 30.0  # s in-flight requests get to finish after SIGTERM, then 503
    limit_concurrency: int = 1024  # open connections (or running requests) past which new requests get 503
    backlog: int = 2048  # connections the kernel queues before they are accepted (listen backlog)
    http: str = "auto"  # HTTP/1.1 parser (uvicorn's --http): auto (httptools when installed), h11 or httptools
    loop: str = "auto"  # the HTTP server's event loop (uvicorn's --loop): auto (uvloop when installed), asyncio or uvloop
    stream_interval: int = 1  # a stream sends a chunk once this many tokens arrived (SGLang's flag)
    httpserver_workers: int = 1  # HTTP server processes sharing the port (LightLLM's flag; docs/limits.md)
    # Logging (vLLM's flag names)
    disable_log_requests: bool = False  # no log line per request (method, route, status, tokens, ms)
    disable_log_stats: bool = False  # no periodic throughput line while busy
    # Resolved during validation (never set by users)
    resolved_model_dir: Optional[str] = field(default=None, repr=False)

    @property
    def asd_enabled(self) -> bool:
        return self.mtp_asd_regret_budget is not None

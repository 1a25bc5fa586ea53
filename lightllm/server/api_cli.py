"""Every server flag, with help text (LightLLM names), in groups; `--help` shows every default."""
import argparse

from lightllm.common.constants import (DATA_TYPE_ALIASES, DATA_TYPES, HTTP_IMPLEMENTATIONS, LOAD_FORMATS,
                                       LOOP_IMPLEMENTATIONS, MAX_MTP_STEP, canonical_data_type)
from lightllm.server.core.objs.start_args_type import MTP_MODES, StartArgs


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default: "(default: ...)"; None reads "(default: none)"."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return text + (" (default: none)" if action.default is None else " (default: %(default)s)")


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line, as every other start-up error (not the usage block above it); a flag must be
    spelt out (no silent abbreviations: --batch is not --batch_max_tokens)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (--help lists every flag)\n")


def make_argument_parser() -> argparse.ArgumentParser:
    d = StartArgs()
    top = _Parser(prog="python -m lightllm.server.api_server", description="LightLLM-shaped LLM server",
                  formatter_class=_HelpFormatter)
    p = top.add_argument_group("model", "What is served and how it is loaded.")
    p.add_argument("--model_dir", type=str, default=d.model_dir,
                   help="Hugging Face model dir (config.json + safetensors, a llama or qwen3 model). "
                        "none: the embedded SmolLM2-135M-Instruct (converted from its GGUF on the first start).")
    p.add_argument("--model_name", type=str, default=d.model_name,
                   help="The name OpenAI clients send as `model` (others get a 404) and /v1/models lists; "
                        "none: the model dir's basename.")
    p.add_argument("--data_type", type=canonical_data_type, default=d.data_type, choices=DATA_TYPES,
                   help="Weights and KV dtype; also " + ", ".join(f"{a} ({n})" for a, n in DATA_TYPE_ALIASES.items())
                        + ". none: bfloat16 on CUDA, float32 on CPU.")
    p.add_argument("--load_format", type=str, default=d.load_format, choices=LOAD_FORMATS,
                   help="auto: the model dir's safetensors; dummy: random weights for its config.json "
                        "(benchmark a model shape without its weights; the dir needs config.json and a tokenizer).")
    p = top.add_argument_group("server", "The HTTP server and its log.")
    p.add_argument("--host", type=str, default=d.host, help="Address to listen on (0.0.0.0: every interface).")
    p.add_argument("--port", type=int, default=d.port,
                   help="HTTP port; taken before the model starts (a port in use fails at once).")
    p.add_argument("--stream_interval", type=int, default=d.stream_interval,
                   help="SGLang's flag: a streamed response sends a chunk once this many tokens arrived since "
                        "its last one (the first tokens and the end at once). 1: every decode step. Larger "
                        "values cost the HTTP process less per token, and each chunk carries more tokens.")
    p.add_argument("--disable_log_requests", action="store_true", default=d.disable_log_requests,
                   help="No log line per request (method, route, status, prompt and output tokens, ms).")
    p.add_argument("--disable_log_stats", action="store_true", default=d.disable_log_stats,
                   help="No throughput line every few seconds while busy (tokens/s, running and waiting "
                        "requests, KV use, MTP tokens/step).")
    p = top.add_argument_group("scheduling", "Requests, lengths and the KV cache.")
    p.add_argument("--max_total_token_num", type=int, default=d.max_total_token_num,
                   help="KV cache pool size in tokens. none: sized from free memory.")
    p.add_argument("--running_max_req_size", type=int, default=d.running_max_req_size,
                   help="Most requests running at once.")
    p.add_argument("--max_req_total_len", type=int, default=d.max_req_total_len,
                   help="Most prompt + generated tokens of one request (the model's max_position_embeddings "
                        "caps it too: /v1/models' max_model_len is the smaller).")
    p.add_argument("--batch_max_tokens", type=int, default=d.batch_max_tokens,
                   help="Most prompt tokens prefilled in one step (chunked prefill's chunk budget; "
                        "decode rows come on top). Mixed steps take at most --graph_max_prefill_tokens of them "
                        "on CUDA with graphs.")
    p.add_argument("--mixed_max_prefill_tokens", type=int, default=d.mixed_max_prefill_tokens,
                   help="Most prompt tokens in a step that also decodes the running requests (a mixed step): "
                        "every stream waits for that step, so this bounds the inter-token latency while prompts "
                        "are prefilled; a step with nothing to decode takes up to --batch_max_tokens. At most "
                        "--batch_max_tokens; none: --batch_max_tokens.")
    p.add_argument("--mixed_prefill_pace_steps", type=int, default=d.mixed_prefill_pace_steps,
                   help="N > 0: a mixed step takes about 1/N of the prompt tokens left to prefill (at least 256, at "
                        "most --mixed_max_prefill_tokens), so a long prompt is spread over about N steps that all "
                        "cost alike instead of a few full ones; 0: every mixed step takes the whole budget "
                        "(default: %(default)s).")
    p.add_argument("--router_max_wait_tokens", type=int, default=d.router_max_wait_tokens,
                   help="While requests are decoding, admit waiting requests only once this many decode steps "
                        "have run since the last admission (LightLLM's flag), so arrivals join in groups and "
                        "share one mixed step; at once when nothing decodes or a prompt is being prefilled "
                        "anyway; 0: admit at every step (default: %(default)s).")
    p.add_argument("--router_admit_behind_step", action="store_true", default=d.router_admit_behind_step,
                   help="Launch the step after the one in flight before its commit even while requests wait, and "
                        "admit them into the step after that one: a finish no longer leaves the GPU idle while "
                        "the host commits and admits (inter-token latency), at the cost of one step of time to "
                        "first token for the requests that join.")
    p.add_argument("--disable_dynamic_prompt_cache", action="store_true", default=d.disable_dynamic_prompt_cache,
                   help="Prefill every prompt from token 0. By default the KV of prompts (and outputs) already "
                        "seen is kept in a radix tree and a new prompt prefills only what follows its longest "
                        "cached prefix (LightLLM's dynamic prompt cache; off with --dp above 1; "
                        "docs/prompt_cache.md).")
    p = top.add_argument_group("MTP / ASD", "Speculative decoding with draft modules, and ASD's approximate "
                                            "acceptance (docs/asd.md).")
    p.add_argument("--mtp_mode", type=str, default=d.mtp_mode, choices=MTP_MODES,
                   help="MTP speculative decoding mode. none: off.")
    p.add_argument("--mtp_step", type=int, default=d.mtp_step,
                   help=f"Draft tokens per decode step (K): 1..{MAX_MTP_STEP} with --mtp_mode (dspark: at most its "
                        f"block size - 1, 3 for the packaged draft); 0 without.")
    p.add_argument("--mtp_draft_model_dir", type=str, nargs="+", default=d.mtp_draft_model_dir,
                   help="Draft module dir(s): vanilla chains K modules, eagle reuses one. none: the packaged "
                        "draft of the embedded model for eagle_with_att / dspark.")
    p.add_argument("--mtp_asd_regret_budget", type=float, default=d.mtp_asd_regret_budget,
                   help="ASD: per-request total regret budget B (unset: strict verification; 0: strict via ASD path).")
    p.add_argument("--mtp_asd_local_regret_ratio", type=float, default=d.mtp_asd_local_regret_ratio,
                   help="ASD: local cap g on regret / suffix value (unset: no local gate).")
    p.add_argument("--mtp_asd_block_max_mismatch", type=int, default=d.mtp_asd_block_max_mismatch,
                   help="ASD: most relaxed tokens per verify step m (unset: no cap).")
    p = top.add_argument_group("parallel", "Several GPUs, processes or hosts (docs/parallel.md).")
    p.add_argument("--tp", type=int, default=d.tp,
                   help="Tensor parallel ranks: one worker process each (one GPU each on CUDA; gloo on CPU).")
    p.add_argument("--dp", type=int, default=d.dp,
                   help="Data parallel groups (must divide --tp): each group runs its own requests and KV cache "
                        "with attention split over tp / dp ranks; the MLP stays split over all tp ranks.")
    p.add_argument("--enable_decode_microbatch_overlap", action="store_true",
                   default=d.enable_decode_microbatch_overlap,
                   help="Split each decode batch in two micro-batches whose forwards interleave, so one's "
                        "communication overlaps the other's compute (uses the DP backend, also with --dp 1).")
    p = top.add_argument_group("graphs", "CUDA graphs and the decode step (docs/decode_step.md).")
    p.add_argument("--graph_max_batch_size", type=int, default=d.graph_max_batch_size,
                   help="CUDA graph decode: largest captured batch, in requests (capped at --running_max_req_size); "
                        "larger batches decode eagerly.")
    p.add_argument("--graph_split_batch_size", type=int, default=d.graph_split_batch_size,
                   help="CUDA graph ladder: powers of two below this size, then this size and every "
                        "--graph_grow_step_size after it up to --graph_max_batch_size.")
    p.add_argument("--graph_grow_step_size", type=int, default=d.graph_grow_step_size,
                   help="CUDA graph ladder step above --graph_split_batch_size.")
    p.add_argument("--disable_cudagraph", action="store_true", default=d.disable_cudagraph,
                   help="Decode eagerly (same padding to the ladder, so outputs are identical to graph decoding).")
    p.add_argument("--enable_tp_cudagraph", action="store_true", default=d.enable_tp_cudagraph,
                   help="CUDA graphs also with --tp > 1: every rank captures the same graphs, the NCCL collectives "
                        "inside them (with --dp > 1 the decode ladder only; docs/parallel.md). Off by default until it "
                        "has run on several GPUs; without it (and always with micro-batch overlap) such ranks decode "
                        "eagerly.")
    p.add_argument("--graph_max_prefill_tokens", type=int, default=d.graph_max_prefill_tokens,
                   help="CUDA, where graphs run (one rank, or --enable_tp_cudagraph): a prefill step of at most this "
                        "many new tokens runs as decode rows "
                        "from a CUDA graph (captured for powers of two up to it); longer ones run the prefill "
                        "forward. 0: never. With --disable_cudagraph the same rows run eagerly.")
    p.add_argument("--disable_mixed_steps", action="store_true", default=d.disable_mixed_steps,
                   help="Run prefill chunks in steps of their own, alternating with decode steps, instead of in "
                        "the same forward as every running request's decode rows (docs/decode_step.md).")
    p.add_argument("--disable_overlap_schedule", action="store_true", default=d.disable_overlap_schedule,
                   help="One rank: launch each decode step only after the host has committed the previous one. "
                        "By default the next step of the same requests is launched first, so the commit and "
                        "scheduling run while the GPU decodes (with MTP too; its mixed steps stay step by step); "
                        "outputs are the same either way.")
    p.add_argument("--enable_deterministic_inference", action="store_true", default=d.enable_deterministic_inference,
                   help="CUDA: batch-invariant kernels (SGLang's flag), so a request's tokens do not depend on the "
                        "rest of its batch and strict MTP is token-identical to plain decoding in bf16; slower.")
    http = top.add_argument_group("HTTP connections", "Timeouts and limits of the HTTP server (docs/limits.md).")
    http.add_argument("--timeout_keep_alive", type=float, default=d.timeout_keep_alive,
                      help="Seconds an idle kept-alive connection may wait for its next request before it is "
                           "closed (uvicorn's).")
    http.add_argument("--timeout_request_header", type=float, default=d.timeout_request_header,
                      help="Seconds a connection has to send a request's headers, counted from connecting or from "
                           "the previous response; then it is closed (idle and slow-header connections).")
    http.add_argument("--timeout_request_body", type=float, default=d.timeout_request_body,
                      help="Seconds from a request's headers to the end of its body; a slower or stalled upload "
                           "gets a 408 and the connection is closed. (8 MiB at 140 KB/s.)")
    http.add_argument("--timeout_graceful_shutdown", type=float, default=d.timeout_graceful_shutdown,
                      help="On SIGTERM / SIGINT the server stops accepting connections and reading bodies; "
                           "in-flight requests get this many seconds to finish, then they fail with 503 and the "
                           "server exits (a second signal fails them at once).")
    http.add_argument("--limit_concurrency", type=int, default=d.limit_concurrency,
                      help="Most open connections (and running requests) at once; past it new requests get 503 "
                           "(uvicorn's limit_concurrency).")
    http.add_argument("--backlog", type=int, default=d.backlog,
                      help="Connections the kernel queues before the server accepts them.")
    http.add_argument("--http", type=str, default=d.http, choices=HTTP_IMPLEMENTATIONS,
                      help="The HTTP/1.1 parser (uvicorn's --http): httptools (C, uvicorn[standard]'s) or h11 "
                           "(pure Python); auto takes httptools when it is installed, as uvicorn does. Both keep "
                           "the header deadline and a 16 KiB header bound.")
    http.add_argument("--loop", type=str, default=d.loop, choices=LOOP_IMPLEMENTATIONS,
                      help="The HTTP server's event loop (uvicorn's --loop): uvloop (C, uvicorn[standard]'s) or "
                           "asyncio; auto takes uvloop when it is installed, as uvicorn does.")
    http.add_argument("--httpserver_workers", type=int, default=d.httpserver_workers,
                      help="HTTP server processes sharing the port (LightLLM's flag): each parses, tokenizes, "
                           "detokenizes and streams its own connections, so a busy server's streams do not wait "
                           "for one event loop. /metrics adds up every process's counts.")
    p = top.add_argument_group("parallel hosts", "Ranks spread over several hosts (docs/parallel.md).")
    p.add_argument("--nnodes", type=int, default=d.nnodes, help="Hosts the --tp ranks are spread over.")
    p.add_argument("--node_rank", type=int, default=d.node_rank,
                   help="This host's index (0..nnodes-1); node 0 serves HTTP, the others only run ranks.")
    p.add_argument("--nccl_host", type=str, default=d.nccl_host, help="Address of node 0 for the rank rendezvous.")
    p.add_argument("--nccl_port", type=int, default=d.nccl_port, help="Port on --nccl_host for the rank rendezvous.")
    return top

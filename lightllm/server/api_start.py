"""Validate StartArgs, start the model worker process(es), serve HTTP."""
import atexit
import dataclasses
import importlib.util
import json
import math
import multiprocessing as mp
import os
import signal
import sys
from typing import List, Optional, Sequence

from lightllm.common.constants import (DATA_TYPE_ALIASES, DATA_TYPES, HTTP_IMPLEMENTATIONS, LOAD_FORMATS,
                                       LOOP_IMPLEMENTATIONS, MAX_MTP_STEP, canonical_data_type)
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.utils.signals import signal_handlers

WORKER_START_TIMEOUT_S = 900
# Seconds the worker processes get to exit once told to (then they are killed)
WORKER_EXIT_TIMEOUT_S = 10.0
# Worker processes leave these to the API server: a signal sent to the whole process group
# (Ctrl-C in a terminal, a supervisor that signals every process) must not end them while the
# server lets its in-flight requests finish. The server stops them (None on their queue), and
# they end with it if it dies (router.manager.exit_with_parent).
WORKER_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The log's format, set up before anything can log (the first start converts the embedded model)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# File descriptors kept free beyond --limit_concurrency connections (model files, pipes, logs)
SPARE_FILE_DESCRIPTORS = 256
# Most HTTP server processes (--httpserver_workers): each holds a tokenizer and a queue the router feeds
MAX_HTTPSERVER_WORKERS = 64


class StartArgsError(ValueError):
    """A bad flag value; the message names the flag."""


def _need(cond: bool, flag: str, msg: str) -> None:
    if not cond:
        raise StartArgsError(f"{flag}: {msg}")


def _validate_listen(args: StartArgs) -> None:
    """The flags the HTTP socket needs (checked, and the port taken, before the model is resolved: a first start
    converts the embedded model)."""
    _need(1 <= args.port <= 65535, "--port", f"must be in 1..65535, got {args.port}")
    _validate_http(args)


def validate_start_args(args: StartArgs) -> StartArgs:
    """Check every flag; return a copy with defaults resolved (model dir, dtype)."""
    _validate_listen(args)
    _need(args.running_max_req_size >= 1, "--running_max_req_size", f"must be >= 1, got {args.running_max_req_size}")
    _need(args.max_req_total_len >= 2, "--max_req_total_len", f"must be >= 2, got {args.max_req_total_len}")
    if args.max_total_token_num is not None:
        _need(args.max_total_token_num >= 1, "--max_total_token_num", f"must be >= 1, got {args.max_total_token_num}")
    if args.batch_max_tokens is not None:
        _need(args.batch_max_tokens >= 1, "--batch_max_tokens", f"must be >= 1, got {args.batch_max_tokens}")
    if args.mixed_max_prefill_tokens is not None:
        budget = args.batch_max_tokens or args.max_req_total_len
        _need(1 <= args.mixed_max_prefill_tokens <= budget, "--mixed_max_prefill_tokens",
              f"must be in 1..--batch_max_tokens ({budget}): a mixed step is a step, got {args.mixed_max_prefill_tokens}")
    _need(args.mixed_prefill_pace_steps >= 0, "--mixed_prefill_pace_steps",
          f"must be >= 0, got {args.mixed_prefill_pace_steps}")
    _need(args.router_max_wait_tokens >= 0, "--router_max_wait_tokens",
          f"must be >= 0, got {args.router_max_wait_tokens}")
    for flag in ("graph_max_batch_size", "graph_split_batch_size", "graph_grow_step_size"):
        _need(getattr(args, flag) >= 1, f"--{flag}", f"must be >= 1, got {getattr(args, flag)}")
    _need(args.graph_max_prefill_tokens >= 0, "--graph_max_prefill_tokens",
          f"must be >= 0, got {args.graph_max_prefill_tokens}")
    data_type = None if args.data_type is None else canonical_data_type(args.data_type)
    _need(data_type is None or data_type in DATA_TYPES, "--data_type",
          f"must be one of {', '.join(DATA_TYPES + tuple(DATA_TYPE_ALIASES))}, got {args.data_type!r}")
    _need(args.model_name is None or (isinstance(args.model_name, str) and args.model_name.strip() != ""),
          "--model_name", f"must be a non-empty string, got {args.model_name!r}")
    _need(args.load_format in LOAD_FORMATS, "--load_format",
          f"must be one of {', '.join(LOAD_FORMATS)}, got {args.load_format!r}")
    _need(args.load_format != "dummy" or args.model_dir is not None, "--load_format",
          "dummy needs --model_dir (a dir with the config.json and tokenizer of the shape to build)")
    _validate_mtp(args)
    _validate_asd(args)
    _validate_parallel(args)
    if args.enable_deterministic_inference:
        _need(resolve_device_and_dtype(args)[0] == "cuda", "--enable_deterministic_inference",
              "needs a CUDA device (its kernels are Triton); CPU decoding is fp32 torch")
    if args.model_dir is not None:
        _need(os.path.isfile(os.path.join(args.model_dir, "config.json")), "--model_dir",
              f"{args.model_dir!r} is not a Hugging Face model dir (no config.json)")
        model_dir = args.model_dir
    else:
        from lightllm.utils.embedded_model import get_default_model_dir

        try:
            model_dir = get_default_model_dir()
        except Exception as e:
            raise StartArgsError(f"--model_dir: not given and the embedded model is unavailable: {e}") from None
    from lightllm.models.registry import check_model_type

    try:
        check_model_type(model_dir)
    except ValueError as e:
        raise StartArgsError(f"--model_dir: {model_dir!r}: {e}") from None
    resolved = dataclasses.replace(
        args,
        data_type=data_type,
        resolved_model_dir=model_dir,
        batch_max_tokens=args.batch_max_tokens or args.max_req_total_len,
        mtp_draft_model_dir=_resolve_draft_dirs(args, model_dir),
    )
    _validate_dspark(resolved)
    _validate_heads(resolved)
    _validate_weights(resolved)
    _validate_mtp_drafts(resolved)
    k = resolved.mtp_step
    if resolved.max_total_token_num is not None:
        _need(resolved.max_total_token_num >= resolved.max_req_total_len + k, "--max_total_token_num",
              f"must be >= --max_req_total_len + --mtp_step ({resolved.max_req_total_len + k}), "
              f"got {resolved.max_total_token_num}")
    return resolved


def _validate_mtp(args: StartArgs) -> None:
    if args.mtp_mode is None:
        _need(args.mtp_step == 0, "--mtp_step", "needs --mtp_mode")
        _need(not args.mtp_draft_model_dir, "--mtp_draft_model_dir", "needs --mtp_mode")
        return
    _need(1 <= args.mtp_step <= MAX_MTP_STEP, "--mtp_step",
          f"must be in 1..{MAX_MTP_STEP} with --mtp_mode, got {args.mtp_step}")
    for d in args.mtp_draft_model_dir or []:
        _need(os.path.isfile(os.path.join(d, "config.json")), "--mtp_draft_model_dir",
              f"{d!r} is not a draft model dir (no config.json)")
    if args.mtp_draft_model_dir and args.mtp_mode.startswith("vanilla"):
        n = len(args.mtp_draft_model_dir)
        _need(n in (1, args.mtp_step), "--mtp_draft_model_dir",
              f"vanilla mode chains --mtp_step ({args.mtp_step}) modules: give 1 or {args.mtp_step} dirs, got {n}")
    if args.mtp_draft_model_dir and args.mtp_mode.startswith(("eagle", "dspark")):
        _need(len(args.mtp_draft_model_dir) == 1, "--mtp_draft_model_dir",
              f"{args.mtp_mode} mode uses one draft: give exactly 1 dir, got {len(args.mtp_draft_model_dir)}")


def _validate_mtp_drafts(args: StartArgs) -> None:
    """Eagle / vanilla draft dirs: MTP drafts whose attention fits --mtp_mode, of the target's width and vocabulary
    (before: the worker found out, after loading the target)."""
    if args.mtp_mode is None or args.mtp_mode == "dspark":
        return
    from lightllm.models.llama_mtp.model import MTPDraftConfig

    with open(os.path.join(args.resolved_model_dir, "config.json")) as f:
        target = json.load(f)
    with_att = args.mtp_mode.endswith("_with_att")
    for d in args.mtp_draft_model_dir:
        try:
            cfg = MTPDraftConfig.load(d)
        except (ValueError, TypeError, KeyError) as e:
            raise StartArgsError(f"--mtp_draft_model_dir: {d!r} is not an MTP draft: {e}") from None
        _need(cfg.with_attention == with_att, "--mtp_draft_model_dir",
              f"{d!r} has with_attention={cfg.with_attention}, which does not fit --mtp_mode {args.mtp_mode}")
        for key in ("hidden_size", "vocab_size"):
            _need(target.get(key) in (None, getattr(cfg, key)), "--mtp_draft_model_dir",
                  f"{d!r} has {key} {getattr(cfg, key)}, the target model {target.get(key)}")


def _validate_dspark(args: StartArgs) -> None:
    """A dspark draft dir, K within its block, one rank."""
    if args.mtp_mode != "dspark":
        return
    from lightllm.models.dspark.config import DSparkConfig

    d = args.mtp_draft_model_dir[0]
    try:
        cfg = DSparkConfig.load(d)
    except (ValueError, TypeError, KeyError) as e:
        raise StartArgsError(f"--mtp_draft_model_dir: {d!r} is not a dspark draft: {e}") from None
    _need(args.mtp_step <= cfg.max_mtp_step, "--mtp_step",
          f"must be <= block_size - 1 = {cfg.max_mtp_step} for the dspark draft {d!r}, got {args.mtp_step}")
    _need(args.tp == 1 and args.dp == 1, "--tp", f"--mtp_mode dspark runs on one rank (--tp 1 --dp 1), got --tp {args.tp}")


def _validate_weights(args: StartArgs) -> None:
    """The model dir (unless --load_format dummy) and every draft dir hold their weights."""
    from lightllm.common.basemodel.layer_weights.hf_load_utils import missing_weights

    dirs = [] if args.load_format == "dummy" else [("--model_dir", args.resolved_model_dir)]
    dirs += [("--mtp_draft_model_dir", d) for d in args.mtp_draft_model_dir or []]
    for flag, d in dirs:
        why = missing_weights(d)
        _need(why is None, flag, f"{d!r} {why}")


# Files one of which a Hugging Face tokenizer loads from (fast tokenizer, sentencepiece, BPE / WordPiece vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _validate_tokenizer(args: StartArgs) -> None:
    """The model dir holds a tokenizer: the HTTP side loads it once the model is up, so a server checks it before
    (the worker alone, as tests and tools start it, needs none)."""
    d = args.resolved_model_dir
    _need(any(os.path.isfile(os.path.join(d, f)) for f in TOKENIZER_FILES), "--model_dir",
          f"{d!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): prompts are tokenized with the "
          f"model's own")


def _resolve_draft_dirs(args: StartArgs, model_dir: str):
    if args.mtp_mode is None or args.mtp_draft_model_dir:
        return args.mtp_draft_model_dir
    from lightllm.utils.embedded_model import default_draft_dir_for

    draft = default_draft_dir_for(model_dir, args.mtp_mode)
    _need(draft is not None, "--mtp_draft_model_dir",
          f"required for --mtp_mode {args.mtp_mode} with this model (no default draft exists for it)")
    return [draft]


def _validate_asd(args: StartArgs) -> None:
    flags = {
        "--mtp_asd_regret_budget": args.mtp_asd_regret_budget,
        "--mtp_asd_local_regret_ratio": args.mtp_asd_local_regret_ratio,
        "--mtp_asd_block_max_mismatch": args.mtp_asd_block_max_mismatch,
    }
    for flag, v in flags.items():
        if v is None:
            continue
        _need(args.mtp_mode is not None, flag, "needs an enabled --mtp_mode")
        _need(not isinstance(v, bool) and isinstance(v, (int, float)), flag, f"must be a number, got {v!r}")
        _need(math.isfinite(v), flag, f"must be finite, got {v}")
        _need(v >= 0, flag, f"must be >= 0, got {v}")
    m = args.mtp_asd_block_max_mismatch
    _need(m is None or (isinstance(m, int) and not isinstance(m, bool)), "--mtp_asd_block_max_mismatch",
          f"must be an integer, got {m!r}")
    if args.mtp_asd_regret_budget is None:
        for flag in ("--mtp_asd_local_regret_ratio", "--mtp_asd_block_max_mismatch"):
            _need(flags[flag] is None, flag, "needs --mtp_asd_regret_budget (ASD is off without a budget)")


def httptools_installed() -> bool:
    return importlib.util.find_spec("httptools") is not None


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


HTTP_TIMEOUT_FLAGS = ("timeout_keep_alive", "timeout_request_header", "timeout_request_body",
                      "timeout_graceful_shutdown")


def _validate_http(args: StartArgs) -> None:
    for flag in HTTP_TIMEOUT_FLAGS:
        v = getattr(args, flag)
        _need(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0, f"--{flag}",
              f"must be a number of seconds > 0, got {v!r}")
    for flag in ("limit_concurrency", "backlog", "stream_interval", "httpserver_workers"):
        v = getattr(args, flag)
        _need(not isinstance(v, bool) and isinstance(v, int) and v >= 1, f"--{flag}", f"must be an integer >= 1, got {v!r}")
    _need(args.httpserver_workers <= MAX_HTTPSERVER_WORKERS, "--httpserver_workers",
          f"must be <= {MAX_HTTPSERVER_WORKERS}, got {args.httpserver_workers}")
    _need(args.http in HTTP_IMPLEMENTATIONS, "--http", f"must be one of {', '.join(HTTP_IMPLEMENTATIONS)}, got {args.http!r}")
    _need(args.http != "httptools" or httptools_installed(), "--http",
          "httptools is not installed (pip install httptools, or --http h11)")
    _need(args.loop in LOOP_IMPLEMENTATIONS, "--loop", f"must be one of {', '.join(LOOP_IMPLEMENTATIONS)}, got {args.loop!r}")
    _need(args.loop != "uvloop" or uvloop_installed(), "--loop", "uvloop is not installed (pip install uvloop, or --loop asyncio)")


def _validate_parallel(args: StartArgs) -> None:
    for flag, v in (("--tp", args.tp), ("--dp", args.dp), ("--nnodes", args.nnodes)):
        _need(not isinstance(v, bool) and isinstance(v, int) and v >= 1, flag, f"must be an integer >= 1, got {v!r}")
    _need(args.tp % args.dp == 0, "--dp", f"must divide --tp ({args.tp}), got {args.dp}")
    _need(args.tp % args.nnodes == 0, "--nnodes",
          f"must divide --tp ({args.tp}): every node runs --tp / --nnodes ranks, got {args.nnodes}")
    _need(0 <= args.node_rank < args.nnodes, "--node_rank", f"must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    _need(1 <= args.nccl_port <= 65535, "--nccl_port", f"must be in 1..65535, got {args.nccl_port}")
    if args.tp > 1:
        _need(args.nccl_port != args.port, "--nccl_port", f"must differ from --port ({args.port})")


def _read_heads(config_path: str):
    """(num_attention_heads, num_key_value_heads) of a config.json, or None when it has no heads."""
    with open(config_path) as f:
        cfg = json.load(f)
    q = cfg.get("num_attention_heads")
    if q is None:
        return None
    return q, cfg.get("num_key_value_heads") or q


def _validate_heads(args: StartArgs) -> None:
    """Attention heads are split over the --tp / --dp ranks of a DP group: q and kv heads
    of the model (and of draft modules with attention) must divide evenly."""
    attn_tp = args.tp // args.dp
    if attn_tp == 1:
        return
    dirs = [("the model", args.resolved_model_dir)]
    if args.mtp_mode is not None and args.mtp_mode.endswith("_with_att"):
        dirs += [("draft " + d, d) for d in args.mtp_draft_model_dir or []]
    for what, d in dirs:
        heads = _read_heads(os.path.join(d, "config.json"))
        if heads is None:
            continue
        for name, n in zip(("num_attention_heads", "num_key_value_heads"), heads):
            _need(n % attn_tp == 0, "--tp",
                  f"{what} has {name} = {n}, not divisible by --tp / --dp = {attn_tp} (heads are split over them)")


def resolve_device_and_dtype(args: StartArgs):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = canonical_data_type(args.data_type) if args.data_type else ("bfloat16" if device == "cuda" else "float32")
    return device, dtype


class WorkerProcesses:
    """This node's rank processes (router + model worker each), in rank order, and on node 0 the
    queues rank 0 sends updates on (one per HTTP process)."""

    def __init__(self, procs: List[mp.Process], update_queues: Sequence = ()):
        self.procs = procs
        self.update_queues = list(update_queues)

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    @property
    def exitcode(self) -> Optional[int]:
        """The first non-zero exit code, 0 when all exited cleanly, None while any runs."""
        codes = [p.exitcode for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def join(self, timeout: Optional[float] = None) -> None:
        for p in self.procs:
            p.join(timeout)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self.join(timeout=10)

    def stop(self, timeout: float = WORKER_EXIT_TIMEOUT_S) -> None:
        """Wait up to ``timeout`` s for the processes (told to exit) to end, then kill the rest."""
        self.join(timeout)
        if any(p.is_alive() for p in self.procs):
            self.kill()


def _signals_ignored(signals: Sequence[int]):
    """Ignore ``signals`` inside the block; processes spawned in it keep ignoring them (exec keeps
    SIG_IGN, and Python installs no KeyboardInterrupt handler over an ignored SIGINT)."""
    return signal_handlers(signals, signal.SIG_IGN)


def _router_worker(*args) -> None:
    """The rank processes' entry: ``router_worker_main``, imported in the child only, so the
    process that starts the workers (the HTTP server) never imports the engine."""
    from lightllm.server.router.manager import router_worker_main

    router_worker_main(*args)


def start_worker(args: StartArgs, device: Optional[str] = None, dtype: Optional[str] = None):
    """Start this node's ranks (``--tp / --nnodes`` processes, each a router + model worker).

    Returns (workers, in_q, out_q, ready_info). On node 0 rank 0 owns the queues and this
    waits for its WorkerReady; on other nodes the queues and ready_info are None."""
    from lightllm.server.core.objs.messages import WorkerError
    from lightllm.utils.dist_utils import local_ranks

    d, t = resolve_device_and_dtype(args)
    device, dtype = device or d, dtype or t
    ranks = local_ranks(args.tp, args.nnodes, args.node_rank)
    if device == "cuda":
        import torch

        found = torch.cuda.device_count()
        if found < len(ranks):
            raise RuntimeError(f"--tp {args.tp} over --nnodes {args.nnodes} needs {len(ranks)} GPUs on this node, "
                               f"found {found}")
    ctx = mp.get_context("spawn")
    is_driver_node = ranks[0] == 0
    # the requests' queue, and one updates' queue per HTTP process (--httpserver_workers)
    in_q = ctx.Queue() if is_driver_node else None
    out_qs = [ctx.Queue() for _ in range(args.httpserver_workers)] if is_driver_node else [None]
    out_q = out_qs[0]
    if in_q is not None:
        # Our exit never waits to flush requests into the pipe of a worker that is gone
        # (a full pipe would block it for ever); the workers' own side: router_worker_main.
        in_q.cancel_join_thread()
    procs = []
    with _signals_ignored(WORKER_IGNORED_SIGNALS):
        for rank in ranks:
            queues = (in_q, out_qs) if rank == 0 else (None, None)
            proc = ctx.Process(target=_router_worker, args=(args, device, dtype, *queues, rank), daemon=True)
            proc.start()
            procs.append(proc)
    workers = WorkerProcesses(procs, out_qs)
    # They ignore SIGTERM, which is how multiprocessing ends daemon children at exit (it would then
    # wait for them for ever): on any exit, kill what is left first (atexit runs this before it).
    atexit.register(workers.kill)
    if not is_driver_node:
        return workers, None, None, None
    import queue as _queue

    waited = 0.0
    poll_s = 1.0
    while True:
        try:
            msg = out_q.get(timeout=poll_s)
            break
        except _queue.Empty:
            waited += poll_s
            if not workers.is_alive():
                workers.kill()
                raise RuntimeError(f"model worker exited during start-up (exit code {workers.exitcode})")
            if waited > WORKER_START_TIMEOUT_S:
                workers.kill()
                raise RuntimeError("model worker did not start in time")
    if isinstance(msg, WorkerError):
        workers.join(timeout=5)
        workers.kill()
        raise RuntimeError(f"model worker failed to start: {msg.message}")
    return workers, in_q, out_q, msg


def _launch_subprocesses(args: StartArgs) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # first: validation may convert the model
    sock = None
    if args.node_rank == 0:  # the HTTP port, taken before the model is resolved or started: a conflict shows at once
        from lightllm.server.httpserver.serving import bind_socket

        try:
            _validate_listen(args)
            sock = bind_socket(args.host, args.port, args.backlog, reuse_port=args.httpserver_workers > 1)
        except StartArgsError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except OSError as e:
            print(f"error: --host / --port: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
                  file=sys.stderr)
            sys.exit(1)
    try:
        args = validate_start_args(args)
        if args.node_rank == 0:  # the node that serves HTTP tokenizes
            _validate_tokenizer(args)
    except StartArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        workers, in_q, out_q, ready = start_worker(args)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if args.node_rank > 0:  # ranks only: node 0 serves HTTP and drives every step
        logging.getLogger(__name__).info("node %d: %d ranks joined %s:%d", args.node_rank, len(workers.procs),
                                         args.nccl_host, args.nccl_port)
        workers.join()
        sys.exit(workers.exitcode or 0)
    from lightllm.server.api_http import create_app
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.httpserver.serving import serve_http

    _raise_open_file_limit(args.limit_concurrency + SPARE_FILE_DESCRIPTORS)
    peers = None
    if args.httpserver_workers > 1:
        from lightllm.server.httpserver.peers import HttpPeers

        peers = HttpPeers.start(_http_worker, args, in_q, workers.update_queues[1:], ready, workers)
    try:
        manager = HttpServerManager(args, in_q, out_q, ready, worker=workers, peers=peers)
    except Exception as e:  # e.g. a tokenizer that does not load: one line, and the worker stops
        print(f"error: the HTTP server could not start: {type(e).__name__}: {e}", file=sys.stderr)
        if peers is not None:
            peers.kill()
            peers.close()
        workers.stop()
        sys.exit(1)
    app = create_app(manager)
    logging.getLogger(__name__).info(
        "serving %s on http://%s:%d (device %s, %s, KV pool %d tokens, %d CUDA graphs, %d HTTP processes)",
        args.resolved_model_dir, args.host, args.port, ready.device, ready.data_type, ready.max_total_token_num,
        ready.cuda_graphs, args.httpserver_workers,
    )
    try:
        serve_http(app, manager, args, sock, on_signal=None if peers is None else peers.forward,
                   on_started=None if peers is None else peers.release)
    finally:
        if peers is not None:  # the app's shutdown did it already, unless uvicorn was forced out
            peers.join()
        manager.shutdown()  # likewise
        workers.stop()
        manager.close()
        if peers is not None:
            peers.close()
    logging.getLogger(__name__).info("shut down")
    if peers is not None and peers.failed:
        from lightllm.server.httpserver.peers import PEER_DIED_EXIT_CODE

        sys.exit(PEER_DIED_EXIT_CODE)


def _http_worker(args: StartArgs, index: int, in_q, out_q, ready, metrics_dir: str, go, started) -> None:
    """Entry of HTTP process ``index`` (1..N-1) of --httpserver_workers N (httpserver/peers.py): its app,
    then, once process 0 serves (``go``), its server (``started`` set once it accepts connections)."""
    import logging

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT.replace("%(name)s", f"http[{index}] %(name)s"))
    from lightllm.utils.process_lifetime import exit_with_parent

    exit_with_parent()
    logging.getLogger(__name__).info("HTTP process %d of %d: pid %d", index, args.httpserver_workers, os.getpid())
    from lightllm.server.api_http import create_app
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.httpserver.peers import PEER_SHUTDOWN_SIGNAL, WorkerState
    from lightllm.server.httpserver.serving import bind_socket, serve_http

    _raise_open_file_limit(args.limit_concurrency + SPARE_FILE_DESCRIPTORS)
    manager = HttpServerManager(args, in_q, out_q, ready, worker=WorkerState(), http_worker=index,
                                metrics_dir=metrics_dir)
    app = create_app(manager)
    go.wait()  # process 0 serves (should it die first, exit_with_parent ends this process)
    sock = bind_socket(args.host, args.port, args.backlog, reuse_port=True, first=False)  # beside process 0's
    try:
        serve_http(app, manager, args, sock, shutdown_signals=(PEER_SHUTDOWN_SIGNAL,), on_started=started.set)
    finally:
        manager.shutdown()
        manager.close()


def _raise_open_file_limit(wanted: int) -> None:
    """Raise this process's open-file limit to ``wanted`` where the hard limit allows: every
    connection holds one (past the limit accept() fails, and asyncio logs a traceback per try)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))

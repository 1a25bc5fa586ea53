"""The HTTP process does not import the engine: the messages it exchanges with the router live in
``lightllm/server/core/objs/messages.py``, and ``lightllm/server/httpserver/`` (with the app and
the metrics it serves) imports nothing from the router, the model code or Triton, neither at
import time (a fresh interpreter's sys.modules) nor inside functions (their source)."""
import ast
import json
import os
import pickle
import subprocess
import sys

import lightllm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(lightllm.__file__)))
HTTPSERVER_DIR = os.path.join(REPO, "lightllm", "server", "httpserver")
# What the HTTP process runs besides httpserver/: the app, its OpenAI request parsing, its metrics, the messages
HTTP_SIDE_FILES = [os.path.join(REPO, "lightllm", "server", p) for p in
                   ("api_http.py", "openai_protocol.py", "metrics.py", os.path.join("core", "objs", "messages.py"))]
ENGINE_PREFIXES = ("lightllm.server.router", "lightllm.common.basemodel", "lightllm.models", "triton")


def _engine(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ENGINE_PREFIXES)


def _engine_loaded(name: str) -> bool:
    """An engine module in a fresh interpreter's sys.modules. Triton is left to the source check
    (``_imported_names``): on a CUDA machine third-party packages the HTTP process uses load it
    themselves (seen on the H200: neither torch alone nor any lightllm engine module did)."""
    return _engine(name) and not (name == "triton" or name.startswith("triton."))


def _modules_after_import(modules, pickled: bytes = b"") -> list:
    """sys.modules of a fresh interpreter (this worktree's lightllm first) after importing
    ``modules`` and unpickling ``pickled`` (if given), as the HTTP process unpickles the router's messages."""
    code = ("import importlib, json, pickle, sys\n"
            f"for m in {list(modules)!r}:\n"
            "    importlib.import_module(m)\n"
            "data = sys.stdin.buffer.read()\n"
            "if data:\n"
            "    pickle.loads(data)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, input=pickled, capture_output=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def _httpserver_modules() -> list:
    names = sorted(f[:-3] for f in os.listdir(HTTPSERVER_DIR) if f.endswith(".py") and f != "__init__.py")
    assert {"manager", "serving", "detokenize"} <= set(names)
    return [f"lightllm.server.httpserver.{n}" for n in names]


def test_http_process_imports_no_engine_module():
    modules = _httpserver_modules() + ["lightllm.server.api_http", "lightllm.server.metrics",
                                       "lightllm.server.api_start", "lightllm.server.api_server"]
    loaded = _modules_after_import(modules)
    assert "lightllm.server.httpserver.manager" in loaded and "lightllm.server.core.objs.messages" in loaded
    assert [m for m in loaded if _engine_loaded(m)] == []


def test_messages_module_is_torch_free():
    loaded = _modules_after_import(["lightllm.server.core.objs.messages"])
    assert [m for m in loaded if _engine_loaded(m) or m == "torch" or m.startswith("torch.")] == []


def test_unpickling_the_routers_messages_imports_no_engine_module():
    """What the router puts on the queue, built through the router's own imports, unpickles in
    the HTTP process without the engine (a class pickles by its module: the messages module)."""
    from lightllm.server.core.objs.sampling_params import SamplingParams
    from lightllm.server.router.manager import (AbortReq, AddReq, BatchClock, StepTiming, WorkerError, WorkerReady,
                                                WorkerStats)
    from lightllm.server.router.model_infer.mode_backend.base_backend import ReqStepUpdate

    timing = StepTiming(decode_by_batch={1: BatchClock(0.5, 1, 1)})
    update = ReqStepUpdate(1, [5], [0.0], None, 4, 0, 0, 0.0, queue_time_s=0.25)
    messages = [WorkerReady(100, 1000, "cpu", "float32"), WorkerError("boom"), ([update], WorkerStats(1, 1, 0, timing)),
                AddReq(1, [1, 2], SamplingParams(), [2], 0.0), AbortReq(1)]
    loaded = _modules_after_import(["lightllm.server.httpserver.manager"], pickle.dumps(messages))
    assert [m for m in loaded if _engine_loaded(m)] == []


def _imported_names(path: str) -> list:
    """Every module an import statement of the file names, at any depth (lazy imports included)."""
    names = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: resolve against the file's package
            pkg = os.path.relpath(os.path.dirname(path), REPO).replace(os.sep, ".").split(".")
            base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def test_no_http_side_file_imports_the_engine_even_lazily():
    files = [os.path.join(HTTPSERVER_DIR, f) for f in sorted(os.listdir(HTTPSERVER_DIR)) if f.endswith(".py")]
    bad = {os.path.relpath(p, REPO): [n for n in _imported_names(p) if _engine(n)] for p in files + HTTP_SIDE_FILES}
    assert {p: names for p, names in bad.items() if names} == {}


def test_router_reexports_the_messages():
    """Older imports keep working: the router's modules hand out the very same classes."""
    from lightllm.server.core.objs import messages
    from lightllm.server.router import manager
    from lightllm.server.router.model_infer.mode_backend import base_backend

    for name in ("AddReq", "AbortReq", "WorkerReady", "WorkerError", "WorkerStats", "StepTiming", "BatchClock",
                 "ReqStepUpdate", "decode_batch_bucket"):
        assert getattr(manager, name) is getattr(messages, name), name
    assert base_backend.ReqStepUpdate is messages.ReqStepUpdate


def test_a_step_update_crosses_the_queue_with_every_field():
    """ReqStepUpdate pickles as its values (``__reduce__``): every field, each set to a value
    other than its default, comes back equal, and the compare=False queue time too."""
    import dataclasses

    from lightllm.server.core.objs.messages import ReqStepUpdate

    values = dict(req_id=7, token_ids=[1, 2], logprobs=[-0.5, -0.25], finish_reason="stop", prompt_tokens=11,
                  mtp_accepted_token_num=3, asd_relaxed_token_num=1, asd_regret_spent=0.75, accept_len=2,
                  draft_confidence=[0.5, 0.25], top_logprobs=[[(1, -0.5)], [(2, -0.25)]], error="e",
                  queue_time_s=0.125, prompt_cached_tokens=4)
    assert set(values) == {f.name for f in dataclasses.fields(ReqStepUpdate)}  # a new field is added here too
    back = pickle.loads(pickle.dumps([ReqStepUpdate(**values)]))[0]
    assert type(back) is ReqStepUpdate and dataclasses.asdict(back) == values


def test_a_steps_updates_cross_the_queue_as_columns():
    """StepUpdates pickles a step's updates by field and unpickles as the list of updates, equal
    field by field (the queue time too), for several updates and for none."""
    import dataclasses

    from lightllm.server.core.objs.messages import ReqStepUpdate, StepUpdates

    ups = [ReqStepUpdate(i, [i, i + 1][: 1 + i % 2], [-0.5 * i][: 1], "eos" if i == 2 else None, 10 + i, i, 0,
                         0.25 * i, 1 + i % 2, [0.5] if i else None, None, None, 0.125 * i, i) for i in range(3)]
    back = pickle.loads(pickle.dumps(StepUpdates(ups)))
    assert type(back) is list and all(type(u) is ReqStepUpdate for u in back)
    assert [dataclasses.asdict(u) for u in back] == [dataclasses.asdict(u) for u in ups]
    assert [u.queue_time_s for u in back] == [u.queue_time_s for u in ups]
    assert pickle.loads(pickle.dumps(StepUpdates([]))) == []

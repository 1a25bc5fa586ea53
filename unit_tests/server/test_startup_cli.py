"""Start-up a newcomer can follow (issue 29): bad start-ups are one line on stderr within ~2 s
(driven through the CLI), --help in groups with every default, --data_type aliases, and the
throughput line's numbers."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from lightllm.common.constants import DATA_TYPE_ALIASES
from lightllm.server.api_cli import make_argument_parser
from lightllm.server.api_start import validate_start_args
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.metrics import ThroughputLog
from lightllm.server.router.manager import StepTiming, WorkerStats
from lightllm.server.router.model_infer.mode_backend.base_backend import ReqStepUpdate
from unit_tests.data_paths import REPO_ROOT
from unit_tests.server.start_args_util import fake_model_dir

BAD_START_S = 2.5  # ~2 s, and a busy 2-core machine


def _model_dir(tmp_path, model_type: str) -> str:
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(d)


def _run(argv):
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "lightllm.server.api_server", *argv], capture_output=True, text=True,
                       cwd=REPO_ROOT, timeout=120)
    return p, time.monotonic() - start


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "gpt2"])
def test_unsupported_architecture_is_one_line_before_the_worker(tmp_path, model_type):
    p, took = _run(["--model_dir", _model_dir(tmp_path, model_type)])
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: --model_dir:") and f"unsupported model_type '{model_type}'" in lines[0]
    assert "valid names: llama, qwen3" in lines[0]
    assert took < BAD_START_S, took


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "so_reuseport"])
def test_port_in_use_is_one_line_at_once(tmp_path, reuse_port):
    """Also with --httpserver_workers 2, whose sockets set SO_REUSEPORT: a port another server holds
    with SO_REUSEPORT too (a second server started on the same port) is refused, not shared. Without the
    check a second server bound beside the first."""
    with socket.socket() as taken:
        if reuse_port:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        workers = "2" if reuse_port else "1"
        p, took = _run(["--model_dir", fake_model_dir(tmp_path), "--port", str(port), "--httpserver_workers", workers])
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --host / --port: cannot listen on 127.0.0.1:{port}"), p.stderr
    assert "serving" not in p.stdout + p.stderr
    assert took < BAD_START_S, took


def test_bad_data_type_is_one_line(tmp_path):
    p, took = _run(["--model_dir", fake_model_dir(tmp_path), "--data_type", "int3"])
    assert p.returncode == 2 and "Traceback" not in p.stderr and "invalid choice" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr  # not argparse's usage block before it
    assert took < BAD_START_S, took


def test_flags_are_spelt_out():
    """Before: argparse took --batch for --batch_max_tokens (and any other unique prefix) silently."""
    p, _ = _run(["--batch", "512"])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "unrecognized arguments: --batch 512" in lines[0], p.stderr


def test_a_model_dir_without_a_tokenizer_is_one_line_before_the_worker(tmp_path):
    """Before: the model loaded, then the HTTP process's tokenizer load ended in a traceback."""
    d = fake_model_dir(tmp_path)
    os.remove(os.path.join(d, "tokenizer.json"))
    p, took = _run(["--model_dir", d])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("error: --model_dir:") and "has no tokenizer" in lines[0]
    assert took < BAD_START_S, took


INTERRUPT_WAIT_S = 120.0  # the worker process appears once the embedded model is converted (the first start)


@pytest.mark.parametrize("sig, code, line", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_while_starting_is_one_line_and_leaves_no_process(sig, code, line):
    """SIGINT or SIGTERM while the model worker loads: one line, exit 128 + the signal, the worker gone too.
    Before: a KeyboardInterrupt traceback; SIGTERM killed the launcher, and multiprocessing warned of leaked
    semaphores."""
    psutil = pytest.importorskip("psutil")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "lightllm.server.api_server", "--port", str(port)], cwd=REPO_ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = psutil.Process(p.pid)
    deadline = time.monotonic() + INTERRUPT_WAIT_S
    while not server.children() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    children = server.children(recursive=True)
    assert children, "no worker process started"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == code and err.strip().splitlines()[-1] == line and "Traceback" not in err, err
    assert "leaked" not in err, err
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, alive


@pytest.mark.parametrize("alias,name", sorted(DATA_TYPE_ALIASES.items()))
def test_data_type_aliases(tmp_path, alias, name):
    assert make_argument_parser().parse_args(["--data_type", alias]).data_type == name
    args = validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), data_type=alias))
    assert args.data_type == name


def test_help_has_groups_and_every_default():
    parser = make_argument_parser()
    text = parser.format_help()
    for group in ("model:", "server:", "scheduling:", "MTP / ASD:", "graphs:", "parallel:", "HTTP connections:"):
        assert f"\n{group}\n" in text, group
    for flag in ("--model_name", "--disable_log_requests", "--disable_log_stats"):
        assert flag in text
    helps = {a.option_strings[0]: parser._get_formatter()._expand_help(a) if a.help else ""
             for a in parser._actions if a.option_strings and a.dest != "help"}
    missing = [f for f, h in helps.items() if "(default: " not in h]
    assert not missing, missing
    assert "(default: 8000)" in helps["--port"] and "(default: 127.0.0.1)" in helps["--host"]


def _stats(running=1, waiting=0, kv=100):
    return WorkerStats(kv_used_tokens=kv, running_reqs=running, waiting_reqs=waiting, timing=StepTiming())


def _update(tokens, accept_len):
    return ReqStepUpdate(1, [5] * tokens, [0.0] * tokens, None, 4, 0, 0, 0.0, accept_len=accept_len)


def test_throughput_line():
    now = [0.0]
    log = ThroughputLog(kv_capacity_tokens=1000, mtp=True, clock=lambda: now[0])
    now[0] = 1.0
    assert log.line() is None  # idle: no line
    log.add_prompt(40)
    log.observe([_update(1, 0)], _stats())  # the prefill's token
    log.observe([_update(3, 3), _update(1, 1)], _stats(running=2, waiting=1, kv=250))
    now[0] = 3.0
    line = log.line()
    assert line == ("throughput: prompt 20.0 tokens/s, generation 2.5 tokens/s, running 2 reqs, waiting 1 reqs, "
                    "KV 250/1000 tokens (25.0%), MTP 2.00 tokens/step")
    log.observe([], _stats(running=0, kv=0))
    now[0] = 8.0
    assert log.line() is None

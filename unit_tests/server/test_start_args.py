import subprocess
import sys

import pytest
import torch

from lightllm.server.api_start import StartArgsError, validate_start_args
from lightllm.server.core.objs.start_args_type import DEFAULT_BATCH_MAX_TOKENS, StartArgs
from unit_tests.data_paths import REPO_ROOT
from unit_tests.server.start_args_util import fake_model_dir


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"port": 0}, "--port"),
        ({"running_max_req_size": 0}, "--running_max_req_size"),
        ({"max_req_total_len": 1}, "--max_req_total_len"),
        ({"max_total_token_num": 0}, "--max_total_token_num"),
        ({"max_total_token_num": 100, "max_req_total_len": 200}, "--max_total_token_num"),
        ({"batch_max_tokens": 0}, "--batch_max_tokens"),
        ({"mixed_max_prefill_tokens": 0}, "--mixed_max_prefill_tokens"),
        ({"mixed_max_prefill_tokens": 513, "batch_max_tokens": 512}, "--mixed_max_prefill_tokens"),  # was capped silently
        ({"mixed_prefill_pace_steps": -1}, "--mixed_prefill_pace_steps"),
        ({"httpserver_workers": 0}, "--httpserver_workers"),
        ({"httpserver_workers": 65}, "--httpserver_workers"),
        ({"httpserver_workers": 2.0}, "--httpserver_workers"),
        ({"model_dir": "/nonexistent/model"}, "--model_dir"),
    ],
)
def test_bad_flag_is_a_clear_error(tmp_path, kwargs, flag):
    kwargs.setdefault("model_dir", fake_model_dir(tmp_path))
    with pytest.raises(StartArgsError) as e:
        validate_start_args(StartArgs(**kwargs))
    assert str(e.value).startswith(flag + ":")


def test_good_flags_resolve_defaults(tmp_path):
    args = validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), max_req_total_len=64))
    assert args.resolved_model_dir == args.model_dir
    assert args.batch_max_tokens == DEFAULT_BATCH_MAX_TOKENS == 2048  # short steps whatever the request length
    # none: one step may prefill a whole request
    unset = validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), max_req_total_len=64, batch_max_tokens=None))
    assert unset.batch_max_tokens == 64


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--port", "0"], "error: --port: must be in 1..65535"),
        (["--port", "abc"], "argument --port: invalid int value"),
        (["--mtp_asd_regret_budget", "1.0"], "error: --mtp_asd_regret_budget: needs an enabled --mtp_mode"),
        (["--data_type", "int3"], "argument --data_type: invalid choice"),
        (["--httpserver_workers", "0"], "error: --httpserver_workers: must be an integer >= 1"),
    ] + ([] if torch.cuda.is_available() else [
        (["--enable_deterministic_inference"], "error: --enable_deterministic_inference: needs a CUDA device"),
    ]),
)
def test_cli_bad_flag_exits_without_traceback(tmp_path, argv, needle):
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", fake_model_dir(tmp_path), *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert p.returncode != 0
    assert needle in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"timeout_keep_alive": 0}, "--timeout_keep_alive"),
        ({"timeout_request_header": -1.0}, "--timeout_request_header"),
        ({"timeout_request_body": float("inf")}, "--timeout_request_body"),
        ({"timeout_graceful_shutdown": float("nan")}, "--timeout_graceful_shutdown"),
        ({"limit_concurrency": 0}, "--limit_concurrency"),
        ({"backlog": 0}, "--backlog"),
        ({"http": "httptool"}, "--http"),
        ({"stream_interval": 0}, "--stream_interval"),
        ({"stream_interval": 2.5}, "--stream_interval"),
    ],
)
def test_bad_http_flag_is_a_clear_error(tmp_path, kwargs, flag):
    with pytest.raises(StartArgsError) as e:
        validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), **kwargs))
    assert str(e.value).startswith(flag + ":")


def test_http_flags_parse_into_start_args_with_public_server_defaults():
    from lightllm.server.api_cli import make_argument_parser

    d = StartArgs()
    # a bounded header, body and shutdown wait, and a connection limit, by default
    assert (d.timeout_keep_alive, d.timeout_request_header, d.timeout_request_body, d.timeout_graceful_shutdown,
            d.limit_concurrency, d.backlog) == (5.0, 30.0, 60.0, 30.0, 1024, 2048)
    ns = make_argument_parser().parse_args(["--timeout_keep_alive", "2", "--timeout_request_header", "3.5",
                                            "--timeout_request_body", "4", "--timeout_graceful_shutdown", "6",
                                            "--limit_concurrency", "7", "--backlog", "8"])
    assert (ns.timeout_keep_alive, ns.timeout_request_header, ns.timeout_request_body, ns.timeout_graceful_shutdown,
            ns.limit_concurrency, ns.backlog) == (2.0, 3.5, 4.0, 6.0, 7, 8)
    help_text = make_argument_parser().format_help()
    for flag in ("--timeout_keep_alive", "--timeout_request_header", "--timeout_request_body",
                 "--timeout_graceful_shutdown", "--limit_concurrency", "--backlog"):
        assert flag in help_text


def test_http_parser_flag(tmp_path, monkeypatch):
    from lightllm.server import api_start
    from lightllm.server.api_cli import make_argument_parser

    assert StartArgs().http == "auto"
    assert StartArgs().stream_interval == 1 and make_argument_parser().parse_args(["--stream_interval", "4"]).stream_interval == 4
    assert make_argument_parser().parse_args(["--http", "h11"]).http == "h11"
    with pytest.raises(SystemExit):  # argparse's own error for a value outside the choices
        make_argument_parser().parse_args(["--http", "uvloop"])
    assert validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), http="h11")).http == "h11"
    # without httptools installed: auto falls back to h11, asking for httptools is a start-up error
    monkeypatch.setattr(api_start, "httptools_installed", lambda: False)
    assert validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path))).http == "auto"
    with pytest.raises(StartArgsError, match=r"^--http: httptools is not installed \(pip install httptools, or --http h11\)$"):
        validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), http="httptools"))


def test_event_loop_flag(tmp_path, monkeypatch):
    from lightllm.server import api_start
    from lightllm.server.api_cli import make_argument_parser

    assert StartArgs().loop == "auto" and make_argument_parser().parse_args([]).loop == "auto"
    assert make_argument_parser().parse_args(["--loop", "asyncio"]).loop == "asyncio"
    with pytest.raises(SystemExit):  # argparse's own error for a value outside the choices
        make_argument_parser().parse_args(["--loop", "trio"])
    with pytest.raises(StartArgsError, match=r"^--loop: must be one of auto, asyncio, uvloop, got 'trio'$"):
        validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), loop="trio"))
    # without uvloop installed: auto falls back to asyncio, asking for uvloop is a start-up error
    monkeypatch.setattr(api_start, "uvloop_installed", lambda: False)
    assert validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path))).loop == "auto"
    with pytest.raises(StartArgsError, match=r"^--loop: uvloop is not installed \(pip install uvloop, or --loop asyncio\)$"):
        validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), loop="uvloop"))


def _no_weights_dir(tmp_path, name, files=()):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    for f, text in files:
        (d / f).write_text(text)
    return str(d)


@pytest.mark.parametrize(
    "files,needle",
    [
        ((), "holds no model.safetensors or model.safetensors.index.json"),
        ((("pytorch_model.bin", ""),), "(it has pytorch_model.bin: only safetensors checkpoints load)"),
        ((("model.safetensors.index.json", '{"weight_map": {"w": "model-00001-of-00002.safetensors"}}'),),
         "model.safetensors.index.json names missing files: model-00001-of-00002.safetensors"),
        ((("model.safetensors.index.json", "{not json"),), "unreadable model.safetensors.index.json: JSONDecodeError"),
        ((("model.safetensors", "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n"),),
         "model.safetensors is a Git LFS pointer, not the weights (fetch them: git lfs pull)"),
        ((("model.safetensors", ""),), "model.safetensors is not a safetensors file (0 bytes)"),
        ((("model.safetensors", "\x40\x00\x00\x00\x00\x00\x00\x00{}"),), "model.safetensors is not a safetensors file"),
    ],
)
def test_a_model_dir_without_its_weights_is_a_start_up_error(tmp_path, files, needle):
    d = _no_weights_dir(tmp_path, "model", files)
    with pytest.raises(StartArgsError) as e:
        validate_start_args(StartArgs(model_dir=d))
    assert str(e.value).startswith("--model_dir:") and needle in str(e.value), str(e.value)
    # dummy weights need only the shape
    assert validate_start_args(StartArgs(model_dir=d, load_format="dummy")).resolved_model_dir == d


def test_a_draft_dir_without_its_weights_is_a_start_up_error(tmp_path):
    draft = _no_weights_dir(tmp_path, "draft")
    with pytest.raises(StartArgsError, match="^--mtp_draft_model_dir: .*holds no model.safetensors"):
        validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), mtp_mode="eagle_with_att", mtp_step=3,
                                      mtp_draft_model_dir=[draft]))
    # the draft loads real weights beside a dummy target too
    with pytest.raises(StartArgsError, match="^--mtp_draft_model_dir:"):
        validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), load_format="dummy",
                                      mtp_mode="eagle_with_att", mtp_step=3, mtp_draft_model_dir=[draft]))


def test_cli_model_dir_without_weights_is_one_line(tmp_path):
    d = _no_weights_dir(tmp_path, "model")
    p = subprocess.run([sys.executable, "-m", "lightllm.server.api_server", "--model_dir", d], capture_output=True,
                       text=True, cwd=REPO_ROOT, timeout=120)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --model_dir:") and "holds no model.safetensors" in lines[0], p.stderr

"""--tp / --dp / --enable_decode_microbatch_overlap / --nnodes flags: validation, the worker
processes the server starts (rank 0 broadcasts the router's messages), and two "nodes" on one
machine over loopback (gloo)."""
import os
import subprocess
import sys

import pytest

from lightllm.server.api_cli import make_argument_parser
from lightllm.server.api_start import StartArgsError, validate_start_args
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.offline_engine import OfflineEngine
from lightllm.utils.server_launcher import free_port
from unit_tests.data_paths import REPO_ROOT
from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.server.router.engine_util import make_engine
from unit_tests.server.start_args_util import fake_model_dir

COMMON = dict(max_req_total_len=64, running_max_req_size=4, max_total_token_num=300)
NODE_TIMEOUT_S = 240


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"tp": 0}, "--tp"),
        ({"tp": 2, "dp": 0}, "--dp"),
        ({"tp": 4, "dp": 3}, "--dp"),
        ({"tp": 2, "dp": 4}, "--dp"),
        ({"tp": 3, "nnodes": 2}, "--nnodes"),
        ({"tp": 2, "nnodes": 2, "node_rank": 2}, "--node_rank"),
        ({"tp": 2, "node_rank": -1}, "--node_rank"),
        ({"tp": 2, "nccl_port": 0}, "--nccl_port"),
        ({"tp": 2, "nccl_port": 8000, "port": 8000}, "--nccl_port"),
    ],
)
def test_bad_parallel_flag_is_a_clear_error(tmp_path, kwargs, flag):
    with pytest.raises(StartArgsError) as e:
        validate_start_args(StartArgs(model_dir=fake_model_dir(tmp_path), **kwargs))
    assert str(e.value).startswith(flag + ":")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    m = tiny_model("llama", seed=2, root=tmp_path_factory.mktemp("launch"))  # 4 q heads, 2 kv heads
    return dict(target=m.model_dir, vocab=m.vocab_size, draft=m.draft("draft", True, 1, seed=4))


def test_kv_heads_must_split_over_the_attention_ranks(llama, tmp_path):
    with pytest.raises(StartArgsError, match=r"^--tp: the model has num_key_value_heads = 2, not divisible by "
                                             r"--tp / --dp = 4"):
        validate_start_args(StartArgs(model_dir=llama["target"], tp=4))
    # with --dp 2 each DP group splits heads over 2 ranks: fine; and --dp 4 keeps whole heads
    assert validate_start_args(StartArgs(model_dir=llama["target"], tp=4, dp=2)).tp == 4
    assert validate_start_args(StartArgs(model_dir=llama["target"], tp=8, dp=4)).dp == 4


def test_flags_parse_with_lightllm_names():
    ns = make_argument_parser().parse_args(
        ["--tp", "4", "--dp", "2", "--enable_decode_microbatch_overlap", "--nnodes", "2", "--node_rank", "1",
         "--nccl_host", "10.0.0.1", "--nccl_port", "29000"]
    )
    assert (ns.tp, ns.dp, ns.enable_decode_microbatch_overlap, ns.nnodes, ns.node_rank, ns.nccl_host,
            ns.nccl_port) == (4, 2, True, 2, 1, "10.0.0.1", 29000)


def _workload(vocab):
    prompts = random_prompts(vocab, 3, range(3, 25), seed=11)
    return prompts, [{"max_new_tokens": n, "ignore_eos": True} for n in (8, 2, 10)]


def test_worker_processes_dp_overlap_mtp_asd_match_one_process(llama):
    """The server's own launch path (start_worker: one process per rank, rank 0 broadcasting the
    incoming messages): --tp 2 --dp 2 with overlap, MTP and ASD at B = 0 equals one process."""
    prompts, params = _workload(llama["vocab"])
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=2, mtp_draft_model_dir=[llama["draft"]], mtp_asd_regret_budget=0.0)
    ref = make_engine(llama["target"], **COMMON, **mtp).generate(prompts, params)
    args = StartArgs(model_dir=llama["target"], tp=2, dp=2, enable_decode_microbatch_overlap=True,
                     nccl_port=free_port(), **COMMON, **mtp)
    with OfflineEngine(args, device="cpu", dtype="float32") as eng:
        assert eng.workers is not None and len(eng.workers.procs) == 2
        res = eng.generate(prompts, params)
        res2 = eng.generate(prompts[:1], params[:1])  # the ranks keep serving
        workers = eng.workers
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    assert res2[0].token_ids == ref[0].token_ids
    assert not workers.is_alive() and workers.exitcode == 0  # None shut every rank down cleanly


def test_two_nodes_over_loopback(llama, tmp_path):
    """--nnodes 2: node 1 runs rank 1 from the server CLI (no HTTP), node 0 drives rank 0."""
    prompts, params = _workload(llama["vocab"])
    ref = make_engine(llama["target"], **COMMON).generate(prompts, params)
    port = free_port()
    flags = ["--model_dir", llama["target"], "--tp", "2", "--nnodes", "2", "--nccl_host", "127.0.0.1",
             "--nccl_port", str(port), "--max_req_total_len", "64", "--running_max_req_size", "4",
             "--max_total_token_num", "300", "--data_type", "float32"]
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "lightllm.server.api_server", *flags, "--node_rank", "1"],
                             cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))  # gloo on CPU, as node 0 here
    try:
        args = StartArgs(model_dir=llama["target"], tp=2, nnodes=2, node_rank=0, nccl_port=port, **COMMON)
        with OfflineEngine(args, device="cpu", dtype="float32") as eng:
            assert len(eng.workers.procs) == 1  # this node runs rank 0 only
            res = eng.generate(prompts, params)
        assert node1.wait(timeout=NODE_TIMEOUT_S) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]

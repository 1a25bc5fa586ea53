"""Where CUDA graphs are captured: one rank, or several with --enable_tp_cudagraph; never with micro-batch overlap;
--disable_cudagraph keeps the ladder's padding without graphs."""
import pytest
import torch

from lightllm.server.api_cli import make_argument_parser
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.router.model_infer.mode_backend.base_backend import decode_graph_plan, graph_capable
from lightllm.utils.dist_utils import ParallelContext

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


def _ctx(tp: int, dp: int = 1) -> ParallelContext:
    return ParallelContext(world_size=tp, dp_size=dp, device="cuda")


@pytest.mark.parametrize("tp, dp, tp_graphs, overlap, capable", [
    (1, 1, False, False, True),
    (2, 1, False, False, False),  # the default: --tp > 1 decodes eagerly
    (2, 1, True, False, True),
    (4, 1, True, False, True),
    (2, 2, True, False, True),  # DP groups: the decode ladder, each group padded to the fullest one's size
    (2, 2, False, False, False),
    (1, 1, False, True, False),  # micro-batch overlap: two streams of collectives
    (2, 1, True, True, False),
])
def test_graph_capable(tp, dp, tp_graphs, overlap, capable):
    args = StartArgs(tp=tp, dp=dp, enable_tp_cudagraph=tp_graphs, enable_decode_microbatch_overlap=overlap)
    assert graph_capable(args, _ctx(tp, dp)) is capable
    ladder, use_graphs = decode_graph_plan(args, CUDA, _ctx(tp, dp))
    assert ladder is not None and use_graphs is capable  # CUDA pads to the ladder either way
    eager = StartArgs(tp=tp, dp=dp, enable_tp_cudagraph=tp_graphs, enable_decode_microbatch_overlap=overlap,
                      disable_cudagraph=True)
    assert decode_graph_plan(eager, CUDA, _ctx(tp, dp)) == (ladder, False)


def test_no_ladder_on_cpu():
    args = StartArgs(tp=2, enable_tp_cudagraph=True)
    assert decode_graph_plan(args, torch.device("cpu"), ParallelContext(world_size=2)) == (None, False)


def test_the_flag_parses_and_defaults_off():
    p = make_argument_parser()
    assert p.parse_args([]).enable_tp_cudagraph is False
    assert p.parse_args(["--tp", "2", "--enable_tp_cudagraph"]).enable_tp_cudagraph is True


def _mode_on_rank(rank: int) -> str:
    from lightllm.common.basemodel.cuda_graph import capture_error_mode

    return capture_error_mode()


def test_capture_mode_is_thread_local_with_several_ranks():
    from lightllm.common.basemodel.cuda_graph import capture_error_mode
    from unit_tests.dist_util import run_ranks

    assert capture_error_mode() == "global"  # no process group: one rank
    assert run_ranks(_mode_on_rank, 2) == ["thread_local", "thread_local"]

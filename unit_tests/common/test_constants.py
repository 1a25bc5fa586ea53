"""The shared names and limits, and what is derived from them."""
from lightllm.common.basemodel.basemodel import TORCH_DTYPES
from lightllm.common.basemodel.triton_kernel.mtp_utils import MAX_MTP_BLOCK
from lightllm.common.constants import DATA_TYPES, LOAD_FORMATS, MAX_MTP_STEP, MTP_TABLE_WIDTH
from lightllm.server.api_cli import make_argument_parser
from lightllm.server.metrics import ACCEPT_LEN_BUCKETS


def test_mtp_limit_is_derived_everywhere():
    assert MTP_TABLE_WIDTH == MAX_MTP_STEP + 1 <= MAX_MTP_BLOCK
    # accept_len of one verify step is 1..K + 1
    assert ACCEPT_LEN_BUCKETS == tuple(range(1, MAX_MTP_STEP + 2))


def test_cli_choices_and_torch_dtypes_come_from_the_shared_names():
    choices = {a.dest: tuple(a.choices) for a in make_argument_parser()._actions if a.choices}
    assert choices["data_type"] == DATA_TYPES and choices["load_format"] == LOAD_FORMATS
    assert tuple(TORCH_DTYPES) == DATA_TYPES
    assert all(str(dtype) == f"torch.{name}" for name, dtype in TORCH_DTYPES.items())

"""The longest request: --max_req_total_len capped by the model's positions, for the HTTP side and the worker's
KV pool alike."""
import dataclasses
import json

from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.router.model_infer.mode_backend.base_backend import resolve_max_total_token_num
from lightllm.utils.model_len import max_model_len, read_max_position_embeddings


def _model_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_positions_cap_the_flag(tmp_path):
    d = _model_dir(tmp_path, max_position_embeddings=256)
    assert read_max_position_embeddings(d) == 256
    assert max_model_len(10_000, d) == 256 and max_model_len(100, d) == 100


def test_no_positions_or_no_dir_leave_the_flag(tmp_path):
    for config in ({}, {"max_position_embeddings": True}, {"max_position_embeddings": 0}):
        assert max_model_len(300, _model_dir(tmp_path, **config)) == 300
    assert max_model_len(300, None) == 300


def test_the_kv_pool_is_sized_for_the_capped_length(tmp_path):
    """Before: a --max_req_total_len past the model's positions sized the pool (and the request tables) for
    requests the server never takes."""
    args = dataclasses.replace(StartArgs(), max_req_total_len=100_000, running_max_req_size=2,
                               resolved_model_dir=_model_dir(tmp_path, max_position_embeddings=256))
    assert resolve_max_total_token_num(args, "cpu", "float32", mtp_step=3) == 2 * (256 + 3)

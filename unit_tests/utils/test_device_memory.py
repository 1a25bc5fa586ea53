"""Start-up allocations checked against free memory: one line naming the flag to lower, before the allocator
(or the OOM killer) is reached."""
import pytest
import torch

from lightllm.common.kv_cache_mem_manager import MemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.server.router.manager import _format_error
from lightllm.utils import device_memory
from lightllm.utils.device_memory import GIB, StartupError, check_fits, host_available_bytes

CPU = torch.device("cpu")


def test_host_available_bytes_reads_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    500 kB\n")
    monkeypatch.setattr(device_memory, "MEMINFO", str(meminfo))
    assert host_available_bytes() == 500 * 1024
    monkeypatch.setattr(device_memory, "MEMINFO", str(tmp_path / "none"))
    assert host_available_bytes() is None


def test_check_fits_names_what_and_the_fix(monkeypatch):
    monkeypatch.setattr(device_memory, "free_bytes", lambda device: 2 * GIB)
    check_fits(2 * GIB, CPU, "x", "y")
    with pytest.raises(StartupError, match=r"^the pool needs 3.0 GiB, and 2.0 GiB of cpu memory is free: lower --f$"):
        check_fits(3 * GIB, CPU, "the pool", "lower --f")
    monkeypatch.setattr(device_memory, "free_bytes", lambda device: None)
    check_fits(1 << 60, CPU, "x", "y")  # unknown free memory: not checked


def test_a_kv_pool_or_request_table_past_free_memory_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(device_memory, "free_bytes", lambda device: GIB)
    with pytest.raises(StartupError, match="KV cache of 10000000 tokens .*--max_total_token_num"):
        MemoryManager(10_000_000, torch.float32, head_num=4, head_dim=64, layer_num=2, device="cpu")
    mem = MemoryManager(1000, torch.float32, head_num=4, head_dim=64, layer_num=2, device="cpu")
    with pytest.raises(StartupError, match="request table of 1000000 requests x 4096 positions .*--running_max_req_size"):
        ReqManager(1_000_000, 4096, mem, "cpu")


def test_a_startup_error_is_reported_without_a_traceback():
    try:
        raise StartupError("the pool needs more")
    except StartupError as e:
        assert _format_error(0, e) == "rank 0: the pool needs more"
    try:
        raise ValueError("bad")
    except ValueError as e:
        assert _format_error(1, e).startswith("rank 1: ValueError: bad\nTraceback")

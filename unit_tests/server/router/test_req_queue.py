import pytest

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.router.model_infer.infer_batch import InferReq
from lightllm.server.router.req_queue import ReqQueue, kv_reservation


def _req(i, prompt_len, max_new):
    return InferReq(i, list(range(prompt_len)), SamplingParams(max_new_tokens=max_new), [0])


def test_fifo_admission_bounded_by_kv_pool_and_req_slots():
    q = ReqQueue(max_total_token_num=100, running_max_req_size=3, mtp_step=2)
    reqs = [_req(0, 30, 10), _req(1, 30, 10), _req(2, 15, 5), _req(3, 1, 1)]
    for r in reqs:
        q.append(r)
    assert kv_reservation(reqs[0], 2) == 42
    admitted = q.pop_admissible(num_running=0)
    assert [r.req_id for r in admitted] == [0, 1]  # req 2 would pass 100
    assert q.reserved_tokens == 84
    # the head (req 2, 22 tokens) does not fit: nothing behind it overtakes
    assert q.pop_admissible(num_running=2) == []
    q.release(admitted[0])
    assert [r.req_id for r in q.pop_admissible(num_running=2)] == [2]  # req 3 hits running_max_req_size
    # req_idx rows are the other bound
    assert q.pop_admissible(num_running=3) == []


def test_remove_waiting():
    q = ReqQueue(10, 2, 0)
    q.append(_req(5, 1, 1))
    assert q.remove(5).req_id == 5 and q.remove(5) is None


def test_dp_groups_have_their_own_pools_and_slots():
    """--dp 2: each group has its own KV pool and req_idx rows; a request goes to the group
    with the fewest running requests among those it fits, and stays FIFO."""
    q = ReqQueue(max_total_token_num=50, running_max_req_size=2, mtp_step=0, dp_size=2)
    reqs = [_req(0, 30, 10), _req(1, 10, 5), _req(2, 5, 5), _req(3, 30, 10), _req(4, 1, 1)]
    for r in reqs:
        q.append(r)
    admitted = q.pop_admissible([0, 0])
    # 0 -> g0 (tie: lowest index); 1 -> g1 (fewest running); 2 -> g1 (g0 has 40 of 50 reserved, 2 fits
    # both, equal running, g1 reserves less); 3 (40 tokens) fits no group: it waits and 4 does not overtake
    assert [(r.req_id, r.dp_rank) for r in admitted] == [(0, 0), (1, 1), (2, 1)]
    assert q.reserved_per_group == [40, 25] and q.reserved_tokens == 65
    q.release(admitted[0])
    # 3 now fits g0; 4 fits g0 too (g1 is at running_max_req_size)
    assert [(r.req_id, r.dp_rank) for r in q.pop_admissible([0, 2])] == [(3, 0), (4, 0)]
    assert q.reserved_per_group == [42, 25]
    with pytest.raises(ValueError, match="expected 2"):
        q.pop_admissible(3)

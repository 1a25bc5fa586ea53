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

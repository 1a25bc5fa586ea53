"""--stream_interval (SGLang's flag): a stream sends a chunk once N tokens arrived since its last one;
the first tokens and the end go at once, and the text, tokens and log-probs are those of N = 1."""
from typing import List

import pytest

from lightllm.server.core.objs.messages import ReqStepUpdate
from lightllm.server.httpserver.manager import HeldUpdates
from unit_tests.server.http.test_hostile_client import TEXT, Script, _stream, scripted, tok  # noqa: F401 (fixture)


def _update(n_tokens: int, finish: str = None, error: str = None) -> ReqStepUpdate:
    return ReqStepUpdate(req_id=1, token_ids=[7] * n_tokens, logprobs=[-0.5] * n_tokens, finish_reason=finish,
                         prompt_tokens=3, mtp_accepted_token_num=0, asd_relaxed_token_num=0, asd_regret_spent=0.0,
                         error=error)


def _due_sizes(held: HeldUpdates, updates: List[ReqStepUpdate]) -> List[int]:
    """Tokens handed over each time the held updates are due, the task taking them at once."""
    sizes = []
    for u in updates:
        if held.add(u):
            sizes.append(sum(len(v.token_ids) for v in held.take()))
    assert held.updates == [] and not held.signaled
    return sizes


def test_held_updates_are_due_at_the_first_tokens_every_n_tokens_and_at_the_end():
    # a prefill update without tokens waits; the first token is due at once; then every 3 tokens; the end
    assert _due_sizes(HeldUpdates(3), [_update(0), _update(1)] + [_update(1) for _ in range(8)]
                      + [_update(1, "length")]) == [1, 3, 3, 3]
    # MTP-like steps of 2 tokens: due once 3 or more are held
    assert _due_sizes(HeldUpdates(3), [_update(2) for _ in range(4)] + [_update(1, "stop")]) == [2, 4, 3]
    # an error ends what is held at once; the final-only holder waits for the end alone
    assert _due_sizes(HeldUpdates(4), [_update(1), _update(1), _update(0, "error", "boom")]) == [1, 1]
    assert _due_sizes(HeldUpdates(None), [_update(1) for _ in range(5)] + [_update(1, "length")]) == [6]


def test_held_updates_signal_once_until_taken():
    held = HeldUpdates(2)
    assert held.add(_update(1))  # the first token: due
    assert not held.add(_update(2))  # due again, but HELD_DUE is already in the queue
    assert not held.add(_update(1, "length"))
    assert [len(u.token_ids) for u in held.take()] == [1, 2, 1]


def _chunk_tokens(chunks) -> List[int]:
    return [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]]


@pytest.mark.parametrize("group", [1, 2])
def test_streams_send_every_n_tokens_with_the_same_text_and_logprobs(tok, group):
    ids = tok.encode(TEXT, add_special_tokens=False)
    body = {"prompt": "Q", "max_tokens": len(ids), "stream": True, "logprobs": 0}
    streams = {}
    for interval in (1, 3):
        with scripted(Script(ids, group=group), stream_interval=interval) as app:
            streams[interval] = _stream(app, "/v1/completions", body)
            events = _stream(app, "/generate_stream", {"inputs": "Q", "parameters": {"max_new_tokens": len(ids)}})
            assert [e["token"]["id"] for e in events if e["token"] is not None] == ids
            assert events[-1]["finished"] and events[-1]["generated_text"] == TEXT
    for chunks in streams.values():
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == TEXT
        assert sum(_chunk_tokens(chunks)) == len(ids)
    lp = [x for c in streams[1] if c["choices"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert lp == [x for c in streams[3] if c["choices"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    sizes = _chunk_tokens(streams[3])
    assert sizes[0] == group  # the first tokens at once
    assert all(s >= 3 for s in sizes[1:-1]), sizes  # then at least 3 a chunk (more when the loop is behind)
    assert len(sizes) <= 1 + -(-(len(ids) - group) // 3), sizes
    assert streams[3][-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_stream_as_without_the_interval(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    body = {"prompt": "Q", "max_tokens": len(ids), "stop": " 6, we", "stream": True}
    with scripted(Script(ids), stream_interval=4) as app:
        chunks = _stream(app, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "To find 7 *"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

"""The streaming hot path's pieces against their plain equivalents: SseChunks against json.dumps of
the whole chunk, UpdateBox against asyncio.Queue's order and wake-up."""
import asyncio
import json
import random

import pytest

from lightllm.server.api_http import SseChunks
from lightllm.server.httpserver.manager import UpdateBox

TEXTS = ["", " the", "caf\u00e9", "\u4f60\u597d", "\U0001f600", 'quote " and \\ backslash', "new\nline\ttab",
         "\x00\x1f control", "\ufffd", "\ud800 lone surrogate"]


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "none", "bool"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return rng.choice(TEXTS)
    if kind == "int":
        return rng.randint(-2**40, 2**40)
    if kind == "float":
        return rng.choice([0.0, -0.0, 1e-300, -123.456, 1.0 / 3.0, rng.uniform(-50, 0)])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(TEXTS) + str(i): _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _reference(head, choices, rest) -> str:
    return f"data: {json.dumps({**head, 'choices': choices, **(rest or {})}, allow_nan=False)}\n\n"


def test_sse_chunks_equal_json_dumps_of_the_whole_chunk():
    rng = random.Random(3)
    for _ in range(300):
        head = {"id": f"cmpl-{rng.getrandbits(64):x}", "object": rng.choice(["text_completion", "chat.completion.chunk"]),
                "created": rng.randint(0, 2**31), "model": rng.choice(TEXTS[1:])}
        choices = [{"index": i, "finish_reason": rng.choice([None, "stop", "length"]), "text": rng.choice(TEXTS),
                    "logprobs": _random_value(rng)} for i in range(rng.randint(0, 2))]
        rest = rng.choice([None, {}, {"usage": None}, {"usage": _random_value(rng), "asd_regret_spent": 0.5}])
        assert SseChunks(head).event(choices, rest) == _reference(head, choices, rest)


def test_sse_chunks_refuse_what_json_refuses():
    chunks = SseChunks({"id": "x"})
    with pytest.raises(ValueError):
        chunks.event([{"logprobs": float("nan")}])
    with pytest.raises(ValueError):
        SseChunks({})


def test_update_box_keeps_order_and_wakes_its_reader():
    async def main():
        box, seen = UpdateBox(), []

        async def reader():
            while True:
                item = await box.get()
                if item is None:
                    return
                seen.append(item)

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader waits on an empty box
        for i in range(5):
            box.put_nowait(i)
        box.put_nowait("a")
        await asyncio.sleep(0)
        box.put_nowait("b")
        box.put_nowait(None)
        await asyncio.wait_for(task, 1.0)
        assert seen == [0, 1, 2, 3, 4, "a", "b"] and box.empty()

        # a reader cancelled while it waits leaves a box that still works
        waiting = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        box.put_nowait("c")
        assert await asyncio.wait_for(box.get(), 1.0) == "c"
        box.put_nowait("d")
        assert not box.empty() and box.get_nowait() == "d" and box.empty()

    asyncio.run(main())

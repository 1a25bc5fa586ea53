"""FastAPI app: LightLLM's /generate, /generate_stream, OpenAI-compatible endpoints, /health, /metrics.

What a client may send is bounded here (media type, body size and read time, prompt length) and
when SamplingParams is built (parameter ranges); docs/limits.md lists them. Every refusal is a 4xx
naming the client's own field. Connection limits (header and keep-alive timeouts, the connection
limit, shutdown) are uvicorn's and httpserver/serving.py's.
"""
import json
import logging
import math
import os
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

import asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lightllm.server.core.objs.sampling_params import SamplingParams, SamplingParamsError, quote
from lightllm.server.httpserver.manager import (ClientDisconnected, HttpServerManager, ReqResult, ShuttingDown,
                                                Unavailable)
from lightllm.server.metrics import METRICS_PUBLISH_S, THROUGHPUT_LOG_INTERVAL_S
from lightllm.server.openai_protocol import (ModelNotFound, OpenAIRequest, check_token_ids, client_error, error_body,
                                             fill_max_tokens, need_text, openai_names, parse_openai_request)

logger = logging.getLogger(__name__)

# OpenAI finish reasons for ours
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
SSE_DONE = "data: [DONE]\n\n"

# Request bodies above this are refused with 413 (Content-Length first, then the bytes read)
MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
# An oversized body up to this size is read and dropped so the client gets the 413 instead of a
# connection reset mid-upload; larger ones (or ones sent after 100-continue) are not read at all.
MAX_DISCARDED_BODY_BYTES = 64 * 1024 * 1024
# nginx's status for "client closed the request": the answer nobody reads
CLIENT_CLOSED_REQUEST = 499
# Worker watchdog: how often it looks, how long failed requests get to send their 503
WORKER_WATCH_INTERVAL_S = 0.5
WORKER_DEATH_GRACE_S = 0.5
# --httpserver_workers: how long process 0 then waits for the others to fail their requests and exit
PEERS_WORKER_DEATH_WAIT_S = 2.0
WORKER_DIED_EXIT_CODE = 1  # the API server's exit status when the model worker died
# The one media type of request bodies: a browser's cross-site "simple" request (no CORS
# preflight) can only send text/plain, form or multipart bodies
JSON_MEDIA_TYPE = "application/json"
CLOSE_CONNECTION = {"connection": "close"}
Run = Tuple[List[int], SamplingParams]  # one choice of an OpenAI request: its prompt's ids and its parameters


class BodyTooLarge(Exception):
    """The request body exceeds MAX_REQUEST_BODY_BYTES."""


class BodyReadTimeout(Exception):
    """The request body did not arrive within --timeout_request_body."""


class UnsupportedMediaType(Exception):
    """The request body is not declared application/json."""


class BodyReadGuard:
    """ASGI middleware: a request's body must arrive within ``timeout_s`` of its headers, and
    reading stops when the server begins shutting down (``stopping()`` resolves). Reading the
    body then raises BodyReadTimeout (408) or ShuttingDown (503); both close the connection.
    Once the body is in, receive() is passed through (it then only reports a disconnect)."""

    def __init__(self, app, timeout_s: float, stopping: Callable[[], Optional[asyncio.Future]]):
        self.app = app
        self.timeout_s = timeout_s
        self.stopping = stopping

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False

        async def guarded_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            stopping = self.stopping()
            if stopping is not None and stopping.done():
                raise ShuttingDown("the server is shutting down")
            message = asyncio.ensure_future(receive())
            waiting = {message} if stopping is None else {message, stopping}
            try:
                await asyncio.wait(waiting, timeout=max(0.0, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not message.done():
                    message.cancel()
            if not message.done() or message.cancelled():
                if stopping is not None and stopping.done():
                    raise ShuttingDown("the server is shutting down")
                raise BodyReadTimeout()
            msg = message.result()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                body_done = True
            return msg

        await self.app(scope, guarded_receive, send)


# Where a request's token counts travel from its route to the request log line (ASGI scope key)
REQUEST_RECORD_KEY = "lightllm.request_record"
# GET routes that pollers call all the time: no log line for them
UNLOGGED_GET_ROUTES = ("/health", "/metrics")


@dataclass
class RequestRecord:
    """What the request log line says about one request besides its method, route and status;
    the routes fill it in (``_record``)."""

    prompt_tokens: int = 0
    output_tokens: int = 0


class RequestLog:
    """ASGI middleware: one INFO line per request when its response has been sent (or failed):
    method, route, status, prompt and output tokens, milliseconds. Off with --disable_log_requests."""

    def __init__(self, app, log: logging.Logger):
        self.app = app
        self.log = log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (scope["method"] == "GET" and scope["path"] in UNLOGGED_GET_ROUTES):
            await self.app(scope, receive, send)
            return
        record = scope[REQUEST_RECORD_KEY] = RequestRecord()
        start = time.monotonic()
        status = None
        logged = False

        def log_line(code) -> None:
            nonlocal logged
            if not logged and code != CLIENT_CLOSED_REQUEST:  # a client gone mid-upload: logged where noticed
                logged = True
                self.log.info("%s %s %s prompt_tokens=%d output_tokens=%d %.1f ms", scope["method"], scope["path"],
                              code, record.prompt_tokens, record.output_tokens, 1000 * (time.monotonic() - start))

        async def logged_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log_line(status)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            log_line(status if status is not None else 500)


def _record(request: Request, prompt_tokens: int, output_tokens: int) -> None:
    """The token counts of the request log line (no-op when the log is off)."""
    record = request.scope.get(REQUEST_RECORD_KEY)
    if record is not None:
        record.prompt_tokens, record.output_tokens = prompt_tokens, output_tokens


def _json_response(content: Dict[str, Any]) -> JSONResponse:
    """A 200 reply of plain JSON values (dicts, lists, str, int, float, None), serialized at once:
    a dict returned from an endpoint goes through FastAPI's jsonable_encoder first, which walks
    every value in Python (3.7 ms for /generate's 256 per-token details on this CPU, 0.4 for
    json.dumps) on the event loop that also takes in every other request."""
    return JSONResponse(content)


def _error(status: int, field: Optional[str], message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, field, message))


def _content_length(request: Request) -> Optional[int]:
    value = request.headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None


async def _read_body(request: Request) -> bytes:
    """The body, or BodyTooLarge past MAX_REQUEST_BODY_BYTES (declared or read); ClientDisconnected
    (one log line) when the client hangs up before it is all sent."""
    declared = _content_length(request)
    if declared is not None and declared > MAX_REQUEST_BODY_BYTES:
        if declared > MAX_DISCARDED_BODY_BYTES or request.headers.get("expect", "").lower() == "100-continue":
            raise BodyTooLarge()
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= MAX_REQUEST_BODY_BYTES:
                parts.append(chunk)
            elif size > MAX_DISCARDED_BODY_BYTES:
                break
    except ClientDisconnect:
        logger.info("%s %s: client disconnected after %d body bytes", request.method, request.url.path, size)
        raise ClientDisconnected() from None
    if size > MAX_REQUEST_BODY_BYTES:
        raise BodyTooLarge()
    return b"".join(parts)


def _media_type(request: Request) -> str:
    value = request.headers.get("content-type", "")
    return value.split(";", 1)[0].strip().lower()


async def _json_body(request: Request) -> Dict[str, Any]:
    if _media_type(request) != JSON_MEDIA_TYPE:
        raise UnsupportedMediaType()
    raw = await _read_body(request)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise SamplingParamsError("body", "is nested too deeply") from None
    except ValueError:  # bad JSON, bad UTF-8, an integer of too many digits
        raise SamplingParamsError("body", "is not valid JSON") from None
    if not isinstance(body, dict):
        raise SamplingParamsError("body", "must be a JSON object")
    return body


def _finite(x: float) -> Optional[float]:
    """JSON has no inf / NaN: such a value is sent as null."""
    return x if math.isfinite(x) else None


def _asd_fields(res: ReqResult) -> Dict[str, Any]:
    return {
        "mtp_accepted_token_num": res.mtp_accepted_token_num,
        "asd_relaxed_token_num": res.asd_relaxed_token_num,
        "asd_regret_spent": _finite(res.asd_regret_spent),
    }


# One encoder for every event (json.dumps with allow_nan=False builds an encoder per call)
_SSE_JSON = json.JSONEncoder(allow_nan=False)


def _sse(obj: Dict[str, Any]) -> str:
    return f"data: {_SSE_JSON.encode(obj)}\n\n"


class SseChunks:
    """The events of one streamed OpenAI response, whose chunks all begin with the same fields
    (``head``: id, object, created, model): those are encoded once, and each event encodes only its
    ``choices`` and the fields after them. ``event(choices, rest)`` is
    ``_sse({**head, "choices": choices, **rest})``, character for character."""

    def __init__(self, head: Dict[str, Any]):
        if not head:
            raise ValueError("a chunk head needs at least one field")
        self._prefix = f'data: {_SSE_JSON.encode(head)[:-1]}, "choices": '

    def event(self, choices: List[Dict[str, Any]], rest: Optional[Dict[str, Any]] = None) -> str:
        more = f", {_SSE_JSON.encode(rest)[1:-1]}" if rest else ""
        return f"{self._prefix}{_SSE_JSON.encode(choices)}{more}}}\n\n"


def stream_token_texts(singles: List[str], delta: str) -> List[str]:
    """The text each of a result's new tokens adds to a /generate_stream, whose events must add up to the text
    shown (``delta``): each token's own text when they do, else (a character split over tokens, a stop string
    cut inside one) the whole delta on the last token and "" on the others."""
    if "".join(singles) == delta:
        return singles
    return [""] * (len(singles) - 1) + [delta]


def _worker_failed_message(res: ReqResult) -> str:
    return f"the model worker could not serve this request: {res.error}"


def _check_stream_field(stream: Any, streaming: bool) -> None:
    """``stream`` of a LightLLM request: absent, or true on /generate_stream and false on /generate."""
    if stream is None:
        return
    if not isinstance(stream, bool):
        raise SamplingParamsError("stream", "must be true or false")
    if stream and not streaming:
        raise SamplingParamsError("stream", "/generate does not stream: send the request to /generate_stream")
    if not stream and streaming:
        raise SamplingParamsError("stream", "/generate_stream always streams: send the request to /generate")


def _exit_process(code: int) -> None:
    logging.shutdown()
    os._exit(code)


def create_app(manager: HttpServerManager, exit_process: Callable[[int], None] = _exit_process) -> FastAPI:
    """The app over ``manager``. When the model worker dies the app fails its waiting requests
    (503) and calls ``exit_process(WORKER_DIED_EXIT_CODE)``; tests pass their own."""

    async def watch_worker():
        while manager.worker_alive():
            await asyncio.sleep(WORKER_WATCH_INTERVAL_S)
        failed = manager.fail_pending()
        logger.error("the model worker exited (code %s): failing %d waiting requests, exiting with code %d",
                     manager.worker_exit_code(), failed, WORKER_DIED_EXIT_CODE)
        await asyncio.sleep(WORKER_DEATH_GRACE_S)  # the failed requests send their 503
        if manager.peers is not None:  # and those of the other HTTP processes (WorkerExited told them)
            await asyncio.to_thread(manager.peers.join, PEERS_WORKER_DEATH_WAIT_S)
            manager.peers.close()  # exit_process skips the launcher's clean-up
        manager.stop_worker()
        exit_process(WORKER_DIED_EXIT_CODE)

    async def log_throughput():
        while True:
            await asyncio.sleep(THROUGHPUT_LOG_INTERVAL_S)
            line = manager.throughput.line()
            if line is not None:
                logger.info("%s", line)

    async def publish_metrics():
        while True:
            await asyncio.sleep(METRICS_PUBLISH_S)
            manager.shared_metrics.publish()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        manager.start(asyncio.get_running_loop())
        tasks = [asyncio.create_task(watch_worker())]
        if manager.throughput is not None:
            tasks.append(asyncio.create_task(log_throughput()))
        if manager.shared_metrics is not None:
            tasks.append(asyncio.create_task(publish_metrics()))
        yield
        for task in tasks:
            task.cancel()
        if manager.shared_metrics is not None:
            manager.shared_metrics.publish()  # this process's last counts stay on the others' pages
        if manager.peers is not None:  # the other HTTP processes finish their requests before the worker stops
            await asyncio.to_thread(manager.peers.join)
        manager.shutdown()

    app = FastAPI(title="lightllm", lifespan=lifespan)
    app.add_middleware(BodyReadGuard, timeout_s=manager.args.timeout_request_body, stopping=lambda: manager.stopping)
    if not manager.args.disable_log_requests:  # outermost: it sees every answer, 408 and 415 included
        app.add_middleware(RequestLog, log=logger)

    @app.exception_handler(SamplingParamsError)
    async def _params_error(request: Request, exc: SamplingParamsError):
        manager.metrics.bad_requests.inc()
        return _error(400, exc.field_name, exc.message)

    @app.exception_handler(ModelNotFound)
    async def _no_such_model(request: Request, exc: ModelNotFound):
        return _error(404, "model", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # no such route or method
        return JSONResponse(status_code=exc.status_code, content=error_body(exc.status_code, None, str(exc.detail)),
                            headers=exc.headers)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge):
        return _error(413, "body", f"larger than {MAX_REQUEST_BODY_BYTES} bytes")

    @app.exception_handler(UnsupportedMediaType)
    async def _not_json(request: Request, exc: UnsupportedMediaType):
        got = request.headers.get("content-type")
        return _error(415, "content-type", f"must be {JSON_MEDIA_TYPE}, got {quote(got) if got else 'none'}")

    @app.exception_handler(BodyReadTimeout)
    async def _body_too_slow(request: Request, exc: BodyReadTimeout):
        response = _error(408, "body", f"not received within {manager.args.timeout_request_body:g} s "
                                       f"(--timeout_request_body)")
        response.headers.update(CLOSE_CONNECTION)
        return response

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the cause is logged

    @app.exception_handler(ClientDisconnect)
    async def _client_gone_reading(request: Request, exc: ClientDisconnect):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # a body read outside _read_body

    @app.exception_handler(Unavailable)
    async def _unavailable(request: Request, exc: Unavailable):
        response = _error(503, None, str(exc))
        if isinstance(exc, ShuttingDown):
            response.headers.update(CLOSE_CONNECTION)
        return response

    async def _final(prompt_ids, params, request: Request, arrival: float) -> ReqResult:
        """Run a non-streaming request to its end (ClientDisconnected when its client hangs up)."""
        final = None
        async for res in manager.generate(prompt_ids, params, request.is_disconnected, arrival, final_only=True):
            final = res
        return final

    @app.get("/health")
    async def health():
        if not manager.worker_alive():
            return JSONResponse(status_code=503, content={"status": "worker down"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(content=manager.render_metrics(), media_type="text/plain; version=0.0.4")

    started = int(time.time())

    def model_card() -> Dict[str, Any]:
        return {"id": manager.model_name, "object": "model", "created": started, "owned_by": "lightllm",
                "max_model_len": manager.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != manager.model_name:
            raise ModelNotFound(model, manager.model_name)
        return model_card()

    async def _lightllm_request(body, streaming: bool) -> Tuple[List[int], SamplingParams]:
        inputs = need_text("inputs", body.get("inputs"))
        unknown = sorted(set(body) - {"inputs", "parameters", "stream"})
        if unknown:
            raise SamplingParamsError(unknown[0], "unknown field (valid: inputs, parameters)")
        _check_stream_field(body.get("stream"), streaming)
        parameters = body.get("parameters")
        params = SamplingParams.from_request({} if parameters is None else parameters)  # [] is refused, not empty
        prompt_ids = await manager.encode_prompt_async(inputs)
        manager.check_request(prompt_ids, params)
        return prompt_ids, params

    def _token(res: ReqResult, i: int, text: Optional[str] = None) -> Dict[str, Any]:
        """Token i of ``res``; ``text``: what it adds to a stream (default: its own text)."""
        t = res.token_ids[i]
        out = {"id": t, "text": manager.token_text(t) if text is None else text, "logprob": _finite(res.logprobs[i]),
               "special": t in manager.eos_token_ids}
        if res.top_logprobs:  # parameters.top_logprobs > 0: the most likely alternatives
            out["top_logprobs"] = [{"id": a, "text": manager.token_text(a), "logprob": _finite(lp)}
                                   for a, lp in res.top_logprobs[i]]
        return out

    def _details(res: ReqResult) -> Dict[str, Any]:
        return {**_asd_fields(res), "prompt_tokens": res.prompt_tokens, "prompt_cached_tokens": res.prompt_cached_tokens,
                "count_output_tokens": len(res.token_ids)}

    @app.post("/generate")
    async def generate(request: Request):
        arrival = time.monotonic()  # receipt: the serving latencies start here (RequestClock)
        prompt_ids, params = await _lightllm_request(await _json_body(request), streaming=False)
        res = await _final(prompt_ids, params, request, arrival)
        _record(request, res.prompt_tokens, len(res.token_ids))
        if res.finish_reason == "error":
            return _error(500, None, _worker_failed_message(res))
        out = {
            "generated_text": [res.text],
            "count_output_tokens": len(res.token_ids),
            "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
            "prompt_cached_tokens": res.prompt_cached_tokens,
            **_asd_fields(res),
        }
        if params.return_details:
            out["tokens"] = [{k: v for k, v in _token(res, i).items() if k != "special"} for i in range(len(res.token_ids))]
        return _json_response(out)

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        arrival = time.monotonic()
        prompt_ids, params = await _lightllm_request(await _json_body(request), streaming=True)

        async def events():
            sent = 0  # token events sent
            sent_text = ""  # the text they add up to
            try:
                async for res in manager.generate(prompt_ids, params, arrival=arrival):
                    done = res.finish_reason is not None
                    _record(request, res.prompt_tokens, len(res.token_ids))
                    if res.finish_reason == "error":
                        yield _sse({"token": None, "generated_text": None, "finished": True, "finish_reason": "error",
                                    "error": _worker_failed_message(res), "details": None})
                        return
                    upto = max(res.stream_token_num, sent)  # tokens that cannot be part of a stop string
                    texts = []
                    if upto > sent:  # the text shown so far (held back: a possible stop string, split characters)
                        visible = res.text[:res.stream_text_len]
                        delta = visible[len(sent_text):] if visible.startswith(sent_text) else ""
                        texts = stream_token_texts([manager.token_text(res.token_ids[i]) for i in range(sent, upto)],
                                                   delta)
                        sent_text += delta
                    # one event per token, and one write per result (an MTP step's tokens, or every step
                    # that waited for a stream behind the worker)
                    batch = []
                    for i in range(sent, upto):
                        last = done and i == upto - 1
                        batch.append(_sse({
                            "token": _token(res, i, texts[i - sent]),
                            "generated_text": res.text if last else None,
                            "finished": last,
                            "finish_reason": res.finish_reason if last else None,
                            "details": _details(res) if last else None,
                        }))
                    if done and upto == sent:
                        batch.append(_sse({"token": None, "generated_text": res.text, "finished": True,
                                           "finish_reason": res.finish_reason, "details": _details(res)}))
                    if batch:
                        yield "".join(batch)
                    sent = upto
            except Unavailable as e:
                yield _sse({"token": None, "generated_text": None, "finished": True, "finish_reason": "error",
                            "error": str(e), "details": None})

        return StreamingResponse(events(), media_type="text/event-stream")

    def _usage(results: List[ReqResult], per_prompt: int) -> Dict[str, Any]:
        """OpenAI usage: each prompt once (its ``per_prompt`` choices are consecutive), the completion
        tokens of every choice, and of the prompts the tokens served from the prompt cache (OpenAI's
        prompt_tokens_details.cached_tokens)."""
        groups = [results[k:k + per_prompt] for k in range(0, len(results), per_prompt)]
        prompt, n = sum(g[0].prompt_tokens for g in groups), sum(len(r.token_ids) for r in results)
        # A prompt counts once, as prompt_tokens: each choice is its own engine request and may
        # find a different share of it cached (the later ones often the first one's prefill), so
        # the fewest any choice found, the same whatever order the choices were admitted in.
        cached = sum(min(r.prompt_cached_tokens for r in g) for g in groups)
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _asd_total(results: List[ReqResult]) -> Dict[str, Any]:
        fields = [_asd_fields(r) for r in results]
        return {k: sum(f[k] for f in fields) if all(f[k] is not None for f in fields) else None for k in fields[0]}

    def _token_text(token_id: int) -> str:
        return manager.token_text(token_id)

    def _chat_logprobs(res: ReqResult, lo: int, hi: int) -> Dict[str, Any]:
        """OpenAI chat log-probs of tokens [lo, hi): each token's text, log-prob and UTF-8 bytes, and
        its ``top_logprobs`` most likely alternatives in the same shape (an empty list when 0)."""
        def entry(token_id: int, logprob: float) -> Dict[str, Any]:
            text = _token_text(token_id)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

        content = []
        for i in range(lo, hi):
            top = res.top_logprobs[i] if res.top_logprobs else []
            content.append({**entry(res.token_ids[i], res.logprobs[i]),
                            "top_logprobs": [entry(t, lp) for t, lp in top]})
        return {"content": content}

    def _completion_top(res: ReqResult, i: int) -> Optional[Dict[str, Optional[float]]]:
        """Legacy completions' alternatives of token i: {text: log-prob}, most likely first, plus the
        returned token when it is not among them (OpenAI: up to logprobs + 1 entries). Tokens of the
        same text keep the likelier one's log-prob. None when the request asked 0."""
        if not res.top_logprobs:
            return None
        top: Dict[str, Optional[float]] = {}
        for t, lp in res.top_logprobs[i] + [(res.token_ids[i], res.logprobs[i])]:
            top.setdefault(_token_text(t), _finite(lp))
        return top

    def _completion_logprobs(res: ReqResult, lo: int, hi: int, offset: int) -> Dict[str, Any]:
        """OpenAI (legacy) completion log-probs of tokens [lo, hi); ``offset``: text_offset of token lo.
        A token's offset is the previous one's plus its text's length (vLLM's rule)."""
        tokens, offsets = [], []
        for i in range(lo, hi):
            tokens.append(_token_text(res.token_ids[i]))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [_finite(x) for x in res.logprobs[lo:hi]],
                "top_logprobs": [_completion_top(res, i) for i in range(lo, hi)], "text_offset": offsets}

    async def _results(runs: List[Run], request: Request, arrival: float) -> List[ReqResult]:
        """Every choice run to its end, together (ClientDisconnected when the client hangs up:
        the other choices are aborted too)."""
        if len(runs) == 1:
            return [await _final(*runs[0], request, arrival)]
        gone = False
        lock = asyncio.Lock()

        async def is_disconnected() -> bool:  # one poll of the connection for all choices
            nonlocal gone
            async with lock:
                gone = gone or await request.is_disconnected()
            return gone

        async def final(prompt_ids: List[int], p: SamplingParams) -> ReqResult:
            res = None
            async for res in manager.generate(prompt_ids, p, is_disconnected, arrival, final_only=True):
                pass
            return res

        tasks = [asyncio.ensure_future(final(*run)) for run in runs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # their aborts are sent

    def _updates(runs: List[Run], arrival: float) -> AsyncIterator:
        """(choice index, its result so far) as the choices' updates arrive; each choice's last
        one has finish_reason set and none of it comes after. Leaving early aborts them all.
        One choice: its results alone (manager.generate's, no (index, result) pairs)."""
        if len(runs) == 1:
            return manager.generate(*runs[0], arrival=arrival)
        return _choices_updates(runs, arrival)

    async def _choices_updates(runs: List[Run], arrival: float) -> AsyncIterator[Tuple[int, ReqResult]]:
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, prompt_ids: List[int], p: SamplingParams) -> None:
            try:
                async for res in manager.generate(prompt_ids, p, arrival=arrival):
                    q.put_nowait((i, res, None))
            except Unavailable as e:
                q.put_nowait((i, None, e))

        tasks = [asyncio.ensure_future(pump(i, *run)) for i, run in enumerate(runs)]
        finished = set()
        try:
            while len(finished) < len(tasks):
                i, res, exc = await q.get()
                if exc is not None:
                    raise exc
                if i in finished:  # a result object is updated in place: its final state was sent
                    continue
                if res.finish_reason is not None:
                    finished.add(i)
                yield i, res
        finally:
            for t in tasks:
                t.cancel()

    async def _prompt_ids(req: OpenAIRequest, chat: bool) -> List[List[int]]:
        """Each prompt's token ids, checked against the server's limits (a prompt of several named by its
        index)."""
        if chat:
            prompts = [await manager.apply_chat_template_async(req.messages)]
        else:
            prompts = await asyncio.gather(*(manager.encode_prompt_async(p) if isinstance(p, str) else _ids(p)
                                             for p in req.prompts))
        for i, ids in enumerate(prompts):
            at = f"[{i}] " if len(prompts) > 1 else ""
            try:
                if not chat and not isinstance(req.prompts[i], str):
                    check_token_ids(ids, manager.vocab_size)
                manager.check_request(ids, fill_max_tokens(req, len(ids), manager.max_model_len).params)
            except SamplingParamsError as e:
                raise SamplingParamsError(e.field_name, at + e.message) from None
        return list(prompts)

    async def _ids(ids: List[int]) -> List[int]:  # a prompt sent as token ids, beside those being tokenized
        return ids

    async def _openai(request: Request, chat: bool):
        arrival = time.monotonic()
        body = await _json_body(request)
        prompt_field = "messages" if chat else "prompt"
        try:  # everything cheap first, then tokenize
            req = parse_openai_request(body, chat, manager.model_name)
            prompts = await _prompt_ids(req, chat)
        except SamplingParamsError as e:
            raise client_error(e, openai_names(body, prompt_field)) from None
        if chat:
            req = fill_max_tokens(req, len(prompts[0]), manager.max_model_len)
        choices = req.choices
        runs = [(ids, p) for ids in prompts for p in req.choice_params]  # choice k * n + j: prompt k's j-th
        prompt_tokens = sum(len(ids) for ids in prompts)
        stream, include_usage = req.stream, req.include_usage
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def choice(index: int, text: str, finish: Optional[str], delta: bool,
                   logprobs: Optional[Dict[str, Any]], role: bool = True) -> Dict[str, Any]:
            """``role``: the message's role; a stream sends it in each choice's first delta only (as OpenAI)."""
            c = {"index": index, "finish_reason": OPENAI_FINISH.get(finish) if finish else None}
            if chat:
                message = {"role": "assistant", "content": text} if role else {"content": text}
                c["delta" if delta else "message"] = message
            else:
                c["text"] = text
            c["logprobs"] = logprobs
            return c

        chunks = SseChunks({"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                            "model": manager.model_name})

        def stream_error(status: int, message: str) -> str:
            return _sse(error_body(status, None, message))

        def logprobs_of(res: ReqResult, lo: int, hi: int, offset: int = 0) -> Optional[Dict[str, Any]]:
            if not choices.logprobs:
                return None
            return _chat_logprobs(res, lo, hi) if chat else _completion_logprobs(res, lo, hi, offset)

        if not stream:
            results = await _results(runs, request, arrival)
            _record(request, prompt_tokens, sum(len(r.token_ids) for r in results))
            failed = next((r for r in results if r.finish_reason == "error"), None)
            if failed is not None:
                return _error(500, None, _worker_failed_message(failed))
            return _json_response({"id": rid, "object": obj, "created": created, "model": manager.model_name,
                                   "choices": [choice(i, r.text, r.finish_reason, False,
                                                      logprobs_of(r, 0, len(r.token_ids)))
                                               for i, r in enumerate(results)],
                                   "usage": _usage(results, choices.n), **_asd_total(results)})

        async def events():
            n = len(runs)
            sent_text = [""] * n
            sent_tokens = [0] * n  # tokens whose log-probs were sent
            text_offset = [0] * n  # completions: text_offset of the next token
            final: List[Optional[ReqResult]] = [None] * n
            sent_role = [False] * n
            try:
                async with aclosing(_updates(runs, arrival)) as updates:
                    async for item in updates:
                        i, res = (0, item) if n == 1 else item
                        done = res.finish_reason is not None
                        if res.finish_reason == "error":
                            yield stream_error(500, _worker_failed_message(res))
                            break
                        # held back: the start of a possible stop string, an incomplete UTF-8 sequence
                        visible = res.text[:res.stream_text_len]
                        delta = visible[len(sent_text[i]):] if visible.startswith(sent_text[i]) else ""
                        if not delta and not done:
                            continue
                        sent_text[i] += delta
                        upto = max(res.stream_token_num, sent_tokens[i])  # tokens within the text shown
                        lp = logprobs_of(res, sent_tokens[i], upto, text_offset[i])
                        if lp is not None and not chat:
                            text_offset[i] += sum(len(t) for t in lp["tokens"])
                        sent_tokens[i] = upto
                        rest = {"usage": None} if include_usage else {}  # OpenAI: only the extra last chunk has usage
                        if done:
                            rest.update(_asd_fields(res))
                            final[i] = res
                            _record(request, prompt_tokens, sum(len(r.token_ids) for r in final if r is not None))
                        yield chunks.event([choice(i, delta, res.finish_reason, True, lp, not sent_role[i])], rest)
                        sent_role[i] = True
            except Unavailable as e:
                yield stream_error(503, str(e))
            if include_usage and all(r is not None for r in final):
                yield chunks.event([], {"usage": _usage(final, choices.n)})
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _openai(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _openai(request, chat=True)

    return app

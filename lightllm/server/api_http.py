"""FastAPI app: LightLLM's /generate, /generate_stream, OpenAI-compatible endpoints, /health, /metrics."""
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Dict, List, Optional

import asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lightllm.server.core.objs.sampling_params import SamplingParams, SamplingParamsError
from lightllm.server.httpserver.manager import HttpServerManager, ReqResult

# OpenAI finish reasons for ours
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
SSE_DONE = "data: [DONE]\n\n"


def _bad_request(manager: HttpServerManager, field: str, message: str) -> JSONResponse:
    manager.metrics.bad_requests.inc()
    return JSONResponse(status_code=400, content={"error": f"{field}: {message}", "field": field})


async def _json_body(request: Request) -> Dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SamplingParamsError("body", "is not valid JSON") from None
    if not isinstance(body, dict):
        raise SamplingParamsError("body", "must be a JSON object")
    return body


def _asd_fields(res: ReqResult) -> Dict[str, Any]:
    return {
        "mtp_accepted_token_num": res.mtp_accepted_token_num,
        "asd_relaxed_token_num": res.asd_relaxed_token_num,
        "asd_regret_spent": res.asd_regret_spent,
    }


def _sse(obj: Dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# OpenAI request fields and our sampling parameter names
OPENAI_PARAM_MAP = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop_sequences",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "ignore_eos": "ignore_eos",
    "asd_regret_budget": "asd_regret_budget",
}
OPENAI_IGNORED = {"model", "user", "stream_options", "logprobs", "echo", "suffix", "best_of", "n", "stream"}
OPENAI_DEFAULT_MAX_TOKENS = 16
OPENAI_DEFAULT_TEMPERATURE = 1.0


def _openai_params(body: Dict[str, Any], prompt_field: str) -> SamplingParams:
    unknown = sorted(set(body) - set(OPENAI_PARAM_MAP) - OPENAI_IGNORED - {prompt_field})
    if unknown:
        raise SamplingParamsError(unknown[0], "unknown field")
    n = body.get("n", 1)
    if n != 1:
        raise SamplingParamsError("n", "only n = 1 is supported")
    params = {ours: body[theirs] for theirs, ours in OPENAI_PARAM_MAP.items() if theirs in body}
    params.setdefault("max_new_tokens", OPENAI_DEFAULT_MAX_TOKENS)
    temperature = params.get("temperature", OPENAI_DEFAULT_TEMPERATURE)
    # OpenAI semantics: temperature 0 (or top_k 1) is greedy, anything else samples
    params["do_sample"] = not (temperature == 0 and not isinstance(temperature, bool)) and params.get("top_k") != 1
    return SamplingParams.from_request(params)


def create_app(manager: HttpServerManager) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        manager.start(asyncio.get_running_loop())
        yield
        manager.shutdown()

    app = FastAPI(title="lightllm", lifespan=lifespan)

    @app.exception_handler(SamplingParamsError)
    async def _params_error(request: Request, exc: SamplingParamsError):
        return _bad_request(manager, exc.field_name, str(exc).split(": ", 1)[-1])

    async def _run(prompt_ids, params, request: Request) -> ReqResult:
        final = None
        async for res in manager.generate(prompt_ids, params, request.is_disconnected):
            final = res
        return final

    @app.get("/health")
    async def health():
        if not manager.worker_alive():
            return JSONResponse(status_code=503, content={"status": "worker down"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(content=manager.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": manager.model_name, "object": "model", "owned_by": "lightllm",
                                            "max_model_len": manager.args.max_req_total_len}]}

    def _lightllm_request(body) -> (List[int], SamplingParams):
        inputs = body.get("inputs")
        if not isinstance(inputs, str):
            raise SamplingParamsError("inputs", "must be a string")
        unknown = sorted(set(body) - {"inputs", "parameters", "stream"})
        if unknown:
            raise SamplingParamsError(unknown[0], "unknown field (valid: inputs, parameters)")
        params = SamplingParams.from_request(body.get("parameters") or {})
        prompt_ids = manager.encode_prompt(inputs)
        manager.check_request(prompt_ids, params)
        return prompt_ids, params

    def _generate_payload(res: ReqResult, params: SamplingParams) -> Dict[str, Any]:
        out = {
            "generated_text": [res.text],
            "count_output_tokens": len(res.token_ids),
            "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
            **_asd_fields(res),
        }
        if params.return_details:
            out["tokens"] = [
                {"id": t, "text": manager.tokenizer.decode([t]), "logprob": lp}
                for t, lp in zip(res.token_ids, res.logprobs)
            ]
        return out

    @app.post("/generate")
    async def generate(request: Request):
        prompt_ids, params = _lightllm_request(await _json_body(request))
        res = await _run(prompt_ids, params, request)
        return _generate_payload(res, params)

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        prompt_ids, params = _lightllm_request(await _json_body(request))

        async def events():
            sent = 0
            async for res in manager.generate(prompt_ids, params, request.is_disconnected):
                new = res.token_ids[sent:]
                for i, t in enumerate(new):
                    last = res.finish_reason is not None and i == len(new) - 1
                    yield _sse({
                        "token": {"id": t, "text": manager.tokenizer.decode([t]), "logprob": res.logprobs[sent + i],
                                  "special": t in manager.eos_token_ids},
                        "generated_text": res.text if last else None,
                        "finished": last,
                        "finish_reason": res.finish_reason if last else None,
                        "details": {**_asd_fields(res), "prompt_tokens": res.prompt_tokens,
                                    "count_output_tokens": len(res.token_ids)} if last else None,
                    })
                sent = len(res.token_ids)
                if res.finish_reason is not None and not new:
                    yield _sse({"token": None, "generated_text": res.text, "finished": True,
                                "finish_reason": res.finish_reason, "details": _asd_fields(res)})

        return StreamingResponse(events(), media_type="text/event-stream")

    def _usage(res: ReqResult) -> Dict[str, int]:
        n = len(res.token_ids)
        return {"prompt_tokens": res.prompt_tokens, "completion_tokens": n, "total_tokens": res.prompt_tokens + n}

    async def _openai(request: Request, chat: bool):
        body = await _json_body(request)
        prompt_field = "messages" if chat else "prompt"
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise SamplingParamsError("messages", "must be a non-empty list of {role, content} strings")
            params = _openai_params(body, prompt_field)
            prompt_ids = manager.apply_chat_template(messages)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise SamplingParamsError("prompt", "must be a string (or a list of one string)")
            params = _openai_params(body, prompt_field)
            prompt_ids = manager.encode_prompt(prompt)
        manager.check_request(prompt_ids, params)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise SamplingParamsError("stream", "must be true or false")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: Optional[str], delta: bool) -> Dict[str, Any]:
            c = {"index": 0, "finish_reason": OPENAI_FINISH.get(finish) if finish else None}
            if chat:
                c["delta" if delta else "message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
                c["logprobs"] = None
            return c

        if not stream:
            res = await _run(prompt_ids, params, request)
            return {"id": rid, "object": obj, "created": created, "model": manager.model_name,
                    "choices": [choice(res.text, res.finish_reason, False)], "usage": _usage(res), **_asd_fields(res)}

        async def events():
            sent_text = ""
            async for res in manager.generate(prompt_ids, params, request.is_disconnected):
                text = res.text
                if res.finish_reason is None and text.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 sequence: wait for the next token
                delta = text[len(sent_text):]
                sent_text = text
                chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                         "model": manager.model_name, "choices": [choice(delta, res.finish_reason, True)]}
                if res.finish_reason is not None:
                    chunk["usage"] = _usage(res)
                    chunk.update(_asd_fields(res))
                yield _sse(chunk)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _openai(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _openai(request, chat=True)

    return app

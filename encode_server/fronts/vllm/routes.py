"""`POST /v1/chat/completions`: the OpenAI-style route of the vLLM producer, whichever connector hands the rows
over (`--ec-storage`, or `--ec-transfer-config` with ECExampleConnector, ECMooncakeConnector or ECCPUConnector).

vLLM's EPD proxy sends its encoder instance the user's chat body (one item per request with `max_tokens` 1, or
an encoder's items grouped into one request, with a `uuid` each or without; not streamed; the `x-request-id`
header) and goes on to prefill only after a 200. This route answers that 200 with an OpenAI `chat.completion`
object once every media item is handed over (no text is generated: the message is empty, `finish_reason`
"length"), with vLLM's `ec_transfer_params` (each identifier's `item_indices`, `metadata` and the connector's
handles), and any failure with an OpenAI-style error body (`{"error": {"message", "type", "param", "code"}}`,
as vLLM's own server answers). Without a connector the route is a 404 that says how to turn it on. Bodies
over `INLINE_JSON_LIMIT` are parsed in a thread, as native `/encode`'s are.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from encode_server.fronts.bodies import parse_json_body, read_body
from encode_server.fronts.vllm.completions import ChatCompletions, Completion
from encode_server.records import EncodeError

#: OpenAI's error `type` for each status we answer with.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError",
               413: "BadRequestError", 499: "ClientClosedRequest", 500: "InternalServerError",
               502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "TimeoutError"}
OFF = ("/v1/chat/completions is the vLLM producer's endpoint: start the server with --ec-storage PATH (the "
       "consumers' shared_storage_path) or --ec-transfer-config (vLLM's, e.g. ECMooncakeConnector)")


def openai_error(error: EncodeError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": ERROR_TYPES.get(error.status, "InternalServerError"),
                      "param": None, "code": error.status}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def chat_completion(request_id: str, completion: Completion) -> dict[str, Any]:
    """The `chat.completion` object the proxy waits for, with vLLM's `ec_transfer_params`; `encoder_cache` says
    what was stored (an extension OpenAI clients ignore)."""
    tokens = sum(item.rows_count or 0 for item in completion.items)
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": completion.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        "ec_transfer_params": completion.transfer_params,
        "encoder_cache": [{"identifier": item.identifier, "tokens": item.rows_count, "hit": item.hit}
                          for item in completion.items],
    }


def add_chat_route(app: FastAPI, completions: ChatCompletions | None, max_request_bytes: int) -> None:
    """`/v1/chat/completions`, answered by `completions` (a 404 naming the flags when there is none)."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        if completions is None:
            return openai_error(EncodeError(404, OFF))
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            payload = await parse_json_body(await read_body(request, max_request_bytes))
            completion = await completions.answer(payload, request_id)
        except EncodeError as error:
            return openai_error(error)
        return JSONResponse(chat_completion(request_id, completion))

"""`POST /v1/chat/completions`: the OpenAI-style route of the vLLM producer (`--ec-storage`, or
`--ec-transfer-config` with `ECMooncakeConnector`, whose rows are pushed to the consumer the request names and
whose answer carries vLLM's `ec_transfer_params`).

vLLM's EPD proxy sends its encoder instance the user's chat body (`max_tokens` 1, not streamed, the
`x-request-id` header) and goes on to prefill only after a 200. This route answers that 200 with an
OpenAI `chat.completion` object once every media item's rows are in the storage (no text is generated:
the message is empty, `finish_reason` "length"), and any failure with an OpenAI-style error body
(`{"error": {"message", "type", "param", "code"}}`, as vLLM's own server answers). Without
`--ec-storage` the route is a 404 that says how to turn it on.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from encode_server.fronts.bodies import parse_json, read_body
from encode_server.fronts.vllm.chat import media_parts
from encode_server.fronts.vllm.producer import StoredItem
from encode_server.records import EncodeError

if TYPE_CHECKING:
    from encode_server.fronts.vllm.front import VllmFront

#: OpenAI's error `type` for each status we answer with.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError",
               413: "BadRequestError", 499: "ClientClosedRequest", 500: "InternalServerError",
               502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "TimeoutError"}


def openai_error(error: EncodeError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": ERROR_TYPES.get(error.status, "InternalServerError"),
                      "param": None, "code": error.status}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def chat_completion(request_id: str, model: str, stored: list[StoredItem]) -> dict[str, Any]:
    """The `chat.completion` object the proxy waits for; `encoder_cache` says what was stored (an extension
    OpenAI clients ignore)."""
    tokens = sum(item.tokens or 0 for item in stored)
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        "encoder_cache": [{"identifier": item.identifier, "tokens": item.tokens, "hit": item.hit}
                          for item in stored],
    }


def add_chat_route(app: FastAPI, front: VllmFront) -> None:
    """`/v1/chat/completions`, answered by what `front` started (a 404 naming the flags when it started none)."""
    settings = front.settings

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        producer, pusher = front.producer, front.pusher
        if producer is None:
            return openai_error(EncodeError(404, "/v1/chat/completions is the vLLM producer's endpoint: start the "
                                                 "server with --ec-storage PATH (the consumers' shared_storage_path) "
                                                 "or --ec-transfer-config (vLLM's, e.g. ECMooncakeConnector)"))
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            payload = parse_json(await read_body(request, settings.max_request_bytes))
            parts = media_parts(payload)
            model = payload.get("model") if isinstance(payload.get("model"), str) else settings.model
            # The proxy sends one request per item, all under the same x-request-id: admission needs its own id.
            job_id = f"{request_id[:400]}#{uuid.uuid4().hex[:12]}"
            if pusher is None:
                stored = await producer.store(parts, job_id)
                return JSONResponse(chat_completion(request_id, model, stored))
            items = await producer.rows(parts, job_id)
            params = await pusher.push(items, payload.get("ec_transfer_params"), request_id)
        except EncodeError as error:
            return openai_error(error)
        pushed = [StoredItem(item.identifier, int(item.rows.shape[0]), False) for item in items]
        return JSONResponse({**chat_completion(request_id, model, pushed), "ec_transfer_params": params})

"""The error answers' log lines (`http/error_log.py`) in-process, on a plain ASGI app: the vLLM front's OpenAI-style
bodies give their message and the request's `x-request-id`, and the lines a flood leaves out are counted in a line
of their own soon after (a second in the server), whether or not another error answer comes."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from encode_server.http.error_log import ErrorAnswerLog, LineBudget

pytestmark = pytest.mark.quick


def answering(status: int, body: dict):
    async def app(scope, receive, send) -> None:
        raw = orjson.dumps(body)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": raw})

    return app


async def call(app, path: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message) -> None:
        pass

    await app({"type": "http", "method": "POST", "path": path, "headers": list(headers)}, receive, send)


async def test_an_openai_style_error_is_logged_with_its_message_and_request_id(caplog):
    caplog.set_level(logging.INFO, logger="encode_server.http.errors")
    app = ErrorAnswerLog(answering(400, {"error": {"message": "messages[0].content[0]: not a decodable image",
                                                   "type": "BadRequestError", "param": None, "code": 400}}))
    await call(app, "/v1/chat/completions", [(b"x-request-id", b"proxy-7")])
    (line,) = [record.getMessage() for record in caplog.records]
    assert line == ("answered 400 to POST /v1/chat/completions req_id=proxy-7: messages[0].content[0]: not a "
                    "decodable image")


async def test_the_lines_a_flood_leaves_out_are_counted_within_a_second(caplog):
    caplog.set_level(logging.INFO, logger="encode_server.http.errors")
    app = ErrorAnswerLog(answering(503, {"status": "error", "message": "the server is shutting down",
                                         "req_id": None}), LineBudget(per_second=3), report_after_s=0.1)
    await asyncio.gather(*(call(app, "/encode") for _ in range(8)))
    assert len(caplog.records) == 3
    await asyncio.sleep(0.2)  # no other error answer comes: the count is told anyway
    lines = [record.getMessage() for record in caplog.records]
    assert lines[3:] == ["(5 more error answers were not logged: at most 3 lines a second)"], lines
    app.flush()  # as the server stops: nothing more to tell
    assert len(caplog.records) == 4

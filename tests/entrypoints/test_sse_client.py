"""The serving benchmark's streaming HTTP client against a hand-written server: chunked,
length-delimited and close-delimited bodies, CRLF events, events split across chunks,
error statuses and bad URLs."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllmpy.entrypoints.sse_client import HTTPStatusError, stream_events

EVENTS = [b'data: {"a": 1}\n\n', b': a comment\n\n', b'data: {"b": "x y"}\n\n', b"data: [DONE]\n\n"]
WANT = [b'{"a": 1}', b'{"b": "x y"}', b"[DONE]"]


async def _serve(mode: str, seen: list[dict]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_line = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers["content-length"]))
        seen.append({"line": request_line.decode().strip(), "headers": headers,
                     "body": json.loads(body)})
        if mode == "error":
            msg = b'{"error": "no such model"}'
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(msg), msg))
        elif mode == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            stream = b"".join(EVENTS)
            for i in range(0, len(stream), 7):  # events split across chunks
                piece = stream[i:i + 7]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            writer.write(b"0\r\n\r\n")
        elif mode == "length":
            stream = b"".join(e.replace(b"\n", b"\r\n") for e in EVENTS)  # CRLF events
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(stream), stream))
        else:  # close-delimited
            writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + b"".join(EVENTS))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _collect(mode: str):
    seen: list[dict] = []
    server, port = await _serve(mode, seen)
    async with server:
        url = f"http://127.0.0.1:{port}/v1/completions?x=1"
        events = [e async for e in stream_events(url, b'{"prompt": "hi"}')]
    return events, seen


@pytest.mark.parametrize("mode", ["chunked", "length", "close"])
def test_events_come_back_in_order_whatever_the_framing(mode):
    events, seen = asyncio.run(_collect(mode))
    assert events == WANT
    assert seen[0]["line"] == "POST /v1/completions?x=1 HTTP/1.1"
    assert seen[0]["body"] == {"prompt": "hi"}
    assert seen[0]["headers"]["content-type"] == "application/json"


def test_an_error_status_raises_with_the_body():
    with pytest.raises(HTTPStatusError, match="HTTP 404.*no such model") as info:
        asyncio.run(_collect("error"))
    assert info.value.status == 404


def test_a_url_that_is_not_http_is_refused_by_name():
    async def go():
        return [e async for e in stream_events("ftp://example.com/x", b"{}")]

    with pytest.raises(ValueError, match="ftp://example.com/x"):
        asyncio.run(go())

"""A lean HTTP/1.1 client for one streamed POST (server-sent events), for the serving
benchmark.

A benchmark client must cost the machine little per token, or the latencies it reports are
its own: with 64 streams of a fast model, tens of thousands of events a second arrive,
and a general-purpose client spends most of a core on them. This one opens a connection
per request over asyncio streams (``Connection: close``), decodes chunked,
length-delimited or close-delimited bodies, and yields each event's ``data`` payload
as bytes, leaving JSON decoding to the caller.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

READ_SIZE = 1 << 16


class HTTPStatusError(Exception):
    """The server answered with a status other than 200."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status
        self.body = body


async def stream_events(url: str, payload: bytes,
                        headers: dict[str, str] | None = None) -> AsyncIterator[bytes]:
    """POST ``payload`` (JSON) to ``url`` and yield the ``data`` field of every event of
    the streamed response, in order. Raises HTTPStatusError for a non-200 answer,
    ValueError for a URL or response this client cannot read, OSError on connection
    failures."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"cannot stream from {url!r}: expected an http:// or https:// URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    context = ssl.create_default_context() if parts.scheme == "https" else None
    reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=context,
                                                   limit=READ_SIZE)
    try:
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        head = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}",
                "Content-Type: application/json", "Accept: text/event-stream",
                f"Content-Length: {len(payload)}", "Connection: close"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
        await writer.drain()
        status, response_headers = await _read_head(reader)
        body = _body(reader, response_headers)
        if status != 200:
            text = b"".join([piece async for piece in body])
            raise HTTPStatusError(status, text.decode("utf-8", "replace"))
        buffer = b""
        async for piece in body:
            buffer += piece
            if b"\r" in buffer and not buffer.endswith(b"\r"):
                buffer = buffer.replace(b"\r\n", b"\n")
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].lstrip(b" ")
    finally:
        writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    fields = status_line.split(None, 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/") or not fields[1].isdigit():
        raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(fields[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, Any]) -> AsyncIterator[bytes]:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise ValueError(f"bad chunk size line {size_line[:40]!r}") from None
            if size == 0:
                return
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            yield data[:-2]
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, READ_SIZE))
            if not data:
                raise ValueError("the connection closed inside the response body")
            left -= len(data)
            yield data
    else:
        while data := await reader.read(READ_SIZE):
            yield data

"""A small HTTP/1.1 client over asyncio streams for the load tests: cheap enough to open hundreds of
connections a second on a 2-core machine beside the server, and able to drop a connection at any
byte (before the answer, after its head, mid-stream, at its end) the way a vanished client does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    events: list[Any] = field(default_factory=list)  # SSE payloads, "[DONE]" last


class Connection:
    """One request on its own connection (`Connection: close`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def post(cls, url: str, path: str, body: dict[str, Any]) -> Connection:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        content = json.dumps(body).encode()
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(content)}\r\nConnection: close\r\n\r\n".encode()
            + content
        )
        await writer.drain()
        return cls(reader, writer)

    async def head(self) -> Answer:
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return Answer(int(lines[0].split()[1]), headers)

    async def body(self, answer: Answer) -> Answer:
        """The whole body (Content-Length or chunked); SSE events parsed."""
        if "content-length" in answer.headers:
            answer.body = await self.reader.readexactly(int(answer.headers["content-length"]))
        else:
            async for chunk in self.chunks():
                answer.body += chunk
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            answer.events = parse_events(answer.body)
        return answer

    async def chunks(self):  # type: ignore[no-untyped-def]
        """The chunks of a chunked body, as they arrive."""
        while True:
            size = int((await self.reader.readline()).split(b";")[0], 16)
            if size == 0:
                await self.reader.readline()
                return
            data = await self.reader.readexactly(size + 2)
            yield data[:-2]

    def drop(self) -> None:
        """Close at once, without reading the rest (a reset, as when a client process dies)."""
        self.writer.transport.abort()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


def parse_events(body: bytes) -> list[Any]:
    events: list[Any] = []
    for block in body.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def request(url: str, path: str, body: dict[str, Any]) -> Answer:
    connection = await Connection.post(url, path, body)
    try:
        return await connection.body(await connection.head())
    finally:
        await connection.close()

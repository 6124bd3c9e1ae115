"""A server with nothing behind it, for what the benchmark's client alone costs a burst's TTFT.

It speaks just enough of the OpenAI API for benchmarks/openai_load.py (`GET /v1/models`, streamed
`POST /v1/completions` over kept-alive HTTP/1.1) and does no work: it holds each request until
`--burst` of them are in, then writes every held stream its first text chunk at the same instant,
as an engine's step hands out a burst's first tokens all at once; the rest of each stream follows
`--itl-ms` later in one write. TTFT against this server, from the burst's last request body on the
socket, is what the client (the OpenAI SDK on one event loop) and the sockets take to bring sixteen
first tokens that are ready together to the sixteen callers: a floor no server can go under on
this machine with this client.

    python -m benchmarks.null_server --port 8123 --model M --burst 16
"""

from __future__ import annotations

import argparse
import asyncio
import json

_CHUNKED_HEADERS = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(data: dict | str) -> bytes:
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return _chunk(f"data: {body}\n\n".encode())


class NullServer:
    def __init__(self, model: str, burst: int, itl_s: float) -> None:
        self.model, self.burst, self.itl_s = model, burst, itl_s
        self._held: list[tuple[asyncio.StreamWriter, str, asyncio.Future]] = []
        self._served = 0

    def _chunk_event(self, stream_id: str, choices: list[dict], **extra: object) -> bytes:
        return _event({"id": stream_id, "object": "text_completion", "created": 0, "model": self.model,
                       "choices": choices, **extra})

    def _text(self, stream_id: str, text: str, finish: str | None = None) -> bytes:
        return self._chunk_event(stream_id, [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}])

    async def _complete(self, writer: asyncio.StreamWriter, max_tokens: int) -> None:
        self._served += 1
        stream_id = f"cmpl-null-{self._served}"
        done = asyncio.get_running_loop().create_future()
        self._held.append((writer, stream_id, done))
        if len(self._held) >= self.burst:
            held, self._held = self._held, []
            for each, each_id, released in held:  # every first token of the burst at once
                each.write(_CHUNKED_HEADERS + self._text(each_id, " a"))
                released.set_result(None)
        await done
        await asyncio.sleep(self.itl_s)
        rest = [self._text(stream_id, " a") for _ in range(max_tokens - 2)]
        rest.append(self._text(stream_id, " a", finish="length"))
        usage = {"prompt_tokens": 0, "completion_tokens": max_tokens, "total_tokens": max_tokens}
        rest.append(self._chunk_event(stream_id, [], usage=usage))
        rest.append(_event("[DONE]") + _chunk(b""))
        writer.write(b"".join(rest))
        await writer.drain()

    def _models(self, writer: asyncio.StreamWriter) -> None:
        body = json.dumps({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "null"}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                method, path, _ = request_line.split(" ", 2)
                if method == "GET" and path.endswith("/models"):
                    self._models(writer)
                elif method == "POST" and path.endswith("/completions"):
                    await self._complete(writer, max(int(json.loads(body).get("max_tokens") or 16), 2))
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--burst", type=int, default=16, help="requests held until all their first tokens go out")
    parser.add_argument("--itl-ms", type=float, default=20.0, help="pause before the rest of each stream")
    args = parser.parse_args()
    server = NullServer(args.model, args.burst, args.itl_ms / 1000.0)
    listener = await asyncio.start_server(server.connection, "127.0.0.1", args.port)
    async with listener:
        await listener.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())

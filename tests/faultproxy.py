"""A fault-injecting HTTP proxy on loopback, for testing hsx against an unreliable S3.

`FaultProxy(upstream)` listens on a free loopback port and forwards each HTTP/1.1
request to `upstream` (SeaweedFS in the tests) byte for byte, so SigV4 signatures (which
cover the Host header the client sent) still verify. For a seeded fraction of requests
it misbehaves instead, as object stores and networks do:

- `error`: answers 503 SlowDown or 500 InternalError without forwarding;
- `drop`: closes the connection before forwarding (the request never happened);
- `lost`: forwards, lets the store act, then closes without answering (the request
  happened, the client does not know: the case that makes retried creates interesting);
- `truncate`: forwards and sends only the first half of the answer, then closes;
- `delay`: waits a little (up to `max_delay_s`), then forwards normally.

`Faults(latency_s=...)` adds a fixed wait to every request before it is forwarded: the
per-request latency of a remote object store (benchmarks/bench_s3.py's `--latency-ms`).

`ignore_conditional=True` emulates a store that ignores `If-None-Match: *`: a conditional
PUT the store refuses (412) is answered 200, as if it had replaced the object.

One asyncio loop in a daemon thread; every connection is closed after one exchange
(`Connection: close`), so a client never reuses a connection the proxy is about to drop.
`python tests/faultproxy.py UPSTREAM [--latency-ms N]` runs one in its own process (so
its Python work does not share the GIL of the process it serves), prints its endpoint on
the first line of stdout and forwards until stdin closes or it is killed.
A test utility, not product code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

FAULTS = ("error", "drop", "lost", "truncate", "delay")
_HEAD_LIMIT = 1 << 16
_CHUNK = 1 << 16


@dataclass
class Faults:
    """Probability of each fault per request (their sum is the fraction misbehaving)."""

    error: float = 0.0
    drop: float = 0.0
    lost: float = 0.0
    truncate: float = 0.0
    delay: float = 0.0
    max_delay_s: float = 0.3
    latency_s: float = 0.0  # every request waits this long before it is forwarded

    @property
    def failing(self) -> float:
        """The fraction of requests that do not get their answer (delays do)."""
        return self.error + self.drop + self.lost + self.truncate

    def pick(self, rng: random.Random) -> str | None:
        draw = rng.random()
        for name in FAULTS:
            draw -= getattr(self, name)
            if draw < 0:
                return name
        return None


@dataclass
class FaultProxy:
    """See the module docstring. Use as a context manager, or `start()` / `stop()`."""

    upstream: str  # http://host:port
    faults: Faults = field(default_factory=Faults)
    seed: int = 0
    ignore_conditional: bool = False
    stats: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        scheme, _, hostport = self.upstream.partition("://")
        if scheme != "http":
            raise ValueError(f"FaultProxy forwards plain HTTP only, not {self.upstream}")
        host, _, port = hostport.rstrip("/").rpartition(":")
        self._up = (host, int(port))
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._server = loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0, limit=_HEAD_LIMIT)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fault proxy did not start")

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is None or server is None:
            return

        async def close() -> None:
            server.close()
            await server.wait_closed()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = self._server = None

    def _decide(self) -> tuple[str | None, float]:
        """This request's fault (None: forward it as it is) and delay."""
        with self._lock:
            fault = self.faults.pick(self._rng)
            delay = self._rng.uniform(0, self.faults.max_delay_s)
            self.stats["requests"] += 1
            if fault is not None:
                self.stats[fault] += 1
            return fault, delay

    # -- one connection, one exchange

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await _read_message(reader, request=True)
            if request is None:
                return
            head, body = request
            fault, delay = self._decide()
            if fault == "drop":
                return
            if fault == "error":
                await _answer_error(writer, self._rng_status())
                return
            if fault == "delay":
                await asyncio.sleep(delay)
            if self.faults.latency_s > 0:
                await asyncio.sleep(self.faults.latency_s)
            await self._forward(head, body, writer, fault)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _rng_status(self) -> int:
        with self._lock:
            return 503 if self._rng.random() < 0.5 else 500

    async def _forward(self, head: bytes, body: bytes, client: asyncio.StreamWriter,
                       fault: str | None) -> None:
        lines = head.split(b"\r\n")
        kept = [line for line in lines[1:] if line and not line.lower().startswith(
            (b"connection:", b"keep-alive:", b"proxy-connection:"))]
        conditional = any(line.lower().startswith(b"if-none-match:") for line in kept)
        method = lines[0].split(b" ", 1)[0]
        out = b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""])
        up_reader, up_writer = await asyncio.open_connection(*self._up, limit=_HEAD_LIMIT)
        try:
            up_writer.write(out + body)
            await up_writer.drain()
            answer = await _read_message(up_reader, request=False, method=method)
        finally:
            up_writer.close()
            with contextlib.suppress(Exception):
                await up_writer.wait_closed()
        if answer is None:
            return
        rhead, rbody = answer
        if fault == "lost":
            return
        status = int(rhead.split(b" ", 2)[1])
        if self.ignore_conditional and conditional and status == 412:
            with self._lock:
                self.stats["412 answered 200"] += 1
            rhead = (b'HTTP/1.1 200 OK\r\nETag: "ignored-condition"\r\n'
                     b"Last-Modified: Mon, 30 Nov 2026 00:00:00 GMT\r\nContent-Length: 0")
            rbody = b""
        rlines = [line for line in rhead.split(b"\r\n") if line and not line.lower().startswith(
            (b"connection:", b"keep-alive:"))]
        data = b"\r\n".join([*rlines, b"Connection: close", b"", b""]) + rbody
        if fault == "truncate":
            data = data[: max(len(data) // 2, 1)]
        for i in range(0, len(data), _CHUNK):
            client.write(data[i : i + _CHUNK])
            await client.drain()


async def _answer_error(writer: asyncio.StreamWriter, status: int) -> None:
    code, reason = ("SlowDown", "Slow Down") if status == 503 else (
        "InternalError", "Internal Server Error")
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>injected by the fault proxy</Message></Error>").encode()
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
    )
    await writer.drain()


async def _read_message(reader: asyncio.StreamReader, *, request: bool,
                        method: bytes = b"GET") -> tuple[bytes, bytes] | None:
    """(head without its final CRLFs, body) of one HTTP/1.1 message; None at EOF."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as err:
        if not err.partial:
            return None
        raise
    head = raw[:-4]
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if not request:
        status = int(head.split(b" ", 2)[1])
        if method == b"HEAD" or status in (204, 304) or 100 <= status < 200:
            return head, b""
    if b"content-length" in headers:
        return head, await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        # Forwarded as it came (chunked), so the head's framing stays right.
        parts = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            parts.append(size_line)
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = await reader.readuntil(b"\r\n")
                    parts.append(trailer)
                    if trailer == b"\r\n":
                        return head, b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    if request:
        return head, b""
    return head, await reader.read()  # delimited by the end of the connection


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A loopback HTTP proxy with a fixed latency.")
    p.add_argument("upstream", help="http://host:port to forward to")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="wait before forwarding each request (default 0)")
    args = p.parse_args(argv)
    with FaultProxy(args.upstream, Faults(latency_s=args.latency_ms / 1000)) as proxy:
        print(proxy.endpoint, flush=True)
        sys.stdin.read()  # until the parent closes the pipe
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Limits on a connection's request head, below the ASGI app: how many bytes of request line and
headers a client may send and how long it may take, on uvicorn's own HTTP protocols."""

from __future__ import annotations

import asyncio
from typing import Any

def _answer(status: str, text: str) -> bytes:
    body = text.encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


HEADERS_TOO_LARGE = _answer("431 Request Header Fields Too Large", "request headers exceed this server's limit")
HEADER_TIMEOUT = _answer("408 Request Timeout", "request headers took too long to arrive")


def _base_protocol(http: str) -> type:
    """uvicorn's protocol class for ``http`` ("auto": httptools when installed, else h11)."""
    if http == "auto":
        try:
            import httptools  # noqa: F401

            http = "httptools"
        except ImportError:
            http = "h11"
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    if http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    raise ValueError(f"http={http!r}: use auto, httptools or h11")


def head_limited_protocol(*, max_header_bytes: int, header_timeout_s: float, http: str = "auto") -> type:
    """A subclass of uvicorn's HTTP protocol that answers 431 and closes the connection once a
    request's line and headers pass ``max_header_bytes``, and 408 once they have taken longer
    than ``header_timeout_s`` (a slowloris client). The clock starts with the connection, or
    with the first byte of a later request on a kept-alive connection (idle time between
    requests is uvicorn's ``timeout_keep_alive``), and stops when the headers are complete;
    bodies are the app's business (``max_request_bytes``)."""
    base = _base_protocol(http)

    class HeadLimitedProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_bytes, self._head_tail = 0, b""
            self._head_of = self.cycle  # a new cycle object = this request's headers are complete
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_expired)

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._head_bytes, self._head_of = 0, self.cycle  # a new request on a kept-alive connection
                self._head_tail = b""
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_expired)
            if self._head_timer is not None:
                # the head's bytes: up to the blank line that ends it (a body may follow in the same read)
                seen = self._head_tail + data
                end = seen.find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else max(end + 4 - len(self._head_tail), 0)
                self._head_tail = seen[-3:]
                if self._head_bytes > max_header_bytes:
                    self._refuse(HEADERS_TOO_LARGE)
                    return
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not None and self.cycle is not self._head_of:
                self._stop_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle is self._head_of:  # still reading headers
                self._refuse(HEADER_TIMEOUT)

        def _refuse(self, answer: bytes) -> None:
            self._stop_head_timer()
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    HeadLimitedProtocol.__name__ = HeadLimitedProtocol.__qualname__ = f"HeadLimited{base.__name__}"
    return HeadLimitedProtocol


def uvicorn_limits(config: Any, *, http: str = "auto") -> dict[str, Any]:
    """uvicorn.Config keyword arguments for a ``ServerConfig``'s connection limits."""
    return {"http": head_limited_protocol(max_header_bytes=config.max_header_bytes,
                                          header_timeout_s=config.header_timeout_s, http=http),
            "h11_max_incomplete_event_size": config.max_header_bytes,
            "timeout_keep_alive": config.keep_alive_timeout_s}

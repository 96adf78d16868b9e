"""A bound on the time a client may take to send a request's headers (nginx's client_header_timeout).

uvicorn has none: a connection that sends part of a request line, or nothing, and then waits is held
for as long as the client likes, and enough of them (slowloris) take every socket the server has. Here
the clock starts when a connection opens, and again at the first byte of a next request on a connection
kept alive (--timeout-keep-alive bounds the wait between requests); it stops once the headers
are complete, when uvicorn starts the request. At the bound the connection is closed without an answer,
as nginx does (a 408 on a connection kept alive could be read as the answer to the client's next request).
"""

from __future__ import annotations

import asyncio


def with_header_timeout(protocol_class: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """`protocol_class` (uvicorn's httptools or h11 protocol) with the header timeout."""

    class HeaderTimeoutProtocol(protocol_class):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_header_clock()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._between_requests():
                self._start_header_clock()
            super().data_received(data)
            if not self._between_requests():  # the headers are complete: a request cycle runs
                self._stop_header_clock()

        def connection_lost(self, exc) -> None:
            self._stop_header_clock()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _start_header_clock(self) -> None:
            self._header_timer = asyncio.get_running_loop().call_later(timeout_s, self._headers_timed_out)

        def _stop_header_clock(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol

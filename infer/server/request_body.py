"""A request's body on its way to the routes: bounded in size, JSON in UTF-8, and read to its end even when
the answer comes first (a pure ASGI middleware: streaming untouched).

    Content-Length over --max-request-bytes      413 at once, before a byte of the body is read
    a chunked body that passes the bound         413 as soon as it does
    JSON with a charset other than UTF-8         415 at once (RFC 8259: JSON between systems is UTF-8)
    a UTF-16 or UTF-32 JSON body                 415 at its first bytes (a byte-order mark, or NUL bytes,
                                                 which UTF-8 JSON never has; Python's json would decode it)

Lingering read: an answer sent before the body was read to its end (these, a 401, ...) is followed by
reading the rest of the body and discarding it, as nginx's lingering close does, and only then is the
response ended. A client still sending (urllib sends a 20 MB body in one go, with `Connection: close`)
would otherwise see the connection reset, as the kernel resets a socket closed with unread data, and
never read the answer. The read is bounded: LINGER_MAX_BYTES, LINGER_MAX_S. A client that asked
`Expect: 100-continue` and was never told to continue sends no body, so nothing is read for it.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException

from infer.server.protocol import APIError

# a 20 MB body over a 4 MiB bound is read to its end; a client sending beyond both may see a reset
LINGER_MAX_BYTES = 64 * 2**20
LINGER_MAX_S = 5.0
UTF8_CHARSETS = ("utf-8", "utf8")


def is_json(content_type: str) -> bool:
    """application/json or any application/*+json (as FastAPI and OpenAI's API take them)."""
    subtype = content_type.split(";", 1)[0].strip().lower()
    return subtype == "application/json" or (subtype.startswith("application/") and subtype.endswith("+json"))


def charset(content_type: str) -> str | None:
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


class RequestBody:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes
        self.too_large = (
            f"the request body is larger than the server's --max-request-bytes ({max_bytes} bytes)"
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = _Body(scope, receive, self.max_bytes, self.too_large)

        async def send_then_linger(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body") and body.unread:
                await send({**message, "more_body": True})  # the whole answer reaches the client first
                await body.discard_rest()
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        refusal = body.refusal()
        if refusal is not None:
            return await refusal.response()(scope, body.receive, send_then_linger)
        await self.app(scope, body.receive, send_then_linger)


class _Body:
    """One request's body as the app reads it: counted, its first bytes checked, and what is left of it."""

    def __init__(self, scope, receive, max_bytes: int, too_large: str):
        self.scope, self._receive, self.max_bytes, self.too_large = scope, receive, max_bytes, too_large
        headers = dict(scope["headers"])
        self.length = headers.get(b"content-length")
        self.content_type = headers.get(b"content-type", b"").decode("latin-1")
        self.done = self.length in (None, b"0") and b"transfer-encoding" not in headers
        # uvicorn tells a client that asked to wait for it to send the body on the first read, not before
        self.awaits_continue = headers.get(b"expect", b"").lower() == b"100-continue"
        self.received = 0
        self.head = b"" if is_json(self.content_type) else None  # JSON's first bytes, until checked

    @property
    def unread(self) -> bool:
        """Body bytes that the client is sending and nobody has read."""
        return not self.done and not self.awaits_continue

    def error(self, status: int, detail: str) -> APIError:
        return APIError(status, f"{self.scope['method']} {self.scope['path']}: {detail}")

    def refusal(self) -> APIError | None:
        """What the headers alone refuse."""
        if self.length is not None and (not self.length.isdigit() or int(self.length) > self.max_bytes):
            return self.error(413, self.too_large)
        declared = charset(self.content_type)
        if self.head is not None and declared is not None and declared not in UTF8_CHARSETS:
            hint = "send JSON encoded as UTF-8 (charset=utf-8, or none)"
            return self.error(415, f"charset={declared} is not supported: {hint}")
        return None

    async def receive(self):
        message = await self._receive()
        self.awaits_continue = False
        if message["type"] != "http.request":
            self.done = True  # http.disconnect: nothing more will come
            return message
        chunk = message.get("body", b"")
        self.received += len(chunk)
        self.done = not message.get("more_body", False)
        if self.received > self.max_bytes:
            raise HTTPException(413, self.too_large)  # FastAPI passes an HTTPException from reading through
        if self.head is not None:
            self._check_encoding(chunk)
        return message

    def _check_encoding(self, chunk: bytes) -> None:
        self.head += chunk[: 4 - len(self.head)]
        if len(self.head) < 4 and not self.done:
            return
        head, self.head = self.head, None
        if head.startswith((b"\xfe\xff", b"\xff\xfe")) or b"\x00" in head:
            raise HTTPException(
                415,
                f"the body is not UTF-8: it starts with bytes {head.hex(' ')}, as UTF-16 or UTF-32 text "
                "does; send JSON encoded as UTF-8",
            )

    async def discard_rest(self) -> None:
        discarded = 0
        try:
            async with asyncio.timeout(LINGER_MAX_S):
                while not self.done and discarded < LINGER_MAX_BYTES:
                    message = await self._receive()
                    discarded += len(message.get("body", b""))
                    self.done = message["type"] != "http.request" or not message.get("more_body", False)
        except TimeoutError:
            pass

"""API keys: the `--api-key` / `--api-key-file` values, the check of `Authorization: Bearer KEY`, and the
owner a key makes of what it stores.

One key is one owner. A request's owner is the SHA-256 of its key, so that nothing the server keeps per
request (a stored response) holds a key itself; with no key configured every request has the one
anonymous owner "". A stored response answers only its owner (infer.server.responses).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from starlette.requests import Request

from infer.server.protocol import APIError

ANONYMOUS = ""
_OWNER = "infer.owner"  # the key in the ASGI scope's "state", which Request.state reads

# Routes behind the keys: the API (vLLM's /tokenize and /detokenize too, which sit outside /v1), and what
# shows the server's configuration or its traffic (/debug/trace).
_KEYED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/server_info", "/debug", "/models")


def split_keys(values: list[str]) -> list[str]:
    """--api-key values: each one key or several, comma-separated (llama.cpp's form)."""
    return [key.strip() for value in values for key in value.split(",")]


def read_key_file(path: Path) -> list[str]:
    """One key a line; blank lines and lines starting with # are left out (llama.cpp's --api-key-file)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"--api-key-file {path} is not UTF-8 text: {exc}") from exc
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key: write one key a line (# starts a comment)")
    return keys


def check_keys(keys: list[str]) -> tuple[str, ...]:
    """The keys, each once, in order. A key a client cannot send in a header is refused at start-up."""
    for key in keys:
        if not key:
            raise ValueError("--api-key: an empty key; give a key, or leave --api-key out")
        if not (key.isascii() and key.isprintable()) or " " in key:
            raise ValueError(
                "--api-key: a key must be printable ASCII without spaces (it travels in an HTTP header)"
            )
    return tuple(dict.fromkeys(keys))


def owner_of(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


def request_owner(request: Request) -> str:
    """The owner of the request's key (ANONYMOUS when the server has none)."""
    return request.scope.get("state", {}).get(_OWNER, ANONYMOUS)


def same_owner(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` with one of the keys on every route of _KEYED_PREFIXES; the request's
    owner goes into its scope (a pure ASGI middleware: streaming untouched). It knows the keys' digests
    alone, and compares the presented key's with every one of them in constant time."""

    def __init__(self, app, owners: tuple[str, ...]):
        self.app = app
        self.owners = [owner.encode() for owner in owners]

    def _owner(self, auth: bytes | None) -> str | None:
        if auth is None or not auth.startswith(b"Bearer "):
            return None
        presented = owner_of(auth.removeprefix(b"Bearer ")).encode()
        match = None
        for owner in self.owners:  # no early exit: the time does not tell which key matched
            if hmac.compare_digest(presented, owner):
                match = owner
        return None if match is None else match.decode()

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith(_KEYED_PREFIXES)
            and scope["method"] != "OPTIONS"
        ):
            auth = dict(scope["headers"]).get(b"authorization")
            owner = self._owner(auth)
            if owner is None:
                message = "missing API key" if auth is None else "incorrect API key provided"
                error = APIError(
                    401,
                    f"{message}: send `Authorization: Bearer KEY` with one of the server's API keys",
                    "authentication_error",
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
            scope.setdefault("state", {})[_OWNER] = owner
        await self.app(scope, receive, send)

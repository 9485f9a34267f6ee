"""API keys: where they come from, and checking a request's bearer token against them."""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable

from services.gateway.errors import APIError

API_KEYS_ENV = "HINTSERVE_API_KEYS"  # comma-separated
ADMIN_KEY_ENV = "HINTSERVE_ADMIN_KEY"


def load_api_keys(env_value: str | None = None, key_file: str | None = None) -> list[str]:
    """Keys from the env value (comma-separated) and a file (one per line, `#` comments)."""
    keys = [k.strip() for k in (env_value or "").split(",") if k.strip()]
    if key_file:
        if not os.path.isfile(key_file):
            raise FileNotFoundError(f"--api-key-file not found: {key_file}")
        try:
            with open(key_file, encoding="utf-8") as f:
                keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        except OSError as exc:  # unreadable (permissions, a device): one line, not a traceback
            raise ValueError(f"--api-key-file {key_file}: cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--api-key-file {key_file}: not UTF-8 text") from None
    return keys


def unauthorized(message: str, invalid: bool = False) -> APIError:
    """A 401 with the WWW-Authenticate challenge RFC 9110 requires (RFC 6750's error for a wrong token)."""
    challenge = 'Bearer realm="hintserve"' + (', error="invalid_token"' if invalid else "")
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": challenge})


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(token: str | None, keys: Iterable[str]) -> bool:
    if token is None:
        return False
    # compare_digest against every key: the time taken does not tell which prefix matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token.encode(), key.encode())
    return matched


class Authenticator:
    """Checks `Authorization: Bearer <key>`; `keys=None` means authentication is off (explicitly chosen)."""

    def __init__(self, keys: Iterable[str] | None) -> None:
        self.keys = None if keys is None else tuple(keys)
        if self.keys is not None and not self.keys:
            raise ValueError("authentication is on but no API key is configured")

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def check(self, authorization: str | None) -> None:
        if self.keys is None:
            return
        token = bearer_token(authorization)
        if token is None:
            raise unauthorized("missing API key: send it as 'Authorization: Bearer <key>'")
        if not key_matches(token, self.keys):
            raise unauthorized("incorrect API key provided", invalid=True)

    def accepts(self, authorization: str | None) -> bool:
        """Whether the request may see what only key holders see (always, with authentication off)."""
        return self.keys is None or key_matches(bearer_token(authorization), self.keys)

    @property
    def any_key(self) -> str | None:
        """A key the gateway can use to call itself (the replay endpoint's load generator)."""
        return self.keys[0] if self.keys else None

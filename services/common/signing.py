"""Signed broker messages: Redis is a trust boundary. With a shared secret in HINTSERVE_BROKER_SECRET (set on
the engines and the predictor alike, as the API keys are), every context batch and hint batch carries an
HMAC-SHA256 of its payload; a message without a valid one is dropped by its reader, so a client that can
write to Redis but does not know the secret can neither feed the predictor (nor take its model slots, nor
get into its snapshots) nor send hints to an engine. Without the secret, messages travel unsigned as before.
"""

from __future__ import annotations

import hashlib
import hmac
import os

SECRET_ENV = "HINTSERVE_BROKER_SECRET"
_MAGIC = b"HSIG1"
_MAC_BYTES = 32


class Sealer:
    def __init__(self, secret: str | bytes | None) -> None:
        self.secret = secret.encode() if isinstance(secret, str) else secret

    @classmethod
    def from_env(cls) -> Sealer:
        return cls(os.environ.get(SECRET_ENV) or None)

    @property
    def enabled(self) -> bool:
        return bool(self.secret)

    def seal(self, payload: bytes) -> bytes:
        if not self.secret:
            return payload
        return _MAGIC + hmac.new(self.secret, payload, hashlib.sha256).digest() + payload

    def open(self, data: bytes) -> tuple[bytes | None, str]:
        """(payload, "") when the message is authentic (or signing is off), else (None, why)."""
        if not self.secret:
            return data, ""
        if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + _MAC_BYTES:
            return None, "unsigned"
        mac, payload = data[len(_MAGIC) : len(_MAGIC) + _MAC_BYTES], data[len(_MAGIC) + _MAC_BYTES :]
        if not hmac.compare_digest(mac, hmac.new(self.secret, payload, hashlib.sha256).digest()):
            return None, "bad_signature"
        return payload, ""

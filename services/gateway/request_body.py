"""Request bodies from bytes to validated models: JSON depth bound, strict schema, valid UTF-8 strings.

Each failure is a 400 naming the field; nothing in a body can reach a handler as a Python exception.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from services.engine.sampling_params import is_valid_utf8
from services.gateway.errors import bad_request

M = TypeVar("M", bound=BaseModel)

MAX_JSON_DEPTH = 32  # our schemas nest 4 deep; the json module's C parser recurses once per level
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects, counted without parsing (strings are skipped)."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate((_DEPTH_STEP[b] for b in brackets), initial=0))


def _first_invalid_string(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, else None."""
    if isinstance(value, str):
        return None if is_valid_utf8(value) else path or "body"
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if not is_valid_utf8(key):
                return path or "body"
            found = _first_invalid_string(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_invalid_string(item, f"{path}[{i}]")
            if found:
                return found
    return None


def parse_json(body: bytes) -> Any:
    if json_depth(body) > MAX_JSON_DEPTH:
        raise bad_request(f"JSON body nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from exc
    where = _first_invalid_string(obj, "")
    if where is not None:
        raise bad_request(f"{where}: strings must be valid UTF-8 (lone surrogate)", param=where)
    return obj


def parse_request(body: bytes, model: type[M]) -> M:
    obj = parse_json(body)
    if not isinstance(obj, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param=param) from exc

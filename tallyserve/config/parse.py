"""Parsing helpers the configuration types share."""

from __future__ import annotations

import json
from typing import Any


def json_object_arg(name: str, value: Any, what: str = "a JSON object") -> dict:
    """A dict given as a dict or as its JSON text (a flag's value); ValueError naming ``name``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be {what}, got {type(value).__name__}")
    return value

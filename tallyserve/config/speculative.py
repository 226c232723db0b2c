"""SpeculativeConfig: validated `speculative_config` (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tallyserve.config.parse import json_object_arg

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: Optional[str] = None  # the draft model (same tokenizer), for method "draft_model"

    @classmethod
    def parse(cls, raw: Any) -> Optional["SpeculativeConfig"]:
        """None, a dict, or a JSON string like '{"method": "ngram", "num_speculative_tokens": 4}'."""
        if raw is None:
            return None
        if isinstance(raw, SpeculativeConfig):
            return raw
        raw = json_object_arg("speculative_config", raw)
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        method = raw.get("method", "draft_model" if raw.get("model") else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        cfg = cls(
            method=method,
            num_speculative_tokens=raw.get("num_speculative_tokens"),
            prompt_lookup_min=raw.get("prompt_lookup_min", 1),
            prompt_lookup_max=raw.get("prompt_lookup_max", 3),
            model=raw.get("model"),
        )
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        for name, lo, hi in (("num_speculative_tokens", 1, 16), ("prompt_lookup_min", 1, 64),
                             ("prompt_lookup_max", 1, 64)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"speculative_config.{name} must be an integer in [{lo}, {hi}], got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model (the draft model) is required for method 'draft_model'")

"""RequestOutput / CompletionOutput, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's PromptLogprobs: one entry per prompt token, None for the first (nothing predicts it).
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: Optional[str] = None
    metrics: dict = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: the prompt token and the top-k at each prompt position
    # (the raw model distribution), complete once the request has produced its first token.
    prompt_logprobs: Optional[PromptLogprobs] = None
    kv_transfer_params: Optional[dict] = None  # disaggregated serving: what a consumer needs (vLLM's name)

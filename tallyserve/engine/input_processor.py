"""InputProcessor: a request validated and tokenized once, into the EngineCoreRequest the core admits.

Every check a request meets before it reaches the scheduler lives here, each in one place: the prompt's
form, tokenization, token-id ranges, the prompt length, logprob caps, n against max_num_seqs, bad words
tokenized, the priority's type and disaggregated serving's kv_transfer_params. The offline engine
(`LLMEngine.add_request`) and the asynchronous front end (`AsyncLLMEngine.generate`) both call
`process`; the server calls the same checks earlier (`check_params`, `check_prompt_ids`) so that a bad
field is a 400 naming it. The engine core never validates again: `LLMEngine.add_core_request` takes the
result as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from tallyserve.config import check_prompt_length
from tallyserve.sampling_params import SamplingParams, check_unicode
from tallyserve.tokenizer import Tokenizer
from tallyserve.distributed.kv_transfer.factory import check_request_params

PromptType = Union[str, list[int], dict[str, Any]]


class InputError(ValueError):
    """A request the engine refuses. ``param`` names the request field at fault (the server's 400 names it)."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class EngineCoreRequest:
    """A validated, tokenized request: what the engine core admits (in this process or in its own)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams  # bad_words already tokenized
    max_tokens: int
    priority: int = 0
    arrival_time: Optional[float] = None
    kv_transfer_params: Optional[dict] = None


class InputProcessor:
    """The request checks of one engine. ``kv_connector``: the scheduler half of disaggregated serving,
    which checks kv_transfer_params (None: a request carrying them is refused)."""

    def __init__(self, tokenizer: Optional[Tokenizer], vocab_size: int, max_model_len: int, max_logprobs: int,
                 max_num_seqs: int, kv_connector: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = min(max_logprobs, vocab_size)
        self.max_num_seqs = max_num_seqs
        self.kv_connector = kv_connector

    # ----------------------------------------------------------------- prompts
    def process_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """A prompt string, {"prompt": str}, {"prompt_token_ids": [...]} or a list of ids -> (text, ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise InputError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("this model has no tokenizer: pass {'prompt_token_ids': [...]} instead of text",
                                 "prompt")
            ids = self.tokenizer.encode(check_unicode("prompt", prompt))
            if not ids:
                raise InputError("prompt must not be empty", "prompt")
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            return None, self.check_token_ids(prompt)
        raise InputError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}",
                         "prompt")

    def check_token_ids(self, ids: Any, param: str = "prompt") -> list[int]:
        """A non-empty list of ints, each in the vocabulary."""
        vocab = self.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InputError("prompt_token_ids must be a non-empty list of ints", param)
        if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab:  # C loops: a long prompt costs ~1 ms
            return list(ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InputError(f"prompt token id {t!r} is out of range [0, {vocab})", param)
        return list(ids)

    def check_prompt_length(self, num_prompt_tokens: int, max_tokens: Optional[int] = None) -> None:
        """The prompt leaves room for a token (and, given ``max_tokens``, for all of them):
        ContextLengthError (a ValueError) naming "prompt" or "max_tokens"."""
        check_prompt_length(num_prompt_tokens, self.max_model_len, max_tokens)

    # ----------------------------------------------------------------- sampling parameters
    def check_params(self, params: SamplingParams) -> SamplingParams:
        """The checks that depend on this engine (SamplingParams checked the rest when it was built);
        returns ``params`` with its bad_words tokenized."""
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise InputError(f"{name} must be <= max_logprobs ({self.max_logprobs}), got {k}", name)
        vocab = self.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InputError(f"{name} token id {bad[0]} is out of range [0, {vocab})", name)
        if params.n > self.max_num_seqs:
            raise InputError(f"n must be at most max_num_seqs ({self.max_num_seqs}): all n sequences of a request "
                             f"run in one batch; got {params.n}", "n")
        if params.bad_words and not params.bad_words_token_ids:
            if self.tokenizer is None:
                raise InputError("bad_words needs a tokenizer: pass bad_words_token_ids instead", "bad_words")
            params = params.with_bad_words_tokenized(self.tokenizer)
        return params

    def check_kv_transfer_params(self, kv_transfer_params: Optional[dict], num_prompt_tokens: int,
                                 params: SamplingParams) -> Optional[dict]:
        if kv_transfer_params is None:
            return None

        kv_transfer_params = check_request_params(self.kv_connector, kv_transfer_params, num_prompt_tokens, params.n)
        if kv_transfer_params and kv_transfer_params.get("do_remote_prefill") and params.prompt_logprobs is not None:
            raise InputError("prompt_logprobs cannot be computed from a remote prefill's KV: ask the prefill "
                             "instance for them, or send the request without kv_transfer_params", "prompt_logprobs")
        return kv_transfer_params

    # ----------------------------------------------------------------- the whole request
    def process(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                priority: int = 0, arrival_time: Optional[float] = None,
                kv_transfer_params: Optional[dict] = None) -> EngineCoreRequest:
        params = self.check_params(params or SamplingParams())
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InputError(f"priority must be an int, got {priority!r}", "priority")
        text, ids = self.process_prompt(prompt)
        self.check_prompt_length(len(ids))
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if isinstance(prompt, dict) and "kv_transfer_params" in prompt:  # the server passes them with the prompt
            kv_transfer_params = prompt["kv_transfer_params"]
        kv_transfer_params = self.check_kv_transfer_params(kv_transfer_params, len(ids), params)
        return EngineCoreRequest(request_id, text, ids, params, max_tokens, priority, arrival_time,
                                 kv_transfer_params)

"""The catalogue of request fields of POST /v1/completions and POST /v1/chat/completions: every
field of OpenAI's request bodies and of vLLM's CompletionRequest / ChatCompletionRequest, each
either honoured or unsupported (with why).

The rule the server applies (serving.check_unsupported):
- honoured: parsed by the request model (protocol.py) and applied; invalid values are 400s of
  their own (ranges, types, the few documented combinations such as echo with logprobs).
- unsupported: accepted only when absent, null, or set to one of its `harmless` values (the
  default or a value that asks for exactly what tallyserve does anyway, e.g. `function_call:
  "none"`, `store: false`, `priority: 0`, `spaces_between_special_tokens: true`, an identifier
  such as `prompt_cache_key`); any other value is a 400 with code "unsupported_parameter" whose
  param is the field, so a client never believes a constraint (a JSON schema, a regex, a
  tool call...) held when it did not. Harmless values compare by JSON type too (`priority: false` is not `0`).
- nested: `stream_options.continuous_usage_stats` (vLLM's) is accepted only false.
- neither (unknown to OpenAI and vLLM): ignored, with one warning per field name per process
  (OpenAI clients add fields over time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Union

HONOURED = "honoured"
UNSUPPORTED = "unsupported"

COMPLETIONS = "completions"
CHAT = "chat"


def ANY_STRING(value: Any) -> bool:
    """A harmless-value predicate: any string (an identifier or a hint that changes no output)."""
    return isinstance(value, str)


def ANY_BOOL(value: Any) -> bool:
    return isinstance(value, bool)


def TEXT_FORMAT(value: Any) -> bool:
    """response_format asking for plain text: {"type": "text"} (or no type)."""
    return isinstance(value, dict) and set(value) <= {"type"} and value.get("type", "text") == "text"


_DESCRIBED = {ANY_STRING: "any string", ANY_BOOL: "true or false", TEXT_FORMAT: '{"type": "text"}'}
Harmless = Union[Any, Callable[[Any], bool]]


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


@dataclass(frozen=True)
class FieldInfo:
    status: str
    reason: str
    harmless: tuple = ()  # unsupported only: values (or predicates) accepted as no-ops besides null

    def accepts(self, value: Any) -> bool:
        """Whether `value` of an unsupported field is a harmless no-op (null always is)."""
        if value is None or self.status == HONOURED:
            return True
        for h in self.harmless:
            if callable(h):
                if h(value):
                    return True
            elif _json(h) == _json(value):
                return True
        return False

    def harmless_text(self) -> str:
        """The accepted values, for error messages: 'null', 'null or false', ..."""
        shown = ["null"] + [_DESCRIBED.get(h, "?") if callable(h) else _json(h) for h in self.harmless]
        return ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0]


def _h(reason: str) -> FieldInfo:
    return FieldInfo(HONOURED, reason)


def _u(reason: str, *harmless: Harmless) -> FieldInfo:
    return FieldInfo(UNSUPPORTED, reason, tuple(harmless))


# --------------------------------------------------------------------------- shared by both endpoints

_SHARED: dict[str, FieldInfo] = {
    # OpenAI
    "model": _h("must name the served model (404 otherwise)"),
    "frequency_penalty": _h("OpenAI's formula on output tokens"),
    "presence_penalty": _h("OpenAI's formula on output tokens"),
    "logit_bias": _h("token id -> bias, ids checked against the vocabulary"),
    "max_tokens": _h("output length limit"),
    "n": _h("choices per prompt (at most 128)"),
    "seed": _h("per-request sampling seed"),
    "stop": _h("stop strings, never split inside returned text"),
    "stream": _h("server-sent events"),
    "stream_options": _h("include_usage honoured; continuous_usage_stats only false"),
    "temperature": _h("0 is greedy"),
    "top_p": _h("nucleus sampling"),
    "user": _h("an end-user identifier: accepted, changes no output"),
    "metadata": _h("OpenAI's string pairs (at most 16 keys of up to 64 characters, values of up to 512): "
                   "nothing is stored, the response object echoes them (stream chunks do not)"),
    "best_of": _h("with use_beam_search the beam width; otherwise only equal to n"),
    # vLLM sampling extras
    "use_beam_search": _h("beam search (no streaming, stop strings, logprobs, penalties)"),
    "top_k": _h("top-k sampling"),
    "min_p": _h("min-p sampling"),
    "repetition_penalty": _h("Hugging Face's formula on prompt and output tokens"),
    "length_penalty": _h("beam search score = cum_logprob / length ** length_penalty"),
    "stop_token_ids": _h("stop on these token ids"),
    "include_stop_str_in_output": _h("keep the matched stop string"),
    "ignore_eos": _h("generate past EOS"),
    "min_tokens": _h("no EOS / stop before this many tokens"),
    "skip_special_tokens": _h("detokenization"),
    "allowed_token_ids": _h("restrict sampling to these ids"),
    "bad_words": _h("never generate these words"),
    "truncate_prompt_tokens": _h("keep only the last N prompt tokens (-1: max_model_len); usage counts the kept ones"),
    # vLLM structured outputs (one constraint per request; a grammar that does not compile is a 400)
    "guided_json": _h("a JSON schema the output follows (xgrammar)"),
    "guided_regex": _h("a regex the output matches (xgrammar)"),
    "guided_choice": _h("the output is one of these strings (xgrammar)"),
    "guided_grammar": _h("an EBNF grammar the output follows (xgrammar)"),
    "guided_decoding_backend": _h('"xgrammar" or "auto"; any other backend is a 400'),
    "guided_whitespace_pattern": _u("xgrammar takes no whitespace pattern (structured_outputs.disable_any_whitespace "
                                    "gives compact JSON)"),
    "structural_tag": _h("an xgrammar structural tag (JSON)"),
    "structured_outputs": _h("json, regex, choice, grammar, json_object or structural_tag (one of them)"),
    # vLLM extras tallyserve does not implement
    "spaces_between_special_tokens": _u("detokenization takes no such option (true, the default, is accepted)", True),
    "prompt_logprobs": _h("logprobs of every prompt token plus this many top alternatives (at most max_logprobs; "
                          "not with stream or use_beam_search)"),
    "priority": _u("there is no priority scheduling", 0),
    "request_id": _u("tallyserve assigns its own request ids (responses would not carry yours)"),
    "logits_processors": _u("custom logits processors are not supported", []),
    "return_tokens_as_token_ids": _u("tokens are always returned as strings", False),
    "return_token_ids": _u("token ids are not returned", False),
    "cache_salt": _u("the prefix cache is not salted per request"),
    "kv_transfer_params": _h("disaggregated serving: do_remote_decode on a kv_producer, a producer's answer "
                             "on a kv_consumer; malformed or stale params are a 400"),
    "vllm_xargs": _u("there are no custom extensions", {}),
    "mm_processor_kwargs": _u("there is no multimodal processor", {}),
    "media_io_kwargs": _u("there is no multimodal input", {}),
}

COMPLETION_FIELDS: dict[str, FieldInfo] = {
    **_SHARED,
    "prompt": _h("a string, strings, token ids or lists of token ids"),
    "echo": _h("prepend the prompt; with logprobs, its tokens' logprobs too; with max_tokens 0, only the prompt"),
    "logprobs": _h("top logprobs per output token, and per prompt token with echo (at most max_logprobs)"),
    "add_special_tokens": _h("encode text prompts with special tokens (default true)"),
    "suffix": _u("insertion (suffix) is not implemented", ""),
    "prompt_embeds": _u("prompt embeddings are not accepted; send text or token ids"),
    "response_format": _h('text, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}'),
}

CHAT_FIELDS: dict[str, FieldInfo] = {
    **_SHARED,
    "messages": _h("through the model's chat template"),
    "max_completion_tokens": _h("output length limit (takes precedence over max_tokens)"),
    "logprobs": _h("logprobs of the output tokens"),
    "top_logprobs": _h("alternatives per token (needs logprobs, at most max_logprobs: 20 unless --max-logprobs)"),
    "add_generation_prompt": _h("passed to the chat template"),
    "continue_final_message": _h("the last message is left open and continued (not with add_generation_prompt)"),
    "chat_template": _h("a Jinja template replacing the model's (rendered sandboxed; a failure is a 400)"),
    "chat_template_kwargs": _h("extra variables for the chat template (e.g. enable_thinking)"),
    "add_special_tokens": _h("also add the tokenizer's special tokens (e.g. BOS) to the rendered prompt"),
    "echo": _h("prepend the last message's content when it is an assistant message (the turn continued)"),
    # OpenAI fields tallyserve does not implement
    "tools": _h("function tools, rendered by the chat template (bad shapes are 400s)"),
    "tool_choice": _h("none / auto (needs --enable-auto-tool-choice) / required / a named function (grammar-enforced)"),
    "parallel_tool_calls": _h("false: at most one call"),
    "functions": _u("the legacy functions field is not supported: send tools", []),
    "function_call": _u("the legacy function_call field is not supported: send tool_choice", "none", "auto"),
    "response_format": _h('text, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}'),
    "audio": _u("audio output is not supported"),
    "modalities": _u("only text output is supported", ["text"]),
    "prediction": _u("predicted outputs are not supported"),
    "reasoning_effort": _u("there is no reasoning control"),
    "verbosity": _u("there is no verbosity control"),
    "service_tier": _u("there are no service tiers", "auto", "default"),
    "store": _u("completions are not stored", False),
    "web_search_options": _u("web search is not supported"),
    "prompt_cache_key": _u("a caching hint: prefix caching is automatic", ANY_STRING),
    "safety_identifier": _u("an end-user identifier: changes no output", ANY_STRING),
    # vLLM chat extras tallyserve does not implement
    "documents": _u("documents are not passed to the chat template", []),
    "include_reasoning": _u("there is no reasoning parser: any reasoning stays in the content", True),
}

CATALOGUES: dict[str, dict[str, FieldInfo]] = {COMPLETIONS: COMPLETION_FIELDS, CHAT: CHAT_FIELDS}

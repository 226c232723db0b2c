"""Tokenizer: offline Hugging Face tokenizer loading and chat templates (incremental detokenization
with stop strings: `tallyserve.detokenizer`).

Decoding never applies `clean_up_tokenization_spaces`: that rewrite looks across token
boundaries, so streamed text could not equal the full decode. With it off, the concatenated
deltas of `IncrementalDetokenizer` equal `Tokenizer.decode(output_ids)` exactly.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Optional, Sequence


ALLOWED_ROLES = ("system", "user", "assistant", "tool", "developer")
# Any one of these in a directory means it holds a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece-style byte-fallback tokens


def load_tokenizer(path: Optional[str]) -> Optional["Tokenizer"]:
    """Load a Hugging Face tokenizer from a local directory (or a .gguf file), never the network.

    Returns None when `path` is None or the directory holds no tokenizer files (a model without
    a tokenizer still serves token-id prompts). A directory with no tokenizer files but exactly
    one .gguf file loads the tokenizer embedded in it. Remote code is never trusted.
    Raises ValueError when the path does not exist or its tokenizer files fail to load.
    """
    if path is None:
        return None
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"tokenizer path {path!r} does not exist")
    gguf_file = None
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"tokenizer path {path!r} must be a directory or a .gguf file")
        path, gguf_file = os.path.split(os.path.abspath(path))
    elif not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if len(ggufs) != 1:
            return None
        gguf_file = os.path.basename(ggufs[0])
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        hf = AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:  # transformers raises many types; surface one clear error
        raise ValueError(f"could not load the tokenizer in {path!r}: {type(e).__name__}: {e}") from e
    return Tokenizer(hf)


class Tokenizer:
    """A thin wrapper over a transformers tokenizer with the few operations the engine needs."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        # The Rust `tokenizers.Tokenizer` decodes without Python overhead when available.
        # the `tokenizers` object behind a fast tokenizer (None otherwise): the detokenizer decodes with it directly
        self.backend = backend if hasattr(backend, "decode") and hasattr(backend, "get_vocab_size") else None
        self.eos_token_id: Optional[int] = hf_tokenizer.eos_token_id
        self.bos_token_id: Optional[int] = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)  # includes added tokens
        self.all_special_ids: list[int] = _special_ids(hf_tokenizer)
        self.chat_template: Optional[str] = getattr(hf_tokenizer, "chat_template", None)
        # Byte-fallback decoders (Llama 2, Mistral) judge UTF-8 validity over a whole run of
        # byte tokens, so the detokenizer waits for a run to end before trusting its text.
        self.byte_token_ids: frozenset[int] = frozenset(
            i for token, i in hf_tokenizer.get_vocab().items() if _BYTE_TOKEN.fullmatch(token)
        )
        # Incremental decoding in one Rust call per step, where it is exact (not with byte tokens).
        self._stream_class = _decode_stream_class(self.backend) if not self.byte_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def decode_stream(self, skip_special_tokens: bool = True) -> Optional[Any]:
        """A new `tokenizers.decoders.DecodeStream`, or None where its text could differ from
        IncrementalDetokenizer's own decoding (see `_decode_stream_class`)."""
        if self._stream_class is None:
            return None
        return self._stream_class(skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, chat_template: Optional[str] = None,
                    chat_template_kwargs: Optional[dict] = None, tools: Optional[list[dict]] = None) -> str:
        """The prompt text the chat template makes of `messages` (validated first).

        vLLM's chat controls: `continue_final_message` renders the last message left open (no
        end-of-turn) so the model continues it; it excludes `add_generation_prompt`.
        `chat_template` replaces the tokenizer's template; `chat_template_kwargs` are extra template
        variables (e.g. enable_thinking), whose `add_generation_prompt` / `continue_final_message`
        override the arguments, as vLLM's do. `tools`: function definitions (OpenAI's shape) for
        templates that render them. Templates render in transformers' sandboxed
        (ImmutableSandboxedEnvironment) Jinja. Raises ChatTemplateError for the controls and the
        template, ValueError for invalid messages."""
        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise ValueError(
                "this model's tokenizer has no chat template; send a plain prompt "
                "(completions API) or use a model with a chat_template"
            )
        kwargs = dict(chat_template_kwargs or {})
        for key in list(kwargs):
            if not isinstance(key, str) or key in _RESERVED_TEMPLATE_KWARGS:
                raise ChatTemplateError(
                    f"chat_template_kwargs must not set {key!r} (an argument of the template call itself)",
                    "chat_template_kwargs")
            if key in ("add_generation_prompt", "continue_final_message"):
                value = kwargs.pop(key)
                if not isinstance(value, bool):
                    raise ChatTemplateError(f"chat_template_kwargs.{key} must be true or false",
                                            "chat_template_kwargs")
                if key == "add_generation_prompt":
                    add_generation_prompt = value
                else:
                    continue_final_message = value
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: "
                                    "continue the final message, or start a new assistant turn",
                                    "continue_final_message")
        normalised = normalise_messages(messages)
        try:
            text = self.hf.apply_chat_template(
                normalised, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=bool(continue_final_message), chat_template=chat_template, tools=tools,
                **kwargs,
            )
        except Exception as e:  # jinja2 TemplateError / SecurityError, raise_exception(...) in the template
            where = "chat_template" if chat_template is not None else "messages"
            if continue_final_message and "continue_final_message" in str(e):
                where = "continue_final_message"
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}",
                                    where) from e
        if not isinstance(text, str):
            raise ChatTemplateError(f"chat template returned {type(text).__name__}, expected a string",
                                    "chat_template" if chat_template is not None else "messages")
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template: Optional[str] = None,
                            chat_template_kwargs: Optional[dict] = None,
                            add_special_tokens: bool = False, tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids of the chat prompt (render_chat's text). The template itself places BOS and
        other special tokens, so by default (vLLM's too) the text is encoded without adding
        special tokens again; `add_special_tokens=True` adds them (e.g. a BOS) as well."""
        text = self.render_chat(messages, add_generation_prompt, continue_final_message=continue_final_message,
                                chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                tools=tools)
        return self.encode(text, add_special_tokens=add_special_tokens)


class ChatTemplateError(ValueError):
    """The chat template or its controls failed; `param` names the request field to blame
    (chat_template, chat_template_kwargs, continue_final_message, or messages for the model's own
    template)."""

    def __init__(self, message: str, param: str = "chat_template") -> None:
        super().__init__(message)
        self.param = param


# Arguments of transformers' apply_chat_template / render call that template kwargs must not replace.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})


def _decode_stream_class(backend: Any) -> Optional[type]:
    """DecodeStream where streaming with it is exactly IncrementalDetokenizer's Python decoding
    for this Rust tokenizer (and so the full decode), else None. Callers also exclude
    byte-fallback tokenizers: their decoder judges a whole run of byte tokens at once, which
    the Python path waits out (see Tokenizer.byte_token_ids) and DecodeStream does not.

    DecodeStream runs the same windowed decode in Rust, with two differences: it moves a window's
    start past ids that decode to nothing, and it raises where a window's text does not extend
    the text before it. Neither changes the text of the byte-level decoder (GPT-2 style: Llama 3,
    Qwen, SmolLM), which maps each token to bytes regardless of its neighbours and decodes their
    concatenation as UTF-8: a window that starts after a complete character decodes to exactly
    the continuation of the text. Metaspace, WordPiece, Strip, CTC and the no-decoder join let a
    token's text depend on its place in the window, so there the window's start matters and the
    two paths are not the same algorithm; they keep the Python path."""
    if backend is None:
        return None
    try:
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers.decoders import ByteLevel, DecodeStream
    except ImportError:  # a tokenizers release without DecodeStream
        return None
    if not isinstance(backend, RustTokenizer) or not isinstance(backend.decoder, ByteLevel):
        return None
    return DecodeStream


def _special_ids(hf: Any) -> list[int]:
    """Ids of the named special tokens plus every added token flagged special."""
    ids = set(hf.all_special_ids)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return sorted(ids)


def normalise_messages(messages: Any) -> list[dict]:
    """Validate chat messages; turn OpenAI list-of-parts content into one string."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    result = []
    call_ids: set[str] = set()  # ids of the calls the latest assistant turn made, which tool messages answer
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}"
            )
        if "role" not in message:
            raise ValueError(f"messages[{i}] lacks 'role'")
        role = message["role"]
        if role not in ALLOWED_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ALLOWED_ROLES)}; got {role!r}")
        calls = (message.get("tool_calls") or None) if role == "assistant" else None  # [] is no calls
        if "content" not in message and calls is None:
            raise ValueError(f"messages[{i}] lacks 'content'")
        content = message.get("content")
        if content is None and calls is not None:
            content = ""  # an assistant turn that only calls tools
        entry = {**message, "content": _content_text(content, i)}
        if calls is not None:
            entry["tool_calls"] = _template_tool_calls(calls, i)
            call_ids = {c["id"] for c in entry["tool_calls"]}
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ValueError(f"messages[{i}] (role tool) needs tool_call_id: the id of the call it answers")
            if call_id not in call_ids:
                raise ValueError(f"messages[{i}].tool_call_id {call_id[:80]!r} answers no tool call of the "
                                 "assistant message before it")
        else:
            call_ids = set()
        result.append(entry)
    return result


def _template_tool_calls(calls: Any, index: int) -> list[dict]:
    """An assistant message's tool_calls as chat templates take them: arguments parsed from their
    JSON string into an object (templates render them with tojson)."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"messages[{index}].tool_calls must be a non-empty list of calls")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise ValueError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name', 'arguments'}}}}")
        if not isinstance(call.get("id"), str):
            raise ValueError(f"{where}.id must be a string")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise ValueError(f"{where}.function.arguments must be a JSON object (as a string); got "
                                 f"{fn['arguments'][:80]!r}") from None
        if not isinstance(args, dict):
            raise ValueError(f"{where}.function.arguments must be a JSON object")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"messages[{index}].content must be a string or a list of text parts, "
            f"got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"{where} must be a {{'type': 'text', 'text': ...}} part; got {kind!r} (only text is supported)"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)

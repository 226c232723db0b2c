"""Token ids for the simulator: a word-level synthetic tokenizer, chat framing in token space,
and the conversation history of multi-turn workloads (synthetic replies included).

One whitespace-separated word is one token (a stable crc32 of the word picks its id), so the
lengths of synthetic workloads are exact. Chat messages are framed like ChatML:
`<start> <role> content... <end>`, and a generation prompt `<start> <assistant>`; a reply
joins the history as `reply... <end>`, so turn k+1's prompt extends turn k's prompt and
output token for token, as a real chat template does, and prefix caching sees it.
"""

from __future__ import annotations

import zlib
from typing import Optional

from tallyserve.bench.workloads import RequestSpec

IM_START, IM_END = 1, 2
ROLE_IDS = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
FIRST_WORD_ID = 16
MAX_WORD_ID = 32000


class SimTokenizer:
    def __init__(self, vocab_size: int) -> None:
        hi = min(vocab_size, MAX_WORD_ID)
        if hi <= FIRST_WORD_ID + 1:
            raise ValueError(f"vocab_size {vocab_size} is too small for the simulator's tokenizer")
        self.vocab_size = vocab_size
        self._span = hi - FIRST_WORD_ID
        self._cache: dict[str, int] = {}

    def word_id(self, word: str) -> int:
        tid = self._cache.get(word)
        if tid is None:
            tid = FIRST_WORD_ID + zlib.crc32(word.encode()) % self._span
            self._cache[word] = tid
        return tid

    def encode(self, text: str) -> list[int]:
        ids = [self.word_id(w) for w in text.split()]
        return ids or [FIRST_WORD_ID]

    def encode_messages(self, messages: list[dict]) -> list[int]:
        out: list[int] = []
        for m in messages:
            out.append(IM_START)
            out.append(ROLE_IDS.get(m.get("role", "user"), ROLE_IDS["user"]))
            out.extend(self.word_id(w) for w in str(m.get("content", "")).split())
            out.append(IM_END)
        return out

    def synthetic_token(self, seed: int, index: int) -> int:
        """A reply token: a cheap deterministic function of the request and its position."""
        return FIRST_WORD_ID + ((seed + index * 2654435761) ^ (index * 40503)) % self._span


class ConversationTokens:
    """Token history of one conversation as the simulator's server sees it."""

    def __init__(self, tokenizer: SimTokenizer) -> None:
        self.tok = tokenizer
        self.history: list[int] = []
        self.chat: Optional[bool] = None

    def prompt_for(self, spec: RequestSpec) -> list[int]:
        if spec.prompt_token_ids is not None:
            return list(spec.prompt_token_ids)
        if spec.messages is not None:
            self.chat = True
            return self.history + self.tok.encode_messages(spec.messages) + [IM_START, ROLE_IDS["assistant"]]
        self.chat = False
        return self.history + self.tok.encode(spec.prompt)

    def add_reply(self, prompt: list[int], reply: list[int]) -> None:
        self.history = prompt + reply + ([IM_END] if self.chat else [])

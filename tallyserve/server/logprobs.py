"""Engine logprobs -> the two OpenAI shapes: legacy completions lists and chat `content` entries."""

from __future__ import annotations

from typing import Optional, Sequence

from tallyserve.outputs import Logprob
from tallyserve.server.protocol import ChatChoiceLogprobs, ChatLogprobEntry, ChatTopLogprob, CompletionLogprobs
from tallyserve.tokenizer import Tokenizer

Entry = dict[int, Logprob]


def _token_text(tokenizer: Optional[Tokenizer], token_id: int, lp: Logprob) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    if tokenizer is not None:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return f"<token_id:{token_id}>"


def _top(entry: Entry, k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position, by rank."""
    ranked = sorted(((lp.rank, tid, lp) for tid, lp in entry.items() if lp.rank is not None), key=lambda x: x[0])
    return [(tid, lp) for _, tid, lp in ranked[:k]]


def completion_logprobs(tokenizer: Optional[Tokenizer], token_ids: Sequence[int], entries: Sequence[Entry],
                        k: int, text_offset: int) -> tuple[CompletionLogprobs, int]:
    """Legacy shape for these tokens; returns it and the text offset after the last token."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries):
        lp = entry[tid]
        text = _token_text(tokenizer, tid, lp)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        top = {text: lp.logprob}  # the sampled token always appears, as in vLLM
        for other_id, other in _top(entry, k):
            top.setdefault(_token_text(tokenizer, other_id, other), other.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out, text_offset


def chat_logprobs(tokenizer: Optional[Tokenizer], token_ids: Sequence[int], entries: Sequence[Entry],
                  k: int) -> ChatChoiceLogprobs:
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry[tid]
        text = _token_text(tokenizer, tid, lp)
        tops = []
        for other_id, other in _top(entry, k):
            other_text = _token_text(tokenizer, other_id, other)
            tops.append(ChatTopLogprob(token=other_text, logprob=other.logprob, bytes=list(other_text.encode())))
        content.append(ChatLogprobEntry(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=tops))
    return ChatChoiceLogprobs(content=content)

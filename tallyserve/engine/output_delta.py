"""RequestOutputs as per-step deltas between the engine core process and the server process.

The engine's RequestOutputs are cumulative (all tokens, text and logprobs so far). Sending them whole
every step would pickle O(n^2) data over a request's life, so the engine core process sends what
changed since its last message for that request (`DeltaEncoder`), and the server process appends it
to its own copy (`DeltaDecoder`) and hands the streams the same cumulative RequestOutputs the
in-thread engine does.

Each list (token ids, logprobs) and the text travel as (keep, new): keep the first `keep` items of
what was sent before, then append `new`. The engine's token and logprob lists only grow, except that
a stop string may end a sequence on a token before the last one sampled (a cut, never a rewrite), so
the encoder sends the new tail, or keeps a prefix; it checks the last token it sent (O(1)) and sends
the whole list again should that ever differ. The text is compared, so any change travels correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tallyserve.outputs import CompletionOutput, RequestOutput

# One request's delta: (request_id, header, finished, error, num_cached_tokens, metrics,
# prompt_logprobs, kv_transfer_params, completions). header is (prompt, prompt_token_ids) in the
# first delta of a request and None after; prompt_logprobs is sent until the first token (it is
# complete then) and with the final delta. completions: one tuple per sequence, see _seq_delta.
Delta = tuple


@dataclass
class _SeqSent:
    """What the server process has of one sequence."""

    num_tokens: int = 0
    last_token: int = -1
    text: str = ""
    num_logprobs: int = 0


@dataclass
class _RequestSent:
    seqs: dict[int, _SeqSent] = field(default_factory=dict)
    first_token_sent: bool = False


def _keep_and_new(old_len: int, new: list) -> tuple[int, list]:
    keep = min(old_len, len(new))
    return keep, new[keep:]


def _token_delta(s: _SeqSent, new: list[int]) -> tuple[int, list[int]]:
    if s.num_tokens and len(new) >= s.num_tokens and new[s.num_tokens - 1] != s.last_token:
        return 0, list(new)  # not a growth of what was sent: send it all
    return _keep_and_new(s.num_tokens, new)


def _text_delta(old: str, new: str) -> tuple[int, str]:
    if new.startswith(old):
        return len(old), new[len(old):]
    keep = 0
    for a, b in zip(old, new):
        if a != b:
            break
        keep += 1
    return keep, new[keep:]


class DeltaEncoder:
    """Engine core side: the delta of each RequestOutput against what was sent before."""

    def __init__(self) -> None:
        self._sent: dict[str, _RequestSent] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def encode(self, out: RequestOutput) -> Delta:
        sent = self._sent.get(out.request_id)
        header = None
        if sent is None:
            sent = self._sent[out.request_id] = _RequestSent()
            header = (out.prompt, out.prompt_token_ids)
        seqs = []
        any_token = False
        for c in out.outputs:
            s = sent.seqs.get(c.index)
            if s is None:
                s = sent.seqs[c.index] = _SeqSent()
            tok_keep, new_tokens = _token_delta(s, c.token_ids)
            text_keep, text_new = _text_delta(s.text, c.text)
            lp_keep, new_lps = (0, None) if c.logprobs is None else _keep_and_new(s.num_logprobs, c.logprobs)
            s.num_tokens, s.text = len(c.token_ids), c.text
            s.last_token = c.token_ids[-1] if c.token_ids else -1
            s.num_logprobs = 0 if c.logprobs is None else len(c.logprobs)
            any_token = any_token or bool(c.token_ids)
            seqs.append((c.index, tok_keep, new_tokens, text_keep, text_new, lp_keep, new_lps,
                         c.cumulative_logprob, c.finish_reason, c.stop_reason))
        prompt_lps = None
        if out.prompt_logprobs is not None and (not sent.first_token_sent or out.finished):
            prompt_lps = out.prompt_logprobs
        sent.first_token_sent = sent.first_token_sent or any_token
        if out.finished:
            del self._sent[out.request_id]
        return (out.request_id, header, out.finished, out.error, out.num_cached_tokens, out.metrics,
                prompt_lps, out.kv_transfer_params, seqs)


@dataclass
class _SeqHeld:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list] = None


@dataclass
class _RequestHeld:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    seqs: dict[int, _SeqHeld] = field(default_factory=dict)
    prompt_logprobs: Any = None


class DeltaDecoder:
    """Server side: applies deltas and returns the cumulative RequestOutputs (fresh lists each time,
    so an output a stream still holds never changes under it)."""

    def __init__(self) -> None:
        self._held: dict[str, _RequestHeld] = {}

    def __len__(self) -> int:
        return len(self._held)

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._held)

    def decode(self, delta: Delta) -> Optional[RequestOutput]:
        """The cumulative output after `delta`; None for a request whose first delta was missed
        (it was forgotten: its stream went away)."""
        rid, header, finished, error, num_cached, metrics, prompt_lps, kv_params, seqs = delta
        held = self._held.get(rid)
        if held is None:
            if header is None:
                return None
            held = self._held[rid] = _RequestHeld(header[0], header[1])
        if prompt_lps is not None:
            held.prompt_logprobs = prompt_lps
        outs = []
        for index, tok_keep, new_tokens, text_keep, text_new, lp_keep, new_lps, cum_lp, reason, stop in seqs:
            s = held.seqs.get(index)
            if s is None:
                s = held.seqs[index] = _SeqHeld()
            if tok_keep < len(s.token_ids):
                del s.token_ids[tok_keep:]
            s.token_ids.extend(new_tokens)
            s.text = s.text[:text_keep] + text_new if text_keep < len(s.text) else s.text + text_new
            if new_lps is None:
                s.logprobs = None
            else:
                if s.logprobs is None:
                    s.logprobs = []
                if lp_keep < len(s.logprobs):
                    del s.logprobs[lp_keep:]
                s.logprobs.extend(new_lps)
            outs.append(CompletionOutput(index=index, text=s.text, token_ids=list(s.token_ids),
                                         cumulative_logprob=cum_lp,
                                         logprobs=None if s.logprobs is None else list(s.logprobs),
                                         finish_reason=reason, stop_reason=stop))
        if finished:
            del self._held[rid]
        return RequestOutput(request_id=rid, prompt=held.prompt, prompt_token_ids=held.prompt_token_ids,
                             outputs=outs, finished=finished, num_cached_tokens=num_cached, error=error,
                             metrics=metrics, prompt_logprobs=held.prompt_logprobs, kv_transfer_params=kv_params)

"""Penalties and token controls, batched on the device (vLLM names and semantics).

Order per step, as in vLLM: logit_bias, allowed_token_ids, bad words, then repetition,
frequency and presence penalties. The math (``apply_penalties``) is one tensor op sequence over
the rows that use penalties; requests without any control pay nothing (``LogitsProcessing``
returns the logits untouched, no tensor is built).

Token history (which tokens a request has in its prompt and output) -- the design:
The runner never sees a Request, and a request's rows do not always cover its prompt: a prefix
cache hit starts a request at ``start_position > 0`` (n > 1 children, repeated prompts, chat
turns), so "collect the prompt from the first prefill rows" would miss the cached prefix. What
the runner does see, every step, is each row's token and the KV slot it is written to (the
block table and positions). ``TokenMirror`` keeps a host copy of that: the token id in every KV
slot, updated from every scheduled row and from the step's block moves (offloads, restores,
partial copies, in the order the runner applies them). A request's history is then simply the
tokens of slots [0, seq_len) of its block table, whoever computed them; preemption (recompute
from 0) and finished requests need no extra bookkeeping, since blocks are rewritten before they are
read again. The split prompt / output uses ``num_output_tokens``: the last that many tokens
of the sequence are outputs.

Async scheduling: a placeholder row (token -1) holds the token the in-flight step samples. Its
slot is recorded as pending with that step's handle; at the next step the step is complete
and the slot is filled from its host result. Until then (the one step where it matters, the
step that feeds it) the token is taken on the device from the in-flight step's token tensor,
so no host sync. Blocks moved to the host tier while still pending keep -1 (counted as nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from tallyserve.sampling_params import SamplingParams
from tallyserve.runner.host_tensors import host_tensor

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- the math


def apply_penalties(logits: torch.Tensor, prompt_ids: torch.Tensor, output_ids: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalised copy of ``logits`` (R, V). prompt_ids (R, P) and output_ids (R, O): int64 token
    ids, padded with any value outside [0, V) (ignored). presence, frequency, repetition: (R,).
    Repetition (HF): tokens in prompt or output have positive logits divided by it, negative ones
    multiplied. Then ``logit - frequency * count - presence * (count > 0)`` over output tokens."""
    rows, vocab = logits.shape
    out_counts = _counts(output_ids, rows, vocab, logits.dtype)
    seen = _counts(prompt_ids, rows, vocab, logits.dtype) > 0
    out_seen = out_counts > 0
    seen |= out_seen
    rep = repetition.to(logits.dtype).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.to(logits.dtype).unsqueeze(1) * out_counts
    return logits - presence.to(logits.dtype).unsqueeze(1) * out_seen.to(logits.dtype)


def _counts(ids: torch.Tensor, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """(R, V) occurrence counts of ids (R, L); entries outside [0, V) count nowhere."""
    counts = torch.zeros((rows, vocab + 1), dtype=dtype, device=ids.device)
    if ids.numel():
        idx = torch.where((ids >= 0) & (ids < vocab), ids, torch.full_like(ids, vocab))
        counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=dtype))
    return counts[:, :vocab]


# --------------------------------------------------------------------------- the history


class TokenMirror:
    """Host copy of the token id held by every KV slot (device pool and host tier); -1 unknown."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device = np.full((0, block_size), -1, dtype=np.int64)
        self.host = np.full((0, block_size), -1, dtype=np.int64)
        # Placeholder slots written this step: (block, slot, index into the in-flight step's tokens).
        self._pending: list[tuple[int, int, int]] = []
        self._pending_step: Any = None

    @staticmethod
    def _grow(table: np.ndarray, n: int) -> np.ndarray:
        if n <= table.shape[0]:
            return table
        grown = np.full((max(n, 2 * table.shape[0]), table.shape[1]), -1, dtype=np.int64)
        grown[: table.shape[0]] = table
        return grown

    def update(self, so: Any, inflight: Any) -> dict[str, int]:
        """Mirror one step (before its sampling): resolve the previous step's placeholders, apply
        the block moves, write every row. Returns request id -> index into ``inflight.token_ids``
        for requests whose rows hold a placeholder (the in-flight step's token)."""
        if self._pending:
            try:
                host = self._pending_step.pending.result().token_ids
            except Exception:  # that step failed: its requests failed with it
                host = None
            if host is not None:
                for blk, slot, i in self._pending:
                    self.device[blk, slot] = host[i]
            self._pending = []
        moves = so.kv_transfers
        bs = self.block_size
        for c in moves.offloads:
            self.host = self._grow(self.host, c.dst + 1)
            self.device = self._grow(self.device, c.src + 1)
            self.host[c.dst] = self.device[c.src]
        for c in moves.restores:
            self.host = self._grow(self.host, c.src + 1)
            self.device = self._grow(self.device, c.dst + 1)
            self.device[c.dst] = self.host[c.src]
        for c in moves.copies:
            self.device = self._grow(self.device, max(c.src, c.dst) + 1)
            self.device[c.dst, : c.num_tokens] = self.device[c.src, : c.num_tokens]
        placeholders: dict[str, int] = {}
        for e in so.requests:
            n = len(e.token_ids)
            if not n:
                continue
            start = e.start_position
            last_block = e.block_ids[(start + n - 1) // bs]
            if last_block >= self.device.shape[0]:
                self.device = self._grow(self.device, max(e.block_ids) + 1)
            if n == 1:  # decode: the common case, kept scalar
                t = e.token_ids[0]
                self.device[last_block, start % bs] = t
                if t < 0:
                    placeholders[e.request_id] = self._placeholder(inflight, e.request_id, last_block, start % bs)
                continue
            pos = np.arange(start, start + n)
            blocks = np.asarray(e.block_ids, dtype=np.int64)[pos // bs]
            toks = np.asarray(e.token_ids, dtype=np.int64)
            self.device = self._grow(self.device, int(blocks.max()) + 1)
            self.device[blocks, pos % bs] = toks
            for j in np.flatnonzero(toks < 0):
                placeholders[e.request_id] = self._placeholder(inflight, e.request_id, int(blocks[j]),
                                                               int(pos[j] % bs))
        self._pending_step = inflight
        return placeholders

    def _placeholder(self, inflight: Any, rid: str, blk: int, slot: int) -> int:
        index = inflight.token_index[rid] if inflight is not None and rid in inflight.token_index else -1
        if index >= 0:
            self._pending.append((blk, slot, index))
        return index

    def tokens(self, block_ids: Sequence[int], length: int) -> np.ndarray:
        """The first ``length`` tokens of a block table (-1 where unknown)."""
        bs = self.block_size
        nb = -(-length // bs)
        if not nb:
            return np.zeros(0, dtype=np.int64)
        return self.device[np.asarray(block_ids[:nb], dtype=np.int64)].reshape(-1)[:length]


# --------------------------------------------------------------------------- one step


@dataclass
class ProcessRow:
    """One logits row to process: its params, history and the in-flight placeholder source."""

    row: int
    params: SamplingParams
    prompt: np.ndarray  # prompt token ids (may hold -1: unknown, counted nowhere)
    output: np.ndarray  # output token ids known on the host
    placeholder: int = -1  # index into the in-flight step's tokens: one more output token


def process_logits(logits: torch.Tensor, rows: list[ProcessRow],
                   inflight_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    """A processed copy of ``logits`` (all rows; only ``rows`` change), built on the device
    without waiting for it. ``inflight_tokens``: the in-flight step's sampled tokens, for rows
    with a placeholder."""
    device = logits.device
    vocab = logits.shape[1]
    out = logits.clone()
    # logit_bias: one scatter-add over every (row, id, bias).
    r_idx, c_idx, vals = [], [], []
    for pr in rows:
        for tid, b in (pr.params.logit_bias or {}).items():
            if tid < vocab:
                r_idx.append(pr.row), c_idx.append(tid), vals.append(b)
    if r_idx:
        out.index_put_((host_tensor(r_idx, device), host_tensor(c_idx, device)),
                       host_tensor(vals, device, out.dtype), accumulate=True)
    # allowed_token_ids: everything else -inf.
    allowed = [pr for pr in rows if pr.params.allowed_token_ids is not None]
    if allowed:
        r_idx, c_idx = [], []
        for k, pr in enumerate(allowed):
            ids = [t for t in pr.params.allowed_token_ids if t < vocab]
            r_idx += [k] * len(ids)
            c_idx += ids
        keep = torch.zeros((len(allowed), vocab), dtype=torch.bool, device=device)
        if r_idx:
            keep[host_tensor(r_idx, device), host_tensor(c_idx, device)] = True
        sel = host_tensor([pr.row for pr in allowed], device)
        out[sel] = out[sel].masked_fill(~keep, _NEG_INF)
    # bad words: single tokens always; longer words when the last output tokens equal the prefix.
    single_r, single_c = [], []
    multi: list[tuple[int, ProcessRow, tuple[int, ...]]] = []
    for k, pr in enumerate(rows):
        for word in pr.params.bad_words_token_ids or ():
            if word[-1] >= vocab:
                continue
            if len(word) == 1:
                single_r.append(pr.row), single_c.append(word[0])
            else:
                multi.append((k, pr, word))
    if single_r:
        out[host_tensor(single_r, device), host_tensor(single_c, device)] = _NEG_INF
    tails = None
    if multi:
        width = max(len(w) for _, _, w in multi) - 1
        tails = _output_tails(rows, width, inflight_tokens, device)  # (R, width), -2 where none
        prefixes = np.full((len(multi), width), -3, dtype=np.int64)  # -3: any token matches
        for j, (_, _, w) in enumerate(multi):
            prefixes[j, width - (len(w) - 1):] = w[:-1]
        pre = host_tensor(prefixes, device)
        got = tails[host_tensor([k for k, _, _ in multi], device)]
        match = ((got == pre) | (pre == -3)).all(dim=1)
        ban = torch.zeros_like(out)
        ban.index_put_((host_tensor([pr.row for _, pr, _ in multi], device),
                        host_tensor([w[-1] for _, _, w in multi], device)), match.to(out.dtype), accumulate=True)
        out.masked_fill_(ban > 0, _NEG_INF)
    # penalties: one batched op sequence over the rows that use them.
    pen = [pr for pr in rows if pr.params.presence_penalty or pr.params.frequency_penalty
           or pr.params.repetition_penalty != 1.0]
    if pen:
        sel = host_tensor([pr.row for pr in pen], device)
        prompt = host_tensor(_pad([pr.prompt for pr in pen]), device)
        output = host_tensor(_pad([pr.output for pr in pen]), device)
        extra = _placeholder_column(pen, inflight_tokens, device)
        if extra is not None:
            output = torch.cat([output, extra], dim=1)
        out[sel] = apply_penalties(
            out[sel], prompt, output,
            host_tensor([pr.params.presence_penalty for pr in pen], device, out.dtype),
            host_tensor([pr.params.frequency_penalty for pr in pen], device, out.dtype),
            host_tensor([pr.params.repetition_penalty for pr in pen], device, out.dtype),
        )
    return out


def _pad(seqs: list[np.ndarray], fill: int = -1) -> np.ndarray:
    width = max((len(s) for s in seqs), default=0)
    out = np.full((len(seqs), max(width, 1)), fill, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def _placeholder_column(rows: list[ProcessRow], inflight_tokens: Optional[torch.Tensor],
                        device: torch.device) -> Optional[torch.Tensor]:
    """(R, 1) the in-flight token of rows with a placeholder, -1 elsewhere; None if no row has one."""
    if inflight_tokens is None or all(pr.placeholder < 0 for pr in rows):
        return None
    src = host_tensor([max(pr.placeholder, 0) for pr in rows], device)
    has = host_tensor([pr.placeholder >= 0 for pr in rows], device, torch.bool)
    return torch.where(has, inflight_tokens[src], torch.full_like(src, -1)).unsqueeze(1)


def _output_tails(rows: list[ProcessRow], width: int, inflight_tokens: Optional[torch.Tensor],
                  device: torch.device) -> torch.Tensor:
    """(R, width): each row's last ``width`` output tokens, right-aligned, -2 where fewer."""
    has = [pr.placeholder >= 0 and inflight_tokens is not None for pr in rows]
    host_w = width - 1 if any(has) else width
    tails = np.full((len(rows), width), -2, dtype=np.int64)
    for i, pr in enumerate(rows):
        keep = (host_w if has[i] else width)
        t = pr.output[len(pr.output) - keep:] if keep else pr.output[:0]
        end = width - 1 if has[i] else width
        tails[i, end - len(t): end] = t
    out = host_tensor(tails, device)
    if any(has):
        col = _placeholder_column(rows, inflight_tokens, device).squeeze(1)
        hasmask = host_tensor(has, device, torch.bool)
        out[:, -1] = torch.where(hasmask, col, out[:, -1])
    return out

"""Exact token lengths for the synthetic completion workloads.

`--random-input-len N` means N prompt tokens of the served model, as users of other servers' benchmark
tools expect: the prompt text is drawn as before (pseudo-words, each at least one token), tokenized,
cut to exactly N token ids, and sent as a token-id prompt (which every OpenAI-compatible completions
endpoint accepts). Shared-prefix prompts cut the prefix and the suffix separately, so every request of
a group sends the very same prefix ids.

The tokenizer is, in order: `--tokenizer PATH` (a local tokenizer directory, loaded with
transformers; needed for a server whose weights are dummy but whose tokenizer lives elsewhere), or
the server's own `POST /tokenize`. A server with neither keeps word-length text prompts, with a warning.
"""

from __future__ import annotations

import logging
import random
from typing import Callable, Optional

import httpx

from tallyserve.bench.workloads import Workload, random_text

logger = logging.getLogger(__name__)

Tokenize = Callable[[str], list[int]]
KINDS = ("random", "shared-prefix")  # the workloads whose lengths are in tokens when a tokenizer exists


def local_tokenizer(path: str) -> Tokenize:
    """Tokenize with the tokenizer saved at `path` (no special tokens: the server adds its own)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {path!r}: cannot load a tokenizer there ({exc})") from None
    return lambda text: list(tok.encode(text, add_special_tokens=False))


def server_tokenizer(root: str, model: Optional[str], api_key: Optional[str]) -> Optional[Tokenize]:
    """The server's own tokenizer through POST /tokenize, or None when the server has none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(headers=headers, timeout=60.0)
    url = root.rstrip("/").removesuffix("/v1") + "/tokenize"

    def tokenize(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False, **({"model": model} if model else {})}
        resp = client.post(url, json=body)
        resp.raise_for_status()
        return list(resp.json()["tokens"])

    try:
        tokenize("probe")
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        logger.warning("the server has no usable /tokenize (%s): prompt lengths stay in words", exc)
        client.close()
        return None
    return tokenize


def _exact(ids: list[int], n: int, rng: random.Random, tokenize: Tokenize) -> list[int]:
    while len(ids) < n:  # a word is at least one token, so this only runs for odd tokenizers
        ids = ids + tokenize(" " + random_text(rng, n - len(ids)))
    return ids[:n]


def apply_token_lengths(workload: Workload, tokenize: Tokenize) -> int:
    """Turn the text prompts of a random or shared-prefix workload into token-id prompts of exactly
    the drawn lengths (the word counts the builder used). Returns how many prompts changed."""
    if workload.name not in KINDS:
        return 0
    rng = random.Random(f"token-lengths-{workload.options.get('seed', 0)}")
    prefix_len = workload.options.get("shared_prefix_len", 0) if workload.name == "shared-prefix" else 0
    prefixes: dict[str, list[int]] = {}
    changed = 0
    for spec in workload.requests:
        if spec.prompt is None or spec.prompt_token_ids is not None:
            continue
        words = spec.prompt.split(" ")
        head, tail = " ".join(words[:prefix_len]), " ".join(words[prefix_len:])
        ids: list[int] = []
        if head:
            if head not in prefixes:
                prefixes[head] = _exact(tokenize(head), prefix_len, rng, tokenize)
            ids = list(prefixes[head])
        ids += _exact(tokenize(" " + tail if head else tail), len(words) - (prefix_len if head else 0), rng, tokenize)
        spec.prompt_token_ids, spec.prompt = ids, None
        changed += 1
    return changed


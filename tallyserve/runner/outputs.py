"""What a launched step hands back to the engine core: ModelRunnerOutput (host data), the
handle that yields it once the device is done (AsyncModelRunnerOutput), and a step whose forward
pass is queued but whose sampling waits for its grammar bitmask (PendingForward)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from tallyserve.runner.prompt_logprobs import PendingPromptLogprobs, PromptLogprobs
from tallyserve.runner.rejection_sampler import TokenSample
from tallyserve.runner.sampler import PendingSamplerOutput

if TYPE_CHECKING:
    from tallyserve.core.sched_output import SchedulerOutput


@dataclass
class ModelRunnerOutput:
    """One step's results on the host. `sampled`: per request that sampled, the tokens it keeps
    (one, or accepted drafts plus one), with logprobs. `beam_logprobs`: per beam-search row, the
    log-softmax of its logits over the vocabulary (beam selection happens in the engine).
    `prompt_logprobs`: per request with prompt_logprobs rows in the step, their logprobs."""

    sampled: dict[str, list[TokenSample]] = field(default_factory=dict)
    beam_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)

    def token_ids(self) -> dict[str, list[int]]:
        return {rid: [t.token_id for t in toks] for rid, toks in self.sampled.items()}


@dataclass
class AsyncModelRunnerOutput:
    """A launched step whose sampled tokens may still be on the device."""

    num_forward_tokens: int  # what the batch builder built (the ledger's forward count)
    resolved: dict[str, list[TokenSample]] = field(default_factory=dict)  # rows settled on the host
    beam_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    token_ids: Optional[torch.Tensor] = None  # device tensor of the plain rows' tokens
    token_index: dict[str, int] = field(default_factory=dict)  # request id -> row of token_ids
    pending: Optional[PendingSamplerOutput] = None
    prompt_logprobs: Optional[PendingPromptLogprobs] = None

    def result(self) -> ModelRunnerOutput:
        """Wait for the device, then the host view of every sampled row."""
        out = dict(self.resolved)
        if self.pending is not None:
            host = self.pending.result()
            for rid, i in self.token_index.items():
                out[rid] = [TokenSample(host.token_ids[i], host.logprobs[i], host.top_logprobs[i])]
        prompt = self.prompt_logprobs.result() if self.prompt_logprobs is not None else {}
        return ModelRunnerOutput(out, self.beam_logprobs, prompt)


@dataclass
class PendingForward:
    """A step whose forward pass is queued on the device and whose sampling is not yet. The engine
    core fills the grammar bitmask of its rows meanwhile (after the previous step's tokens reached
    the host and the matchers accepted them), attaches it to the SchedulerOutput and calls
    ``sample``: the host's work overlaps this step's forward pass."""

    num_forward_tokens: int
    logits: Optional[torch.Tensor]  # None on tensor-parallel ranks other than 0 (rank 0 samples)
    prompt_logprobs: Optional[PendingPromptLogprobs]
    draft_probs: dict[str, torch.Tensor]
    sample_fn: Callable[["SchedulerOutput", torch.Tensor, int, dict[str, torch.Tensor]], AsyncModelRunnerOutput]
    sampled: bool = False

    def sample(self, so: "SchedulerOutput") -> AsyncModelRunnerOutput:
        """Queue the sampling of this step (``so`` may carry a grammar bitmask); once only."""
        if self.sampled:
            raise ValueError("this step was already sampled")
        self.sampled = True
        logits, self.logits = self.logits, None
        if logits is None:
            return AsyncModelRunnerOutput(self.num_forward_tokens)
        step = self.sample_fn(so, logits, self.num_forward_tokens, self.draft_probs)
        step.prompt_logprobs = self.prompt_logprobs
        return step

"""LLM: the offline API, shaped like vLLM's."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from tallyserve.config import EngineArgs
from tallyserve.engine.gc_heap import frozen_heap
from tallyserve.engine.llm_engine import LLMEngine, PromptType
from tallyserve.outputs import RequestOutput
from tallyserve.sampling_params import SamplingParams
from tallyserve.engine.beam_search import BeamSearchParams
from tallyserve.tool_specs import parse_tools

if TYPE_CHECKING:
    from tallyserve.engine.beam_search import BeamSearchOutput

Params = Union[SamplingParams, Sequence[SamplingParams], None]


class LLM:
    """`LLM(model=...)`: a HF directory, a .gguf file, a dummy preset, or None for the bundled model."""

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {EngineArgs.field_names()}")
        # a constraint that does not compile: ValueError in generate(), which returns finished outputs only
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs), wait_for_grammars=True, final_outputs_only=True)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also exit with this process)."""
        self.engine.shutdown()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]], sampling_params: Params = None,
                 use_tqdm: bool = False, priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompt must be a string, a dict or a list of them, got {type(prompts).__name__}")
        return self._run(list(prompts), sampling_params, use_tqdm, priority)

    def chat(self, messages: Union[list[dict], Sequence[list[dict]]], sampling_params: Params = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True, *, tools: Optional[list[dict]] = None,
             chat_template: Optional[str] = None, chat_template_kwargs: Optional[dict] = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations. `tools`: function
        definitions (OpenAI's `{"type": "function", "function": {...}}`) for the chat template;
        messages may hold assistant `tool_calls` and `tool` results. The output is the model's
        text (parse tool calls from it with a `tallyserve.server.tool_parsers` parser)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it cannot apply a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("messages must not be empty")
        template_tools = [t.to_template() for t in parse_tools(tools)] or None if tools is not None else None
        prompts = [
            {"prompt_token_ids": tok.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tools=template_tools, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs, continue_final_message=continue_final_message)}
            for conv in conversations
        ]
        return self._run(prompts, sampling_params, use_tqdm, None)

    def _run(self, prompts: list, sampling_params: Params, use_tqdm: bool,
             priority: Optional[Sequence[int]]) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        engine = self.engine
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            engine.step()  # drain the aborted outputs
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="Processed prompts")
        with frozen_heap():
            while len(results) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: "BeamSearchParams",
                    use_tqdm: bool = False) -> list["BeamSearchOutput"]:
        """Beam search for each prompt; each output's `sequences` are the best `beam_width`, best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError("beam_search needs a BeamSearchParams")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.engine
        ids = []
        for prompt in prompts:
            rid = str(next(self._ids))
            engine.add_beam_search_request(rid, prompt, params)
            ids.append(rid)
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="Beam search")
        with frozen_heap():
            while any(rid not in engine.beams.outputs for rid in ids) and engine.has_unfinished_requests():
                engine.step()
                bar.n = sum(rid in engine.beams.outputs for rid in ids)
                bar.refresh()
        bar.close()
        return [engine.beams.outputs.pop(rid) for rid in ids]

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

"""The load generator: open-loop arrivals (Poisson at --request-rate), optional fixed concurrency,
multi-turn conversations whose history carries the server's replies, and a progress bar."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
from tqdm.auto import tqdm

from tallyserve.bench.client import api_root, first_model_id, send_request
from tallyserve.bench.metrics import RequestRecord
from tallyserve.bench.workloads import RequestSpec, Workload


@dataclass
class BenchOptions:
    base_url: str
    model: Optional[str] = None
    max_concurrency: Optional[int] = None
    request_timeout: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = False  # a vLLM extension of the OpenAI API: sent only when asked
    api_key: Optional[str] = None
    extra_body: dict = field(default_factory=dict)
    disable_tqdm: bool = False


class _Conversation:
    """History of one conversation: chat messages or completion text, replies included."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.text = ""

    def payload_prompt(self, spec: RequestSpec) -> dict[str, Any]:
        if spec.messages is not None:
            return {"messages": self.messages + spec.messages}
        if spec.prompt_token_ids is not None:
            return {"prompt": spec.prompt_token_ids}
        return {"prompt": f"{self.text}\n{spec.prompt}" if self.text else spec.prompt}

    def add_reply(self, sent: dict[str, Any], reply: str) -> None:
        if "messages" in sent:
            self.messages = sent["messages"] + [{"role": "assistant", "content": reply}]
        elif isinstance(sent["prompt"], str):
            self.text = sent["prompt"] + reply


class BenchRunner:
    def __init__(self, workload: Workload, opts: BenchOptions) -> None:
        self.workload = workload
        self.opts = opts
        self.root = api_root(opts.base_url)
        self.records: dict[str, RequestRecord] = {}
        self._bar: Optional[tqdm] = None
        self._sem: Optional[asyncio.Semaphore] = None
        self._t0 = 0.0
        self.model: Optional[str] = opts.model

    def _payload(self, spec: RequestSpec, conv: _Conversation) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": self.opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        payload.update(conv.payload_prompt(spec))
        if self.opts.ignore_eos:
            payload["ignore_eos"] = True
        payload.update(self.opts.extra_body)
        return payload

    async def _sleep_until(self, t: float) -> None:
        delay = t - (time.perf_counter() - self._t0)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _run_conversation(self, client: httpx.AsyncClient, turns: list[RequestSpec]) -> None:
        conv = _Conversation()
        prev_done: Optional[float] = None
        failed: Optional[str] = None
        for spec in turns:
            record = RequestRecord(spec.request_id, spec.conversation_id, spec.turn)
            self.records[spec.request_id] = record
            if failed is not None:
                record.error_kind, record.error = "skipped_after_error", f"turn after failed request {failed}"
                record.start_s = time.perf_counter() - self._t0
                self._bar.update(1)
                continue
            target = spec.arrival_s or 0.0
            if prev_done is not None:
                target = max(target, prev_done + spec.think_time_s)
            await self._sleep_until(target)
            payload = self._payload(spec, conv)
            if self._sem is not None:
                async with self._sem:
                    await send_request(client, self.root, payload, record, self._t0)
            else:
                await send_request(client, self.root, payload, record, self._t0)
            prev_done = time.perf_counter() - self._t0
            if record.ok:
                conv.add_reply(payload, record.output_text)
            else:
                failed = spec.request_id
            self._bar.update(1)

    async def run(self) -> tuple[list[RequestRecord], float]:
        headers = {"Authorization": f"Bearer {self.opts.api_key}"} if self.opts.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.opts.request_timeout, connect=min(30.0, self.opts.request_timeout))
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
            if self.model is None:
                self.model = await first_model_id(client, self.root)
            if self.opts.max_concurrency:
                self._sem = asyncio.Semaphore(self.opts.max_concurrency)
            self._bar = tqdm(total=len(self.workload), desc="bench", unit="req", disable=self.opts.disable_tqdm)
            self._t0 = time.perf_counter()
            try:
                await asyncio.gather(*(self._run_conversation(client, c) for c in self.workload.conversations()))
            finally:
                self._bar.close()
            duration = time.perf_counter() - self._t0
        return [self.records[s.request_id] for s in self.workload.requests], duration


def run_bench(workload: Workload, opts: BenchOptions) -> tuple[list[RequestRecord], float, str]:
    runner = BenchRunner(workload, opts)
    records, duration = asyncio.run(runner.run())
    return records, duration, runner.model

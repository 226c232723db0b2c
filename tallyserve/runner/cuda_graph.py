"""CUDA-graph capture and replay of decode-only steps (every request has exactly one query row).

One graph per batch-size bucket (1, 2, 4, ..., 256, capped at max_num_seqs, which is itself the
last bucket). All graphs read the same static input buffers, sized for the largest bucket:

    input_ids, positions, slot_mapping (n,) int64;  seq_lens (n,) int32;
    query_start_loc (n + 1,) int32 = arange (a decode row per request, padding included);
    block_tables (n, max_blocks_per_seq) int32.

A batch of B requests replays the smallest bucket b >= B: its rows are copied into [0, B) (device
to device, on the stream, no sync: ``ForwardBatch.build`` already moved them from pinned host
memory), and rows [B, b) become padding requests with slot -1 (their K/V is never written) and
seq_len 0 (they read no key, so they output zeros and never touch a real row). Buckets up to
``PACKED_MAX_BATCH`` read their own packed copy of the inputs instead (``forward_batch.graph_input_arrays``:
the bucket's rows, padding included, and a block table as wide as the captured one): ``ForwardBatch.build``
packs a step for such a bucket in that layout (``layout``), so its inputs reach the graph in one device
copy rather than five copies and two fills (a one-request step is bound by such small operations). The graph's output
rows [0, B) are returned (final-norm hidden states; the runner computes logits of the sampled rows).
Buckets up to ``LOGITS_MAX_BATCH`` also compute the logits inside the graph when the runner is given
``compute_logits`` (the lm_head and the float32 cast then replay with the body: two launches fewer, and
the lm_head's dependent launch overlaps the final norm); their static logits stay small
(``LOGITS_MAX_BATCH`` rows of the vocabulary).

The attention backend must read lengths only from device tensors (``supports_cuda_graph``); the
capture-time metadata carries ``max_seq_len = max_model_len`` so host-side choices (e.g. the decode
split count) hold for every replay. With cascade attention (``cascade=True``) buckets of at least
``CASCADE_MIN_REQS`` get a second graph whose attention splits each request's context into the prefix
all requests share (its length in the static ``prefix_kv_lens``, bound ``max_model_len`` at capture)
and the request's own keys; a step whose metadata has ``common_prefix_len`` replays that one. The KV caches are
captured by address: they must not be
reallocated afterwards.

``graph_factory`` is injectable: on CUDA it records real graphs; tests on the CPU pass a factory
that "replays" by re-running the captured function on the same static buffers.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch
from torch import nn

from tallyserve.attention.metadata import CASCADE_MIN_REQS, AttentionMetadata
from tallyserve.runner.forward_batch import graph_input_arrays
from tallyserve.runner.host_tensors import pack

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PADDING_SLOT = -1
# graphs of buckets up to this size compute the logits too (larger steps are bound by the body, and
# their static float32 logits would hold bucket x vocabulary x 4 bytes of the graph pool)
LOGITS_MAX_BATCH = 16
# buckets up to this size keep packed inputs (their padded block tables stay small: bucket x max blocks)
PACKED_MAX_BATCH = 16


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Capture sizes: powers of two below min(max_num_seqs, 256), then that cap itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    cap = min(max_num_seqs, BATCH_BUCKETS[-1])
    return tuple(b for b in BATCH_BUCKETS if b < cap) + (cap,)


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphFactory(Protocol):
    def capture(self, fn: Callable[[], Any]) -> tuple[Graph, Any]: ...


class TorchCudaGraphFactory:
    """Real CUDA graphs sharing one memory pool (capture the largest bucket first)."""

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], Any]) -> tuple[Graph, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        return graph, out


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_seq_len: Optional[int] = None,
        graph_factory: Optional[GraphFactory] = None,
        cascade: bool = False,
        compute_logits: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        """``compute_logits``: hidden rows -> float32 logits; given, buckets up to LOGITS_MAX_BATCH
        capture it after the body (it must be graph-safe: no host sync, no collective)."""
        self.model = model
        self.compute_logits = compute_logits
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.max_blocks_per_seq = max(1, int(max_blocks_per_seq))
        self.max_seq_len = int(max_seq_len) if max_seq_len is not None else self.max_blocks_per_seq * block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.graph_factory = graph_factory
        n = self.buckets[-1]
        with torch.inference_mode():
            kw = dict(device=self.device)
            self.input_ids = torch.zeros(n, dtype=torch.int64, **kw)
            self.positions = torch.zeros(n, dtype=torch.int64, **kw)
            self.slot_mapping = torch.full((n,), PADDING_SLOT, dtype=torch.int64, **kw)
            self.seq_lens = torch.zeros(n, dtype=torch.int32, **kw)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **kw)
            self.block_tables = torch.zeros((n, self.max_blocks_per_seq), dtype=torch.int32, **kw)
            self.prefix_kv_lens = torch.zeros(1, dtype=torch.int32, **kw)
            # small buckets: (packed buffer, its views: ids, positions, slots, seq_lens, block tables), all padding
            self.packed: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
            empty = np.zeros(0, dtype=np.int64)
            for b in self.buckets:
                if b <= PACKED_MAX_BATCH:
                    arrays = graph_input_arrays(b, self.max_blocks_per_seq, empty, empty, empty, empty,
                                                np.zeros((0, 1), dtype=np.int64))
                    host, views = pack(arrays)
                    buf = host.to(self.device)
                    self.packed[b] = (buf, views(buf))
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.logits_outputs: dict[int, torch.Tensor] = {}  # buckets whose graph computes the logits
        # cascade-attention graphs, keyed like ``graphs`` (buckets of at least CASCADE_MIN_REQS)
        self.cascade_sizes = tuple(b for b in self.buckets if b >= CASCADE_MIN_REQS) if cascade else ()
        self.cascade_graphs: dict[int, Graph] = {}
        self.cascade_outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self.num_cascade_replays = 0

    # ------------------------------------------------------------------ capture
    def inputs(self, size: int) -> list[torch.Tensor]:
        """Bucket ``size``'s static inputs: ids, positions, slots, seq_lens, block tables."""
        if size in self.packed:
            return self.packed[size][1]
        return [t[:size] for t in (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables)]

    def layout(self, num_reqs: int, width: int) -> Optional[tuple[int, int]]:
        """(bucket, block-table width) of packed inputs for a decode step of ``num_reqs`` requests whose
        block tables are ``width`` wide, when its bucket keeps packed inputs; else None."""
        if not self.graphs or not 0 < num_reqs <= self.buckets[-1] or width > self.max_blocks_per_seq:
            return None
        size = self.bucket_for(num_reqs)
        return (size, self.max_blocks_per_seq) if size in self.packed else None

    def capture_meta(self, size: int, cascade: bool = False) -> AttentionMetadata:
        """Metadata of bucket ``size`` over views of the static buffers (host fields: bounds)."""
        _, _, slots, seq_lens, tables = self.inputs(size)
        return AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=seq_lens,
            block_tables=tables,
            query_start_loc_cpu=tuple(range(size + 1)),
            seq_lens_cpu=(self.max_seq_len,) * size,
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            common_prefix_len=self.max_seq_len if cascade else 0,
            prefix_kv_lens=self.prefix_kv_lens if cascade else None,
        )

    def graph_logits(self, size: int, cascade: bool = False) -> bool:
        """Whether bucket ``size``'s graph (of that kind) computes the logits too."""
        return self.compute_logits is not None and not cascade and size <= LOGITS_MAX_BATCH

    def _forward_fn(self, size: int, cascade: bool = False) -> Callable[[], Any]:
        """The captured step: hidden states, or (hidden states, logits) for graph_logits buckets."""
        meta = self.capture_meta(size, cascade)
        ids, pos = self.inputs(size)[:2]
        if not self.graph_logits(size, cascade):
            return lambda: self.model(ids, pos, self.kv_caches, meta)

        def body_and_logits() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.model(ids, pos, self.kv_caches, meta)
            return hidden, self.compute_logits(hidden)
        return body_and_logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its pool memory). The static
        buffers hold padding only (slot -1, seq_len 0), so warm-up runs write no cache slot."""
        if self.graph_factory is None:
            self.graph_factory = TorchCudaGraphFactory(self.device)
        self._reset_padding(self.buckets[-1], 0)
        self.prefix_kv_lens.zero_()
        start = time.perf_counter()
        variants = [(size, False) for size in self.buckets] + [(size, True) for size in self.cascade_sizes]
        for size, cascade in sorted(variants, reverse=True):
            fn = self._forward_fn(size, cascade)
            fn()  # warm-up: compiles the Triton kernels and creates library handles outside the graph
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            graphs, outputs = (self.cascade_graphs, self.cascade_outputs) if cascade else (self.graphs, self.outputs)
            graphs[size], out = self.graph_factory.capture(fn)
            if self.graph_logits(size, cascade):
                out, self.logits_outputs[size] = out
            outputs[size] = out
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s, cascade attention for %s, logits for %s) in %.2f s",
                    len(variants), list(self.buckets), list(self.cascade_sizes), sorted(self.logits_outputs),
                    time.perf_counter() - start)

    # ------------------------------------------------------------------ replay
    def bucket_for(self, num_reqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_reqs)]

    def can_run(self, batch) -> bool:
        """A captured decode step fits: one row per request, no trailing padding rows, sizes in range."""
        meta: AttentionMetadata = batch.attn_meta
        return (
            bool(self.graphs)
            and meta.max_query_len == 1
            and 0 < meta.num_reqs <= self.buckets[-1]
            and batch.num_tokens == meta.num_reqs == batch.input_ids.shape[0]
            and meta.block_size == self.block_size
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
            and meta.max_seq_len <= self.max_seq_len
        )

    def _reset_padding(self, size: int, start: int) -> None:
        """Rows [start, size) of bucket ``size``'s inputs become padding (slot -1, length 0)."""
        if size > start:
            _, _, slots, seq_lens, _ = self.inputs(size)
            slots[start:].fill_(PADDING_SLOT)
            seq_lens[start:].zero_()

    @torch.inference_mode()
    def run(self, batch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Replay the graph of the batch's bucket; returns the hidden states (B, hidden) of the real
        rows and, when the graph computes them, their float32 logits (B, vocab) (else None): views of
        the graph's static outputs, valid until the next replay."""
        meta: AttentionMetadata = batch.attn_meta
        num = meta.num_reqs
        size = self.bucket_for(num)
        packed = getattr(batch, "graph_inputs", None)
        if size in self.packed and packed is not None and packed.numel() == self.packed[size][0].numel():
            self.packed[size][0].copy_(packed, non_blocking=True)  # built in this bucket's layout, padding included
        else:
            ids, pos, slots, seq_lens, tables = self.inputs(size)
            ids[:num].copy_(batch.input_ids, non_blocking=True)
            pos[:num].copy_(batch.positions, non_blocking=True)
            slots[:num].copy_(meta.slot_mapping, non_blocking=True)
            seq_lens[:num].copy_(meta.seq_lens, non_blocking=True)
            width = meta.block_tables.shape[1]
            tables[:num, :width].copy_(meta.block_tables, non_blocking=True)
            self._reset_padding(size, num)
        if meta.common_prefix_len > 0 and size in self.cascade_graphs:
            self.prefix_kv_lens.copy_(meta.prefix_kv_lens, non_blocking=True)
            self.cascade_graphs[size].replay()
            self.num_replays += 1
            self.num_cascade_replays += 1
            return self.cascade_outputs[size][:num], None
        self.graphs[size].replay()
        self.num_replays += 1
        logits = self.logits_outputs.get(size)
        return self.outputs[size][:num], (logits[:num] if logits is not None else None)


def make_graph_runner(
    model: nn.Module, kv_caches: list[torch.Tensor], max_num_seqs: int, max_model_len: int,
    device: torch.device, dtype: torch.dtype, block_size: int, cascade: bool = False,
) -> Optional[CudaGraphRunner]:
    """A captured CudaGraphRunner when the device is CUDA and the model's attention backend can be
    captured; None otherwise (the runner then stays eager). Small buckets capture the logits too,
    unless the model is tensor-parallel (its logits are gathered across ranks)."""
    if device.type != "cuda":
        return None
    backend = getattr(model, "attn_backend", None)
    if not getattr(backend, "supports_cuda_graph", False):
        logger.warning("attention backend %r cannot be captured in CUDA graphs: decode runs eagerly",
                       getattr(backend, "name", backend))
        return None
    max_blocks = -(-max_model_len // block_size)
    logits_fn = None
    if getattr(model, "tp_size", 1) == 1:
        logits_fn = getattr(model, "compute_logits", None)
    runner = CudaGraphRunner(model, kv_caches, max_num_seqs, max_blocks, device, dtype, block_size,
                             max_seq_len=max_model_len, cascade=cascade, compute_logits=logits_fn)
    runner.capture()
    return runner

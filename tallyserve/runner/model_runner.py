"""ModelRunner: owns the model and the paged KV cache; executes one ForwardBatch."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from tallyserve.attention.metadata import AttentionMetadata
from tallyserve.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs, default_max_num_batched_tokens
from tallyserve.core.kv_cache_manager import KVCopy, KVTransfers, cdiv
from tallyserve.models.cpu_products import onednn_float32_pays, sgemm_float32_pays
from tallyserve.config.device import resolve_dtype, resolve_matmul_dtype
from tallyserve.config.model import ModelConfig, kv_bytes_per_token
from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
from tallyserve.runner.forward_batch import ForwardBatch
from tallyserve.runner.memory import kv_budget_bytes
from tallyserve.runner.outputs import AsyncModelRunnerOutput, PendingForward
from tallyserve.runner.prompt_logprobs import compute_prompt_logprobs
from tallyserve.runner.rejection_sampler import verify_drafts
from tallyserve.runner.host_tensors import host_tensor
from tallyserve.runner.sampler import Sampler
from tallyserve.runner.grammar_mask import apply_grammar_bitmask
from tallyserve.runner.penalties import ProcessRow, TokenMirror, process_logits

logger = logging.getLogger(__name__)

def apply_matmul_dtype(model, name: str, device: torch.device) -> None:
    """``model.set_matmul_dtype`` when ``resolve_matmul_dtype`` asks for one (after ``enable_fused_kernels``); a
    float32 model on the CPU gets the fastest product instead: tallyserve's AVX2 kernel where it beats both
    libraries (``cpu_products.sgemm_float32_pays``), else oneDNN's blocked weights where they multiply faster than ATen's
    matmul (``cpu_products.onednn_float32_pays``)."""
    matmul_dtype = resolve_matmul_dtype(name, device)
    if matmul_dtype is None:
        if device.type == "cpu" and resolve_dtype(name, device) == torch.float32 and hasattr(model, "pack_cpu_weights"):
            if sgemm_float32_pays():
                model.pack_cpu_weights(kernel="sgemm")
            elif onednn_float32_pays():
                model.pack_cpu_weights()
        return
    if not bf16_matmul_native():
        logger.warning("dtype=%s on a CPU without AVX512-BF16/AMX: its bfloat16 matmuls are emulated and slower "
                       "than float32; dtype=float32 is faster here", name)
    model.set_matmul_dtype(matmul_dtype)


def bf16_matmul_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (oneDNN's AVX512-BF16 or AMX kernels)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """A KV cache for block copies: an FP8 one as its bytes (indexing kernels have no FP8 variants)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                       tensor_parallel_size: int = 1) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return kv_bytes_per_token(model_config, elem, tensor_parallel_size) * block_size


# GPU memory kept free beyond the profiled activations: CUDA-graph pools, sampler, fragmentation.
GPU_HEADROOM_BYTES = 512 << 20


def _full_budget_forward(model: nn.Module, args: EngineArgs, model_config: ModelConfig, device: torch.device) -> int:
    """One forward of a full token budget (plus logits of max_num_seqs rows) over a one-block scratch cache
    shared by every layer: slots -1 and an all-zero block table, so it writes nothing and needs no real KV
    pool. Returns the token count."""
    max_len = args.max_model_len or model_config.max_position_embeddings
    num_tokens = args.max_num_batched_tokens or default_max_num_batched_tokens(args.enable_chunked_prefill, max_len)
    lens = [min(max_len, num_tokens - s) for s in range(0, num_tokens, max_len)]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    kw = dict(device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, **kw),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, **kw),
        seq_lens=torch.tensor(lens, dtype=torch.int32, **kw),
        block_tables=torch.zeros((len(lens), cdiv(max(lens), args.block_size)), dtype=torch.int32, **kw),
        query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(lens), block_size=args.block_size,
        max_query_len=max(lens), max_seq_len=max(lens),
    )
    cache = torch.zeros(model.get_kv_cache_shape(1, args.block_size), dtype=next(model.parameters()).dtype, **kw)
    positions = torch.cat([torch.arange(n, dtype=torch.int64, **kw) for n in lens])
    sampled = torch.arange(num_tokens - min(args.max_num_seqs, num_tokens), num_tokens, **kw)
    hidden = model(torch.zeros(num_tokens, dtype=torch.int64, **kw), positions,
                   [cache] * model_config.num_hidden_layers, meta)
    model.compute_logits(hidden[sampled])
    return num_tokens


@torch.inference_mode()
def profile_activation_bytes(model: nn.Module, args: EngineArgs, model_config: ModelConfig,
                             device: torch.device) -> int:
    """Peak bytes one forward of a full token budget allocates (plus logits of max_num_seqs rows),
    measured on the GPU (``_full_budget_forward``)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    num_tokens = _full_budget_forward(model, args, model_config, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()  # the KV pool is sized from free memory next
    logger.info("profiled a %d-token forward: %.2f GiB of activations", num_tokens, peak / 2**30)
    return int(peak)


@torch.inference_mode()
def warm_up_full_budget(model: nn.Module, args: EngineArgs, model_config: ModelConfig, device: torch.device) -> bool:
    """On CUDA, once the KV pool exists: one more forward of a full token budget, so that the caching
    allocator already holds the activation blocks of a full prefill step and cuBLAS has chosen its kernels for
    those row counts before the first request (the profiling forward's blocks went back to the driver when
    the pool was sized). Returns whether it ran. Out of memory here is
    logged, not raised: the engine serves as it would have without it. Single-process engines only: a tensor
    parallel rank that ran out of memory here would leave the others waiting in its all-reduces."""
    if device.type != "cuda":
        return False
    try:
        _full_budget_forward(model, args, model_config, device)
        torch.cuda.synchronize(device)
    except RuntimeError as exc:  # torch.cuda.OutOfMemoryError, or a library's failed workspace allocation
        text = str(exc)
        if not isinstance(exc, torch.cuda.OutOfMemoryError) and "out of memory" not in text \
                and "ALLOC_FAILED" not in text:
            raise
        logger.warning("no memory for the full-budget warm-up forward; the first large step allocates instead")
        torch.cuda.empty_cache()
        return False
    return True


def determine_num_blocks(args: EngineArgs, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                         model: Optional[nn.Module] = None, tensor_parallel_size: int = 1) -> int:
    """Blocks of the KV pool: the override, else a byte budget (CPU) or free GPU memory (after
    profiling a full-budget forward of ``model`` when it is given)."""
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    per_block = kv_bytes_per_block(model_config, args.block_size, dtype, tensor_parallel_size)
    if args.kv_cache_memory_bytes is not None:
        budget = args.kv_cache_memory_bytes
    elif device.type == "cuda":
        if model is not None:
            activations = profile_activation_bytes(model, args, model_config, device) + GPU_HEADROOM_BYTES
        else:  # estimate: activations of a full token budget (logits dominate at large vocab)
            tokens = args.max_num_batched_tokens or 8192
            activations = tokens * (model_config.vocab_size * 4 + model_config.intermediate_size * 12)
        budget = kv_budget_bytes(device, args.gpu_memory_utilization, activations)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // per_block
    # More blocks than every sequence could ever fill is wasted memory.
    ceiling = cdiv(model_config.max_position_embeddings, args.block_size) * args.max_num_seqs
    num_blocks = min(num_blocks, max(ceiling, 1))
    if num_blocks < 1:
        raise ValueError(
            f"not enough memory for a single KV block ({per_block} bytes); "
            "raise gpu_memory_utilization or kv_cache_memory_bytes"
        )
    return int(num_blocks)


def num_host_blocks(args: EngineArgs, model_config: ModelConfig, dtype: torch.dtype,
                    tensor_parallel_size: int = 1) -> int:
    """Blocks of the host KV tier: kv_offload_bytes over the bytes of one block on one rank (0 = no tier)."""
    if not args.kv_offload_bytes:
        return 0
    per_block = kv_bytes_per_block(model_config, args.block_size, dtype, tensor_parallel_size)
    return max(args.kv_offload_bytes // per_block, 1)


class ModelRunner:
    """The model, its paged KV cache and the sampler of one device (one tensor-parallel rank).
    A step: ``prepare`` builds the ForwardBatch of a frozen SchedulerOutput, ``launch`` queues
    the forward pass and the sampling on the device and returns an AsyncModelRunnerOutput."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, num_host_blocks: int = 0, *,
                 use_cuda_graph: bool = False, max_num_seqs: int = 256, max_model_len: Optional[int] = None,
                 eos_token_ids: tuple[int, ...] = (), seed: int = 0, use_cascade_attn: bool = True) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        shape = model.get_kv_cache_shape(num_blocks, block_size)
        layers = model_config.num_hidden_layers
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.host_kv_caches: list[torch.Tensor] = []
        if num_host_blocks:
            host_shape = model.get_kv_cache_shape(num_host_blocks, block_size)
            pin = device.type == "cuda"
            self.host_kv_caches = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in range(layers)]
        self.bytes_per_block = kv_bytes_per_block(model_config, block_size, dtype, getattr(model, "tp_size", 1))
        self.bytes_moved = 0
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(generator=torch.Generator(device=device).manual_seed(seed))
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own generators
        self._token_mirror = None  # host copy of every KV slot's token (penalties read histories from it)
        self._last_step: Optional[AsyncModelRunnerOutput] = None  # its tokens fill the next step's placeholders
        # cascade attention over a prefix all decode rows share (backends that have it; not disable_cascade_attn)
        self.use_cascade_attn = use_cascade_attn and getattr(getattr(model, "attn_backend", None),
                                                             "supports_cascade", False)
        # CPU: steps where only some rows are sampled run the model's last layer for those rows alone, once every
        # row's K/V is written (ForwardBatch.output_rows)
        self.output_rows = device.type == "cpu" and getattr(model, "supports_output_rows", False)
        self.graph_runner = None  # decode steps replay CUDA graphs (CUDA, graph-safe backend, not enforce_eager)
        if use_cuda_graph and not getattr(model, "cuda_graph_safe", True):
            logger.info("CUDA graphs are off for this model: its mixture-of-experts layers read their routing on "
                        "the host")
            use_cuda_graph = False
        if use_cuda_graph:
            from tallyserve.runner.cuda_graph import make_graph_runner

            self.graph_runner = make_graph_runner(model, self.kv_caches, max_num_seqs,
                                                  max_model_len or model_config.max_position_embeddings,
                                                  device, dtype, block_size, cascade=self.use_cascade_attn)

    def copy_blocks(self, copies: Sequence[KVCopy]) -> None:
        """Partial reuse: copy the leading slots of cached blocks into the requests' new blocks."""
        for c in copies:
            for cache in self.kv_caches:
                cache = _raw(cache)
                cache[:, c.dst, : c.num_tokens] = cache[:, c.src, : c.num_tokens]

    @torch.inference_mode()
    def apply_transfers(self, moves: KVTransfers) -> None:
        """A step's block moves, in order: offloads (device -> host), restores, partial copies."""
        if moves.offloads:
            src = torch.tensor([c.src for c in moves.offloads], device=self.device)
            dst = torch.tensor([c.dst for c in moves.offloads])
            for dev, host in zip(self.kv_caches, self.host_kv_caches):
                _raw(host)[:, dst] = _raw(dev)[:, src].to("cpu")
        if moves.restores:
            src = torch.tensor([c.src for c in moves.restores])
            dst = torch.tensor([c.dst for c in moves.restores], device=self.device)
            for dev, host in zip(self.kv_caches, self.host_kv_caches):
                _raw(dev)[:, dst] = _raw(host)[:, src].to(self.device, non_blocking=True)
        self.bytes_moved += (len(moves.offloads) + len(moves.restores)) * self.bytes_per_block
        self.copy_blocks(moves.copies)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch, prev_token_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Run the forward pass; return float32 logits of the sampled rows (S, vocab) (None on
        tensor-parallel ranks other than 0, which only help compute them).
        ``prev_token_ids``: the in-flight step's sampled tokens, for the batch's placeholder rows
        (copied device to device, so this step is queued without waiting for that one)."""
        return self._logits(batch, *self._forward(batch, prev_token_ids))

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch, prev_token_ids: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The model's hidden states of every row of the batch, and the logits of every row when a
        CUDA graph computed them (small decode-only steps; else None)."""
        if batch.fill_rows is not None:
            if prev_token_ids is None:
                raise ValueError("the batch has placeholder rows but no previous step's tokens")
            batch.input_ids[batch.fill_rows] = prev_token_ids[batch.fill_src]
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        if batch.output_rows is not None:  # the last layer only for the sampled rows: hidden is theirs
            return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_meta, batch.output_rows), None
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_meta), None

    @torch.inference_mode()
    def _logits(self, batch: ForwardBatch, hidden: torch.Tensor,
                all_logits: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Float32 logits of the sampled rows; ``all_logits``: every row's, already computed."""
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        if batch.logits_all_rows or batch.output_rows is not None:  # every row of hidden is sampled: no gather
            return all_logits if all_logits is not None else self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[batch.logits_indices])

    # ----------------------------------------------------------------- one step
    def prepare(self, so: SchedulerOutput, prev: Optional[AsyncModelRunnerOutput] = None) -> ForwardBatch:
        """The batch of a step; placeholder rows point at ``prev``'s sampled tokens."""
        for rid in so.finished_request_ids:
            self._generators.pop(rid, None)
        return ForwardBatch.build(so, self.block_size, self.device, prev.token_index if prev is not None else None,
                                  cascade=self.use_cascade_attn,
                                  graph_layout=self.graph_runner.layout if self.graph_runner is not None else None,
                                  output_rows=self.output_rows)

    def launch(self, so: SchedulerOutput, batch: ForwardBatch, prev: Optional[AsyncModelRunnerOutput] = None,
               draft_probs: Optional[dict[str, torch.Tensor]] = None) -> AsyncModelRunnerOutput:
        """Forward and sampling of a prepared step, queued on the device (nothing waits for it)."""
        return self.launch_forward(so, batch, prev, draft_probs).sample(so)

    def launch_forward(self, so: SchedulerOutput, batch: ForwardBatch, prev: Optional[AsyncModelRunnerOutput] = None,
                       draft_probs: Optional[dict[str, torch.Tensor]] = None) -> PendingForward:
        """The forward pass of a prepared step, queued on the device; its ``sample(so)`` queues the
        sampling later (structured outputs fill the step's bitmask in between)."""
        hidden, all_logits = self._forward(batch, prev.token_ids if prev is not None else None)
        logits = self._logits(batch, hidden, all_logits)  # None on a tensor-parallel rank other than 0: rank 0 samples
        # rows with prompt_logprobs: their logits too, in slices (runner/prompt_logprobs.py); every TP rank
        prompt_lp = compute_prompt_logprobs(self.model.compute_logits, hidden, so.requests,
                                            batch.attn_meta.query_start_loc_cpu, self.model_config.vocab_size)
        del hidden
        return PendingForward(batch.num_tokens, logits, prompt_lp, draft_probs or {}, self.sample)

    def _generator(self, e: ScheduledRequest) -> Optional[torch.Generator]:
        seed = e.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(e.request_id)
        if gen is None:
            gen = self._generators[e.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    @torch.inference_mode()  # the logits are inference tensors; min_tokens bans edit them in place
    def sample(self, so: SchedulerOutput, logits: torch.Tensor, num_forward_tokens: int,
               draft_probs: dict[str, torch.Tensor]) -> AsyncModelRunnerOutput:
        """Queue the sampling of a step's logits. Plain rows stay on the device (their tokens feed
        the next async step); beam rows and draft verification are resolved here, on the host."""
        step = AsyncModelRunnerOutput(num_forward_tokens)
        raw = logits
        logits = self._process_logits(so, logits)  # penalties, logit_bias, allowed ids, bad words
        # structured outputs: grammar rows only; the unmasked logits are kept only for reported logprobs
        wants_logprobs = any(e.sample and e.sampling_params.logprobs is not None for e in so.requests)
        logits = apply_grammar_bitmask(so, logits, raw if wants_logprobs else None)
        row, plain, plain_rows, gens = 0, [], [], []
        for e in so.requests:
            if not e.sample:
                continue
            n = e.num_sample_rows
            if e.beam_search:  # beam search picks tokens per group, in the engine, after the step
                step.beam_logprobs[e.request_id] = torch.log_softmax(logits[row].float(), dim=-1).cpu()
                row += n
                continue
            if e.num_output_tokens < e.sampling_params.min_tokens:
                banned = list(self.eos_token_ids) + list(e.sampling_params.stop_token_ids)
                if banned:
                    logits[row:row + n].index_fill_(1, host_tensor(banned, logits.device), float("-inf"))
                    if raw is not logits:
                        raw[row:row + n].index_fill_(1, host_tensor(banned, logits.device), float("-inf"))
            gen = self._generator(e)
            if e.num_draft_tokens:
                gen = gen or self.sampler.shared_generator(logits.device)
                step.resolved[e.request_id] = verify_drafts(logits[row:row + n], e.draft_token_ids, e.sampling_params,
                                                            gen, draft_probs.get(e.request_id))
            else:
                plain.append(e)
                plain_rows.append(row)
                gens.append(gen)
            row += n
        if plain:
            sub = logits if len(plain_rows) == logits.shape[0] else logits[host_tensor(plain_rows, logits.device)]
            raw_sub = None
            if raw is not logits:
                raw_sub = raw if len(plain_rows) == raw.shape[0] else raw[host_tensor(plain_rows, raw.device)]
            tensors = self.sampler.sample_tensors(sub, [e.sampling_params for e in plain], gens, raw_sub)
            step.token_ids = tensors.token_ids
            step.token_index = {e.request_id: i for i, e in enumerate(plain)}
            step.pending = tensors.to_host()
        self._last_step = step  # the next step's placeholders are this step's tokens
        return step

    def _process_logits(self, so: SchedulerOutput, logits: torch.Tensor) -> torch.Tensor:
        """Penalties and token controls (runner/penalties.py) on a copy of the logits; the logits
        themselves when no sampled row uses any (then nothing is built)."""
        mirror = self._token_mirror
        if mirror is None:
            mirror = self._token_mirror = TokenMirror(self.block_size)
        inflight = self._last_step
        placeholders = mirror.update(so, inflight)  # every step: prefix hits read slots others wrote
        rows: list[ProcessRow] = []
        row = 0
        for e in so.requests:
            if not e.sample:
                continue
            n = e.num_sample_rows
            p = e.sampling_params
            if not e.beam_search and p.has_logits_processing:
                length = e.start_position + e.num_tokens  # the sequence, drafts included
                seq = mirror.tokens(e.block_ids, length) if p.uses_history else None
                ph = placeholders.get(e.request_id, -1)
                for j in range(n):  # row j follows the sequence up to its j-th draft token
                    end = length - e.num_draft_tokens + j
                    prompt_len = length - e.num_draft_tokens - e.num_output_tokens
                    if seq is None:
                        prompt = output = np.zeros(0, dtype=np.int64)
                    else:
                        prompt, output = seq[:prompt_len], seq[prompt_len:end]
                        if ph >= 0:  # the placeholder is the newest output token: it comes from the device
                            output = output[output >= 0]
                    rows.append(ProcessRow(row + j, p, prompt, output, ph))
            row += n
        if not rows:
            return logits
        return process_logits(logits, rows, inflight.token_ids if inflight is not None else None)

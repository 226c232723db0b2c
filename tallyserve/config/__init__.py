"""Engine configuration: validated user arguments, then frozen configs derived once by resolve()."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from tallyserve.config.device import KV_CACHE_DTYPES
from tallyserve.config.kv_transfer import KVTransferConfig
from tallyserve.config.model import ModelConfig
from tallyserve.config.parse import json_object_arg  # noqa: F401 - part of this package's interface
from tallyserve.config.quantization import QUANTIZATION_METHODS
from tallyserve.config.speculative import SpeculativeConfig

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


class ContextLengthError(ValueError):
    """A prompt (plus the tokens asked for) does not fit max_model_len. ``param``: the field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, max_tokens: Optional[int] = None) -> None:
    """The one prompt-length check (engine, scheduler, beam search and server). The prompt must leave
    room for one generated token; with ``max_tokens``, prompt + max_tokens must fit too."""
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthError(f"This model's maximum context length (max_model_len) is {max_model_len} tokens. However, your "
                                 f"prompt has {num_prompt_tokens} tokens; it must be shorter.", "prompt")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length (max_model_len) is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or the completion length.", "max_tokens")


def default_max_num_batched_tokens(enable_chunked_prefill: bool, max_model_len: int) -> int:
    """The per-step token budget when the user sets none (the engine and the profiler agree)."""
    return DEFAULT_MAX_NUM_BATCHED_TOKENS if enable_chunked_prefill else max(max_model_len, 2048)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    enable_partial_reuse: bool
    num_host_blocks: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool
    # vLLM's concurrent partial prefill knobs (see EngineArgs); the defaults keep today's schedules.
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        check_partial_prefill_args(self.max_num_partial_prefills, self.max_long_partial_prefills,
                                   self.long_prefill_token_threshold, self.enable_chunked_prefill)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    args: "EngineArgs"


def _check_int(name: str, value: Any, lo: int, hi: Optional[int] = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {rng}, got {value!r}")


def check_partial_prefill_args(max_num_partial_prefills: Any, max_long_partial_prefills: Any,
                               long_prefill_token_threshold: Any, enable_chunked_prefill: bool) -> None:
    """ValueError naming the argument: max_num_partial_prefills >= 1, 1 <= max_long_partial_prefills <=
    max_num_partial_prefills, long_prefill_token_threshold >= 0, and chunked prefill on when either knob is."""
    _check_int("max_num_partial_prefills", max_num_partial_prefills, 1)
    _check_int("max_long_partial_prefills", max_long_partial_prefills, 1, max_num_partial_prefills)
    _check_int("long_prefill_token_threshold", long_prefill_token_threshold, 0)
    if not enable_chunked_prefill:
        if max_num_partial_prefills > 1:
            raise ValueError("max_num_partial_prefills > 1 needs enable_chunked_prefill=True, "
                             f"got max_num_partial_prefills={max_num_partial_prefills!r}")
        if long_prefill_token_threshold > 0:
            raise ValueError("long_prefill_token_threshold > 0 chunks long prefills and needs "
                             f"enable_chunked_prefill=True, got long_prefill_token_threshold={long_prefill_token_threshold!r}")


@dataclass
class EngineArgs:
    """Keyword arguments of `LLM(...)` and `--kebab-case` flags of the CLI; names follow vLLM."""

    model: Optional[str] = None  # HF directory, .gguf file, dummy preset, or None / "bundled"
    tokenizer: Optional[str] = None
    served_model_name: Optional[str] = None
    load_format: str = "auto"
    dtype: str = "auto"
    # "fp8": quantize the projections to FP8 at load (an FP8 checkpoint is FP8 without it); None: as the checkpoint
    quantization: Optional[str] = None
    # "auto" (the model's dtype) or "fp8" / "fp8_e4m3": K/V stored in FP8, twice the blocks in the same memory
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_partial_reuse: bool = True
    enable_chunked_prefill: bool = True
    num_gpu_blocks_override: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: Optional[int] = None  # KV pool size on CPU (and on GPU, if given)
    kv_offload_bytes: Optional[int] = None  # host-memory KV tier for evicted prefix blocks
    max_logprobs: int = 20
    # {"method": "ngram" | "draft_model", "num_speculative_tokens": k, "model": draft, ...}
    speculative_config: Optional[Any] = None
    enforce_eager: bool = False
    # Cascade attention (GPU): decode steps whose requests all share a prefix of >= 256 KV tokens
    # attend it once for all of them and merge; True keeps every request on its own kernel.
    disable_cascade_attn: bool = False
    # Schedule and launch step N+1 while step N runs (its sampled tokens feed N+1 on the device).
    # None: on for CUDA without speculative decoding, off on the CPU (where nothing overlaps).
    async_scheduling: Optional[bool] = None
    # Tensor parallelism: one worker process per rank (torch.distributed: NCCL on GPUs, gloo on CPU).
    tensor_parallel_size: int = 1
    # Mixture of experts under tensor parallelism: whole experts per rank instead of a slice of every expert.
    enable_expert_parallel: bool = False
    # Several machines: nnodes of them, each running tensor_parallel_size / nnodes ranks; node 0 runs
    # the scheduler and the server, the others only workers. dist_init_addr: HOST:PORT of the rendezvous.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None
    # Seconds a worker may take to answer a step (or a collective to complete) before it counts as dead.
    worker_timeout: float = 300.0
    # Concurrent partial prefills (vLLM's names and defaults; the defaults keep today's schedules):
    # at most max_num_partial_prefills requests are mid-prefill (chunked, not finished) at once, at most
    # max_long_partial_prefills of them long: more than long_prefill_token_threshold tokens left to
    # compute; a long prefill gets at most long_prefill_token_threshold tokens per step (0: off).
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    # Disaggregated prefill/decode (vLLM's name): {"kv_connector": "NixlConnector", "kv_role": ...}.
    kv_transfer_config: Optional[Any] = None
    # Structured outputs: a grammar compile that takes longer than this many seconds is a 400 (its
    # worker process is killed), and constraints over these sizes are refused before compiling.
    structured_outputs_compile_timeout: float = 5.0
    structured_outputs_max_schema_bytes: int = 128 * 1024
    structured_outputs_max_enum_values: int = 1000
    structured_outputs_max_properties: int = 1000

    def validate(self) -> None:
        """Range checks that need no model: run before any weight is loaded."""
        self._validate_parallel()
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, got "
                             f"{self.quantization!r}")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _check_int("seed", self.seed, 0)
        _check_int("max_model_len", self.max_model_len, 1, optional=True)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("block_size", self.block_size, 1, 1024)
        _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1, optional=True)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        _check_int("kv_offload_bytes", self.kv_offload_bytes, 0, optional=True)
        _check_int("max_logprobs", self.max_logprobs, 0)
        for name in ("structured_outputs_max_schema_bytes", "structured_outputs_max_enum_values",
                     "structured_outputs_max_properties"):
            _check_int(name, getattr(self, name), 1)
        timeout = self.structured_outputs_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"structured_outputs_compile_timeout must be a positive number of seconds, got {timeout!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {gmu!r}")
        for name in ("enable_prefix_caching", "enable_partial_reuse", "enable_chunked_prefill", "enforce_eager",
                     "disable_cascade_attn", "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_partial_prefill_args(self.max_num_partial_prefills, self.max_long_partial_prefills,
                                   self.long_prefill_token_threshold, self.enable_chunked_prefill)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling does not support speculative decoding; "
                             "set async_scheduling=False or drop speculative_config")

    def _validate_parallel(self) -> None:
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("nnodes", self.nnodes, 1)
        _check_int("node_rank", self.node_rank, 0, self.nnodes - 1)
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                             f"nnodes ({self.nnodes}): every node runs the same number of ranks")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of node 0's rendezvous)")
        if self.dist_init_addr is not None:
            host, _, port = str(self.dist_init_addr).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if isinstance(self.worker_timeout, bool) or not isinstance(self.worker_timeout, (int, float)) \
                or not 0 < self.worker_timeout < float("inf"):
            raise ValueError(f"worker_timeout must be a positive number of seconds, got {self.worker_timeout!r}")
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1 yet; "
                             "set async_scheduling=False")

    def resolve(self, model_config: ModelConfig, num_blocks: int, num_host_blocks: int = 0) -> EngineConfig:
        """Derive max_model_len and the token budget once; the result is frozen."""
        model_max = model_config.max_position_embeddings
        capacity = num_blocks * self.block_size
        if self.max_model_len is not None:
            if self.max_model_len > model_max:
                raise ValueError(
                    f"max_model_len ({self.max_model_len}) is larger than the model's "
                    f"max_position_embeddings ({model_max})"
                )
            if self.max_model_len > capacity:
                raise ValueError(
                    f"max_model_len ({self.max_model_len}) does not fit in the KV cache "
                    f"({num_blocks} blocks x block_size {self.block_size} = {capacity} tokens); "
                    "lower max_model_len or give the cache more memory"
                )
            max_model_len = self.max_model_len
        else:
            max_model_len = min(model_max, capacity)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = default_max_num_batched_tokens(self.enable_chunked_prefill, max_model_len)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) "
                "when enable_chunked_prefill is False, or long prompts could never be scheduled"
            )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                self.block_size, num_blocks, self.enable_prefix_caching, self.enable_partial_reuse, num_host_blocks
            ),
            scheduler_config=SchedulerConfig(
                budget, self.max_num_seqs, max_model_len, self.enable_chunked_prefill,
                self.max_num_partial_prefills, self.max_long_partial_prefills, self.long_prefill_token_threshold,
            ),
            args=dataclasses.replace(self),
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

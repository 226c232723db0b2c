"""ModelConfig: the model's shape, read once from a Hugging Face config dict or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# Architectures served by models/llama.py, by their Hugging Face name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # Hugging Face class name, e.g. "LlamaForCausalLM"
    model_type: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: Optional[str] = None  # dtype named by the checkpoint, if any
    # mixture of experts (Qwen3-MoE, Mixtral): experts per sparse layer, experts per token, one expert's
    # intermediate size, whether the top-k routing weights are renormalised to sum to 1, the sparse layers
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def sliding_window(self) -> Optional[int]:
        """The attention window of the layers that have one, as transformers reads the config (None: every layer
        attends its whole context): Mistral's ``sliding_window``; Qwen2 / Qwen3's with ``use_sliding_window`` and
        layers from ``max_window_layers`` on; any config's ``layer_types`` naming "sliding_attention"."""
        cfg = self.hf_config
        window = cfg.get("sliding_window")
        if not window:
            return None
        types = cfg.get("layer_types")
        if types is not None:
            return int(window) if "sliding_attention" in types else None
        if self.model_type in ("qwen2", "qwen3"):
            layers = cfg.get("max_window_layers", self.num_hidden_layers)
            return int(window) if cfg.get("use_sliding_window", False) and layers < self.num_hidden_layers else None
        return int(window) if self.model_type in ("mistral", "mixtral") else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = SUPPORTED_ARCHITECTURES[arch]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 nests RoPE settings here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        layers = int(cfg["num_hidden_layers"])
        moe = _moe_fields(model_type, cfg, layers)
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            **moe,
            hf_config=dict(cfg),
        )


def _moe_fields(model_type: str, cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a Qwen3-MoE or Mixtral config (empty for dense models);
    ValueError for counts that cannot route (top-k outside [1, experts])."""
    if model_type == "qwen3_moe":
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))  # transformers 5 writes the latter
        inter = int(cfg.get("moe_intermediate_size", 0))
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if experts > 0 and i not in dense and step > 0 and (i + 1) % step == 0)
        norm = bool(cfg.get("norm_topk_prob", False))
    elif model_type == "mixtral":
        experts, inter = int(cfg.get("num_local_experts", 8)), int(cfg["intermediate_size"])
        sparse, norm = tuple(range(layers)), True
    else:
        return {}
    top_k = int(cfg.get("num_experts_per_tok", 2))
    if sparse and not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({experts})")
    if sparse and inter <= 0:
        raise ValueError(f"the experts' intermediate size must be positive, got {inter}")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter, norm_topk_prob=norm,
                moe_layers=sparse)


def kv_bytes_per_token(mc: ModelConfig, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Bytes of K and V, all layers, for one token on one tensor-parallel rank: the runner sizes its
    pool with it and the simulator its virtual one. A rank holds num_kv_heads / tp heads, or one
    replicated head when there are fewer KV heads than ranks."""
    local_kv_heads = max(mc.num_key_value_heads // tensor_parallel_size, 1)
    return 2 * mc.num_hidden_layers * local_kv_heads * mc.head_dim * dtype_bytes


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """ValueError unless ``config`` can be split over ``tp_size`` ranks: tp_size >= 1,
    num_attention_heads % tp_size == 0, num_key_value_heads % tp_size == 0 when
    num_key_value_heads >= tp_size (else tp_size % num_key_value_heads == 0: KV heads replicated),
    intermediate_size % tp_size == 0. Any vocab size works (padded to a multiple of tp_size)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % tp_size:
        problems.append(f"num_attention_heads ({heads}) is not divisible by it")
    if kv_heads >= tp_size and kv_heads % tp_size:
        problems.append(f"num_key_value_heads ({kv_heads}) is not divisible by it")
    if kv_heads < tp_size and tp_size % kv_heads:
        problems.append(f"it is not a multiple of num_key_value_heads ({kv_heads}), so KV heads cannot be replicated")
    if config.intermediate_size % tp_size:
        problems.append(f"intermediate_size ({config.intermediate_size}) is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp_size} does not fit {config.architecture}: " + "; ".join(problems))

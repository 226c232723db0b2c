"""Find a model (``resolve_model``, cheap: config only) and build it with weights (``load_model``).

Accepted model sources:
  * a Hugging Face-format directory: config.json + model.safetensors, or shards listed in
    model.safetensors.index.json;
  * a ``.gguf`` file (or a directory holding exactly one and no config.json): converted once into
    a cached Hugging Face-format directory (see ``gguf_convert``);
  * ``None``, "bundled" or "SmolLM2-135M-Instruct": the bundled SmolLM2 GGUF;
  * a preset name (``tallyserve/model_configs/<name>.json``): real shapes, random weights.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from tallyserve.config.model import ModelConfig
from tallyserve.config.quantization import Fp8Config, resolve_quantization
from tallyserve.models import fp8_loader
from tallyserve.models.bundled import BUNDLED_ALIASES, BUNDLED_SERVED_NAME, bundled_gguf_path
from tallyserve.models.layers import ShardSpec

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
PRESET_DIR = Path(__file__).resolve().parent.parent / "model_configs"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
DUMMY_STD = 0.02


@dataclass(frozen=True)
class ResolvedModel:
    model_dir: str  # Hugging Face-format directory holding config.json (and weights unless dummy)
    model_config: ModelConfig
    tokenizer_dir: Optional[str]  # model_dir when it has tokenizer files, else None
    served_name: str
    load_format: str = "safetensors"  # how load_model reads weights: "safetensors" or "dummy"
    weight_files: tuple[str, ...] = ()  # safetensors files, in load order (empty for dummy presets)
    source: str = ""  # what the user named: a directory, a .gguf path, a preset name


def check_load_format(load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    return load_format


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def _read_config(config_path: Path) -> ModelConfig:
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {str(config_path)!r}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"model config {str(config_path)!r} is not a JSON object")
    return ModelConfig.from_hf_config(cfg)


def _tokenizer_dir(model_dir: Path) -> Optional[str]:
    return str(model_dir) if any((model_dir / f).is_file() for f in _TOKENIZER_FILES) else None


def find_safetensors(model_dir: Path) -> tuple[str, ...]:
    """Weight files of a directory: the shards named by the index, model.safetensors, or else
    every *.safetensors file. Empty when there are none; ValueError for a broken index."""
    index = model_dir / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read {str(index)!r}: {exc!r}") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ValueError(f"{str(index)!r} names shards that do not exist: {missing}")
        return tuple(str(model_dir / s) for s in shards)
    if (model_dir / _SINGLE_FILE).is_file():
        return (str(model_dir / _SINGLE_FILE),)
    return tuple(str(p) for p in sorted(model_dir.glob("*.safetensors")))


def _resolve_gguf(path: Path, load_format: str, served_name: str) -> ResolvedModel:
    if load_format == "safetensors":
        raise ValueError(f"load_format='safetensors' but {str(path)!r} is a GGUF file; use 'auto' or 'gguf'")
    from tallyserve.models.gguf_convert import ensure_converted

    out_dir = ensure_converted(path)
    return ResolvedModel(
        model_dir=str(out_dir),
        model_config=_read_config(out_dir / "config.json"),
        tokenizer_dir=_tokenizer_dir(out_dir),
        served_name=served_name,
        load_format="dummy" if load_format == "dummy" else "safetensors",
        weight_files=find_safetensors(out_dir),
        source=str(path),
    )


def _resolve_dir(path: Path, load_format: str) -> ResolvedModel:
    ggufs = sorted(path.glob("*.gguf"))
    has_config = (path / "config.json").is_file()
    if load_format == "gguf" or (not has_config and load_format == "auto" and ggufs):
        if len(ggufs) != 1:
            raise ValueError(
                f"load_format={load_format!r} needs exactly one .gguf file in {str(path)!r}, found {len(ggufs)}"
            )
        return _resolve_gguf(ggufs[0], load_format, ggufs[0].stem)
    if not has_config:
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    files = find_safetensors(path)
    if not files and load_format != "dummy":
        raise ValueError(
            f"model directory {str(path)!r} has no safetensors weights ({_SINGLE_FILE} or {_INDEX_FILE}); "
            "use load_format='dummy' for random weights"
        )
    return ResolvedModel(
        model_dir=str(path),
        model_config=_read_config(path / "config.json"),
        tokenizer_dir=_tokenizer_dir(path),
        served_name=path.name,
        load_format="dummy" if load_format == "dummy" else "safetensors",
        weight_files=files,
        source=str(path),
    )


def _resolve_preset(name: str, load_format: str) -> ResolvedModel:
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"preset {name!r} has shapes but no weights: use load_format='dummy' (got {load_format!r})")
    from tallyserve.models.gguf_convert import cache_root

    text = (PRESET_DIR / f"{name}.json").read_text()
    config = ModelConfig.from_hf_config(json.loads(text))
    # Materialise a config-only directory so model_dir always holds a config.json.
    model_dir = cache_root() / "presets" / name
    config_path = model_dir / "config.json"
    if not config_path.is_file() or config_path.read_text() != text:
        model_dir.mkdir(parents=True, exist_ok=True)
        tmp = model_dir / f".config.json.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, config_path)
    return ResolvedModel(str(model_dir), config, None, name, load_format="dummy", source=name)


def resolve_model(model: Optional[str], load_format: str = "auto") -> ResolvedModel:
    """Locate ``model`` and read its config (no weights are read; a GGUF file is converted once)."""
    load_format = check_load_format(load_format)
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a path, a preset name or None, got {type(model).__name__}")
    path = Path(model).expanduser() if model is not None else None
    if path is None or (str(model) in BUNDLED_ALIASES and not path.exists()):
        return _resolve_gguf(bundled_gguf_path(), load_format, BUNDLED_SERVED_NAME)
    if path.is_dir():
        return _resolve_dir(path, load_format)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _resolve_gguf(path, load_format, path.stem)
        raise ValueError(f"model {str(model)!r} is a file but not a .gguf file; pass a model directory instead")
    if str(model) in preset_names():
        return _resolve_preset(str(model), load_format)
    raise ValueError(
        f"model {str(model)!r} does not exist: pass a Hugging Face-format directory, a .gguf file, "
        f"None for the bundled model, or a preset name ({', '.join(preset_names())})"
    )


def _cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` on the meta device, except the FP8 projections' weights and float32 scales."""
    for module in model.modules():
        fp8 = getattr(module, "fp8", None) is not None
        for pname, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and not (fp8 and pname != "bias"):
                param.data = param.data.to(dtype)


def _init_dummy(model: nn.Module, seed: int, device: torch.device, dtype: torch.dtype) -> None:
    """Every parameter ~ N(0, 0.02), norm weights 1.0; deterministic from seed (per device type).

    Under tensor parallelism a split parameter is drawn at its full (tp_size 1) shape from the
    same generator stream and then sliced, so every rank holds exactly the tp_size 1 values of its
    slice (each rank draws the whole model's numbers: as slow as tp_size 1, no slower)."""
    shards = _weight_shards(model)
    fp8 = fp8_loader.fp8_layers(model)
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    with torch.no_grad():
        for name, param in model.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            layer = fp8.get(module_name)
            if layer is not None:  # drawn like the unquantized weight (the same numbers), then quantized
                if leaf == "weight":
                    spec = shards.get(name)
                    shape = _full_shape(param, spec) if spec is not None else tuple(param.shape)
                    full = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, DUMMY_STD, generator=gen)
                    fp8_loader.init_dummy(layer, full, spec)
                elif leaf == "bias":
                    param.normal_(0.0, DUMMY_STD, generator=gen)
                continue  # the scales come with the weight
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name not in shards:
                param.normal_(0.0, DUMMY_STD, generator=gen)
            else:
                spec = shards[name]
                full = param.new_empty(_full_shape(param, spec)).normal_(0.0, DUMMY_STD, generator=gen)
                _copy_shard(param, full.narrow(spec.dim, spec.start, spec.size), spec)


def _weight_shards(model: nn.Module) -> dict[str, ShardSpec]:
    """The model's split parameters (empty at tp_size 1)."""
    return model.weight_shards() if getattr(model, "tp_size", 1) > 1 else {}


def _full_shape(param: torch.Tensor, spec: ShardSpec) -> tuple[int, ...]:
    """The checkpoint (tp_size 1) shape of a parameter that holds slice ``spec``."""
    shape = list(param.shape)
    shape[spec.dim] = spec.full_size
    return tuple(shape)


def _copy_shard(param: torch.Tensor, part: torch.Tensor, spec: ShardSpec) -> None:
    """Copy a rank's slice into its parameter; rows past it (vocab padding) become zero."""
    param.narrow(spec.dim, 0, spec.size).copy_(part)
    pad = param.shape[spec.dim] - spec.size
    if pad:
        param.narrow(spec.dim, spec.size, pad).zero_()


def _read_shard(f, name: str, param: torch.Tensor, spec: ShardSpec, file: str) -> torch.Tensor:
    """Only this rank's slice ``spec`` of checkpoint tensor ``name`` (safetensors ``get_slice``
    reads just those bytes of the memory-mapped file)."""
    sl = f.get_slice(name)
    shape, want = tuple(sl.get_shape()), _full_shape(param, spec)
    if shape != want:
        raise ValueError(f"{name}: checkpoint shape {shape} != model shape {want} ({file})")
    index = [slice(None)] * len(shape)
    index[spec.dim] = slice(spec.start, spec.start + spec.size)
    return sl[tuple(index)]


def _custom_owner(name: str, custom: dict) -> Optional[str]:
    """The name of the module in ``custom`` that ``name`` lies under, if any."""
    if not custom:
        return None
    parts = name.split(".")
    for n in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in custom:
            return prefix
    return None


def _load_safetensors(model: nn.Module, files: tuple[str, ...], quant: Optional[Fp8Config]) -> None:
    """Copy checkpoint tensors into the model by name; a split parameter (tensor parallelism)
    reads only this rank's slice; FP8 projections load through ``fp8_loader``."""
    from safetensors import safe_open

    params = dict(model.named_parameters())  # a tied lm_head.weight is listed once, as embed_tokens
    shards = _weight_shards(model)
    fp8 = fp8_loader.fp8_layers(model)
    # modules that read their own checkpoint tensors (a mixture of experts stacks per-expert tensors)
    custom = {n: m for n, m in model.named_modules() if hasattr(m, "load_checkpoint_tensor")}
    rename = getattr(model, "checkpoint_name", lambda n: n)
    tied = model.config.tie_word_embeddings
    loaded, unexpected = set(), []
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for ckpt_name in f.keys():
                    name = rename(ckpt_name)
                    owner = _custom_owner(name, custom)
                    if owner is not None:
                        loaded.update(custom[owner].load_checkpoint_tensor(owner, name[len(owner) + 1:], f, ckpt_name,
                                                                           file))
                        continue
                    module_name, _, leaf = name.rpartition(".")
                    if module_name in fp8:
                        loaded.update(fp8_loader.load_tensor(fp8[module_name], module_name, leaf, f, file, quant))
                        continue
                    if leaf in fp8_loader.KV_SCALE_LEAVES:  # an FP8 KV cache's scales (used when the cache is FP8)
                        fp8_loader.load_kv_scale(model, module_name, leaf, f.get_tensor(ckpt_name), file)
                        continue
                    param = params.get(name)
                    if param is None:
                        if not ((name == "lm_head.weight" and tied) or name.endswith("rotary_emb.inv_freq")):
                            unexpected.append(name)
                        continue
                    if fp8_loader.is_fp8_tensor(f, ckpt_name):
                        raise ValueError(f"{name} is FP8 in {file}, but the quantization_config leaves it unquantized "
                                         "(it is in ignored_layers / ignore, or the config has no FP8 scheme)")
                    if name in shards:
                        _copy_shard(param, _read_shard(f, ckpt_name, param, shards[name], file), shards[name])
                        loaded.add(name)
                        continue
                    tensor = f.get_tensor(ckpt_name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                         f"model shape {tuple(param.shape)} ({file})")
                    param.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing == ["lm_head.weight"]:
        logger.info("checkpoint has no lm_head.weight: tying it to the input embedding")
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = []
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")


def _check_tp_args(config: ModelConfig, tp_rank: int, tp_size: int) -> None:
    """tp_size fits the model, tp_rank is in range, and they agree with an initialized group."""
    from tallyserve.distributed import parallel_state
    from tallyserve.config.model import check_tensor_parallel

    check_tensor_parallel(config, tp_size)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be an integer in [0, {tp_size}), got {tp_rank!r}")
    if tp_size > 1 and parallel_state.is_initialized() and \
            (parallel_state.tp_size(), parallel_state.tp_rank()) != (tp_size, tp_rank):
        raise ValueError(f"load_model(tp_rank={tp_rank}, tp_size={tp_size}) disagrees with the tensor-parallel "
                         f"group (rank {parallel_state.tp_rank()} of {parallel_state.tp_size()})")


def load_model(
    resolved: ResolvedModel,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attn_backend=None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    quantization: Optional[str] = None,
    enable_expert_parallel: bool = False,
) -> nn.Module:
    """Build the model on ``device`` in ``dtype`` (eval mode, no grads) and fill its weights.

    ``tp_size > 1``: build rank ``tp_rank``'s shard of the model and read only its slices of the
    weights (see ``models/llama.py``). Loading needs no process group (so one process can build
    any rank's shard); running a sharded model needs ``tallyserve.distributed.init_tensor_parallel``
    with the same size and rank. Bad tp arguments raise ValueError before any weight is read.

    ``enable_expert_parallel`` (vLLM's name): a mixture of experts' experts are placed whole on the ranks instead
    of each being split. ``quantization="fp8"`` (vLLM's name) quantizes the projections at load; an FP8 checkpoint (its
    ``quantization_config``) loads as FP8 either way (``config/quantization.py`` says which schemes). On a device
    without FP8 products the FP8 projections are dequantized once into ``dtype`` (``fp8_loader.finish``)."""
    from tallyserve.attention.backend import get_attn_backend
    from tallyserve.models.registry import get_model_class

    _check_tp_args(resolved.model_config, tp_rank, tp_size)
    load_format = check_load_format(load_format)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    dummy = load_format == "dummy" or resolved.load_format == "dummy"
    if dummy and load_format in ("safetensors", "gguf"):
        raise ValueError(f"{resolved.source or resolved.model_dir!r} has no weights; load_format must be 'dummy'")
    if not dummy and not resolved.weight_files:
        raise ValueError(f"no weight files for {resolved.model_dir!r}; use load_format='dummy' for random weights")
    device = torch.device(device)
    quant = resolve_quantization(resolved.model_config.hf_config, quantization)
    cls = get_model_class(resolved.model_config.architecture)
    with torch.device("meta"):  # shapes only: nothing is allocated or initialised twice
        kwargs = {} if tp_size == 1 else dict(tp_size=tp_size, tp_rank=tp_rank)
        if quant is not None:
            kwargs["quant_config"] = quant
        if enable_expert_parallel:
            kwargs["enable_expert_parallel"] = True
        model = cls(resolved.model_config, attn_backend or get_attn_backend("torch"), **kwargs)
    if quant is not None:
        fp8_loader.check_layout(model, quant)
    _cast_floating(model, dtype)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty replaces parameters, which unties shared ones
    if dummy:
        _init_dummy(model, seed, device, dtype)
    else:
        _load_safetensors(model, resolved.weight_files, quant)
    if quant is not None:
        fp8_loader.finish(model, quant, device, dtype)
    model.eval()
    model.requires_grad_(False)
    return model

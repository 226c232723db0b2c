"""Convert a llama-architecture GGUF file into a Hugging Face-format directory, once, cached.

The output directory holds ``config.json`` (built from the GGUF metadata), ``model.safetensors``
(every tensor dequantized to float32, so our model and a reference that dequantizes the same file
agree exactly; models over ``FLOAT32_MAX_PARAMS`` parameters are stored as float16 instead, to keep
the conversion's memory and disk use at two bytes a parameter) and, when the GGUF carries a tokenizer, ``tokenizer.json`` /
``tokenizer_config.json`` (with the chat template and bos/eos tokens).

llama.cpp stores the q and k projections with each head's rows interleaved (x0, y0, x1, y1, ...)
for its interleaved RoPE; we undo that so the rows follow the rotate-half layout
(x0, x1, ..., y0, y1, ...) that ``models/layers.apply_rotary`` expects.

Cache: ``$TALLYSERVE_CACHE_DIR`` or ``~/.cache/tallyserve``, under ``gguf/<stem>-<key>`` where the
key hashes the file's absolute path, size and mtime (and this converter's version). A conversion
is written into a temporary sibling directory and renamed into place, so racing processes never
see a half-written directory; the loser of the race discards its copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from tallyserve import envs

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1
FLOAT32_MAX_PARAMS = 3_000_000_000
CACHE_ENV = "TALLYSERVE_CACHE_DIR"

# GGUF per-layer tensor name -> Hugging Face name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def cache_root() -> Path:
    env = envs.TALLYSERVE_CACHE_DIR
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tallyserve"


def converted_dir_for(gguf_path: str | os.PathLike) -> Path:
    """Where the conversion of ``gguf_path`` lives (whether or not it exists yet). Cheap: one stat."""
    path = Path(gguf_path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{path.stem}-{digest}"


def is_converted(out_dir: Path) -> bool:
    return (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file()


def ensure_converted(gguf_path: str | os.PathLike) -> Path:
    """Return the cached HF-format directory for ``gguf_path``, converting it first if needed."""
    path = Path(gguf_path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    out_dir = converted_dir_for(path)
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        logger.info("converting GGUF %s into %s (one time)", path, out_dir)
        convert_gguf(path, tmp_dir)
        _make_readable(tmp_dir)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            if not is_converted(out_dir):  # not a lost race: a real failure
                raise
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _make_readable(directory: Path) -> None:
    """mkdtemp makes a private (0700) directory; a cache entry should read like any other file."""
    os.chmod(directory, 0o755)
    for child in directory.iterdir():
        os.chmod(child, 0o644)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_to_hf_config(reader, tensor_names: set[str]) -> dict:
    """config.json contents for a llama-architecture GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; only 'llama' GGUF files can be converted")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with a rope_freqs tensor (Llama 3.1-style RoPE scaling) are not supported yet")

    def need(key: str):
        value = _field(reader, f"llama.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("GGUF metadata has neither llama.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens.data)
    head_dim = _field(reader, "llama.attention.key_length") or _field(reader, "llama.rope.dimension_count")
    theta = float(_field(reader, "llama.rope.freq_base", 10000.0))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if _field(reader, "llama.rope.scaling.type") == "linear":
        factor = float(_field(reader, "llama.rope.scaling.factor"))
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        cfg["rope_parameters"] = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                      ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        value = _field(reader, name)
        if value is not None:
            cfg[key] = int(value)
    return cfg


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of q/k rows: GGUF row 2r + c of a head becomes HF row
    c * (head_dim / 2) + r. Works for weights (rows, cols) and biases (rows,)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot unpermute {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    trailing = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *trailing).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] in ("weight", "bias"):
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def gguf_tensors_to_hf(reader, config: dict, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every GGUF tensor dequantized (to ``dtype``) under its Hugging Face name."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = weight.reshape(tuple(int(d) for d in reversed(tensor.shape)))  # GGUF lists dims innermost first
        if ".attn_q." in tensor.name:
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(weight, dtype=np.float32, order="C")).to(dtype)  # owns its memory
    return out


def _write_tokenizer(gguf_path: Path, out_dir: Path, reader) -> None:
    """tokenizer.json + tokenizer_config.json from the GGUF's tokenizer metadata (via transformers)."""
    if "tokenizer.ggml.tokens" not in reader.fields:
        logger.warning("GGUF %s carries no tokenizer; the converted model has none", gguf_path)
        return
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # an unsupported tokenizer model must not block serving token ids
        logger.warning("could not build a tokenizer from GGUF %s: %s", gguf_path, exc)
        return
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(str(out_dir))
    # transformers 5 writes the template to chat_template.jinja only; keep a copy in
    # tokenizer_config.json too for readers that look there.
    cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    for drop in ("is_local", "local_files_only"):
        tok_cfg.pop(drop, None)
    if template:
        tok_cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write config.json, model.safetensors and tokenizer files for ``gguf_path`` into ``out_dir``."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    config = gguf_to_hf_config(reader, {t.name for t in reader.tensors})
    num_params = sum(int(np.prod([int(d) for d in t.shape])) for t in reader.tensors)
    dtype = torch.float32 if num_params <= FLOAT32_MAX_PARAMS else torch.float16
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = gguf_tensors_to_hf(reader, config, dtype)
    _write_tokenizer(gguf_path, out_dir, reader)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # config.json last: together with model.safetensors it marks a complete conversion.
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

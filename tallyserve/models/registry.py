"""Architecture name (Hugging Face class name, as in config.json "architectures") -> model class."""

from __future__ import annotations

from torch import nn

from tallyserve.models.llama import LlamaForCausalLM

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODEL_CLASSES)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class serving ``architecture``; ValueError naming the supported ones otherwise."""
    cls = _MODEL_CLASSES.get(architecture)
    if cls is None:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {supported_architectures()}"
        )
    return cls

"""transformers' own model of the bundled SmolLM2 GGUF (its weights dequantized and un-permuted by
transformers itself), the reference the bundled model's parity tests compare against."""

from __future__ import annotations

import torch


def load_hf_reference(model_dir: str):
    """An eval-mode float32 transformers model of the bundled GGUF. ``model_dir``: the converted
    directory (only its config is read: parsing the GGUF metadata again would cost seconds)."""
    import transformers
    from transformers.utils import is_accelerate_available

    from tallyserve.models.bundled import bundled_gguf_path

    path = bundled_gguf_path()
    if is_accelerate_available():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager")
        return model.eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position of ``ids`` (len, vocab), float32."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

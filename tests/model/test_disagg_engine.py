"""Disaggregated prefill/decode between two in-process engines over NIXL (UCX, host memory on CPU):
the consumer's greedy tokens equal a colocated engine's, the producer holds its blocks until the
pull is confirmed, and failures recompute or fail as configured, leaking no block."""

from __future__ import annotations

import random

import pytest

from tallyserve import EngineArgs, SamplingParams
from tallyserve.engine.llm_engine import LLMEngine
from tests.tiny_models import make_tiny_model

pytest.importorskip("nixl_cu13")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("disagg"), "llama")


def _engine(model_dir, role=None, engine_id=None, kv_cache_dtype="auto", **kv):
    cfg = None if role is None else {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id, **kv}
    return LLMEngine(EngineArgs(model=model_dir, block_size=4, num_gpu_blocks_override=64, max_model_len=128,
                                kv_transfer_config=cfg, kv_cache_dtype=kv_cache_dtype))


def _drain(engine, until=(), limit=3000):
    """Step until the requests ``until`` finished (a producer keeps holding blocks after that), or,
    without ``until``, until the engine is idle (holds released)."""
    done = {}
    for _ in range(limit):
        if set(until) <= set(done) if until else not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(until) <= set(done) if until else not engine.has_unfinished_requests(), "engine did not drain"
    return done


def _free_or_cached(engine):
    kv = engine.scheduler.kv
    kv.check_integrity()
    return kv.num_free_blocks == kv.num_total_blocks


@pytest.fixture(scope="module")
def engines(model_dir):
    prod = _engine(model_dir, "kv_producer", "prod")
    cons = _engine(model_dir, "kv_consumer", "cons", load_timeout_s=2.0)
    prod.kv_connector.advertise("127.0.0.1", 9)
    cons.executor.kv_connector.add_remote(prod.executor.kv_connector.metadata())
    plain = _engine(model_dir)
    yield prod, cons, plain
    for e in (prod, cons, plain):
        e.shutdown()


def _prompts():
    rng = random.Random(3)
    shared = [rng.randrange(3, 250) for _ in range(13)]
    return [shared + [rng.randrange(3, 250) for _ in range(k)] for k in (0, 1, 3, 4, 9)] + [[7, 8], [9]]


def _prefill(prod, rid, prompt):
    prod.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0),
                     kv_transfer_params={"do_remote_decode": True})
    out = _drain(prod, [rid])[rid]
    assert out.kv_transfer_params is not None
    return out


def test_consumer_tokens_equal_colocated(engines):
    prod, cons, plain = engines
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts()):
        pre = _prefill(prod, f"p{i}", prompt)
        assert prod.scheduler.kv_xfer.num_held == (len(prompt) > 1)  # pinned until the pull is confirmed
        params = pre.kv_transfer_params
        cons.add_request(f"d{i}", {"prompt_token_ids": prompt}, greedy, kv_transfer_params=params)
        plain.add_request(f"c{i}", {"prompt_token_ids": prompt}, greedy)
        got, want = _drain(cons)[f"d{i}"], _drain(plain)[f"c{i}"]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].token_ids[0] == pre.outputs[0].token_ids[0]
        _drain(prod)  # the READ's notification reaches the producer: its blocks are released
        assert prod.scheduler.kv_xfer.num_held == 0
    st = cons.scheduler.kv_xfer.stats
    assert st.loads_finished >= 5 and st.load_failures == 0 and st.bytes_received > 0
    assert cons.stats()["kv_loads_finished"] == st.loads_finished
    assert _free_or_cached(prod) and _free_or_cached(cons)


def test_n_siblings_load_once(engines):
    prod, cons, plain = engines
    prompt = list(range(20, 47))
    pre = _prefill(prod, "pn", prompt)
    before = cons.scheduler.kv_xfer.stats.loads_started
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=3)
    cons.add_request("dn", {"prompt_token_ids": prompt}, greedy, kv_transfer_params=pre.kv_transfer_params)
    plain.add_request("cn", {"prompt_token_ids": prompt}, greedy)
    got, want = _drain(cons)["dn"], _drain(plain)["cn"]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert cons.scheduler.kv_xfer.stats.loads_started == before + 1
    _drain(prod)
    assert _free_or_cached(prod) and _free_or_cached(cons)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_unknown_engine_recomputes_or_fails(model_dir, policy):
    cons = _engine(model_dir, "kv_consumer", "lonely", unknown_engine_policy=policy, load_timeout_s=1.0)
    plain_tokens = None
    try:
        prompt = list(range(30, 50))
        params = {"do_remote_prefill": True, "remote_engine_id": "nobody", "remote_request_id": "x",
                  "remote_block_ids": list(range(5)), "remote_host": "127.0.0.1", "remote_port": 9, "block_size": 4}
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        cons.add_request("u", {"prompt_token_ids": prompt}, greedy, kv_transfer_params=params)
        out = _drain(cons)["u"]
        st = cons.scheduler.kv_xfer.stats
        assert st.load_failures == 1 and st.unknown_engine == 1
        if policy == "fail":
            assert out.error is not None and "KV" in out.error
        else:
            plain_tokens = out.outputs[0].token_ids
            assert out.error is None and len(plain_tokens) == 4
        assert _free_or_cached(cons)
    finally:
        cons.shutdown()


def test_bad_params_are_value_errors(engines):
    prod, cons, _ = engines
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    bad = [{"do_remote_prefill": True}, {"do_remote_prefill": "yes"},
           {"do_remote_prefill": True, "remote_engine_id": "prod", "remote_request_id": "p", "remote_host": "h",
            "remote_port": 1, "remote_block_ids": [0], "block_size": 4},  # too few blocks for the prompt
           {"do_remote_prefill": True, "remote_engine_id": "prod", "remote_request_id": "p", "remote_host": "h",
            "remote_port": 1, "remote_block_ids": [0, 1, 2, 3], "block_size": 4, "expires_at": 1.0}]  # stale
    for params in bad:
        with pytest.raises(ValueError):
            cons.add_request("bad", {"prompt_token_ids": list(range(3, 16))}, greedy, kv_transfer_params=params)
    with pytest.raises(ValueError, match="kv_producer"):
        cons.add_request("bad", {"prompt_token_ids": [5, 6]}, greedy, kv_transfer_params={"do_remote_decode": True})
    assert not cons.has_unfinished_requests()


def test_tensor_parallel_ranks_pull_their_own_heads(model_dir):
    """Producer and consumer at tensor_parallel_size=2: each rank reads its own heads from the
    producer's same rank (metadata over HTTP, as between servers), and the tokens equal a colocated
    engine's; the producer frees its blocks once both ranks' pulls are confirmed."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlparse

    def tp(role, eid):
        return LLMEngine(EngineArgs(model=model_dir, block_size=4, num_gpu_blocks_override=64, max_model_len=128,
                                    tensor_parallel_size=2, kv_transfer_config={
                                        "kv_connector": "NixlConnector", "kv_role": role, "engine_id": eid}))

    prod = tp("kv_producer", "tp-prod")
    cons = tp("kv_consumer", "tp-cons")

    class Meta(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            rank = int(parse_qs(urlparse(self.path).query)["rank"][0])
            body = json.dumps(prod.executor.kv_transfer_metadata(rank)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Meta)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prod.kv_connector.advertise("127.0.0.1", server.server_address[1])
    try:
        plain = _engine(model_dir)
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(_prompts()[:4]):
            pre = _prefill(prod, f"tp{i}", prompt)
            cons.add_request(f"tpd{i}", {"prompt_token_ids": prompt}, greedy, kv_transfer_params=pre.kv_transfer_params)
            plain.add_request(f"tpc{i}", {"prompt_token_ids": prompt}, greedy)
            got, want = _drain(cons)[f"tpd{i}"], _drain(plain)[f"tpc{i}"]
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            _drain(prod)
        st = cons.scheduler.kv_xfer.stats
        assert st.loads_finished == 4 and st.load_failures == 0
        assert prod.scheduler.kv_xfer.stats.sends_finished == 4
        assert _free_or_cached(prod) and _free_or_cached(cons)
        plain.shutdown()
    finally:
        server.shutdown()
        prod.shutdown()
        cons.shutdown()


def test_fp8_cache_moves_a_quarter_of_the_float32_bytes_and_keeps_the_tokens(model_dir):
    """kv_cache_dtype="fp8" on both sides: the consumer's tokens equal a colocated FP8 engine's, each block moves in
    a quarter of a float32 block's bytes, and a producer with another cache dtype is refused at the handshake."""
    prod = _engine(model_dir, "kv_producer", "prod8", kv_cache_dtype="fp8")
    cons = _engine(model_dir, "kv_consumer", "cons8", kv_cache_dtype="fp8", load_timeout_s=2.0)
    plain = _engine(model_dir, kv_cache_dtype="fp8")
    f32 = _engine(model_dir, "kv_consumer", "cons32", load_timeout_s=2.0)
    try:
        meta = prod.executor.kv_connector.metadata()
        assert meta["kv_cache_dtype"] == "float8_e4m3fn"
        assert meta["block_bytes"] * 4 == f32.executor.kv_connector.metadata()["block_bytes"]
        with pytest.raises(LookupError, match=r"caches K/V in float8_e4m3fn, this one in float32: prefill and decode "
                                              r"instances need the same kv_cache_dtype"):
            f32.executor.kv_connector.add_remote(meta)
        prod.kv_connector.advertise("127.0.0.1", 9)
        cons.executor.kv_connector.add_remote(meta)
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(_prompts()[:4]):
            pre = _prefill(prod, f"p{i}", prompt)
            cons.add_request(f"d{i}", {"prompt_token_ids": prompt}, greedy, kv_transfer_params=pre.kv_transfer_params)
            plain.add_request(f"c{i}", {"prompt_token_ids": prompt}, greedy)
            assert _drain(cons)[f"d{i}"].outputs[0].token_ids == _drain(plain)[f"c{i}"].outputs[0].token_ids
            _drain(prod)
        st = cons.scheduler.kv_xfer.stats
        assert st.loads_finished >= 3 and st.load_failures == 0 and st.bytes_received > 0
        assert _free_or_cached(prod) and _free_or_cached(cons)
    finally:
        for e in (prod, cons, plain, f32):
            e.shutdown()

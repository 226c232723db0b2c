"""The engine-level Prometheus metrics come from the stats snapshot, host tier and speculative
decoding included: a real offline engine with both features feeds the collector."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tallyserve import LLM, SamplingParams
from tallyserve.server.metrics import EngineStatsCollector
from tests.tiny_models import make_tiny_model


def test_host_tier_and_spec_decode_counters(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    llm = LLM(model=path, block_size=4, num_gpu_blocks_override=12, max_model_len=48, kv_offload_bytes=1 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefix = [5, 6, 7, 8] * 5
    for prompt in (prefix + [1], [40 + i for i in range(21)], [70 + i for i in range(21)], prefix + [2]):
        llm.generate({"prompt_token_ids": prompt}, params)
    stats = llm.stats()
    fake = SimpleNamespace(stats=lambda: stats, health=lambda: SimpleNamespace(alive=True, healthy=True))
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(fake))
    values = {s.name: s.value for fam in text_string_to_metric_families(generate_latest(registry).decode())
              for s in fam.samples}
    assert values["tallyserve_host_hit_tokens_total"] == stats["host_hit_tokens"] > 0
    assert values["tallyserve_host_blocks_offloaded_total"] == stats["host_blocks_offloaded"] > 0
    assert values["tallyserve_kv_transfer_bytes_total"] == stats["kv_bytes_moved"] > 0
    assert values["tallyserve_spec_decode_draft_tokens_total"] == stats["spec_proposed"] > 0
    assert values["tallyserve_spec_decode_accepted_tokens_total"] == stats["spec_accepted"]
    assert values["tallyserve_host_kv_blocks_total"] == stats["num_host_blocks"] > 0
    assert values["tallyserve_scheduled_tokens_total"] == values["tallyserve_forward_tokens_total"]


def test_cache_config_info_names_the_kv_dtype_blocks_and_quantization(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    llm = LLM(model=path, quantization="fp8", kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 20)
    stats = llm.stats()
    assert stats["kv_cache_dtype"] == "float8_e4m3fn" and stats["quantization"] == "fp8"
    fake = SimpleNamespace(stats=lambda: stats, health=lambda: SimpleNamespace(alive=True, healthy=True))
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(fake))
    info = [s for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples
            if s.name == "tallyserve_cache_config_info"]
    assert len(info) == 1 and info[0].value == 1.0
    assert info[0].labels == {"cache_dtype": "float8_e4m3fn", "num_gpu_blocks": str(stats["num_total_blocks"]),
                              "num_host_blocks": "0", "quantization": "fp8"}

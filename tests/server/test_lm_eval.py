"""lm-evaluation-harness against a live tallyserve: its ``local-completions`` model scores a small
multiple-choice task (a local YAML over a local JSONL file, no downloads) through echo + logprobs,
and every per-choice loglikelihood it logs equals transformers' on the bundled model's GGUF weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.bundled_reference import prompt_logprobs
from tests.server.live_server import API_KEY, wait_idle

lm_eval = pytest.importorskip("lm_eval")

ATOL = 1e-4
QUESTIONS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "a banana"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["warm", "cold", "blue", "loud"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit"], "answer": 0},
]
TASK_YAML = """\
task: tally_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm-eval-task")
    data = d / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (d / "tally_mc.yaml").write_text(TASK_YAML.format(data=data))
    return d


def test_lm_eval_loglikelihoods_equal_transformers(bundled_server, bundled_dir, bundled_hf, task_dir, tmp_path,
                                                   monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")  # nothing may come from a hub
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # local-completions sends it as the bearer token
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model("local-completions")(
        base_url=f"{bundled_server.base_url}/v1/completions", model="smol", tokenizer=bundled_dir,
        tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1, max_retries=1,
        batch_size=2)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tally_mc"], task_manager=TaskManager(include_path=str(task_dir)),
                                      log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    samples = results["samples"]["tally_mc"]
    assert len(samples) == len(QUESTIONS)
    checked = 0
    for sample in samples:
        doc = sample["doc"]
        assert len(sample["resps"]) == len(doc["choices"])
        for args, resp in zip(sample["arguments"], sample["resps"]):
            context, continuation = args[0], args[1]
            loglik, is_greedy = resp[0]
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            ref = prompt_logprobs(bundled_hf, ctx_ids + cont_ids)
            rows = ref[len(ctx_ids) - 1:len(ctx_ids) + len(cont_ids) - 1]
            want = float(rows.gather(1, torch.tensor(cont_ids)[:, None]).sum())
            assert math.isfinite(loglik) and abs(loglik - want) <= ATOL, (context, continuation, loglik, want)
            assert bool(is_greedy) == bool((rows.argmax(-1) == torch.tensor(cont_ids)).all())
            checked += 1
    assert checked == sum(len(q["choices"]) for q in QUESTIONS)
    acc = results["results"]["tally_mc"]["acc,none"]
    assert acc == sum(s["acc"] for s in samples) / len(samples)
    m = wait_idle(bundled_server.base_url)
    assert m["tallyserve_kv_blocks_free"] == m["tallyserve_kv_blocks_total"]
    assert m["tallyserve_ledger_violations_total"] == 0

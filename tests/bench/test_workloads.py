"""Workloads are seeded and deterministic, have the requested shape, and traces parse strictly."""

from __future__ import annotations

import json
import math
import re

import pytest

from tallyserve.bench.workloads import WorkloadOptions, build_workload, sample_len


def _opts(**kw) -> WorkloadOptions:
    return WorkloadOptions(**kw)


@pytest.mark.parametrize("kind", ["random", "shared-prefix", "multi-turn"])
def test_deterministic_and_counted(kind):
    a = build_workload(_opts(workload=kind, num_requests=37, seed=3, request_rate=5.0))
    b = build_workload(_opts(workload=kind, num_requests=37, seed=3, request_rate=5.0))
    c = build_workload(_opts(workload=kind, num_requests=37, seed=4, request_rate=5.0))
    assert [s.as_dict() for s in a.requests] == [s.as_dict() for s in b.requests]
    assert [s.as_dict() for s in a.requests] != [s.as_dict() for s in c.requests]
    assert len(a) == 37 and len({s.request_id for s in a.requests}) == 37


def test_random_lengths_and_poisson_arrivals():
    w = build_workload(_opts(workload="random", num_requests=400, random_input_len=100, random_output_len=20,
                             random_range_ratio=0.5, request_rate=10.0))
    lens = [len(s.prompt.split()) for s in w.requests]
    assert min(lens) >= 50 and max(lens) <= 150 and min(lens) < 60 and max(lens) > 140
    assert all(10 <= s.max_tokens <= 30 for s in w.requests)
    arrivals = [s.arrival_s for s in w.requests]
    assert arrivals == sorted(arrivals)
    assert 400 / arrivals[-1] == pytest.approx(10.0, rel=0.2)
    inf = build_workload(_opts(workload="random", num_requests=5, request_rate=math.inf))
    assert all(s.arrival_s == 0.0 for s in inf.requests)


def test_shared_prefix_groups():
    w = build_workload(_opts(workload="shared-prefix", num_requests=30, shared_prefix_groups=3,
                             shared_prefix_len=50, shared_prefix_suffix_len=5))
    prefixes = {" ".join(s.prompt.split()[:50]) for s in w.requests}
    assert len(prefixes) == 3
    assert all(len(s.prompt.split()) == 55 for s in w.requests)


def test_multi_turn_structure():
    w = build_workload(_opts(workload="multi-turn", num_requests=20, multi_turn_turns=4, multi_turn_system_len=10,
                             multi_turn_user_len=7, think_time=0.5, request_rate=8.0))
    convs = w.conversations()
    assert sum(len(c) for c in convs) == 20 and len(convs) == 5
    for conv in convs:
        assert [s.turn for s in conv] == list(range(len(conv)))
        assert conv[0].messages[0]["role"] == "system" and conv[0].messages[1]["role"] == "user"
        assert all(len(s.messages) == 1 and s.messages[0]["role"] == "user" for s in conv[1:])
        assert conv[0].think_time_s == 0 and all(s.think_time_s > 0 for s in conv[1:])
        assert conv[0].arrival_s is not None and all(s.arrival_s is None for s in conv[1:])
    systems = {c[0].messages[0]["content"] for c in convs}
    assert len(systems) == 1  # one system prompt shared by every conversation


def test_jsonl_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"arrival_s": 0.0, "prompt": "hello there", "max_tokens": 3},
        {"arrival_s": 0.1, "prompt_token_ids": [5, 6, 7]},
        {"arrival_s": 0.2, "conversation_id": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {"conversation_id": "c", "messages": [{"role": "user", "content": "more"}], "think_time_s": 0.3},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = build_workload(_opts(workload=f"file:{path}", num_requests=1 << 40, random_output_len=9))
    specs = w.requests
    assert [s.max_tokens for s in specs] == [3, 9, 2, 9]
    assert specs[1].prompt_token_ids == [5, 6, 7]
    assert (specs[3].conversation_id, specs[3].turn, specs[3].think_time_s) == ("c", 1, 0.3)
    assert [len(c) for c in w.conversations()] == [1, 1, 2]
    assert len(build_workload(_opts(workload=f"file:{path}", num_requests=2))) == 2


@pytest.mark.parametrize("line, message", [  # each message names the file and line, then what is wrong
    ({"max_tokens": 3}, "needs exactly one of prompt, prompt_token_ids, messages, got none"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
     r"needs exactly one of prompt, prompt_token_ids, messages, got \['prompt', 'messages'\]"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"prompt_token_ids": ["x"]}, "prompt_token_ids must be a non-empty list of ints >= 0"),
    ({"messages": [{"role": "user"}]}, "each message needs string 'role' and 'content'"),
    ({"prompt": "a", "arrival_s": -1}, "arrival_s must be a number >= 0, got -1"),
])
def test_bad_trace_lines(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:1: {message}"):
        build_workload(_opts(workload=f"file:{path}"))


def test_token_ids_cannot_form_conversations(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"conversation_id": 1, "prompt_token_ids": [1]}) + "\n"
                    + json.dumps({"conversation_id": 1, "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="multi-turn"):
        build_workload(_opts(workload=f"file:{path}"))


def test_sharegpt(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "q one"}, {"from": "gpt", "value": "x y z"},
                                      {"from": "human", "value": "q two"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only"}, {"from": "gpt", "value": "r"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    w = build_workload(_opts(workload=f"file:{path}", num_requests=10, random_output_len=7, request_rate=2.0))
    assert [(s.conversation_id, s.turn, s.max_tokens) for s in w.requests] == [("a", 0, 3), ("a", 1, 7), ("b", 0, 1)]
    assert w.requests[0].arrival_s is not None and w.requests[1].arrival_s is None


def test_validation():
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload(_opts(workload="nope"))
    with pytest.raises(ValueError, match="request_rate"):
        build_workload(_opts(request_rate=0.0))
    with pytest.raises(ValueError, match="random_range_ratio"):
        build_workload(_opts(random_range_ratio=1.5))
    assert sample_len(__import__("random").Random(0), 1, 0.9) >= 1


def _stream_record(chunks, chat=False):
    """send_request over a fake server that streams `chunks` (dicts) then [DONE]."""
    import asyncio
    import json as _json

    import httpx

    from tallyserve.bench.client import send_request
    from tallyserve.bench.metrics import RequestRecord

    body = "".join(f"data: {_json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda req: httpx.Response(200, text=body,
                                                               headers={"content-type": "text/event-stream"}))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            payload = {"messages": []} if chat else {"prompt": [1, 2]}
            return await send_request(client, "http://x/v1", payload, RequestRecord("r"), 0.0)
    return asyncio.run(go())


def test_ttft_of_streams_without_text():
    """A server without a tokenizer streams empty text: each chunk still marks tokens, and an answer
    that arrives whole in its finishing chunk still has a TTFT; a chat role-only chunk does not count."""
    one = _stream_record([{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}])
    assert one.ttft_s is not None and len(one.chunk_times_s) == 1 and one.error is None
    two = _stream_record([{"choices": [{"index": 0, "text": "", "finish_reason": None}]},
                          {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}])
    assert two.ttft_s is not None and len(two.chunk_times_s) == 1  # the finishing empty chunk after it adds none
    chat = _stream_record([{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                           {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}], chat=True)
    assert chat.ttft_s is not None and len(chat.chunk_times_s) == 1

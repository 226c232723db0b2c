"""The step loop runs with the heap frozen (engine/gc_heap.py): full collections skip the engine's
long-lived objects while it steps, the heap is handed back when the last loop ends, and an engine
dropped afterwards is still collected."""

from __future__ import annotations

import gc
import weakref

from tallyserve import LLM, SamplingParams
from tallyserve.engine.gc_heap import frozen_heap
from tests.tiny_models import make_tiny_model


def test_nested_loops_unfreeze_once_the_last_ends():
    # Frozen objects can still die by reference count (a thread left by an earlier test drops a
    # few), so the counts are compared with margins far above such noise and far below the
    # 10,000 objects that would move if the inner loop froze again or the heap were handed back.
    assert gc.get_freeze_count() == 0
    keep = [object() for _ in range(10)]
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        fresh = [[] for _ in range(10_000)]  # tracked objects born after the outer freeze
        with frozen_heap():
            inner = gc.get_freeze_count()
            assert frozen - 1_000 < inner < frozen + 5_000  # the inner loop did not freeze again
        assert gc.get_freeze_count() > inner - 1_000  # the outer loop still runs: still frozen
    assert gc.get_freeze_count() == 0
    del keep, fresh


def test_generate_freezes_while_stepping_and_the_engine_is_collected_later(tmp_path):
    llm = LLM(model=make_tiny_model(tmp_path, "llama"), block_size=4)
    seen, orig = [], {"step": llm.engine.step}

    def traced_step():
        seen.append(gc.get_freeze_count())
        return orig["step"]()

    llm.engine.step = traced_step
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert seen and all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0
    ref = weakref.ref(llm.engine)
    del llm.engine.step  # the instance attribute: the class's method again
    orig.clear()
    del llm, out
    gc.collect()
    assert ref() is None  # nothing stayed in the permanent generation

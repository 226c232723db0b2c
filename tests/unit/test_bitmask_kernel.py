"""The one-kernel grammar bitmask (kernels/logits_mask.py) under Triton's interpreter, against the
operator-chain path it replaces on a GPU: grammar rows anywhere in the step, bit 31 of a word, a bitmask narrower
than the logits (tokens past it are forbidden), rows without a grammar untouched. One subprocess, since Triton
reads TRITON_INTERPRET when a kernel is decorated."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import interpreter_too_old, run_interpreted

triton = pytest.importorskip("triton")
if interpreter_too_old(triton):
    pytest.skip("Triton < 3.7's interpreter cannot run these kernels under NumPy 2", allow_module_level=True)


WORKER = r'''
import json, torch
from tallyserve.kernels import logits_mask as bitmask_kernel
from tallyserve.runner.grammar_mask import allowed_from_bitmask, mask_rows
res = {}
g = torch.Generator().manual_seed(0)
for name, (rows_total, vocab, words_w, rows) in {
        "scattered": (7, 5000, 157, [0, 3, 6]),
        "narrow_words": (4, 3000, 90, [1, 2]),   # 90 * 32 = 2880 < 3000: the tail is forbidden
        "all_rows": (3, 4099, 129, [0, 1, 2]),
}.items():
    logits = torch.randn(rows_total, vocab, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), words_w), generator=g, dtype=torch.int64).to(torch.int32)
    words[0, 0] = -2**31  # only bit 31 set: token 31 allowed, tokens 0..30 not
    want = logits.clone()
    if words_w * 32 >= vocab:
        sub = want[rows].clone()
        mask_rows(sub, words, cpu_kernel=False)
        want[rows] = sub
    else:
        allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
        allowed[:, :words_w * 32] = allowed_from_bitmask(words, words_w * 32)
        sub = want[rows]
        sub[~allowed] = float("-inf")
        want[rows] = sub
    got = logits.clone()
    assert bitmask_kernel.available(got)
    bitmask_kernel.mask_logits_rows_(got, words, torch.tensor(rows))
    res[name] = {"equal": bool(torch.equal(got, want)), "inf": int(torch.isinf(got).sum()),
                 "untouched": bool(torch.equal(got[[i for i in range(rows_total) if i not in rows]],
                                               logits[[i for i in range(rows_total) if i not in rows]])),
                 "bit31": bool(got[rows[0], 31] == logits[rows[0], 31] and torch.isinf(got[rows[0], :31]).all())}
try:
    bitmask_kernel.mask_logits_rows_(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32), torch.tensor([0, 1]))
    res["bad"] = "no error"
except ValueError as exc:
    res["bad"] = str(exc)
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def results():
    return run_interpreted(["-c", WORKER])


@pytest.mark.parametrize("case", ["scattered", "narrow_words", "all_rows"])
def test_kernel_masks_exactly_what_the_operator_chain_masks(results, case):
    r = results[case]
    assert r["equal"] and r["inf"] > 0
    assert r["untouched"]  # rows without a grammar keep their logits
    assert r["bit31"]


def test_mismatched_rows_are_refused(results):
    assert "one logits row index per bitmask row" in results["bad"]

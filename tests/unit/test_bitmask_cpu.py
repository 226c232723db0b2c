"""The grammar bitmask on the CPU (``mask_logits_rows_`` in kernels/csrc/fused_ops_cpu.cpp, reached through
kernels/logits_mask.py): the same masking as the operator chain it replaces, on grammar rows
anywhere in the step, all-allowed and all-forbidden words, bit 31, words narrower than the vocabulary; rows
without a grammar untouched; bad indices refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from tallyserve.kernels import cpu_kernels
from tallyserve.kernels import logits_mask as bitmask_kernel
from tallyserve.runner.grammar_mask import allowed_from_bitmask

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")


def _reference(logits: torch.Tensor, words: torch.Tensor, rows: list[int]) -> torch.Tensor:
    want = logits.clone()
    allowed = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool)
    width = min(words.shape[1] * 32, logits.shape[1])
    allowed[:, :width] = allowed_from_bitmask(words, width)
    sub = want[rows]
    sub[~allowed] = float("-inf")
    want[rows] = sub
    return want


@pytest.mark.parametrize("rows_total,vocab,num_words,rows", [
    (7, 5000, 157, [0, 3, 6]),   # scattered rows, a vocabulary that is not a multiple of 32
    (4, 3000, 90, [2, 1]),       # 2,880 bits < 3,000 tokens: the tail is forbidden; rows out of order
    (3, 4099, 129, [0, 1, 2]),   # every row
    (300, 1024, 32, list(range(0, 300, 2))),  # more rows than threads
])
def test_cpu_mask_equals_the_operator_chain(rows_total, vocab, num_words, rows):
    g = torch.Generator().manual_seed(rows_total)
    logits = torch.randn(rows_total, vocab, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), num_words), generator=g, dtype=torch.int64).to(torch.int32)
    words[0, 0] = -2**31  # only bit 31: token 31 allowed, 0..30 not
    words[-1, 1] = -1     # a word allowing all 32 tokens
    words[-1, 2] = 0      # a word allowing none
    assert bitmask_kernel.available(logits)
    got = bitmask_kernel.mask_logits_rows_(logits.clone(), words, torch.tensor(rows))
    want = _reference(logits, words, rows)
    assert torch.equal(got, want)
    assert torch.isinf(got[rows[0], :31]).all() and got[rows[0], 31] == logits[rows[0], 31]
    assert torch.equal(got[rows[-1], 32:64], logits[rows[-1], 32:64])
    assert torch.isinf(got[rows[-1], 64:96]).all()
    others = [i for i in range(rows_total) if i not in rows]
    assert torch.equal(got[others], logits[others])


def test_cpu_mask_refuses_bad_rows_without_writing():
    logits = torch.zeros(2, 64)
    words = torch.zeros(2, 2, dtype=torch.int32)
    for rows in ([0, 5], [-1, 0]):  # refused by the Python check, before the kernel
        with pytest.raises(ValueError, match="outside the logits"):
            bitmask_kernel.mask_logits_rows_(logits, words, torch.tensor(rows))
    assert torch.equal(logits, torch.zeros(2, 64))
    with pytest.raises(ValueError, match="one logits row index per bitmask row"):
        bitmask_kernel.mask_logits_rows_(logits, torch.zeros(3, 2, dtype=torch.int32), torch.tensor([0, 1]))


def test_bfloat16_logits_take_the_operator_chain():
    assert not bitmask_kernel.available(torch.zeros(2, 64, dtype=torch.bfloat16))

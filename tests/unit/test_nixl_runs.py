"""Coalescing of a KV load's blocks into descriptors: runs consecutive on both sides."""
import pytest
from hypothesis import given, strategies as st

from tallyserve.distributed.kv_transfer.nixl_connector import contiguous_runs


def test_runs_break_where_either_side_jumps():
    local = [4, 5, 6, 9, 10, 11, 12]
    remote = [0, 1, 3, 4, 5, 6, 7]
    assert contiguous_runs(local, remote) == ([(4, 2), (6, 1), (9, 4)], [(0, 2), (3, 1), (4, 4)])


def test_fully_contiguous_load_is_one_run_and_empty_load_none():
    assert contiguous_runs(range(8, 72), range(100, 164)) == ([(8, 64)], [(100, 64)])
    assert contiguous_runs([], []) == ([], [])


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="3 local blocks for 2 remote"):
        contiguous_runs([1, 2, 3], [1, 2])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_runs_cover_exactly_the_same_block_pairs(pairs):
    local = [a for a, _ in pairs]
    remote = [b for _, b in pairs]
    mine, theirs = contiguous_runs(local, remote)
    assert [n for _, n in mine] == [n for _, n in theirs]
    expanded = [(a + k, b + k) for (a, n), (b, _) in zip(mine, theirs) for k in range(n)]
    assert expanded == list(zip(local, remote))

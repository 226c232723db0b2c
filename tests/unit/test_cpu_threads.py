"""The CPU thread governor: threads follow the cores other processes leave free, after two agreeing windows."""
import pytest

from tallyserve.runner import cpu_threads
from tallyserve.runner.cpu_threads import CpuThreadGovernor, read_machine_busy_seconds, threads_for


class FakeMachine:
    """A clock, the machine's busy seconds and this process's CPU seconds, advanced by hand."""

    def __init__(self):
        self.t = self.busy = self.own = 0.0
        self.set_calls = []

    def run(self, seconds, ours, others):
        self.t += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds

    def governor(self, monkeypatch, cores=2, max_threads=2, setting="auto"):
        monkeypatch.setenv("TALLYSERVE_CPU_THREADS", setting)
        monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(cores)))
        return CpuThreadGovernor(max_threads, busy_seconds=lambda: self.busy, own_seconds=lambda: self.own,
                                 clock=lambda: self.t, set_threads=self.set_calls.append)


def test_rule():
    assert threads_for(2, 0.0, 2) == 2
    assert threads_for(2, 0.2, 2) == 2  # light background work keeps both
    assert threads_for(2, 0.67, 2) == 1  # a busy loop time-sharing with 2 threads
    assert threads_for(2, 1.0, 2) == 1
    assert threads_for(2, 5.0, 2) == 1  # never below one
    assert threads_for(16, 3.0, 16) == 13
    assert threads_for(16, 0.0, 8) == 8  # never above the start count


def test_a_busy_neighbour_drops_a_thread_and_its_exit_brings_it_back(monkeypatch):
    m = FakeMachine()
    g = m.governor(monkeypatch)
    m.run(0.6, ours=2.0, others=0.0)
    assert g.step() == 2 and m.set_calls == []
    m.run(0.6, ours=1.33, others=0.67)  # first window that sees the neighbour: not yet
    assert g.step() == 2 and m.set_calls == []
    m.run(0.6, ours=1.33, others=0.67)
    assert g.step() == 1 and m.set_calls == [1]
    m.run(0.6, ours=1.0, others=1.0)  # with one thread the neighbour gets its full core: stays at one
    assert g.step() == 1
    m.run(0.6, ours=1.0, others=0.0)
    m.run(0.1, ours=1.0, others=0.0)  # steps inside a window do not decide anything
    assert g.step() == 1
    m.run(0.6, ours=1.0, others=0.0)
    assert g.step() == 2 and m.set_calls == [1, 2] and g.changes == 2


def test_a_single_noisy_window_changes_nothing(monkeypatch):
    m = FakeMachine()
    g = m.governor(monkeypatch)
    for others in (0.0, 1.0, 0.0, 1.0, 0.0):
        m.run(0.6, ours=1.5, others=others)
        assert g.step() == 2
    assert m.set_calls == []


def test_a_pinned_count_never_changes(monkeypatch):
    m = FakeMachine()
    g = m.governor(monkeypatch, setting="1")
    assert m.set_calls == [1]
    for _ in range(4):
        m.run(0.6, ours=1.0, others=0.0)
        assert g.step() == 1
    assert m.set_calls == [1]


@pytest.mark.parametrize("bad", ["two", "0", "-3"])
def test_bad_setting_is_a_clear_error(monkeypatch, bad):
    with pytest.raises(ValueError, match="TALLYSERVE_CPU_THREADS"):
        FakeMachine().governor(monkeypatch, setting=bad)


def test_reads_this_machine():
    busy = read_machine_busy_seconds()
    assert busy is not None and busy > 0  # Linux: /proc/stat is there

"""The CPU thread governor: threads follow the cores other processes leave free, or share them all, after two
agreeing windows;
and malloc keeping freed large blocks for reuse."""
import os
import subprocess
import sys
from pathlib import Path

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

    def governor(self, monkeypatch, cores=2, max_threads=2, setting="auto", pool=False):
        monkeypatch.setenv("TALLYSERVE_CPU_THREADS", setting)
        monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(cores)))
        self.pool_calls = []
        return CpuThreadGovernor(max_threads, busy_seconds=lambda: self.busy, own_seconds=lambda: self.own,
                                 clock=lambda: self.t, set_threads=self.set_calls.append,
                                 task_pool=self.pool_calls.append if pool else None)


def test_rule():
    assert threads_for(2, 0.0, 2) == 2
    assert threads_for(2, 0.2, 2) == 2  # light background work keeps both
    # one busy loop: one free core, or 8 threads sharing both cores (8/9 of 2 cores, 1.6 after the efficiency)
    assert threads_for(2, 0.67, 2) == 8  # a busy loop time-sharing with 2 threads
    assert threads_for(2, 1.0, 2) == 8
    assert threads_for(2, 0.4, 2) == 8
    assert threads_for(2, 5.0, 2) == 1  # five busy loops: sharing would give 8/13 of 2 cores; never below one
    assert threads_for(16, 3.0, 16) == 13  # many cores: the free ones beat sharing (13 against 15.3 x 0.9 - 1.6)
    assert threads_for(4, 1.0, 4) == 3  # 3 free cores against 16/17 of 4 (3.39 x 0.9): not worth oversubscribing
    assert threads_for(16, 0.0, 8) == 8  # quiet: never above the start count
    assert threads_for(1, 1.0, 1) == 1  # one core: nothing to share out


def test_a_busy_neighbour_makes_the_threads_share_the_cores_and_its_exit_brings_them_back(monkeypatch):
    m = FakeMachine()
    g = m.governor(monkeypatch)
    m.run(0.6, ours=2.0, others=0.0)
    assert g.step() == 2 and m.set_calls == []
    m.run(0.6, ours=1.33, others=0.67)  # first window that sees the neighbour: not yet
    assert g.step() == 2 and m.set_calls == []
    m.run(0.6, ours=1.33, others=0.67)
    assert g.step() == 8 and m.set_calls == [8]  # eight threads share both cores with it
    for _ in range(3):  # sharing, the neighbour gets 2/9 of the cores (alone, this would read as quiet): stays
        m.run(0.6, ours=1.78, others=0.22)
        assert g.step() == 8
    m.run(0.6, ours=2.0, others=0.0)
    m.run(0.1, ours=2.0, others=0.0)  # steps inside a window do not decide anything
    assert g.step() == 8
    m.run(0.6, ours=2.0, others=0.0)
    assert g.step() == 2 and m.set_calls == [8, 2] and g.changes == 2


def test_small_steps_run_on_the_free_cores_while_the_big_ones_share_them(monkeypatch):
    """Sharing pays for long operators only: a decode step's operators last microseconds and a descheduled sharing
    thread holds its team at the barrier, so steps under SHARED_MIN_TOKENS take the free cores."""
    m = FakeMachine()
    g = m.governor(monkeypatch)
    small, big = cpu_threads.SHARED_MIN_TOKENS - 1, cpu_threads.SHARED_MIN_TOKENS
    assert g.step(small) == 2 and g.step(big) == 2  # quiet: the start count whatever the size
    for _ in range(2):
        m.run(0.6, ours=1.33, others=0.67)
        g.step(big)
    assert g.decision == 8 and g.free == 1 and m.set_calls == [8]
    assert [g.step(n) for n in (small, small, big, None, 1, big)] == [1, 1, 8, 8, 1, 8]
    assert m.set_calls == [8, 1, 8, 1, 8]  # a change only where the count differs from the last step's
    for _ in range(2):  # the neighbour leaves: every step back on the start count
        m.run(0.6, ours=2.0, others=0.0)
        g.step(big)
    assert g.decision == 2 and [g.step(small), g.step(big)] == [2, 2]


def test_with_a_task_pool_every_step_shares_on_the_pool_and_aten_runs_on_one_thread(monkeypatch):
    """Where the forward's heavy operators are the compiled kernels' (the AVX2 product), sharing runs them on the
    task pool, whose calls end when their tasks are done: decode steps share too, and ATen keeps one thread."""
    m = FakeMachine()
    monkeypatch.setattr(cpu_threads.torch, "get_num_threads", lambda: 2)
    g = m.governor(monkeypatch, pool=True)
    small = cpu_threads.SHARED_MIN_TOKENS - 1
    assert g.step(small) == 2 and m.set_calls == [] and m.pool_calls == []  # quiet: ATen's threads, no pool
    for _ in range(2):
        m.run(0.6, ours=1.33, others=0.67)
        g.step(small)
    assert g.threads == 8 and m.set_calls == [1] and m.pool_calls == [8]
    assert [g.step(n) for n in (small, 1, None, 4096)] == [8, 8, 8, 8]  # no switching by step size
    assert m.set_calls == [1] and m.pool_calls == [8]
    for _ in range(2):  # the neighbour leaves: the pool off, ATen back on the start count
        m.run(0.6, ours=2.0, others=0.0)
        g.step(small)
    assert g.threads == 2 and m.set_calls == [1, 2] and m.pool_calls == [8, 0]
    for _ in range(2):
        m.run(0.6, ours=1.33, others=0.67)
        g.step()
    g.close()  # shut down while sharing: the pool off and the process's count back
    assert m.pool_calls[-2:] == [0, 0] and m.set_calls[-1] == 2 and g.threads == 2
    pinned = FakeMachine().governor(monkeypatch, setting="2", pool=True)
    assert pinned._pool is None  # a pinned count never turns the pool on


def test_the_task_pool_follows_the_product_kernel(monkeypatch):
    class Model:
        pass

    model = Model()
    assert cpu_threads.cpu_task_pool(model) is None
    model.cpu_products = "onednn"  # oneDNN's matmuls run on ATen's OpenMP threads
    assert cpu_threads.cpu_task_pool(model) is None
    model.cpu_products = "sgemm"
    assert cpu_threads.cpu_task_pool(model) is not None


def test_close_gives_the_process_its_thread_count_back(monkeypatch):
    """torch.set_num_threads is process-wide: an engine shut down while sharing must not leave its count behind."""
    m = FakeMachine()
    monkeypatch.setattr(cpu_threads.torch, "get_num_threads", lambda: 2)
    g = m.governor(monkeypatch)
    for _ in range(2):
        m.run(0.6, ours=1.33, others=0.67)
        g.step()
    assert g.threads == 8
    g.close()
    assert m.set_calls == [8, 2] and g.threads == 2
    g.close()  # twice: nothing more to restore
    assert m.set_calls == [8, 2]
    pinned = FakeMachine().governor(monkeypatch, setting="1")
    pinned.close()
    assert pinned.threads == 2


def test_one_long_window_decides_on_its_own(monkeypatch):
    """A step of seconds (a long prompt chunk) is a window that averages enough: the count changes after it."""
    m = FakeMachine()
    g = m.governor(monkeypatch)
    m.run(0.6, ours=2.0, others=0.0)
    assert g.step() == 2
    m.run(1.9, ours=1.33, others=0.67)  # a short window: waits for a second one
    assert g.step() == 2 and m.set_calls == []
    m.run(0.6, ours=2.0, others=0.0)
    assert g.step() == 2
    m.run(2.5, ours=1.33, others=0.67)
    assert g.step() == 8 and m.set_calls == [8]


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


_MALLOC_PROBE = r'''
import ctypes, resource, sys, torch
from tallyserve.runner import cpu_threads

def faults_of_big_allocations():
    """A prefill step's pattern: several large activations alive at once, then all freed."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        live = [torch.empty(5 << 20, dtype=torch.float32).fill_(1.0) for _ in range(4)]  # 4 x 20 MiB
        del live
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

# glibc's starting point, without its dynamic adjustment (which depends on what was freed before):
# blocks from 128 KiB on are mapped per allocation and unmapped when freed
libc = ctypes.CDLL(None)
libc.mallopt(-3, 128 * 1024)
libc.mallopt(-1, 128 * 1024)
faults_of_big_allocations()
untuned = faults_of_big_allocations()
ok = cpu_threads.keep_freed_memory()
faults_of_big_allocations()
tuned = faults_of_big_allocations()
print("MALLOC", ok, untuned, tuned, cpu_threads.keep_freed_memory())
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_stops_refaulting_large_activations():
    """After keep_freed_memory(), freed 20 MiB activations' pages are reused: allocating them again costs no page
    faults (before: glibc trimmed the freed heap top and every page faulted again). A MALLOC_* variable the
    user set wins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE], capture_output=True, text=True, env=env,
                         cwd=str(Path(__file__).resolve().parents[2]), timeout=120)
    line = [x for x in out.stdout.splitlines() if x.startswith("MALLOC")]
    assert line, out.stderr[-2000:]
    _, ok, untuned, tuned, again = line[0].split()
    assert ok == "True" and again == "True"
    assert int(untuned) > 4 * 4 * 4000  # ~5,100 faults per 20 MiB allocation
    assert int(tuned) < 1000
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE], capture_output=True, text=True, env=env,
                         cwd=str(Path(__file__).resolve().parents[2]), timeout=120)
    assert [x for x in out.stdout.splitlines() if x.startswith("MALLOC")][0].split()[1] == "False"

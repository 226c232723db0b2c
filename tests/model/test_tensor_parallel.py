"""Tensor parallelism on the CPU: two gloo ranks (this file run as a script, spawned once for the
whole module) against the single-process model on tiny random Llama / Mistral / Qwen2 / Qwen3
checkpoints: logits of hand-built prefill + chunked-prefill + greedy-decode steps over a paged KV
cache, greedy tokens, the fused path (under the Triton interpreter), and in-process checks of the
per-rank shards (safetensors slices, dummy weights) and of tp-size validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root, for tests.* and tallyserve
from tests.tiny_models import PagedKV  # noqa: E402

from tallyserve.distributed import parallel_state  # noqa: E402
from tallyserve.models.loader import load_model, resolve_model  # noqa: E402

TP = 2
ATOL = 1e-4
CASES = {
    "llama-sharded": dict(arch="llama", max_shard_size="40KB"),  # a sharded checkpoint
    "mistral": dict(arch="mistral"),
    "qwen2-vocab255": dict(arch="qwen2", vocab_size=255),  # q/k/v bias; uneven vocab (rank 1 padded)
    "qwen3": dict(arch="qwen3"),  # q/k norm, explicit head_dim
    # one KV head replicated on both ranks, tied embeddings, o_proj and MLP biases (added after the reduce)
    "llama-kv1-tied-bias": dict(arch="llama", num_key_value_heads=1, tie_word_embeddings=True,
                                attention_bias=True, mlp_bias=True),
    "qwen3-kv1-tied": dict(arch="qwen3", num_key_value_heads=1, tie_word_embeddings=True),
}
FUSED_CASE = "qwen3-kv1-tied"  # also run through the fused kernels (Triton interpreter) on both ranks


def _tokens(seed: int, n: int, vocab: int = 250) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = {"a": _tokens(1, 11), "b": _tokens(2, 13)}


@torch.no_grad()
def run_steps(model, broadcast: Callable[[torch.Tensor], None]) -> tuple[list[Optional[torch.Tensor]], list[int]]:
    """A mixed prefill (with padding rows), a chunked prefill next to a decode, then greedy decode
    of both requests. Rank 0 picks each next token (argmax) and ``broadcast`` sends it to every
    rank, as the engine would. Returns (logits of each step (None off rank 0), greedy tokens)."""
    kv = PagedKV(model, num_blocks=32, block_size=4, seed=3)
    a, b = PROMPTS["a"], PROMPTS["b"]
    plans = [([("a", a), ("b", b[:6])], 2), ([("b", b[6:]), ("a", None)], 0)] + [([("a", None), ("b", None)], 0)] * 4
    nxt: dict[str, int] = {}
    all_logits, greedy = [], []
    for plan, padding in plans:
        batch = [(r, toks if toks is not None else [nxt[r]]) for r, toks in plan]
        ids, positions, meta = kv.build(batch, padding)
        logits = model.compute_logits(model(ids, positions, kv.kv_caches, meta))
        ends = torch.tensor(meta.query_start_loc_cpu[1:]) - 1
        chosen = logits[ends].argmax(-1) if logits is not None else torch.zeros(len(batch), dtype=torch.int64)
        broadcast(chosen)
        nxt = {r: int(t) for (r, _), t in zip(batch, chosen)}
        greedy += chosen.tolist()
        all_logits.append(logits)
    return all_logits, greedy


def _load(model_dir: str, tp_rank: int = 0, tp_size: int = 1, load_format: str = "auto"):
    return load_model(resolve_model(model_dir, load_format), load_format, torch.float32, "cpu", 0, None,
                      tp_rank=tp_rank, tp_size=tp_size)


# ---- the worker: `python test_tensor_parallel.py RANK INIT_METHOD CASES_JSON OUT_DIR fused|plain` ----


def _check_collectives(rank: int) -> None:
    x = torch.full((2, 3), float(rank + 1))
    assert torch.equal(parallel_state.all_reduce(x.clone()), torch.full((2, 3), 3.0))
    gathered = parallel_state.all_gather_last_dim(x)
    assert torch.equal(gathered, torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)], -1))
    to_zero = parallel_state.gather_last_dim(x, dst=0)
    assert (to_zero is None) == (rank != 0) and (rank != 0 or torch.equal(to_zero, gathered))


def worker_main(rank: int, init_method: str, cases: dict[str, str], out_dir: Path, fused: bool) -> None:
    torch.set_num_threads(1)
    parallel_state.init_tensor_parallel(TP, rank, init_method, backend="gloo", timeout_s=60)
    try:
        assert (parallel_state.tp_size(), parallel_state.tp_rank()) == (TP, rank)
        _check_collectives(rank)
        group = parallel_state.get_tp_group()
        broadcast = lambda t: torch.distributed.broadcast(t, src=0, group=group)  # noqa: E731
        for name, model_dir in cases.items():
            model = _load(model_dir, rank, TP)
            runs = {"plain": model}
            if fused and name == FUSED_CASE:
                fused = _load(model_dir, rank, TP)
                assert fused.enable_fused_kernels(), "fused kernels unavailable under TRITON_INTERPRET=1"
                runs["fused"] = fused
            for tag, m in runs.items():
                logits, greedy = run_steps(m, broadcast)
                assert all((lg is None) == (rank != 0) for lg in logits)
                if rank == 0:
                    torch.save({"logits": logits, "greedy": greedy}, out_dir / f"{name}.{tag}.pt")
        torch.distributed.barrier(group=group)  # neither rank leaves while the other is mid-collective
    finally:
        parallel_state.destroy()


# ---- the tests ----


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from tests.tiny_models import make_tiny_model

    dirs = {name: make_tiny_model(tmp_path_factory.mktemp(name), **kw) for name, kw in CASES.items()}
    assert (Path(dirs["llama-sharded"]) / "model.safetensors.index.json").is_file()
    return dirs


def _fused_supported() -> bool:
    """The fused kernels run on the CPU under Triton's interpreter from Triton 3.7 (see test_fused_ops)."""
    try:
        import triton
    except ImportError:
        return False
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)


@pytest.fixture(scope="module")
def tp2_results(model_dirs, tmp_path_factory) -> Path:
    """Run both ranks over every case once; rank 0's results land in the returned directory."""
    out = tmp_path_factory.mktemp("tp2")
    init_method = (out / "rendezvous").as_uri()  # a FileStore: no port to race for
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    fused = _fused_supported()
    if fused:
        env["TRITON_INTERPRET"] = "1"
    args = [init_method, json.dumps(model_dirs), str(out), "fused" if fused else "plain"]
    logs = [out / f"rank{rank}.log" for rank in range(TP)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, __file__, str(rank), *args], env=env, cwd=str(REPO),
                                          stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 180
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("tensor-parallel workers timed out")
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{log.read_text()[-4000:]}"
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_matches_tp1(case, model_dirs, tp2_results):
    """Logits of every step within fp32 tolerance, greedy tokens identical."""
    ref_logits, ref_greedy = run_steps(_load(model_dirs[case]), lambda t: None)
    tags = ["plain", "fused"] if case == FUSED_CASE and _fused_supported() else ["plain"]
    for tag in tags:
        got = torch.load(tp2_results / f"{case}.{tag}.pt")
        assert len(got["logits"]) == len(ref_logits)
        for step, (lg, ref) in enumerate(zip(got["logits"], ref_logits)):
            assert lg.dtype == torch.float32 and lg.shape == ref.shape
            torch.testing.assert_close(lg, ref, atol=ATOL, rtol=0, msg=f"{case} {tag} step {step}")
        assert got["greedy"] == ref_greedy, f"{case} {tag}"


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _assert_shards_reassemble(full, ranks) -> None:
    """Every rank's parameter is its slice of the single-process model's (replicated ones equal)."""
    full_params = dict(full.named_parameters())
    for model in ranks:
        shards = model.weight_shards()
        for name, param in model.named_parameters():
            want = full_params[name]
            spec = shards.get(name)
            if spec is not None:
                want = want.narrow(spec.dim, spec.start, spec.size)
                pad = param.narrow(spec.dim, spec.size, param.shape[spec.dim] - spec.size)
                assert not pad.any(), name
                param = param.narrow(spec.dim, 0, spec.size)
            assert torch.equal(param, want), name


def test_safetensors_ranks_read_their_slices(model_dirs):
    full = _load(model_dirs["llama-sharded"])
    ranks = [_load(model_dirs["llama-sharded"], r, TP) for r in range(TP)]
    for r, model in enumerate(ranks):
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert (model.num_local_heads, model.num_local_kv_heads) == (2, 1)
        assert tuple(attn.q_proj.weight.shape) == (32, 64) and tuple(attn.k_proj.weight.shape) == (16, 64)
        assert tuple(attn.o_proj.weight.shape) == (64, 32)
        assert tuple(mlp.gate_proj.weight.shape) == (64, 64) and tuple(mlp.down_proj.weight.shape) == (64, 64)
        assert tuple(model.model.embed_tokens.weight.shape) == (128, 64) == tuple(model.lm_head.weight.shape)
        assert tuple(model.model.norm.weight.shape) == (64,)
        assert model.get_kv_cache_shape(10, 4) == (2, 10, 4, 1, 16)
        assert 0.45 < _param_bytes(model) / _param_bytes(full) < 0.52, r
    _assert_shards_reassemble(full, ranks)


def test_replicated_kv_heads_and_padded_vocab(model_dirs):
    kv1 = [_load(model_dirs["llama-kv1-tied-bias"], r, TP) for r in range(TP)]
    for model in kv1:
        assert model.num_local_kv_heads == 1 and model.get_kv_cache_shape(3, 4) == (2, 3, 4, 1, 16)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    _assert_shards_reassemble(_load(model_dirs["llama-kv1-tied-bias"]), kv1)
    padded = [_load(model_dirs["qwen2-vocab255"], r, TP) for r in range(TP)]
    assert [m.model.embed_tokens.shard.size for m in padded] == [128, 127]
    _assert_shards_reassemble(_load(model_dirs["qwen2-vocab255"]), padded)


class _ThreadGroup:
    """Stand-in collectives for ``tp`` ranks run as threads of this process (rank = thread-local),
    to check shardings the two-process run does not cover (tp 4, KV heads split AND replicated)."""

    def __init__(self, tp: int) -> None:
        self.tp, self.local, self.slots = tp, threading.local(), [None] * tp
        self.barrier = threading.Barrier(tp, timeout=60)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        return x.copy_(torch.stack(parts).sum(0))

    def gather_last_dim(self, x: torch.Tensor, dst: int = 0) -> Optional[torch.Tensor]:
        parts = self._exchange(x)
        return torch.cat(parts, -1) if self.local.rank == dst else None

    def run(self, fn: Callable[[int], object]) -> list:
        results, errors = [None] * self.tp, []

        def target(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def test_tp4_replicated_kv_heads_with_thread_collectives(tmp_path, monkeypatch):
    """8 query heads, 2 KV heads over 4 ranks: ranks 0-1 keep KV head 0, ranks 2-3 KV head 1."""
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path, "qwen2", num_attention_heads=8, num_key_value_heads=2, vocab_size=250)
    group = _ThreadGroup(4)
    monkeypatch.setattr(parallel_state, "all_reduce", group.all_reduce)
    monkeypatch.setattr(parallel_state, "gather_last_dim", group.gather_last_dim)
    monkeypatch.setattr(parallel_state, "tp_size", lambda: 4)
    monkeypatch.setattr(parallel_state, "tp_rank", lambda: group.local.rank)
    ranks = [_load(model_dir, r, 4) for r in range(4)]
    assert [m.tp.kv_head_start for m in ranks] == [0, 0, 1, 1]
    assert all(m.num_local_heads == 2 and m.num_local_kv_heads == 1 for m in ranks)
    _assert_shards_reassemble(_load(model_dir), ranks)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # four threads on two cores
    try:  # other ranks pass zeros for the chosen tokens, so a sum is rank 0's broadcast
        results = group.run(lambda r: run_steps(ranks[r], group.all_reduce))
    finally:
        torch.set_num_threads(threads)
    ref_logits, ref_greedy = run_steps(_load(model_dir), lambda t: None)
    got_logits, got_greedy = results[0]
    for step, (lg, ref) in enumerate(zip(got_logits, ref_logits)):
        torch.testing.assert_close(lg, ref, atol=ATOL, rtol=0, msg=f"step {step}")
    assert got_greedy == ref_greedy and all(r[1] == ref_greedy for r in results[1:])


def test_dummy_tp2_equals_tp1_sliced(model_dirs):
    for case in ("qwen3", "qwen2-vocab255"):
        full = _load(model_dirs[case], load_format="dummy")
        _assert_shards_reassemble(full, [_load(model_dirs[case], r, TP, "dummy") for r in range(TP)])


def test_bad_tp_sizes_raise_before_loading(model_dirs, monkeypatch):
    from tallyserve.models import loader
    from tallyserve.config.model import check_tensor_parallel
    from tallyserve.models.llama import num_local_kv_heads

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the tp size was validated")

    monkeypatch.setattr(loader, "_load_safetensors", no_weights)
    monkeypatch.setattr(loader, "_init_dummy", no_weights)
    resolved = resolve_model(model_dirs["mistral"])  # 4 heads, 2 KV heads, intermediate 128
    config = resolved.model_config
    for tp_size, match in [(3, r"^tensor_parallel_size=3 does not fit \w+: num_attention_heads \(4\) is not divisible"),
                           (8, r"^tensor_parallel_size=8 does not fit \w+: num_attention_heads \(4\) is not divisible"),
                           (0, r"^tensor_parallel_size must be an integer >= 1, got 0"),
                           (2.0, r"^tensor_parallel_size must be an integer >= 1, got 2.0"),
                           (True, r"^tensor_parallel_size must be an integer >= 1, got True")]:
        with pytest.raises(ValueError, match=match):
            check_tensor_parallel(config, tp_size)
        with pytest.raises(ValueError, match=match):
            load_model(resolved, tp_size=tp_size)
    with pytest.raises(ValueError, match="tp_rank must be"):
        load_model(resolved, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="num_key_value_heads \\(3\\) is not divisible"):
        check_tensor_parallel(replace(config, num_attention_heads=6, num_key_value_heads=3), 2)
    with pytest.raises(ValueError, match="^[^;]*multiple of num_key_value_heads \\(4\\)[^;]*$"):
        check_tensor_parallel(replace(config, num_attention_heads=12, num_key_value_heads=4, intermediate_size=120), 6)
    with pytest.raises(ValueError, match="intermediate_size \\(101\\)"):
        check_tensor_parallel(replace(config, intermediate_size=101), 2)
    check_tensor_parallel(replace(config, num_attention_heads=8), 4)  # 2 KV heads, each on 2 ranks
    assert num_local_kv_heads(config, 1) == 2 and num_local_kv_heads(config, 2) == 1


def test_sharded_model_needs_the_group(model_dirs):
    assert not parallel_state.is_initialized() and (parallel_state.tp_size(), parallel_state.tp_rank()) == (1, 0)
    x = torch.ones(3)
    assert parallel_state.all_reduce(x) is x and parallel_state.gather_last_dim(x) is x
    with pytest.raises(ValueError, match="tp_rank must be in"):
        parallel_state.init_tensor_parallel(2, 2, "tcp://127.0.0.1:1")
    model = _load(model_dirs["mistral"], 1, TP)
    kv = PagedKV(model, num_blocks=4)
    ids, positions, meta = kv.build([("a", [1, 2, 3])])
    with pytest.raises(RuntimeError, match="init_tensor_parallel"):
        model(ids, positions, kv.kv_caches, meta)


if __name__ == "__main__":
    import traceback

    try:
        worker_main(int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4]), sys.argv[5] == "fused")
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the log the test reads
        traceback.print_exc()
        code = 1
    # As the executor's workers do: skip interpreter teardown, where gloo's background threads can
    # abort the process ("terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

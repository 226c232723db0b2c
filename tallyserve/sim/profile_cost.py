"""The measured cost model: step times interpolated from a profile that `tallyserve profile` measured on the
engine itself (see ``ProfileCostModel``); `cost_model.load_cost_model` picks it for a profile JSON."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from tallyserve.config.model import ModelConfig
from tallyserve.sim.cost_model import HARDWARE, ModelShape, StepShape, transfer_time


def _locate(axis: Sequence[float], x: float) -> tuple[int, float]:
    """Segment index and fraction of `x` on `axis` (fraction > 1 past the last point; clamped at 0)."""
    if len(axis) == 1:
        return 0, 0.0
    i = 0
    while i < len(axis) - 2 and x > axis[i + 1]:
        i += 1
    return i, max(0.0, (x - axis[i]) / (axis[i + 1] - axis[i]))


def _lerp(a: float, b: float, f: float) -> float:
    """Linear between a and b; past b it extrapolates with a non-negative slope, so noisy
    measurements never make a bigger step cheaper than the grid's edge."""
    if f <= 1.0:
        return a + f * (b - a)
    return b + (f - 1.0) * max(b - a, 0.0)


def grid_extra_attn_pairs(extra_tokens: float, context_len: float) -> float:
    """``StepShape.extra_attn_pairs`` of a profile's grid step: every request has ``context_len``
    tokens cached and the first computes ``1 + extra_tokens`` (`tallyserve.profile`), so all the
    prefill attention is one chunk's: e c + (e + 1)(e + 2) / 2 - 1."""
    e, c = extra_tokens, context_len
    return e * c + e * (e + 3) / 2


class ProfileCostModel:
    """Interpolation of measured step times, one axis after another (linear inside the grid,
    non-decreasing linear extrapolation past its far edges, clamped below its near edges).

    A profile holds axes `batch_size` (requests in the step), `extra_tokens` (new tokens beyond
    one per request, i.e. prefill tokens) and `context_len` (KV tokens cached per request before
    the step), and `step_time_s[b][e][c]` over their product: one step measured on its own, host
    and device in turn. A step is looked up at (requests, tokens - requests, `StepShape.cached_len`),
    so a grid step prices at its own measurement.

    Prefill attention: a grid step's extra tokens are one request's chunk, whose causal attention
    grows with the square of its length; a step of the same size split over several prompts
    attends far fewer query-key pairs. With `prefill_pair_time_s` (seconds per pair, measured by
    `tallyserve profile`) each grid point's own pairs (`grid_extra_attn_pairs`) are priced out
    before interpolating and the step's own (`StepShape.extra_attn_pairs`) priced in.

    Async scheduling (`async_scheduling = True`, which the simulator sets from its mode): a step
    launched while the one before is still on the device costs its period in that stream,
    measured as `stream_time_s` (the step launched back to back, as the engine's async loop does);
    a profile without it takes max(host, total - host) from `host_time_s`. A step launched with
    nothing in flight (`overlapped=False`) costs its measured total.
    A step whose decode rows share a prefix (cascade attention, see ``StepShape.kv_read_tokens``) is
    looked up at the context length that reads as much KV: the grid's steps share nothing.

    Pure decode steps, two departures from the grid's steps (both measured by `tallyserve profile`):
    - CUDA-graph padding (`cuda_graph_batch_sizes`, the engine's capture sizes): a decode step of b
      requests replays the graph of the smallest size B >= b, whose B - b padding rows still run the
      linear layers (they read no KV). Such a step pays the grid's step at (B, context_len[0]) less the
      one at (b, context_len[0]) on top of its own lookup: the rows' cost without attention.
    - Uneven lengths (`decode_spread`): a grid step's requests all have one length, a real batch's
      do not. The decode kernel runs one program per (request, KV head) (per split, and at 64+
      requests in a graph there is one split: ``triton_attn._decode_splits``), handed to the SMs in
      request order; the longest requests' programs still run after the rest have finished, with the
      GPU's bandwidth left idle, on every layer. The profile times decode steps whose lengths are spread
      evenly (shuffled) around each context of the grid; the step's time over the grid's per token of
      their longest length past the mean is interpolated over (batch, context) (edges held) and
      charged per token of the step's own (``StepShape.seq_len_spread``).
    """

    async_scheduling = False

    def __init__(self, profile: dict, model_config: Optional[ModelConfig] = None) -> None:
        try:
            self.axes = [list(map(float, profile[k])) for k in ("batch_size", "extra_tokens", "context_len")]
            self.table = profile["step_time_s"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile is missing {exc}: run `tallyserve profile` to make one") from None
        for axis in self.axes:
            if not axis or any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError("profile axes must be non-empty and strictly increasing")
        shape = (len(self.axes[0]), len(self.axes[1]), len(self.axes[2]))
        if not _has_shape(self.table, shape):
            raise ValueError(f"profile step_time_s must have shape {shape}")
        self.host_table = profile.get("host_time_s")
        self.stream_table = profile.get("stream_time_s")
        for key, table in (("host_time_s", self.host_table), ("stream_time_s", self.stream_table)):
            if table is not None and not _has_shape(table, shape):
                raise ValueError(f"profile {key} must have shape {shape}")
        pair_time = profile.get("prefill_pair_time_s")
        if pair_time is not None and not (isinstance(pair_time, (int, float)) and math.isfinite(pair_time)
                                          and pair_time >= 0):
            raise ValueError(f"profile prefill_pair_time_s must be a number >= 0, got {pair_time!r}")
        self.pair_time = float(pair_time or 0.0)
        graphs = profile.get("cuda_graph_batch_sizes") or []
        if not (isinstance(graphs, list) and all(isinstance(g, int) and g >= 1 for g in graphs)):
            raise ValueError(f"profile cuda_graph_batch_sizes must be a list of integers >= 1, got {graphs!r}")
        self.graph_sizes = sorted(set(graphs))
        self.spread = _check_spread(profile.get("decode_spread"))
        self.mem_bytes = float(profile.get("memory_bytes") or HARDWARE["h200"].mem_bytes)
        self.name = f"profile:{profile.get('device', 'unknown')}"
        # the engine profiled uses cascade attention unless it ran on the CPU (whose backend has none)
        self.cascade = "cpu" not in str(profile.get("device", "")).lower()
        # KV moves are not in the grid: priced from the model's shape and the profile's bandwidths.
        self.shape = ModelShape.of(model_config) if model_config is not None else None
        self.host_bandwidth = float(profile.get("host_bandwidth") or HARDWARE["h200"].host_bandwidth)
        self.mem_bandwidth = float(profile.get("mem_bandwidth") or HARDWARE["h200"].mem_bandwidth)

    def step_time(self, s: StepShape, overlapped: Optional[bool] = None) -> float:
        """``overlapped``: launched while another step is on the device (None: whenever the
        simulator runs async scheduling)."""
        if overlapped is None:
            overlapped = self.async_scheduling
        b = max(s.num_requests, 1)
        t = self._lookup(b, s.num_tokens - s.num_requests, s.cached_len, s.extra_attn_pairs, overlapped)
        if s.num_requests and s.num_decode_rows == s.num_requests:
            t += self.graph_padding_time(b, overlapped) + self.spread_time(b, s.cached_len, s.seq_len_spread,
                                                                            overlapped)
        moves = transfer_time(self.shape, self.host_bandwidth, self.mem_bandwidth, s) if self.shape else 0.0
        return max(t, 1e-7) + moves

    def _lookup(self, b: float, extra: float, cached: float, step_pairs: float, overlapped: bool) -> float:
        """The grid interpolated at (b, extra, cached), the grid points' prefill attention replaced by
        ``step_pairs`` pairs'."""
        (bi, bf), (ei, ef), (ci, cf) = (_locate(axis, x) for axis, x in zip(self.axes, (b, extra, cached)))
        nb, ne, nc = (min(1, len(a) - 1) for a in self.axes)  # 0 on a single-point axis
        stream = self.stream_table if overlapped else None
        host = self.host_table if overlapped else None
        extra_axis, ctx_axis, pair_time = self.axes[1], self.axes[2], self.pair_time

        def cell(i: int, j: int, k: int) -> float:
            # the step's own prefill attention in place of the grid point's
            attn = pair_time * (step_pairs - grid_extra_attn_pairs(extra_axis[j], ctx_axis[k])) if pair_time else 0.0
            return _mode_time(self.table[i][j][k], host[i][j][k] if host is not None else None,
                              stream[i][j][k] if stream is not None else None, attn)

        def along_c(i: int, j: int) -> float:
            return _lerp(cell(i, j, ci), cell(i, j, ci + nc), cf)

        def along_e(i: int) -> float:
            return _lerp(along_c(i, ei), along_c(i, ei + ne), ef)

        return _lerp(along_e(bi), along_e(bi + nb), bf)

    def graph_padding_time(self, b: int, overlapped: bool) -> float:
        """A decode step of ``b`` requests replays the CUDA graph of the smallest captured size B >= b:
        the B - b padding rows' cost, the grid's step at (B, 0, context_len[0]) less (b, 0, context_len[0])."""
        graphs = self.graph_sizes
        if not graphs or b > graphs[-1]:
            return 0.0
        size = next(g for g in graphs if g >= b)
        if size == b:
            return 0.0
        c0 = self.axes[2][0]
        return max(0.0, self._lookup(size, 0, c0, 0, overlapped) - self._lookup(b, 0, c0, 0, overlapped))

    def spread_time(self, b: float, cached: float, spread: float, overlapped: bool) -> float:
        """Uneven lengths in a decode step: ``spread`` (the longest KV length past the mean) times the
        measured seconds per such token near (``b``, ``cached``)."""
        sp = self.spread
        if sp is None or spread <= 0:
            return 0.0
        (bi, bf), (ci, cf) = _locate(sp["batch_size"], b), _locate(sp["context_len"], cached)
        bf, cf = min(bf, 1.0), min(cf, 1.0)  # held at the far edges, like the near ones
        nb, nc = min(1, len(sp["batch_size"]) - 1), min(1, len(sp["context_len"]) - 1)
        host, stream = (sp.get("host_time_s"), sp.get("stream_time_s")) if overlapped else (None, None)

        def rate(i: int, k: int) -> float:
            measured = _mode_time(sp["step_time_s"][i][k], host[i][k] if host is not None else None,
                                  stream[i][k] if stream is not None else None, 0.0)
            even = self._lookup(sp["batch_size"][i], 0, sp["context_len"][k], 0, overlapped)
            # >= 0: the longest programs cannot end before those of the mean length would (below: noise)
            return max(0.0, measured - even) / sp["max_minus_mean"][i][k]

        def along_c(i: int) -> float:
            return rate(i, ci) + cf * (rate(i, ci + nc) - rate(i, ci))

        return spread * (along_c(bi) + bf * (along_c(bi + nb) - along_c(bi)))


def _mode_time(total: float, host: Optional[float], stream: Optional[float], attn: float) -> float:
    """A measured step's cost: in the async stream max(host, period), else with host times max(host,
    device part), else its total; ``attn`` added to the device part."""
    if stream is not None:
        return max(host if host is not None else 0.0, stream + attn)
    if host is not None:
        return max(host, total - host + attn)
    return total + attn


def _check_spread(spread) -> Optional[dict]:
    """A profile's ``decode_spread`` (None when absent or empty), checked: axes strictly increasing, tables
    of their shape, ``max_minus_mean`` > 0."""
    if not spread or not spread.get("batch_size") or not spread.get("context_len"):
        return None
    try:
        out = {k: [float(x) for x in spread[k]] for k in ("batch_size", "context_len")}
        shape = (len(out["batch_size"]), len(out["context_len"]))
        for key in ("max_minus_mean", "step_time_s", "host_time_s", "stream_time_s"):
            table = spread.get(key)
            if table is None and key in ("host_time_s", "stream_time_s"):
                out[key] = None
                continue
            if len(table) != shape[0] or any(len(r) != shape[1] for r in table):
                raise ValueError(f"profile decode_spread {key} must have shape {shape}")
            out[key] = [[float(x) for x in r] for r in table]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"profile decode_spread is malformed: {exc}") from None
    for axis in (out["batch_size"], out["context_len"]):
        if any(b <= a for a, b in zip(axis, axis[1:])):
            raise ValueError("profile decode_spread axes must be strictly increasing")
    if any(m <= 0 for r in out["max_minus_mean"] for m in r):
        raise ValueError("profile decode_spread max_minus_mean must be > 0")
    return out


def _has_shape(table, shape: tuple[int, int, int]) -> bool:
    try:
        return len(table) == shape[0] and all(len(r) == shape[1] and all(len(c) == shape[2] for c in r)
                                              for r in table)
    except TypeError:
        return False

"""Start and stop a live `tallyserve serve` subprocess on 127.0.0.1 for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

HOST = "127.0.0.1"
MODEL = "tiny"  # --served-model-name of the test servers
API_KEY = "test-key-123"
STARTUP_TIMEOUT_S = 90.0
# Small and fixed: fast startup, and "every block free" means something.
BASE_ARGS = ("--num-gpu-blocks-override", "256", "--block-size", "8", "--log-level", "warning",
             "--disable-access-log")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _command() -> list[str]:
    script = Path(sys.executable).parent / "tallyserve"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "tallyserve.cli"]


class LiveServer:
    def __init__(self, model_dir: str, log_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.log_path = Path(log_dir) / f"server-{self.port}.log"
        cmd = _command() + ["serve", "--model", model_dir, "--host", HOST, "--port", str(self.port),
                            *BASE_ARGS, *extra]
        repo = str(Path(__file__).resolve().parents[2])
        # this checkout's tallyserve, not whichever one the interpreter has installed (a worktree
        # sharing another checkout's virtualenv would otherwise serve that checkout's code)
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=repo)
        self._wait_healthy()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(10) is None:
                self.proc.kill()
                self.wait(10)
        self._log.close()


def metrics(base_url: str) -> dict[str, float]:
    """Samples of /metrics by name (with labels appended as name{k=v,...}), parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=5.0).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _counters(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if k.startswith("tallyserve_") and "_total" in k}


def wait_idle(base_url: str, timeout: float = 10.0, settle: float = 0.3) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV block is free, and two samples ``settle`` seconds
    apart agree (the engine core process publishes its counters with its next step or idle tick, so a
    just-aborted request can still be missing from the first idle sample); return the last sample."""
    deadline = time.monotonic() + timeout
    m = metrics(base_url)
    while time.monotonic() < deadline:
        if (m["tallyserve_num_requests_running"] == 0 and m["tallyserve_num_requests_waiting"] == 0
                and m["tallyserve_kv_blocks_free"] == m["tallyserve_kv_blocks_total"]):
            time.sleep(settle)
            again = metrics(base_url)
            if _counters(again) == _counters(m):
                return again
            m = again
            continue
        time.sleep(0.1)
        m = metrics(base_url)
    return m

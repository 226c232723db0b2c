"""tallyserve/envs.py is the one registry of environment variables: nothing else reads TALLYSERVE_* from the
environment, every variable is documented in docs/configuration.md, and reads see the current environment."""

import re
from pathlib import Path

import pytest

from tallyserve import envs

ROOT = Path(__file__).resolve().parents[2]


def test_only_envs_reads_tallyserve_variables():
    readers = []
    for path in (ROOT / "tallyserve").rglob("*.py"):
        if path.name == "envs.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(environ|getenv)\b.*TALLYSERVE_|TALLYSERVE_\w+.*\b(environ|getenv)\b", line):
                readers.append(f"{path.relative_to(ROOT)}:{n}")
    assert readers == []
    cpp = {m for p in (ROOT / "tallyserve" / "kernels" / "csrc").iterdir()
           for m in re.findall(r'getenv\("(TALLYSERVE_\w+)"\)', p.read_text())}
    assert cpp <= set(envs.environment_variables)  # the kernels' own reads are registered (documented) too


def test_every_variable_is_documented_once():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    table = re.findall(r"^\| `(TALLYSERVE_\w+)` \|", doc, re.M)
    assert sorted(table) == sorted(envs.environment_variables)
    for name, var in envs.environment_variables.items():
        assert var.doc and f"| `{name}` | {var.default} | {var.doc} |" in doc


def test_reads_follow_the_environment(monkeypatch):
    monkeypatch.setenv("TALLYSERVE_PDL", "0")
    assert envs.TALLYSERVE_PDL is False
    monkeypatch.setenv("TALLYSERVE_PDL", "1")
    assert envs.TALLYSERVE_PDL is True
    monkeypatch.delenv("TALLYSERVE_CPU_THREADS", raising=False)
    assert envs.TALLYSERVE_CPU_THREADS == "auto"
    monkeypatch.setenv("TALLYSERVE_CPU_THREADS", " 4 ")
    assert envs.TALLYSERVE_CPU_THREADS == "4"
    monkeypatch.setenv("TALLYSERVE_DEVICE", "")
    assert envs.TALLYSERVE_DEVICE is None
    with pytest.raises(AttributeError, match="TALLYSERVE_NO_SUCH_THING"):
        _ = envs.TALLYSERVE_NO_SUCH_THING

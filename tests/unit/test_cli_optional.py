"""A subcommand whose dependencies are missing still parses and says what is missing (instead of
`invalid choice: 'serve'`, which hides the cause)."""

import subprocess
import sys

SCRIPT = r'''
import builtins, sys
real = builtins.__import__
def guarded(name, *a, **k):
    if name == "uvicorn" or name.startswith("uvicorn."):
        raise ImportError("No module named 'uvicorn'")
    return real(name, *a, **k)
builtins.__import__ = guarded
from tallyserve.cli import main
sys.exit(main(sys.argv[1:]))
'''


def _run(*args):
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_missing_dependency_is_named():
    proc = _run("serve", "--model", "m", "--port", "1")
    assert proc.returncode == 2
    assert "`tallyserve serve` needs a package that is not installed" in proc.stderr
    assert "uvicorn" in proc.stderr


def test_other_subcommands_still_work():
    proc = _run("simulate", "--help")
    assert proc.returncode == 0 and "--hardware" in proc.stdout

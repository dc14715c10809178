"""The trap oracles' runner (tests/cpu_watch.py): a hang by the child's CPU time, and raw
SlangPy's verdicts remembered on disk (docs/testing.md)."""

from __future__ import annotations

import sys

import pytest

import cpu_watch


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYDIFF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_watch.FRESH, raising=False)
    return tmp_path


def _child(log, code: int = 0) -> list[str]:
    """A child that appends a line to ``log`` each time it really runs, then exits ``code``."""
    script = f"open({str(log)!r}, 'a').write('ran\\n'); print('verdict'); raise SystemExit({code})"
    return [sys.executable, "-c", script]


def test_a_verdict_is_read_back_without_running_again(private_cache, monkeypatch):
    log = private_cache / "runs.txt"
    first = cpu_watch.run_remembered(_child(log), cpu_budget=30)
    again = cpu_watch.run_remembered(_child(log), cpu_budget=30)
    assert first[0] == again[0] == 0 and again[1].strip() == "verdict"
    assert log.read_text().count("ran") == 1  # the second came from the cache
    cpu_watch.run_remembered(_child(log), cpu_budget=31)  # another budget: another key
    assert log.read_text().count("ran") == 2
    monkeypatch.setenv(cpu_watch.FRESH, "1")
    cpu_watch.run_remembered(_child(log), cpu_budget=30)
    assert log.read_text().count("ran") == 3


def test_errors_are_never_remembered(private_cache):
    log = private_cache / "runs.txt"
    for _ in range(2):
        assert cpu_watch.run_remembered(_child(log, code=1), cpu_budget=30)[0] == 1
    assert log.read_text().count("ran") == 2


def test_a_hang_is_decided_by_cpu_time_and_remembered(private_cache):
    spin = [sys.executable, "-c", "while True: pass"]
    assert cpu_watch.run_watched(spin, cpu_budget=0.5) is None
    assert cpu_watch.run_remembered(spin, cpu_budget=0.5) is None
    assert cpu_watch.run_remembered(spin, cpu_budget=0.5) is None  # (read back: no spin)
    assert list((private_cache / "cache" / "trap-oracle").glob("*.json"))

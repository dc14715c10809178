"""Which of pydiff's kernels the calls under test ask for (tests' helper)."""

from __future__ import annotations


def entries_used(device, monkeypatch) -> list[str]:
    """The kernel entry points ``device.kernels`` is asked for from now on (the ops ask at
    every dispatch; a matrix product's plan asks once per shape)."""
    used: list[str] = []
    real = device.kernels.get_keyed

    def get_keyed(file, entry, **defines):
        used.append(entry)
        return real(file, entry, **defines)

    monkeypatch.setattr(device.kernels, "get_keyed", get_keyed)
    return used

"""Run a call on both paths: through a generated kernel (every covered call, whatever its size:
conftest's ``forced`` fixture) and on SlangPy's path, for bitwise comparisons.

    def test_x(forced):
        gen, ref, counts = run_both_paths(forced, lambda: [m.f(x).numpy()])
"""

from __future__ import annotations

from pydiff import generated


def run_both_paths(forced, run):
    """``run()`` on the generated path (with the stats it left), then on SlangPy's."""
    forced.setenv("PYDIFF_GENERATED", "1")
    generated.reset_stats()
    gen = run()
    counts = generated.stats()
    forced.setenv("PYDIFF_GENERATED", "0")
    return gen, run(), counts

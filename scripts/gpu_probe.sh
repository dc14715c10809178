set -u
out=${OUT:-/tmp}
timeout 150 python3 -m pytest -q -p pydiff.testing -p no:cacheprovider --pydiff-device cuda -m "not slow" -n 8 \
  tests/test_s34_grid2d.py tests/test_s32_grid32.py tests/test_s33_grid33.py tests/test_s33_grid_forward.py \
  tests/test_s33_gridbwd33.py tests/test_edge_grid.py tests/test_s37_result_loop.py tests/test_s37_double_generics.py \
  tests/test_s32_held_launch.py tests/test_s33_bigpool.py tests/test_memory.py 2>&1 | tee $out/t.log | grep -E "^(FAILED|ERROR)|passed|failed" | head -30
echo "== grid bench"; PYDIFF_DEVICE=cuda timeout 90 python3 benchmarks/bench_grid.py --rounds 3 2>&1 | tail -22
echo "== layers"; timeout 60 python3 benchmarks/bench_call_layers.py --device cuda --calls 2000 2>&1 | grep -E "whole|raw SlangPy"

#!/usr/bin/env bash
# One device call's worth of GPU checks (see docs/devices.md): run on the lent machine as
#   bash .gpu/on-device.sh cmd bash scripts/gpu_session.sh
# (after `bash ../shared/gpu/pack.sh` here; `run` with carry [".gpu"], timeout_s 600). Logs go
# to $OUT. First the paths that have never run on CUDA (generated kernels forced, the fused tape
# step, device seeds, captures), then issue 16's figures against raw SlangPy and PyTorch CUDA
# in the time left. Stays under ~560 s.
set -u
out=${OUT:-/tmp}
types=cuda
python3 -c "import pydiff; pydiff.create_device('vulkan')" >/dev/null 2>&1 && types=cuda,vulkan
echo "backends: $types"
timeout 230 python3 -m pytest -q -p pydiff.testing -p no:cacheprovider --pydiff-device "$types" \
  --pydiff-generated=force -m "not slow" -n 8 tests/test_generated.py tests/test_generated_paths.py \
  tests/test_s41_genforce.py tests/test_s41_genbreak.py tests/test_s44_fuse44.py \
  tests/test_s49_fuse49.py tests/test_s50_fuse50.py tests/test_s50_device_seed.py \
  tests/test_s50_fix50.py tests/test_s50_break50.py tests/test_capture.py tests/test_s28_genfix.py \
  tests/test_s30_planned_generated.py tests/test_s36_gen36.py tests/test_s51_*.py \
  2>&1 | tee "$out/tests_generated.log" | grep -E "^(FAILED|ERROR)|passed|failed"
run() { echo "== $*"; PYDIFF_DEVICE=cuda timeout "$1" "${@:2}" 2>&1 | tee -a "$out/bench.log" | tail -30; }
run 130 python3 benchmarks/bench_gpu.py --device cuda
run 80 python3 benchmarks/bench_percall_variants.py cuda
left=$((555 - SECONDS))
[ "$left" -gt 30 ] && run "$left" python3 benchmarks/bench_core.py --device cuda --rounds 10
exit 0

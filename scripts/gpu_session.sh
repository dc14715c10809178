#!/usr/bin/env bash
# One device call's worth of GPU checks (see docs/devices.md): run on the lent machine as
#   bash .gpu/on-device.sh cmd bash scripts/gpu_session.sh
# (after `bash ../shared/gpu/pack.sh` here; `run` with carry [".gpu"], timeout_s 600). Logs go
# to $OUT. The per-call and large-case benchmarks against raw SlangPy and PyTorch CUDA first
# (the figures issue 16 asks for), then the newest tests on CUDA (and Vulkan if the driver
# opens) in the time left. Stays under ~560 s.
set -u
out=${OUT:-/tmp}
run() { echo "== $*"; PYDIFF_DEVICE=cuda timeout "$1" "${@:2}" 2>&1 | tee -a "$out/bench.log" | tail -25; }
run 80 python3 benchmarks/bench_percall_variants.py cuda
run 60 python3 benchmarks/bench_call_layers.py --device cuda --calls 2000
run 40 python3 benchmarks/bench_tape.py
run 90 python3 benchmarks/bench_core.py --device cuda --rounds 10
run 60 python3 benchmarks/bench_generated.py --sizes 20 24 --rounds 5
types=cuda
python3 -c "import pydiff; pydiff.create_device('vulkan')" >/dev/null 2>&1 && types=cuda,vulkan
left=$((560 - SECONDS))
echo "backends: $types; tests get ${left} s"
[ "$left" -gt 30 ] && timeout "$left" python3 -m pytest -q -p pydiff.testing -p no:cacheprovider \
  --pydiff-device "$types" -m "not slow" -n 8 tests/test_s36_*.py tests/test_s35_*.py \
  tests/test_s34_vec34.py tests/test_s34_breakvec34.py tests/test_tape.py tests/test_call_plan.py \
  2>&1 | tee "$out/tests_new.log" | grep -E "^(FAILED|ERROR)|passed|failed"
exit 0

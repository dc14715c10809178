set -u
out=${OUT:-/tmp}
export PYDIFF_DEVICE=cuda
echo "== dispatch modes"; timeout 60 python3 benchmarks/bench_dispatch_modes.py --device cuda 2>&1 | tail -12
echo "== layers, planned after 1000"; PYDIFF_GENERATED_PLANNED_AFTER=1000 timeout 60 python3 benchmarks/bench_call_layers.py --device cuda --calls 2000 2>&1 | tail -28
echo "== profile planned after 1000"; PYDIFF_GENERATED_PLANNED_AFTER=1000 timeout 60 python3 benchmarks/bench_percall_variants.py cuda profile 2>&1 | grep -v "^$" | cut -c1-160 | head -70
echo "== profile default"; timeout 60 python3 benchmarks/bench_percall_variants.py cuda profile 2>&1 | grep -v "^$" | cut -c1-160 | head -70

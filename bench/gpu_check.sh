#!/usr/bin/env bash
# On an H200: the GPU tests (pytest -m gpu), then the connector benchmark, which writes
# bench/results/h200/connector.json. Run from anywhere; everything it prints also goes to
# $OUT/gpu_check.log when OUT is set.
#
#   bash bench/gpu_check.sh            # on the H200
#   bash bench/gpu_check.sh --quick    # anywhere: GPU tests skip without a GPU, a tiny benchmark, no result file
#
# A pyzmq wheel carried in .whl/ (for a machine that cannot reach a package index) is installed
# into /tmp/site first. Exits non-zero if the tests or the benchmark failed.
set -uo pipefail

cd "$(dirname "$0")/.."
quick=""
if [ "${1:-}" = "--quick" ]; then
    quick="--quick"
elif [ $# -gt 0 ]; then
    echo "usage: bash bench/gpu_check.sh [--quick]" >&2
    exit 2
fi

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
if ! python3 -c "import torch, triton, zmq, msgpack; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'pyzmq', zmq.__version__)"; then
    echo "== missing packages: torch, triton, pyzmq and msgpack are needed"
    exit 1
fi
has_cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))")

echo "== pytest -m gpu"
python3 -m pytest -q -m gpu -p no:cacheprovider tests
tests_rc=$?

if [ "$has_cuda" != 1 ] && [ -z "$quick" ]; then
    echo "== no CUDA GPU here: the benchmark needs one (--quick runs a CPU smoke version)"
    exit 1
fi
echo "== bench/bench_connector.py ${quick}"
python3 -m bench.bench_connector $quick
bench_rc=$?

echo "== done: tests rc=$tests_rc, benchmark rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

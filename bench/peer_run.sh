#!/usr/bin/env bash
# Peer restores on the H200, in one device call (ends within 9 minutes):
#
#   bash bench/peer_run.sh          (from the repository root, with the pyzmq wheel in .whl/ carried)
#   bash bench/peer_run.sh --quick  (the same steps on tiny shapes on a CPU machine: host transport)
#
# 1. the peer tests: tests/integration/test_peer_gpu.py (-m gpu: two engine processes on the one
#    GPU) and the protocol tests of tests/integration/test_peer.py  -> $OUT/peer_tests.log
# 2. bench_connector --tiers peer: per request an L2 load and a peer load of the same prefix,
#    Qwen3-8B and -32B geometries, 20 requests + 3,500 and 8,000 tokens -> $OUT/connector_peer.json
# 3. bench_ttft --tiers none,l2,peer: Qwen3-8B 3,500 and 8,000 tokens, Qwen3-4B 3,500
#                                                                    -> $OUT/ttft_peer.json
# Each stage under `timeout` (SIGTERM to its process group, SIGKILL 15 s later); logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
START_S=$SECONDS
END_S=$((START_S + 525))
OUT=${OUT:-/tmp/kvbench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

QUICK=${1:-}
RESULTS=$PWD/bench/results/h200
[[ $QUICK == --quick ]] && RESULTS=$(mktemp -d /tmp/kvbench-quick.XXXXXX)
name() { if [[ $QUICK == --quick ]]; then echo --quick --name "$1" --machine "$RESULTS";
         else echo --name "$1" --machine h200; fi; }

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
trap '[[ $QUICK == --quick ]] && rm -rf "$RESULTS"' EXIT

stage() {
    local name=$1 limit=$2; shift 2
    local left=$((END_S - SECONDS))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then echo "== $name: skipped, ${left}s left" | tee -a "$OUT/$name.log"; return; fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
    timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - START_S))s in all" | tee -a "$OUT/$name.log"
}

stage peer_tests 150 python3 -m pytest -q -rs tests/integration/test_peer_gpu.py tests/integration/test_peer.py
if [[ $QUICK == --quick ]]; then
    stage connector_peer 120 python3 -m bench.bench_connector --tiers peer $(name connector_peer)
    stage ttft_peer 240 python3 -m bench.bench_ttft --tiers none,l2,peer --no-hf $(name ttft_peer)
else
    stage connector_peer 120 python3 -m bench.bench_connector --tiers peer --geometries qwen3-8b,qwen3-32b \
        --requests 20 $(name connector_peer)
    stage ttft_peer $((END_S - SECONDS)) python3 -m bench.bench_ttft --points 'qwen3-8b=3500,8000;qwen3-4b=3500' \
        --tiers none,l2,peer --no-hf --budget-s $((END_S - SECONDS - 60)) $(name ttft_peer)
fi
cp "$RESULTS"/connector_peer.json "$RESULTS"/ttft_peer.json "$OUT/" 2>/dev/null
echo "done in $((SECONDS - START_S))s; files: $(ls "$OUT" | tr '\n' ' ')"

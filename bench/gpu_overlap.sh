#!/usr/bin/env bash
# The H200 run of the layer-by-layer loads and the restores hidden under decode, in one device call
# (ends within 9 minutes):
#
#   bash bench/gpu_overlap.sh          (from the repository root, with the pyzmq wheel in .whl/ carried)
#   bash bench/gpu_overlap.sh --quick  (the same steps on tiny shapes, e.g. on a CPU machine, to try it)
#
# 1. the connector's and the engine's GPU tests (layer events, per-layer waits)  -> $OUT/gpu_tests.log
# 2. bench_connector on Qwen3-8B and -32B: loads, now layer by layer, against a raw DMA of the
#    same bytes (compare with bench/results/h200/connector.json, whole-page loads) -> $OUT/connector_layerwise.json
# 3. bench_overlap                                                               -> $OUT/overlap.json
# Each stage runs under `timeout` (SIGTERM to its process group, the daemons it started included).
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

L3_DIR=$(mktemp -d /var/tmp/kvbench-l3.XXXXXX)
trap 'rm -rf "$L3_DIR"; [[ $QUICK == --quick ]] && rm -rf "$RESULTS"' EXIT

stage() {
    local name=$1 limit=$2; shift 2
    local left=$((END_S - SECONDS))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then echo "== $name: skipped, ${left}s left" | tee -a "$OUT/$name.log"; return; fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
    timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - START_S))s in all" | tee -a "$OUT/$name.log"
}

stage gpu_tests 120 python3 -m pytest -q -m gpu tests/integration/test_connector_gpu.py tests/bench tests/engine_client
stage connector 90 python3 -m bench.bench_connector --geometries qwen3-8b,qwen3-32b --requests 20 \
    $(name connector_layerwise)
cp "$RESULTS/connector_layerwise.json" "$OUT/" 2>/dev/null
stage overlap 300 python3 -m bench.bench_overlap --l3-dir "$L3_DIR" $(name overlap)
cp "$RESULTS/overlap.json" "$OUT/" 2>/dev/null
echo "done in $((SECONDS - START_S))s; files: $(ls "$OUT" | tr '\n' ' ')"

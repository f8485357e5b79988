#!/usr/bin/env bash
# The H200 run, in one device call of at most 10 minutes (this script ends within 9):
#
#   bash bench/gpu_run.sh          (from the repository root, with the pyzmq wheel in .whl/ carried)
#   bash bench/gpu_run.sh --quick  (the same steps on tiny shapes, e.g. on a CPU machine, to try it)
#
# 1. the GPU tests (pytest -m gpu)            -> $OUT/gpu_tests.log
# 2. bench_connector (two geometries, 20 requests) -> $OUT/connector.json, connector.log
# 3. bench_stress (tiers none, l2, l3-cold; policies always, cost) -> $OUT/stress.json, stress.log
# 4. bench_ttft, with whatever time is left   -> $OUT/ttft.json, ttft.log
# plus $OUT/env.txt (GPU, versions). Each stage runs under `timeout`, which sends SIGTERM to the
# stage's whole process group (the daemons it started included; the benchmarks stop their daemons
# on SIGTERM), then SIGKILL 15 s later. Result files are written after every row, so a stage cut
# short still leaves what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
START_S=$SECONDS
END_S=$((START_S + 525))                  # everything ends by then (9 min = 540 s)
OUT=${OUT:-/tmp/kvbench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

QUICK=${1:-}
RESULTS=$PWD/bench/results/h200
[[ $QUICK == --quick ]] && RESULTS=$(mktemp -d /tmp/kvbench-quick.XXXXXX)
# name BENCH: the arguments that send BENCH's result file to $RESULTS/BENCH.json
name() { if [[ $QUICK == --quick ]]; then echo --quick --name "$1" --machine "$RESULTS";
         else echo --name "$1" --machine h200; fi; }

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

L3_DIR=$(mktemp -d /var/tmp/kvbench-l3.XXXXXX)       # a disk (not tmpfs): L3 reads are real reads
trap 'rm -rf "$L3_DIR"; [[ $QUICK == --quick ]] && rm -rf "$RESULTS"' EXIT

{ nvidia-smi; python3 -c 'import torch, triton, transformers, zmq; print("torch", torch.__version__, "cuda",
  torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__, "zmq", zmq.__version__)'
  df -h /var/tmp /dev/shm; nproc; free -g; } >"$OUT/env.txt" 2>&1

left_s() { echo $((END_S - SECONDS)); }

# stage NAME LIMIT_S COMMAND...: run COMMAND under min(LIMIT_S, time left), log to $OUT/NAME.log
stage() {
    local name=$1 limit=$2; shift 2
    local left; left=$(left_s)
    ((limit > left)) && limit=$left
    if ((limit < 20)); then echo "== $name: skipped, ${left}s left" | tee -a "$OUT/$name.log"; return; fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
    timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - START_S))s in all" | tee -a "$OUT/$name.log"
}

stage gpu_tests 110 python3 -m pytest -q -m gpu tests
if [[ -f bench/bench_connector.py ]]; then
    stage connector 70 python3 -m bench.bench_connector --geometries qwen3-8b,qwen3-32b --requests 20 \
        $(name connector)
    cp "$RESULTS/connector.json" "$OUT/" 2>/dev/null
fi
stage stress 150 python3 -m bench.bench_stress --l3-dir "$L3_DIR" $(name stress)
cp "$RESULTS/stress.json" "$OUT/" 2>/dev/null
# bench_ttft starts no new point once its budget is spent, 50 s before its limit.
TTFT_S=$(left_s)
stage ttft "$TTFT_S" python3 -m bench.bench_ttft --l3-dir "$L3_DIR" --budget-s $((TTFT_S - 50)) $(name ttft)
cp "$RESULTS/ttft.json" "$OUT/" 2>/dev/null
echo "done in $((SECONDS - START_S))s; files: $(ls "$OUT" | tr '\n' ' ')"

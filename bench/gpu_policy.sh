#!/usr/bin/env bash
# The cost model's H200 figures, in one device call of at most 10 minutes (this script ends within 9):
#
#   bash bench/gpu_policy.sh          (from the repository root, with the pyzmq wheel in .whl/ carried)
#   bash bench/gpu_policy.sh --quick  (the same on the tiny shape, e.g. on a CPU machine, to try it)
#
# bench_ttft --policy cost: per point and tier, TTFT under the cost model from its default priors,
# and restore and recompute measured in the same run -> $OUT/policy.json, policy.log, env.txt.
# Points start while the budget lasts (the rest are listed as skipped); POINTS overrides the set.
# The policy-cost rows of stress.json come from bench/gpu_run.sh (bench_stress).
set -uo pipefail
cd "$(dirname "$0")/.."
START_S=$SECONDS
OUT=${OUT:-/tmp/kvbench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

QUICK=${1:-}
RESULTS=$PWD/bench/results/h200
NAME=(--name policy --machine h200)
POINTS=${POINTS:-"qwen3-8b=350,1000,3500,8000;qwen3-32b=3500"}
if [[ $QUICK == --quick ]]; then
    RESULTS=$(mktemp -d /tmp/kvbench-quick.XXXXXX)
    NAME=(--quick --name policy --machine "$RESULTS")
    POINTS=tiny=40,100
fi

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

L3_DIR=$(mktemp -d /var/tmp/kvbench-l3.XXXXXX)       # a disk (not tmpfs): L3 reads are real reads
trap 'rm -rf "$L3_DIR"; [[ $QUICK == --quick ]] && rm -rf "$RESULTS"' EXIT

{ nvidia-smi; df -h /var/tmp /dev/shm; nproc; free -g; } >"$OUT/env.txt" 2>&1

# The benchmark starts no new point after --budget-s; timeout stops it (and its daemons) at 525 s.
echo "== policy: points $POINTS" | tee -a "$OUT/policy.log"
timeout -k 15 525 python3 -m bench.bench_ttft --policy cost --points "$POINTS" --no-hf --l3-dir "$L3_DIR" \
    --budget-s 420 "${NAME[@]}" 2>&1 | tee -a "$OUT/policy.log"
echo "== policy: exit ${PIPESTATUS[0]} after $((SECONDS - START_S))s" | tee -a "$OUT/policy.log"
cp "$RESULTS/policy.json" "$OUT/" 2>/dev/null
echo "done in $((SECONDS - START_S))s; files: $(ls "$OUT" | tr '\n' ' ')"

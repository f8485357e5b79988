#!/usr/bin/env bash
# The H200 run: every GPU check and benchmark, in stages; one call of this script ends within 9
# minutes (a device call's limit is 10), so the whole run takes three:
#
#   bash bench/gpu_run.sh tests,connector,overlap,stress     (from the repository root, with the
#   bash bench/gpu_run.sh ttft,policy                          pyzmq wheel in .whl/ carried)
#   bash bench/gpu_run.sh engines
#   bash bench/gpu_run.sh --quick [STAGES]    (the same steps on tiny shapes, e.g. on a CPU machine)
#
# The result files record the commit of the tree (bench/common.py, git_commit). A copy of the tree
# on another machine may carry git metadata older than its files: there, run it with
# KVCACHED_BENCH_COMMIT set to the commit it was copied at (env.txt says which one was recorded).
#
# Stages (default: all of them, in this order, as far as the time goes):
#   tests      the GPU tests (pytest -m gpu; GPU_TESTS: which paths)     -> gpu_tests.log
#   connector  bench_connector: 4 geometries, tiers l2 and peer         -> connector.json (rows so far
#              after each case)
#   overlap    bench_overlap: restores under decode, layer by layer     -> overlap.json
#   stress     bench_stress: batches 1 and 4, policies always and cost, 3 rounds, with
#              --predict-off  -> stress.json
#   engines    bench_stress --engines 8: up to 8 Qwen3-4B engine processes, as many as the GPU holds -> stress_engines.json
#   ttft       bench_ttft: time to first token per tier, with whatever time is left -> ttft.json
#   policy     bench_ttft --policy cost, 16 samples: the cost model's choices -> policy.json
#   trace      trace_restore: where restored requests' TTFT goes           -> trace.log only
#   remote     bench_ttft --tiers none,l2,remote: TTFT from the remote tier (a real Mooncake Store
#              over loopback TCP, another daemon lending it the memory) against recompute and L2
#              -> remote_ttft.json. Not in the default stages: it needs .whl/ (carried) to hold the
#              store's wheel (mooncake-transfer-engine-non-cuda) beside pyzmq's (xxhash's too where
#              the machine lacks it), and the .deb files of libibverbs1 and what it loads that the
#              machine lacks (unpacked into /tmp/ib, on LD_LIBRARY_PATH for this stage only).
# Results go to bench/results/h200/ (h100/ on an H100) and to $OUT with each stage's log, plus $OUT/env.txt. Each
# stage runs under `timeout`, which sends SIGTERM to the stage's process group (the daemons it
# started included), then SIGKILL 15 s later; result files are written after every row, so a stage
# cut short still leaves what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
START_S=$SECONDS
END_S=$((START_S + ${GPU_RUN_S:-525}))   # everything ends by then (9 min = 540 s; GPU_RUN_S: less)
OUT=${OUT:-/tmp/kvbench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

QUICK=
[[ ${1:-} == --quick ]] && { QUICK=--quick; shift; }
STAGES=",${1:-tests,connector,overlap,stress,ttft,policy,engines},"
MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[12]00' | tr H h)
MACHINE=${MACHINE:-h200}                       # bench/results/MACHINE: h200 or h100, as the card is
RESULTS=$PWD/bench/results/$MACHINE
[[ -n $QUICK ]] && RESULTS=$(mktemp -d /tmp/kvbench-quick.XXXXXX)
# name BENCH: the arguments that send BENCH's result file to $RESULTS/BENCH.json
name() { if [[ -n $QUICK ]]; then echo --quick --name "$1" --machine "$RESULTS";
         else echo --name "$1" --machine "$MACHINE"; fi; }
want() { [[ $STAGES == *",$1,"* ]]; }

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

L3_DIR=$(mktemp -d /var/tmp/kvbench-l3.XXXXXX)       # a disk (not tmpfs): L3 reads are real reads
trap 'rm -rf "$L3_DIR"; [[ -n $QUICK ]] && rm -rf "$RESULTS"' EXIT

{ nvidia-smi; python3 -c 'import torch, triton, transformers, zmq; print("torch", torch.__version__, "cuda",
  torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__, "zmq", zmq.__version__)'
  df -h /var/tmp /dev/shm; nproc; free -g
  python3 -c 'from bench.common import git_commit; print("results record commit", git_commit())'; } >"$OUT/env.txt" 2>&1

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
keep() { cp "$RESULTS/$1.json" "$OUT/" 2>/dev/null; }

if want tests; then
    if [[ -n $QUICK ]]; then stage gpu_tests 110 python3 -m pytest -q -m gpu bench/tests/engine
    else stage gpu_tests 170 python3 -m pytest -q -rs -m gpu ${GPU_TESTS:-tests}; fi
fi
if want connector; then
    stage connector 420 python3 -m bench.bench_connector --tiers ${CONNECTOR_TIERS:-l2,peer} \
        --requests ${CONNECTOR_REQUESTS:-50} $(name connector)
    keep connector
fi
if want overlap; then
    stage overlap 120 python3 -m bench.bench_overlap --l3-dir "$L3_DIR" $(name overlap)
    keep overlap
fi
if want stress; then
    stage stress 480 python3 -m bench.bench_stress --l3-dir "$L3_DIR" --predict-off $(name stress)
    keep stress
fi
if want engines; then
    ENGINES=8; [[ -n $QUICK ]] && ENGINES=2
    stage engines 480 python3 -m bench.bench_stress --batches '' --engines $ENGINES $(name stress_engines)
    keep stress_engines
fi
if want ttft; then
    # bench_ttft starts no new point once its budget is spent; policy (when asked too) gets 190 s.
    TTFT_S=$(left_s); want policy && TTFT_S=$((TTFT_S - 190))
    POINTS=(); [[ -z $QUICK ]] && POINTS=(--points "${TTFT_POINTS:-qwen3-8b=350,1000,2000,3500,8000;qwen3-32b=3500;qwen3-4b=1000,3500}")
    stage ttft "$TTFT_S" python3 -m bench.bench_ttft "${POINTS[@]}" --l3-dir "$L3_DIR" --budget-s $((TTFT_S - 50)) \
        $(name ttft)
    keep ttft
fi
if want policy; then
    POLICY_S=$(left_s)
    # 16 samples a policy (their requests interleaved): a point's three medians are compared within 5%.
    POINTS=(); [[ -z $QUICK ]] && POINTS=(--points "${POLICY_POINTS:-qwen3-8b=350,3500,8000}" --samples 16)
    stage policy "$POLICY_S" python3 -m bench.bench_ttft --policy cost "${POINTS[@]}" --no-hf --l3-dir "$L3_DIR" \
        --budget-s $((POLICY_S - 60)) $(name policy)
    keep policy
fi
if want trace; then
    if [[ -n $QUICK ]]; then stage trace 60 python3 -m bench.trace_restore --quick
    else stage trace 90 python3 -m bench.trace_restore --tokens ${TRACE_TOKENS:-350,3500,8000} --repeats 2; fi
fi
if want remote; then
    (
        for deb in .whl/*.deb; do [[ -e $deb ]] && dpkg -x "$deb" /tmp/ib; done
        export LD_LIBRARY_PATH=/tmp/ib/usr/lib/x86_64-linux-gnu:/tmp/ib/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        MOONCAKE=$(python3 -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))' 2>/dev/null)
        [[ -n $MOONCAKE ]] && chmod +x "$MOONCAKE/mooncake_master"
        # What the store's binaries cannot load here (the .deb files to add to .whl/), then the import.
        { echo "== remote: preflight"; for binary in "$MOONCAKE"/store*.so "$MOONCAKE/mooncake_master"; do
              [[ -e $binary ]] && ldd "$binary" | grep 'not found' | sed "s|^|$(basename "$binary"): |"; done
          python3 -c 'import xxhash, zmq; from mooncake.store import MooncakeDistributedStore; print("store client imports")'
        } 2>&1 | tee -a "$OUT/remote.log"
        POINTS=(); [[ -z $QUICK ]] && POINTS=(--points "${REMOTE_POINTS:-qwen3-8b=1000,3500,8000}")
        REMOTE_S=$(left_s)
        stage remote "$REMOTE_S" python3 -m bench.bench_ttft --tiers none,l2,remote "${POINTS[@]}" --no-hf \
            --l3-dir "$L3_DIR" --budget-s $((REMOTE_S - 90)) $(name remote_ttft)
    )
    keep remote_ttft
fi
echo "done in $((SECONDS - START_S))s; files: $(ls "$OUT" | tr '\n' ' ')"

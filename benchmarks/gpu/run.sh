#!/usr/bin/env bash
# The GPU kit: build in place and run the GPU tests and benchmarks, most important first,
# without nox or a package registry.  See benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/run.sh                 # everything: setup tests minmax optim nccl algos net
#   bash benchmarks/gpu/run.sh setup tests     # only these steps, in this order
#   QUICK=1 bash benchmarks/gpu/run.sh bench   # the benchmarks' --quick modes
#   DEADLINE=$(( $(date +%s) + 540 )) bash benchmarks/gpu/run.sh ...   # fit a device lease:
#       each step's limit is cut to what is left before DEADLINE (epoch seconds), and a step
#       with under 20 s left is skipped (recorded in summary.txt)
#   TEST_TIMEOUT=120 ...                       # pytest's per-test limit in the tests step
#   E2E_ARGS="--latencies 50 --algorithms ddp,diloco" ...   # replaces the e2e step's own flags
#
# Steps: setup (build the Cython extensions and libnccl-net-bagua.so in place, print the
# machine), tests (every package's gpu-marked tests with BAGUA_TEST_GPU=1, so a skip is a
# failure), minmax, optim, nccl, algos, net (benchmarks/gpu/*.py), bench (the five), e2e (the
# main job with 8 emulated hosts; long).  Logs go to $OUT (the device runner's folder) or
# out/gpu/, one per step, and a summary line per step to summary.txt there: at most 8 files
# (setup tests minmax optim nccl algos net + summary), the device runner's limit.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
LOGS=${OUT:-$ROOT/out/gpu}
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
export PYTHONPATH=$ROOT/packages/bagua-comm/src:$ROOT/packages/bagua-algos/src:$ROOT/packages/bagua-optim/src:$ROOT/packages/bagua-data/src:$ROOT/packages/bagua-net/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
QUICK_FLAG=${QUICK:+--quick}
RESULTS_FLAG=${RESULTS:+--results $RESULTS}  # RESULTS=PATH: the benchmarks' runs into PATH

summary() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$LOGS/summary.txt"; }

run_step() {  # run_step NAME TIMEOUT_S CMD...: log to $LOGS/NAME.log, record status and time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if [ -n "${DEADLINE:-}" ]; then
    local left=$(( DEADLINE - $(date +%s) - 5 ))
    if [ "$left" -lt 20 ]; then summary "$name skipped: ${left}s left before DEADLINE"; return 124; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== $name: $*" | tee "$LOGS/$name.log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  summary "$name rc=$rc $((SECONDS - t0))s"
  return "$rc"
}

built() { ls packages/bagua-comm/src/bagua_comm/_nccl*.so >/dev/null 2>&1 &&
          ls packages/bagua-algos/src/bagua_algos/_engine/_hot*.so >/dev/null 2>&1 &&
          [ -f packages/bagua-net/src/bagua_net/libnccl-net-bagua.so ]; }

step_setup() {
  echo "--- machine"
  nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  $PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPU', torch.cuda.is_available() and torch.cuda.get_device_name())"
  $PY -c "import cupy; print('cupy', cupy.__version__, '| devices', cupy.cuda.runtime.getDeviceCount())" 2>&1 | tail -1
  $PY -c "import pytest, pytest_timeout, lightning; print('pytest', pytest.__version__, '| lightning', lightning.__version__)" || return 1
  echo "--- build bagua-comm and bagua-algos extensions in place (no project metadata: any setuptools)"
  $PY benchmarks/gpu/build_inplace.py || return 1
  echo "--- build libnccl-net-bagua.so in place (plain cc: no cmake needed)"
  (cd packages/bagua-net && ${CC:-cc} -std=gnu11 -O2 -fPIC -shared -fvisibility=hidden \
      -Wall -Wextra -Wl,-z,nodelete -Wl,--no-undefined -o src/bagua_net/libnccl-net-bagua.so \
      csrc/plugin.c csrc/config.c csrc/transport.c csrc/handshake.c csrc/ifaces.c csrc/log.c -lpthread) || return 1
  $PY -c "import bagua_comm._nccl_loader as L; print('libnccl', L.nccl_version(), L.nccl_library_path())"
}

step_tests() {
  local rc=0 pkg r
  for pkg in bagua-comm bagua-algos bagua-optim bagua-net; do
    # one pytest per package: each has its own conftest and helpers (_common, _helpers)
    (cd "packages/$pkg" && BAGUA_TEST_GPU=1 $PY -m pytest -m gpu -p no:cacheprovider -rA \
        --timeout="${TEST_TIMEOUT:-600}" -q tests)
    r=$?
    [ "$r" -eq 5 ] && r=0          # no gpu test collected in that package
    [ "$r" -ne 0 ] && rc=$r
    summary "  tests $pkg rc=$r"
  done
  return "$rc"
}
export -f summary step_setup step_tests
export LOGS PY

steps=${*:-setup tests minmax optim nccl algos net}
case " $steps " in
  *" setup "*) ;;
  *) built || run_step setup 600 bash -c step_setup || exit 1 ;;
esac
status=0
for s in $steps; do
  case $s in
    setup)  run_step setup 600 bash -c step_setup ;;
    tests)  run_step tests 1800 bash -c step_tests ;;
    minmax) run_step minmax 600 $PY benchmarks/gpu/minmax.py $QUICK_FLAG $RESULTS_FLAG ;;
    optim)  run_step optim 600 $PY benchmarks/gpu/optim.py $QUICK_FLAG $RESULTS_FLAG ;;
    nccl)   run_step nccl 600 $PY benchmarks/gpu/nccl_overhead.py $QUICK_FLAG $RESULTS_FLAG ;;
    algos)  run_step algos 600 $PY benchmarks/gpu/with_bagua.py $QUICK_FLAG $RESULTS_FLAG ;;
    net)    run_step net 300 $PY benchmarks/gpu/net_plugin.py ;;
    bench)  "$0" minmax optim nccl algos net ;;
    e2e)    run_step e2e 1800 $PY benchmarks/e2e/e2e.py --hosts 8 ${E2E_ARGS:-$QUICK_FLAG} \
              --json "$LOGS/e2e.json" --plot "$LOGS/e2e.png" --workdir "/tmp/e2e-work" ;;
    *) echo "unknown step $s (setup tests minmax optim nccl algos net bench e2e)"; exit 2 ;;
  esac
  r=$?; [ "$r" -ne 0 ] && status=$r
done
echo "summary ($LOGS/summary.txt):"; cat "$LOGS/summary.txt"
exit "$status"

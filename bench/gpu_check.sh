#!/usr/bin/env bash
# hetpipe on one CUDA machine, in phases of at most 8 minutes each, one command per phase (a lent GPU
# machine takes commands of 10 minutes at most, and may start bare for each one):
#
#   bash bench/gpu_check.sh wheels         # here, where PyPI is reachable: what the GPU machine may lack, into .whl/
#   bash bench/gpu_check.sh probe          # GPU, first: link speeds and pinning (bench/gpu_probe.py): host<->device
#                                          #   copies from pinned and pageable memory, both directions at once,
#                                          #   whether a stage-sized pool is page-locked, MPI point-to-point
#   bash bench/gpu_check.sh tests          # GPU: tests/gpu with HETPIPE_REQUIRE_GPU=1 (a skip fails)
#   bash bench/gpu_check.sh bench-tied     # GPU: bench/gpu_runtime.py, GPT-2 with its tied head, D = 0 and 1
#   bash bench/gpu_check.sh bench-untied   # GPU: the same with an untied head
#
# Probe first: its figures say whether the later ones can be trusted (a pageable pool, a slow link).
# A benchmark phase runs plain PyTorch, then hetpipe at D = 0, then D = 1, as its time allows; one that
# runs out records the rest as skipped, and BENCH_ARGS="--d 1" gives a D a phase of its own.
# Every GPU phase runs setup first and is bounded by PHASE_LIMIT seconds (default 480) in all, setup
# included: the phase's work is stopped at what setup left of it, and the benchmark starts no run it
# cannot finish within that. Every phase writes as it goes: each probe figure, each test's outcome and
# each benchmark run lands in $OUT the moment it is known, so a phase stopped early leaves what finished.
#
# Setup: the GPU machine is assumed offline, with python3, torch (CUDA), nvcc, CMake, ninja and pybind11.
# It makes a virtual environment over that Python's packages (whose torch it uses), installs into it from
# .whl/ (no index) only what is missing or broken there: pytest (with pluggy and iniconfig) when it does
# not import, mpich + mpi4py when `mpiexec -n 2` with mpi4py does not start, transformers when it does
# not import or is not the pinned version (else the one there, named in env.txt), then builds hetpipe
# with CUDA. transformers must import: the benchmark's model is Hugging Face's GPT-2.
# HETPIPE_REQUIRE_PINNED=1 holds for every phase: a CUDA stage whose pool is pageable fails.
#
# Dry run (GPU_CHECK_DEVICE=cpu): every phase on this machine's Python as it is, with hetpipe importable
# from the environment (PYTHONPATH): no virtual environment, no install, no build, no CUDA check; the
# probe and the benchmark run their CPU smoke sizes. It checks the script, not a GPU.
#
# Environment: OUT (results, default out/gpu-check), PHASE_LIMIT (seconds per phase, default 480),
# HETPIPE_WHEELS (default .whl), HETPIPE_GPU_VENV (default /tmp/hetpipe-gpu-venv), PYTHON (default
# python3), CUDA_ARCH (CMAKE_CUDA_ARCHITECTURES, default 90), GPU_CHECK_DEVICE (cuda or cpu), BENCH_ARGS
# (more bench/gpu_runtime.py options).
# Files in $OUT (at most 7 per phase): summary.txt (one line per phase as it ends), setup.log, env.txt, and
# the phase's folder: probe/{probe.jsonl,probe.txt,probe.log}, tests/{tests-gpu.log,tests-gpu.xml},
# bench-tied/ and bench-untied/{gpu_runtime.json,gpu_runtime.txt,bench.log}.
set -uo pipefail
START=$SECONDS
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-out/gpu-check}
WHEELS=${HETPIPE_WHEELS:-.whl}
VENV=${HETPIPE_GPU_VENV:-/tmp/hetpipe-gpu-venv}
PYTHON=${PYTHON:-python3}
CUDA_ARCH=${CUDA_ARCH:-90}
PHASE_LIMIT=${PHASE_LIMIT:-480}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
# The versions hetpipe pins (requirements.txt), for the GPU machine's Python (3.12 there), and pytest's.
PINNED="mpich==5.0.2 mpi4py==4.1.2 transformers==5.23.0"
TEST_WHEELS="pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1"
WHEELS_PY=${WHEELS_PY:-3.12}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export HETPIPE_REQUIRE_PINNED=1
case "$DEVICE" in
    cuda) PY="$VENV/bin/python" ;;
    cpu) PY=$(command -v "$PYTHON") ;;
    *) echo "gpu_check: GPU_CHECK_DEVICE must be cuda or cpu, not '$DEVICE'" >&2; exit 2 ;;
esac

say() { echo "gpu_check: $*" | tee -a "$OUT/setup.log" >&2; }
fail() {
    say "FAILED: $*"
    echo "${phase:-gpu_check}: FAILED in $((SECONDS - START)) s: $*" >>"$OUT/summary.txt"
    exit 1
}
left() { echo $((PHASE_LIMIT - (SECONDS - START))); }   # seconds this phase has left

wheels() {
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$WHEELS_PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" $PINNED $TEST_WHEELS \
        || fail "pip download of $PINNED $TEST_WHEELS"
    ls -la "$WHEELS"
}

mpi_works() {
    # An MPI job of two ranks through the mpiexec the tests use (beside the Python, else on PATH).
    local mpiexec
    mpiexec="$(dirname "$PY")/mpiexec"
    [ -x "$mpiexec" ] || mpiexec=$(command -v mpiexec || true)
    [ -n "$mpiexec" ] || return 1
    timeout 120 "$mpiexec" -n 2 "$PY" -c "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 2" \
        >>"$OUT/setup.log" 2>&1
}

install_wheel() {  # install_wheel NAME: the pinned wheel NAME from $WHEELS into the venv
    local files=("$WHEELS"/"$1"-*.whl)
    [ -e "${files[0]}" ] || fail "no $1 wheel in $WHEELS (run 'bash bench/gpu_check.sh wheels' where PyPI is reachable)"
    "$PY" -m pip install -q --no-index --no-deps --ignore-installed "${files[@]}" >>"$OUT/setup.log" 2>&1 \
        || fail "installing ${files[*]}"
}

setup() {
    : >>"$OUT/setup.log"
    if [ "$DEVICE" = cuda ]; then
        if [ ! -x "$PY" ]; then
            # A venv over $PYTHON's own site-packages (a .pth file; --system-site-packages would reach the
            # base interpreter's instead when $PYTHON is itself a venv), its packages shadowed by ours.
            say "virtual environment $VENV over the packages of $PYTHON ($($PYTHON --version 2>&1))"
            "$PYTHON" -m venv --without-pip "$VENV" >>"$OUT/setup.log" 2>&1 || fail "$PYTHON -m venv"
            "$PYTHON" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
                >"$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/hetpipe-base.pth" \
                || fail "linking $VENV to the packages of $PYTHON"
        fi
        "$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'" >>"$OUT/setup.log" 2>&1 \
            || fail "this Python's torch has no usable CUDA device (see $OUT/setup.log)"
        if ! "$PY" -c "import pytest" >>"$OUT/setup.log" 2>&1; then
            say "pytest does not import: installing pytest, pluggy and iniconfig from $WHEELS"
            install_wheel pytest
            install_wheel pluggy
            install_wheel iniconfig
        fi
        if ! mpi_works; then
            say "no working MPI for this Python: installing mpich and mpi4py from $WHEELS"
            install_wheel mpich
            install_wheel mpi4py
            mpi_works || fail "mpiexec -n 2 with mpi4py still fails (see $OUT/setup.log)"
        fi
        local want=${PINNED##*transformers==}
        if [ "$("$PY" -c 'import transformers; print(transformers.__version__)' 2>/dev/null)" != "$want" ]; then
            if compgen -G "$WHEELS/transformers-$want-*.whl" >/dev/null; then
                say "transformers $want from $WHEELS"
                install_wheel "transformers-$want"
            else
                say "transformers $want not in $WHEELS: using the one there, if it imports"
            fi
        fi
    fi
    "$PY" -c "import transformers" >>"$OUT/setup.log" 2>&1 \
        || fail "transformers does not import (see $OUT/setup.log): the benchmark's GPT-2 needs it"
    "$PY" -c "import pytest" >>"$OUT/setup.log" 2>&1 || fail "pytest does not import (see $OUT/setup.log)"
    if [ "$DEVICE" = cuda ]; then
        if ! "$PY" -c "import hetpipe_core, sys; b = hetpipe_core.build_info(); sys.exit(0 if b['cuda_built'] else 1)" 2>/dev/null; then
            say "building hetpipe with CUDA (CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH)"
            CMAKE_ARGS="-DHETPIPE_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
                "$PY" -m pip install --no-index --no-deps --no-build-isolation -e "$ROOT" >>"$OUT/setup.log" 2>&1 \
                || fail "building hetpipe (see $OUT/setup.log)"
        fi
        "$PY" -c "import hetpipe_core, sys; b = hetpipe_core.build_info(); print(b); sys.exit(0 if b['cuda_available'] else 1)" \
            >>"$OUT/setup.log" 2>&1 || fail "hetpipe_core built without a usable CUDA device (see $OUT/setup.log)"
    fi
    {
        date -u
        [ "$DEVICE" = cuda ] && { nvidia-smi 2>&1 || true; }
        "$PY" - <<'EOF'
import platform, torch, transformers, pytest, hetpipe_core
try:
    import mpi4py
    from mpi4py import MPI
    mpi = f"mpi4py {mpi4py.__version__} | {MPI.Get_library_version().splitlines()[0]}"
except Exception as e:  # noqa: BLE001 - recorded, the phases that need MPI say so themselves
    mpi = f"no MPI ({e})"
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| transformers", transformers.__version__, "| pytest", pytest.__version__, "|", mpi)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (dry run)",
      "| hetpipe_core", hetpipe_core.build_info())
EOF
    } >"$OUT/env.txt" 2>&1
    say "ready after $((SECONDS - START)) s: $(tail -1 "$OUT/env.txt")"
}

bounded() {  # bounded CMD...: CMD with what is left of the phase (TERM, then KILL 15 s later)
    local t
    t=$(left)
    [ "$t" -gt 20 ] || { say "no time left in this phase's $PHASE_LIMIT s for: $*"; return 124; }
    timeout --signal=TERM --kill-after=15 "$((t - 15))" "$@"
}

probe() {
    mkdir -p "$OUT/probe"
    local args=(--out "$OUT/probe")
    [ "$DEVICE" = cpu ] && args=(--device cpu --sizes 1,4 --pool-mib 16 --out "$OUT/probe")
    say "bench/gpu_probe.py ${args[*]}"
    PYTHONUNBUFFERED=1 bounded "$PY" bench/gpu_probe.py "${args[@]}" 2>&1 | tee "$OUT/probe/probe.log"
    return "${PIPESTATUS[0]}"
}

tests() {
    mkdir -p "$OUT/tests"
    local require=1 limit=()
    [ "$DEVICE" = cpu ] && require=0
    # A hung test fails after 240 s instead of holding up the rest of the phase (where pytest-timeout is installed).
    "$PY" -c "import pytest_timeout" 2>/dev/null && limit=(--timeout 240)
    say "tests/gpu with HETPIPE_REQUIRE_GPU=$require"
    # -v: each test's outcome is a line of the log the moment it ends.
    HETPIPE_REQUIRE_GPU=$require PYTHONUNBUFFERED=1 bounded "$PY" -m pytest tests/gpu -v -rA -p no:cacheprovider \
        "${limit[@]}" --junitxml="$OUT/tests/tests-gpu.xml" 2>&1 | tee "$OUT/tests/tests-gpu.log"
    return "${PIPESTATUS[0]}"
}

bench() {  # bench tied|untied
    local dir="$OUT/bench-$1" t
    mkdir -p "$dir"
    t=$(left)
    # The benchmark stops starting runs 40 s before the phase ends, so that it writes its results itself.
    local args="--head $1 --budget $((t - 40)) --timeout 300 ${BENCH_ARGS:-}"
    [ "$DEVICE" = cpu ] && args="--device cpu --tiny --d 0 $args"
    say "bench/gpu_runtime.py $args"
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 bounded "$PY" bench/gpu_runtime.py --out "$dir" $args 2>&1 | tee "$dir/bench.log"
    return "${PIPESTATUS[0]}"
}

[ $# -eq 1 ] || { echo "usage: bash bench/gpu_check.sh wheels|probe|tests|bench-tied|bench-untied (one phase per command)" >&2; exit 2; }
phase=$1
case "$phase" in
    wheels) wheels; exit $? ;;
    probe | tests | bench-tied | bench-untied) ;;
    *) fail "unknown phase '$phase' (wheels, probe, tests, bench-tied, bench-untied)" ;;
esac
setup
case "$phase" in
    probe) probe ;;
    tests) tests ;;
    bench-tied) bench tied ;;
    bench-untied) bench untied ;;
esac
status=$?
echo "$phase: $([ $status -eq 0 ] && echo ok || echo "FAILED (exit $status)") in $((SECONDS - START)) s of $PHASE_LIMIT ($DEVICE)" \
    | tee -a "$OUT/summary.txt"
exit $status

#!/usr/bin/env bash
# Everything a run on a CUDA machine needs, in phases: build the CUDA core, run tests/gpu with
# HETPIPE_REQUIRE_GPU=1, run bench/gpu_runtime.py; every log and result lands in $OUT.
#
#   bash bench/gpu_check.sh wheels          # on a machine with PyPI: fetch the wheels into .whl/
#   bash bench/gpu_check.sh setup tests     # on the GPU machine: build, then tests/gpu
#   bash bench/gpu_check.sh bench           # on the GPU machine: the benchmark
#   bash bench/gpu_check.sh all             # setup, tests and bench in one go
#
# The GPU machine is assumed offline, with python3, torch (CUDA), nvcc, CMake, ninja and pybind11
# installed: setup makes a virtual environment on top of that Python (whose torch it uses) and
# installs into it, from .whl/ and without an index, what that Python lacks or
# what hetpipe pins: mpich + mpi4py (unless the system's mpi4py already starts an MPI job) and
# transformers. Every phase runs setup first; it is quick once the environment is built, so phases
# may run as separate commands on a machine that keeps /tmp between them.
#
# Environment: OUT (results folder, default out/gpu-check), HETPIPE_WHEELS (default .whl),
# HETPIPE_GPU_VENV (default /tmp/hetpipe-gpu-venv), PYTHON (default python3),
# CUDA_ARCH (CMAKE_CUDA_ARCHITECTURES, default 90), BENCH_ARGS (extra bench/gpu_runtime.py options).
# Files written to $OUT (at most 7): env.txt setup.log tests-gpu.log tests-gpu.xml bench.log
# gpu_runtime.json gpu_runtime.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-out/gpu-check}
WHEELS=${HETPIPE_WHEELS:-.whl}
VENV=${HETPIPE_GPU_VENV:-/tmp/hetpipe-gpu-venv}
PYTHON=${PYTHON:-python3}
CUDA_ARCH=${CUDA_ARCH:-90}
# The versions hetpipe pins (requirements.txt), for the GPU machine's Python (3.12 there).
PINNED="mpich==5.0.2 mpi4py==4.1.2 transformers==5.23.0"
WHEELS_PY=${WHEELS_PY:-3.12}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY="$VENV/bin/python"

say() { echo "gpu_check: $*" | tee -a "$OUT/setup.log" >&2; }
fail() { say "FAILED: $*"; exit 1; }

wheels() {
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$WHEELS_PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" $PINNED \
        || fail "pip download of $PINNED"
    ls -la "$WHEELS"
}

mpi_works() {
    # An MPI job of two ranks through the mpiexec the tests use (beside the Python, else on PATH).
    local mpiexec="$VENV/bin/mpiexec"
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
            say "transformers $want not in $WHEELS: using $("$PY" -c 'import transformers; print(transformers.__version__)' 2>&1)"
        fi
    fi
    if ! "$PY" -c "import hetpipe_core, sys; b = hetpipe_core.build_info(); sys.exit(0 if b['cuda_built'] else 1)" 2>/dev/null; then
        say "building hetpipe with CUDA (CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH)"
        CMAKE_ARGS="-DHETPIPE_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH" \
            "$PY" -m pip install --no-index --no-deps --no-build-isolation -e "$ROOT" >>"$OUT/setup.log" 2>&1 \
            || fail "building hetpipe (see $OUT/setup.log)"
    fi
    "$PY" -c "import hetpipe_core, sys; b = hetpipe_core.build_info(); print(b); sys.exit(0 if b['cuda_available'] else 1)" \
        >>"$OUT/setup.log" 2>&1 || fail "hetpipe_core built without a usable CUDA device (see $OUT/setup.log)"
    {
        date -u
        nvidia-smi 2>&1 || true
        "$PY" - <<'EOF'
import platform, torch, transformers, mpi4py, hetpipe_core
from mpi4py import MPI
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| transformers", transformers.__version__, "| mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0])
print("device", torch.cuda.get_device_name(0), "| hetpipe_core", hetpipe_core.build_info())
EOF
    } >"$OUT/env.txt" 2>&1
    say "ready: $(tail -1 "$OUT/env.txt")"
}

tests() {
    say "tests/gpu with HETPIPE_REQUIRE_GPU=1"
    # A hung test fails after 240 s instead of holding up the rest of the run (where pytest-timeout is installed).
    local limit=()
    "$PY" -c "import pytest_timeout" 2>/dev/null && limit=(--timeout 240)
    HETPIPE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 "$PY" -m pytest tests/gpu -q -rA -p no:cacheprovider "${limit[@]}" \
        --junitxml="$OUT/tests-gpu.xml" 2>&1 | tee "$OUT/tests-gpu.log"
    return "${PIPESTATUS[0]}"
}

bench() {
    # Each child (plain PyTorch, each hetpipe run) is stopped after 240 s, so one hang does not stop the rest.
    local args=${BENCH_ARGS:---head both --timeout 240}
    say "bench/gpu_runtime.py $args"
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 "$PY" bench/gpu_runtime.py --out "$OUT" $args 2>&1 | tee "$OUT/bench.log"
    return "${PIPESTATUS[0]}"
}

[ $# -gt 0 ] || set -- all
status=0
for phase in "$@"; do
    case "$phase" in
        wheels) wheels ;;
        setup) setup ;;
        tests) setup && tests || status=1 ;;
        bench) setup && bench || status=1 ;;
        all) setup && { tests || status=1; bench || status=1; } ;;
        *) fail "unknown phase '$phase' (wheels, setup, tests, bench, all)" ;;
    esac
done
exit $status

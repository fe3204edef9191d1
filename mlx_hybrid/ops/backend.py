"""Where an op computes: the GPU's kernels, our CPU kernels or MLX's ops, decided here for every op
of the package (`ops` and its products ask these, nothing else asks the device)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache

import mlx.core as mx

from . import cpu_extension, selfcheck

_DIFFERENTIABLE = ContextVar("mlx_hybrid_differentiable", default=False)


@contextmanager
def differentiable():
    """Inside this block every op takes its pure-MLX form, which MLX differentiates (mx.grad,
    nn.value_and_grad, and mx.compile tracing them): our CPU and GPU kernels have no backward pass.
    Build the graph to differentiate inside it: call the gradient function there (a compiled
    training step, on its first call)."""
    token = _DIFFERENTIABLE.set(True)
    try:
        yield
    finally:
        _DIFFERENTIABLE.reset(token)


# MLX_HYBRID_FORCE_REFERENCE=1 is a setting of the process, read once when the package loads (as MLX
# reads MLX_ENABLE_TF32): a path decided once (`path_key`) stays right
forced_by_environment = os.environ.get("MLX_HYBRID_FORCE_REFERENCE", "") not in ("", "0")


def force_reference() -> bool:
    """The pure-MLX ops for every call: MLX_HYBRID_FORCE_REFERENCE=1, or inside `differentiable()`."""
    return forced_by_environment or _DIFFERENTIABLE.get()


def path_key() -> tuple:
    """What an op's compute path depends on besides its arguments: the GPU kernels' platform (first),
    the device that computes and whether the pure-MLX ops are forced. A path decided once for a key
    stays right for it."""
    return kernel_platform(), gpu_computes(), forced_by_environment or _DIFFERENTIABLE.get()


@lru_cache(maxsize=None)
def gpu_platform() -> str | None:
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def kernel_platform() -> str | None:
    """'metal' or 'cuda' when custom kernels run the linear-attention ops, else None: also where
    the process made the CPU its default device on a machine with a GPU."""
    return None if force_reference() or not gpu_computes() else gpu_platform()


def backend_name() -> str:
    """Which implementation runs the linear-attention ops in this process."""
    platform = kernel_platform()
    if platform:
        return f"{platform} kernels"
    if cpu_kernels_built():
        return "cpu kernels"
    return "mlx-reference"


# The device `mx.gpu` names; compared as a Device, which is four times quicker than with the device
# type (asked several times for every op of a pass)
_GPU = mx.Device(mx.gpu)


def gpu_computes() -> bool:
    return mx.default_device() == _GPU


def default_dtype():
    """float32 where the CPU computes, bfloat16 on a GPU."""
    return mx.bfloat16 if gpu_computes() else mx.float32


def cpu_kernels_built() -> bool:
    """Whether the CPU computes, with our CPU kernels allowed and built."""
    return not gpu_computes() and not force_reference() and cpu_extension.extension() is not None


def cpu_kernel_passed(spec, small_case, *variant) -> bool:
    """Whether our CPU kernel `spec` computes this variant (else MLX's ops)."""
    return cpu_kernels_built() and selfcheck.passed(spec, small_case, "cpu", *variant)

"""The CPU kernels take views as they come (a transpose, a stepped or offset slice, a broadcast)
and copy them row-contiguous themselves: each kernel gives a view the bits it gives the view's
contiguous copy made by MLX before the call."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import cpu_kernel_tests

from mlx_hybrid.ops import cpu_extension, cpu_quantized, llama_reference, reference
from test_cpu_conv1d import conv_inputs
from test_ops import layer_inputs, make_inputs

pytestmark = cpu_kernel_tests()

# each: a view of a's shape ([B >= 2, T >= 2, ..., D]) whose strides are not its row-contiguous
# ones (an offset slice starts mid-buffer, a broadcast repeats the first row, a reversed one
# reads its last axis backwards)
VIEWS = {
    "transpose": lambda a: mx.contiguous(a.swapaxes(0, 1)).swapaxes(0, 1),
    "stepped slice": lambda a: mx.repeat(a, 2, axis=-1)[..., ::2],
    "offset slice": lambda a: mx.concatenate([a, a], axis=-1)[..., a.shape[-1] :],
    "broadcast": lambda a: mx.broadcast_to(a[:1], a.shape),
    "reversed": lambda a: a[..., ::-1],
}


def assert_views_read_as_copies(kernel, inputs, which):
    """kernel(*inputs) with input `which` replaced by each view, against its contiguous copy."""
    for name, view in VIEWS.items():
        viewed = view(inputs[which])
        got, want = (kernel(*inputs[:which], x, *inputs[which + 1 :]) for x in (viewed, mx.contiguous(viewed)))
        for a, b in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]):
            assert mx.array_equal(a, b).item(), name


def random(shape, seed):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("kind", ["rms", "l2"])
def test_norms(kind):
    module = cpu_extension.extension()
    x, weight = random((2, 3, 4, 40), 0), random((40,), 1)
    if kind == "rms":
        assert_views_read_as_copies(lambda a, w: module.rms_norm(a, w, 1e-6), [x, weight], 0)
    else:
        assert_views_read_as_copies(lambda a: module.l2_normalize(a, 1e-6), [x], 0)


@pytest.mark.parametrize("which", range(6))  # q, k, v, g, beta, the state
def test_gated_delta_rule(which):
    inputs = [mx.array(x) for x in make_inputs(2, 3, 2, 4, 16, 24, True, seed=which)]
    module = cpu_extension.extension()
    assert_views_read_as_copies(lambda *a: module.gated_delta(*a, True), inputs, which)


@pytest.mark.parametrize("which", [0, 2])  # x, the tail
def test_conv(which):
    inputs = [mx.array(x) for x in conv_inputs(2, 5, 40, 4, seed=which)]
    module = cpu_extension.extension()
    assert_views_read_as_copies(lambda *a: module.conv1d_silu(*a, True), inputs, which)


@pytest.mark.parametrize("which", [0, 2, 3, 4, 7, 9])  # x, the tail, a, b, the gate, the state
def test_linear_attention(which):
    heads = reference.HeadShape(2, 4, 16, 24)
    inputs = [mx.array(x) for x in layer_inputs(2, 3, heads, 4, True, seed=which)]
    module = cpu_extension.extension()
    assert_views_read_as_copies(
        lambda *a: module.linear_attention(*a, heads.key_heads, 0.25, 1e-6, 1e-6, False, True), inputs, which
    )


@pytest.mark.parametrize("which", range(2))  # x, y
def test_add_rms_norm(which):
    inputs = [random((2, 3, 4, 40), 0), random((2, 3, 4, 40), 1), random((40,), 2)]
    module = cpu_extension.extension()
    assert_views_read_as_copies(lambda *a: module.add_rms_norm(*a, 1e-6), inputs, which)


@pytest.mark.parametrize("which", range(2))  # x, the gate
def test_gated_product(which):
    inputs = [random((2, 3, 40), 0), random((2, 3, 40), 1)]
    module = cpu_extension.extension()
    assert_views_read_as_copies(lambda *a: module.gated_product(*a, False), inputs, which)


def test_rope():
    c, s = random((3, 24), 1), random((3, 24), 2)
    module = cpu_extension.extension()
    assert_views_read_as_copies(lambda x: module.rope(x, c, s, 16), [random((2, 4, 3, 24), 0)], 0)


@pytest.mark.parametrize("which", range(3))  # q, k, v
def test_attention(which):
    inputs = [random(shape, which) for shape in [(2, 4, 3, 24), (2, 2, 9, 24), (2, 2, 9, 16)]]
    module = cpu_extension.extension()
    assert_views_read_as_copies(lambda *a: module.attention(*a, 0.2, True), inputs, which)


@pytest.mark.parametrize("rows", [1, 3, 9])  # the small-row path and the tiled one
def test_quantized_product(rows):
    w, scales, biases = llama_reference.random_weights((48, 128), 4, 64, seed=rows)
    x = random((2, rows, 128), rows)

    def product(a):
        return cpu_quantized.quantized_matmul(a, w, scales, biases, 64, 4)

    assert_views_read_as_copies(product, [x], 0)

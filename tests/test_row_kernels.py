"""The row-invariant kernels (metal/row_product.metal, metal/row_attention.metal) through the g++
emulation, and on the GPU where one computes (the same launches): every row (query token) bit-equal
whatever rows come with it, and each within its dtype's rounding of a float64 reference.

The GPU's decode steps and verify passes take these kernels, so a verify pass gives each token its
decode step's bits and a batch row its sequence alone (test_row_kernel_models.py runs the models on
them). Widths: the inputs of Qwen3.5-0.8B (hidden 1024, feed-forward 3584, heads of 256) and
Qwen3.5-35B-A3B (hidden 2048, experts of 512); a few output columns each (columns are independent
simdgroups; a row's sum runs over the input width).
"""

import itertools
import shutil

import mlx.core as mx
import numpy as np
import pytest

from emulation import emulate
from mlx_hybrid import ops
from mlx_hybrid.ops import gpu_kernels, row_kernels
from mlx_hybrid.ops.reference import QuantizedEntries

# the emulation everywhere; the GPU's own runner too where one computes (the same launches)
PLATFORMS = ["emulated"] + ([ops.kernel_platform()] if ops.kernel_platform() else [])


@pytest.fixture(params=PLATFORMS)
def platform(request):
    if request.param == "emulated" and shutil.which("g++") is None:
        pytest.skip("needs g++ for the emulation")
    return request.param


ROW_COUNTS = (1, 2, 4, 8, 16)
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
# One rounding of a float32 sum to the dtype: half a step of its precision, relative
HALF_STEP = {mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11, mx.float32: 2.0**-24}
FLOAT32_EPS = 2.0**-23


def launched(platform, spec, launch, strided=False) -> np.ndarray:
    """The launch's output as float32 numpy (strided: the emulation's inputs laid in larger buffers)."""
    if platform == "emulated":
        return emulate(spec, launch, strided=strided)[0][0]
    return np.array(gpu_kernels.run(spec, launch, platform)[0].astype(mx.float32))


def random(rng, shape, dtype, scale=1.0) -> mx.array:
    return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def float64(a) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def assert_within_rounding(got, exact, magnitude, terms: int, dtype):
    """got (the kernel's, rounded to dtype) against the float64 value `exact`: one rounding to the
    dtype, plus float32 accumulation of `terms` products whose absolute values sum to `magnitude`
    (at most terms * eps of it: the textbook bound of a sum in order)."""
    allowed = HALF_STEP[dtype] * np.abs(exact) + terms * FLOAT32_EPS * magnitude + 1e-30
    assert (np.abs(got - exact) <= allowed).all(), np.max(np.abs(got - exact) - allowed)


def decoded(codes, scales, biases, group_size, bits) -> np.ndarray:
    """MLX's affine codes the slow obvious way: code of element i at bits i*b.. of word i*b/32."""
    words = np.array(codes).astype(np.uint64)
    count = words.shape[-1] * 32 // bits
    index = np.arange(count)
    values = (words[..., index * bits // 32] >> ((index * bits) % 32).astype(np.uint64)) & ((1 << bits) - 1)
    expand = np.repeat(np.arange(count // group_size), group_size)
    return values * float64(scales)[..., expand] + float64(biases)[..., expand]


def product_case(rng, K, N, dtype, weights, group_size=64, experts=0):
    """Random x rows (16 of them, or 16 tokens' choices), the stored matrix and its float64 values."""
    E = max(experts, 1)
    matrices = random(rng, (E, N, K), mx.float32, K**-0.5)
    if isinstance(weights, int):
        codes, scales, biases = mx.quantize(matrices.astype(dtype), group_size=group_size, bits=weights)
        stored = dict(w=codes, scales=scales, biases=biases, bits=weights, group_size=group_size)
        exact = decoded(codes, scales, biases, group_size, weights)
    else:
        stored = dict(w=matrices.astype(weights))
        exact = float64(stored["w"])
    if not experts:
        stored = {name: value[0] if isinstance(value, mx.array) else value for name, value in stored.items()}
        exact = exact[0]
    return stored, exact


def run_product(platform, x, stored, indices=None):
    quantized = {name: stored[name] for name in ("scales", "biases") if name in stored}
    launch = row_kernels.product_launch(
        x, stored["w"], indices=indices, bits=stored.get("bits", 0), group_size=stored.get("group_size", 0), **quantized
    )
    return launched(platform, row_kernels.ROW_PRODUCT, launch)


WIDTHS = {"0.8B hidden": 1024, "0.8B feed-forward": 3584, "35B-A3B hidden": 2048, "35B-A3B expert": 512}
WEIGHTS = {"same dtype": None, "bfloat16": mx.bfloat16, "4-bit": 4, "8-bit": 8}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("width", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize("weights", WEIGHTS.values(), ids=WEIGHTS.keys())
def test_product_rows_are_bit_equal_for_every_row_count(platform, dtype, width, weights):
    """Each of 16 rows alone, then 2, 4, 8 and 16 at once: every row the same bits, each within one
    rounding of the float64 product."""
    rng = np.random.default_rng(width)
    stored, exact = product_case(rng, width, 20, dtype, dtype if weights is None else weights)
    x = random(rng, (16, width), dtype)
    alone = np.concatenate([run_product(platform, x[r : r + 1], stored) for r in range(16)])
    for rows in ROW_COUNTS[1:]:
        np.testing.assert_array_equal(run_product(platform, x[:rows], stored), alone[:rows], err_msg=f"{rows} rows")
    wide = float64(x)
    assert_within_rounding(alone, wide @ exact.T, np.abs(wide) @ np.abs(exact).T, width, dtype)


@pytest.mark.parametrize("bits,group_size", list(itertools.product((4, 8), (32, 64, 128))))
def test_quantized_products_in_every_group_size(platform, bits, group_size):
    rng = np.random.default_rng(bits * group_size)
    stored, exact = product_case(rng, 1024, 9, mx.bfloat16, bits, group_size)
    x = random(rng, (5, 1024), mx.bfloat16)
    together = run_product(platform, x, stored)
    alone = np.concatenate([run_product(platform, x[r : r + 1], stored) for r in range(5)])
    np.testing.assert_array_equal(together, alone)
    wide = float64(x)
    assert_within_rounding(together, wide @ exact.T, np.abs(wide) @ np.abs(exact).T, 1024, mx.bfloat16)


@pytest.mark.parametrize("weights", [mx.bfloat16, 4, 8], ids=["bfloat16", "4-bit", "8-bit"])
@pytest.mark.parametrize("share", [8, 1], ids=["a token's row for its 8 choices", "a row a choice"])
def test_expert_products_gather_each_rows_matrix(platform, weights, share):
    """35B-A3B's experts (2048 inputs, 8 chosen a token) of 16 tokens: the chosen matrices' products,
    each token's rows the bits of that token alone."""
    rng = np.random.default_rng(share)
    tokens, k, E = 16, 8, 10
    stored, exact = product_case(rng, 2048, 6, mx.bfloat16, weights, 64, experts=E)
    indices = mx.array(rng.integers(0, E, (tokens, k)), mx.uint32)  # as the router's argpartition gives them
    x = random(rng, (tokens, 1 if share > 1 else k, 1, 2048), mx.bfloat16)
    got = run_product(platform, x, stored, indices)[:, :, 0]  # [tokens, k, N]
    for t in (0, 7, 15):
        alone = run_product(platform, x[t : t + 1], stored, indices[t : t + 1])
        np.testing.assert_array_equal(got[t], alone[0, :, 0])
    rows = float64(x)
    chosen = exact[np.array(indices)]  # [tokens, k, N, K]
    want = (rows @ chosen.swapaxes(-1, -2))[:, :, 0]
    magnitude = (np.abs(rows) @ np.abs(chosen).swapaxes(-1, -2))[:, :, 0]
    assert_within_rounding(got, want, magnitude, 2048, mx.bfloat16)


def test_product_of_a_view_is_the_product_of_its_values(platform):
    """x a strided view (every other feature of a wider array): the launch reads its values."""
    rng = np.random.default_rng(1)
    stored, _ = product_case(rng, 512, 8, mx.bfloat16, 4)
    wide = random(rng, (3, 1024), mx.bfloat16)
    view, copy = wide[:, ::2], mx.contiguous(wide[:, ::2])
    np.testing.assert_array_equal(run_product(platform, view, stored), run_product(platform, copy, stored))


def attention_float64(q, k, v, scale, lengths, causal):
    """Softmax attention in float64, the slow obvious way: token t of row b over its visible keys."""
    B, H, T, _ = q.shape
    group = H // k.shape[1]
    out = np.zeros((B, H, T, v.shape[-1]))
    for b, h, t in itertools.product(range(B), range(H), range(T)):
        seen = lengths[b] - (T - 1 - t if causal else 0)
        scores = k[b, h // group, :seen] @ q[b, h, t] * scale
        weights = np.exp(scores - scores.max())
        out[b, h, t] = weights @ v[b, h // group, :seen] / weights.sum()
    return out


def attention_case(rng, dtype, bits, group_size, dims=(256, 256), heads=(8, 2), keys=40, rows=2):
    Dk, Dv = dims
    k, v = (random(rng, (rows, heads[1], keys, d), dtype) for d in (Dk, Dv))
    if not bits:
        return k, v, float64(k), float64(v)
    held = [QuantizedEntries(*mx.quantize(a, group_size=group_size, bits=bits), bits, group_size) for a in (k, v)]
    return (*held, *(decoded(*a.arrays, group_size, bits) for a in held))


def run_attention(platform, q, k, v, lengths, causal, strided=True):
    launch = row_kernels.attention_launch(q, k, v, 256**-0.5, causal, mx.array(lengths, mx.int32))
    return launched(platform, row_kernels.ROW_ATTENTION, launch, strided)


KV_FORMS = {
    "float": (0, 0),
    "4-bit groups of 32": (4, 32),
    "4-bit groups of 64": (4, 64),
    "4-bit groups of 128": (4, 128),
    "8-bit groups of 64": (8, 64),
    "8-bit groups of 128": (8, 128),
}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("form", KV_FORMS.values(), ids=KV_FORMS.keys())
def test_verify_pass_attention_gives_each_token_its_decode_steps_bits(platform, dtype, form):
    """0.8B's attention (8 heads over 2, heads of 256) over a cache held as views (strided): a pass of
    16 tokens (causal), and of 2, 4 and 8, gives token t the bits of the decode step that sees keys up
    to it; two batch rows of different lengths each the bits of the row alone; all within one
    rounding of float64 attention (softmax sums of at most 40 terms in float32)."""
    rng = np.random.default_rng(sum(form))
    k, v, k64, v64 = attention_case(rng, dtype, *form)
    q = random(rng, (2, 8, 16, 256), dtype)
    lengths = [40, 27]
    together = run_attention(platform, q, k, v, lengths, causal=True)
    for tokens in (2, 4, 8):  # the pass's last `tokens` alone, over the same cache
        last = run_attention(platform, q[:, :, 16 - tokens :], k, v, lengths, True)
        np.testing.assert_array_equal(last, together[:, :, 16 - tokens :])
    for b, t in itertools.product(range(2), (0, 5, 15)):
        step = run_attention(platform, q[b : b + 1, :, t : t + 1], *_row(k, v, b), [lengths[b] - 15 + t], causal=False)
        np.testing.assert_array_equal(step[0, :, 0], together[b, :, t], err_msg=f"row {b} token {t}")
    want = attention_float64(float64(q), k64, v64, 256**-0.5, lengths, True)
    # exp, the running sums and the division in float32: a few float32 steps of the output's scale
    assert_within_rounding(together, want, np.abs(v64).max(), 64, dtype)


def _row(k, v, b):
    if isinstance(k, QuantizedEntries):
        return [
            e._replace(codes=e.codes[b : b + 1], scales=e.scales[b : b + 1], biases=e.biases[b : b + 1]) for e in (k, v)
        ]
    return k[b : b + 1], v[b : b + 1]


def test_attention_over_35b_heads_and_a_dflash_block(platform):
    """35B-A3B's heads (16 over 2, heads of 256), a block of 16 tokens that see every key (DFlash's
    drafter, no mask): each token the bits of itself alone."""
    rng = np.random.default_rng(35)
    k, v, k64, v64 = attention_case(rng, mx.bfloat16, 0, 0, heads=(16, 2), rows=1, keys=33)
    q = random(rng, (1, 16, 16, 256), mx.bfloat16)
    together = run_attention(platform, q, k, v, [33], causal=False)
    for t in (0, 9, 15):
        alone = run_attention(platform, q[:, :, t : t + 1], k, v, [33], False)
        np.testing.assert_array_equal(alone[:, :, 0], together[:, :, t])
    want = attention_float64(float64(q), k64, v64, 256**-0.5, [33], False)
    assert_within_rounding(together, want, np.abs(v64).max(), 64, mx.bfloat16)


def test_attention_of_small_and_wide_heads(platform):
    """Heads narrower than a simdgroup (16 features: idle lanes) and values of 512 (8 key groups)."""
    rng = np.random.default_rng(5)
    for dims in ((16, 16), (64, 512)):
        k, v, k64, v64 = attention_case(rng, mx.float32, 0, 0, dims=dims, heads=(4, 4), keys=19, rows=1)
        q = random(rng, (1, 4, 3, dims[0]), mx.float32)
        launch = row_kernels.attention_launch(q, k, v, 0.25, True, mx.array([19], mx.int32))
        got = launched(platform, row_kernels.ROW_ATTENTION, launch)
        assert_within_rounding(
            got, attention_float64(float64(q), k64, v64, 0.25, [19], True), np.abs(v64).max(), 64, mx.float32
        )

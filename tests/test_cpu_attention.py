"""Attention over a KV cache on the CPU (csrc/attention.cpp), of a few query tokens and of a
prompt's, over float32 entries and a quantized cache's codes, against attention written the slow,
obvious way in float64, and against itself: a verify pass must reproduce the decode steps' bits,
whatever the cache's buffer around its keys.
The rotary embedding's kernel beside it likewise."""

import contextlib

import mlx.core as mx
import numpy as np
import pytest
from conftest import cpu_kernel_tests

from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_extension, reference, rotary, selfcheck
from test_ops import numpy_rope

pytestmark = cpu_kernel_tests()

# (B, H, Hkv, T, S, Dk, Dv): grouped heads and not, one query token and a verify pass's (query rows
# in blocks of 4 and a partial block), feature counts with partial vectors, Qwen3.5's head (256)
# over a long cache; a prompt chunk over a cache and a whole prompt (the BLAS's path, past 16
# tokens: keys in blocks of 512 and a partial one, query rows in blocks of 256 that straddle heads)
SHAPES = [
    (1, 4, 2, 1, 7, 20, 12), (2, 3, 3, 5, 9, 8, 5), (1, 8, 2, 4, 600, 256, 256), (1, 2, 1, 16, 16, 64, 64),
    (2, 16, 1, 3, 33, 72, 40), (1, 4, 2, 37, 300, 64, 48), (1, 2, 1, 53, 53, 256, 256),
    (2, 8, 2, 300, 1100, 256, 256), (1, 3, 3, 17, 17, 72, 40),
]  # fmt: skip

# float32 against float64: scores of a few units (unit inputs: sums of Dk products scaled by
# 1/sqrt(Dk)) through e^x, a weighted sum of values of scale 1: at most 9.5e-7 over SHAPES (MLX's
# op: 9.0e-7; the BLAS's path sums 256 features in its own order). A wrong mask, head group, scale
# or carried softmax moves outputs by 1e-2 or more.
ATTENTION_TOL = 1e-5


def numpy_attention(q, k, v, scale, causal):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale
    T, S = scores.shape[-2:]
    if causal:
        scores = np.where(np.arange(S)[None] <= np.arange(T)[:, None] + S - T, scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def attention_inputs(B, H, Hkv, T, S, Dk, Dv, seed):
    rng = np.random.default_rng(seed)
    shapes = [(B, H, T, Dk), (B, Hkv, S, Dk), (B, Hkv, S, Dv)]
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def cached(x, capacity):
    """x [B, H, S, D] as a KV cache holds it: the first S entries of a buffer of `capacity`."""
    B, H, S, D = x.shape
    buffer = mx.zeros((B, H, capacity, D))
    buffer[..., :S, :] = x
    return buffer[..., :S, :]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_equals_the_float64_attention(shape, causal):
    B, H, Hkv, T, S, Dk, Dv = shape
    q, k, v = attention_inputs(*shape, seed=sum(shape))
    scale = Dk**-0.5
    got = cpu_extension.extension().attention(
        mx.array(q), cached(mx.array(k), S + 9), cached(mx.array(v), S + 9), scale, causal
    )
    np.testing.assert_allclose(np.array(got), numpy_attention(q, k, v, scale, causal), atol=ATTENTION_TOL, rtol=0)


@pytest.mark.parametrize("T", [6, 11, 16])  # 16: a verify pass of 15 drafts, the most
def test_a_verify_pass_reproduces_the_decode_steps(T):
    """T query tokens at once against T calls of one token over the keys each sees: equal to the bit."""
    q, k, v = (mx.array(x) for x in attention_inputs(2, 8, 2, T, 40, 256, 256, seed=5))
    module = cpu_extension.extension()
    whole = module.attention(q, cached(k, 64), cached(v, 64), 0.0625, True)
    for t in range(T):
        seen = 40 - T + t + 1
        step = module.attention(
            q[:, :, t : t + 1], cached(k[:, :, :seen], 64), cached(v[:, :, :seen], 64), 0.0625, False
        )
        assert mx.array_equal(step, whole[:, :, t : t + 1])


@pytest.mark.parametrize("T, D", [(1, 32), (16, 32), (17, 32), (16, 256), (40, 256)])
def test_the_op_runs_the_kernel_and_agrees_with_mlx(T, D):
    """float32 attention of any number of query tokens runs our kernel, within the float32 floor of
    MLX's op (which sums in another order)."""
    q, k, v = (mx.array(x) for x in attention_inputs(1, 4, 2, T, 44, D, D, seed=T))
    got = ops.scaled_dot_product_attention(q, k, v, 0.2, "causal")
    assert mx.array_equal(got, cpu_extension.extension().attention(q, k, v, 0.2, True))
    mlx = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    np.testing.assert_allclose(np.array(got), np.array(mlx), atol=ATTENTION_TOL, rtol=0)


def test_shapes_that_do_not_fit_are_refused():
    q, k, v = (mx.array(x) for x in attention_inputs(1, 4, 2, 3, 5, 16, 8, seed=0))
    module = cpu_extension.extension()
    for bad, causal in [
        ((q, k[:, :, :, :8], v), False),  # key features
        ((q, k, v[:, :, :4]), False),  # values for fewer keys
        ((q[:, :3], k, v), False),  # heads not a multiple of the KV heads
        ((q, k[:, :, :2], v[:, :, :2]), True),  # a causal pass of more tokens than keys
        ((q.astype(mx.float16), k, v), False),
    ]:
        with pytest.raises(ValueError, match="attention"):
            module.attention(*bad, 0.25, causal)


def numpy_decoded(entries: reference.QuantizedEntries) -> np.ndarray:
    """The entries' values in float64: each code (low bits of a uint32 word first) times its
    group's scale plus its bias."""
    words = np.asarray(entries.codes).astype(np.uint64)
    per_word = 32 // entries.bits
    shifts = np.arange(per_word, dtype=np.uint64) * np.uint64(entries.bits)
    codes = (words[..., None] >> shifts) & np.uint64(2**entries.bits - 1)
    codes = codes.reshape(*words.shape[:-1], -1).astype(np.float64)
    scales, biases = (np.repeat(np.asarray(a, np.float64), entries.group_size, -1) for a in entries.arrays[1:])
    return codes * scales + biases


def quantized(x, bits, group, capacity=None) -> reference.QuantizedEntries:
    """x [B, H, S, D] as a quantized cache holds it: in the first S entries of buffers of `capacity`."""
    entries = ops.quantize_entries(mx.array(x), bits, group)
    if capacity is None:
        return entries
    views = []
    for a in entries.arrays:
        buffer = mx.zeros((*a.shape[:2], capacity, a.shape[3]), a.dtype)
        buffer[..., : a.shape[2], :] = a
        views.append(buffer[..., : a.shape[2], :])
    return reference.QuantizedEntries(*views, bits, group)


# (B, H, Hkv, T, S, Dk, Dv, bits, group): one decode token, a verify pass's rows (blocks of 4 and a
# partial one, a group of heads per block), Qwen3.5's heads (256) past the 64 rows decoded at a time,
# prompt chunks (the BLAS's path, keys in blocks of 512 and a partial one); "mla": the values are
# the leading features of the keys (Kimi's latent cache: 512 of 576), views of the same codes
KERNEL_CASES = [
    (1, 4, 2, 1, 7, 64, 32, 8, 32), (2, 3, 3, 5, 9, 128, 64, 4, 64), (1, 8, 2, 4, 600, 256, 256, 8, 64),
    (1, 8, 2, 16, 130, 256, 256, 4, 128), (1, 4, 2, 37, 300, 64, 128, 4, 32),
    (2, 8, 2, 300, 1100, 256, 256, 8, 64), (1, 16, 1, 3, 70, 576, "mla", 4, 64), (1, 16, 1, 40, 70, 576, "mla", 8, 32),
]  # fmt: skip


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_attention_over_a_quantized_cache_equals_the_float64_attention_of_its_values(case):
    """Tolerance: ATTENTION_TOL, the float32 attention's (the decoded values are the inputs' size,
    each decoded by one FMA, within half an ulp of the float64 value): at most 1.5e-6 here, 2.5e-6
    under MLX's reference BLAS. A code read from the wrong bits, a group's scale misplaced, moves
    outputs by 1e-2 or more."""
    B, H, Hkv, T, S, Dk, Dv, bits, group = case
    mla = Dv == "mla"
    q, k, v = attention_inputs(B, H, Hkv, T, S, Dk, 512 if mla else Dv, seed=S)
    keys = quantized(k, bits, group, capacity=S + 40)
    values = keys.leading(512) if mla else quantized(v, bits, group, capacity=S + 40)
    for causal in (False, True):
        got = cpu_extension.extension().quantized_attention(
            mx.array(q), list(keys.arrays), list(values.arrays), Dk**-0.5, causal, bits, group
        )
        want = numpy_attention(q, numpy_decoded(keys), numpy_decoded(values), Dk**-0.5, causal)
        np.testing.assert_allclose(np.array(got), want, atol=ATTENTION_TOL, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_verify_pass_over_a_quantized_cache_reproduces_the_decode_steps(bits):
    """16 query tokens at once against 16 calls of one token over the keys each sees (100 keys: a
    block of 64 decoded rows and a partial one): equal to the bit."""
    q, k, v = attention_inputs(1, 8, 2, 16, 100, 256, 256, seed=bits)
    keys, values = quantized(k, bits, 64, capacity=128), quantized(v, bits, 64, capacity=128)
    module, q = cpu_extension.extension(), mx.array(q)
    whole = module.quantized_attention(q, list(keys.arrays), list(values.arrays), 0.0625, True, bits, 64)
    for t in range(16):
        seen = 100 - 16 + t + 1
        first = [a[..., :seen, :] for a in keys.arrays], [a[..., :seen, :] for a in values.arrays]
        step = module.quantized_attention(q[:, :, t : t + 1], *first, 0.0625, False, bits, 64)
        assert mx.array_equal(step, whole[:, :, t : t + 1])


@pytest.mark.parametrize("T", [1, 20])
def test_the_op_runs_the_kernel_and_agrees_with_mlx_quantized_products(T):
    """ops' attention over `QuantizedEntries` runs our kernel; MLX's quantized products over the
    same codes (`reference.quantized_attention`, the path where a GPU computes) agree within the
    float32 attention's tolerance (another summation order)."""
    q, k, v = attention_inputs(1, 4, 2, T, 44, 128, 64, seed=T)
    keys, values, q = quantized(k, 8, 32), quantized(v, 8, 32), mx.array(q)
    got = ops.scaled_dot_product_attention(q, keys, values, 0.2, "causal")
    kernel = cpu_extension.extension().quantized_attention(q, list(keys.arrays), list(values.arrays), 0.2, True, 8, 32)
    assert mx.array_equal(got, kernel)
    mlx = reference.quantized_attention(q, keys, values, 0.2, "causal")
    np.testing.assert_allclose(np.array(got), np.array(mlx), atol=ATTENTION_TOL, rtol=0)


def test_quantized_entries_that_do_not_fit_are_refused():
    q, k, v = attention_inputs(1, 4, 2, 3, 5, 64, 32, seed=0)
    keys, values, q = quantized(k, 8, 32), quantized(v, 8, 32), mx.array(q)
    module = cpu_extension.extension()
    for bad_keys, bits, group, message in [
        (keys.arrays, 4, 32, "codes uint32"),  # codes of 8 bits read as 4
        (keys.arrays, 8, 64, "codes uint32"),  # another group size
        (keys.arrays, 3, 32, "4 or 8 bits"),
        ((keys.codes.astype(mx.float32), *keys.arrays[1:]), 8, 32, "codes uint32"),
        ((keys.codes[:, :1], *keys.arrays[1:]), 8, 32, "codes uint32"),  # codes of another head count
        (keys.arrays[:2], 8, 32, "each"),
    ]:
        with pytest.raises(ValueError, match=message):
            module.quantized_attention(q, list(bad_keys), list(values.arrays), 0.25, False, bits, group)
    with pytest.raises(ValueError, match="width"):  # keys of 32 features for queries of 64
        module.quantized_attention(q, list(values.arrays), list(values.arrays), 0.25, False, 8, 32)


@pytest.mark.parametrize(
    "shape,dims,offset",
    [((1, 8, 1, 256), 64, 0), ((1, 8, 1, 256), 64, 511), ((2, 2, 37, 128), 128, 5), ((1, 3, 5, 64), 32, 100_000)],
)
def test_rope_kernel_equals_the_float64_rope(shape, dims, offset):
    x = mx.array(np.random.default_rng(offset).standard_normal(shape).astype(np.float32))
    got = ops.rope(x, dims, 1e7, offset)
    c, s = rotary._rope_factors(range(offset, offset + shape[-2]), shape[-1], dims, 1e7)
    assert mx.array_equal(got, cpu_extension.extension().rope(x, c, s, dims))  # the op runs the kernel
    # an ulp of outputs up to 4, as for the pure-MLX form (test_ops.test_rope_against_numpy)
    np.testing.assert_allclose(np.array(got), numpy_rope(np.array(x), dims, 1e7, offset), atol=1e-6, rtol=0)


def test_rope_kernel_one_token_equals_its_row_of_a_longer_call():
    x = mx.array(np.random.default_rng(0).standard_normal((1, 4, 6, 128)).astype(np.float32))
    together = ops.rope(x, 64, 1e4, 10)
    for t in range(6):
        assert mx.array_equal(ops.rope(x[:, :, t : t + 1], 64, 1e4, 10 + t)[:, :, 0], together[:, :, t])


def test_mrope_runs_the_kernel_with_the_pure_mlx_factors():
    x = mx.array(np.random.default_rng(1).standard_normal((1, 2, 5, 64)).astype(np.float32))
    positions = np.array([[3, 3, 3, 3, 4], [3, 3, 4, 4, 5], [3, 4, 3, 4, 6]])
    got, want = ops.mrope(x, 32, 1e4, positions, [2, 3, 3]), rotary.mrope(x, 32, 1e4, positions, [2, 3, 3])
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6, rtol=0)  # two float32 forms: an ulp


def test_rope_shapes_that_do_not_fit_are_refused():
    x = mx.zeros((1, 2, 3, 16))
    c = s = mx.zeros((3, 16))
    module = cpu_extension.extension()
    for bad in [(x, c[:2], s[:2], 8), (x, c, s, 7), (x, c, s, 18), (x.astype(mx.float16), c, s, 8)]:
        with pytest.raises(ValueError, match="rope"):
            module.rope(*bad)


def test_attention_and_rope_each_pass_their_own_first_call_check(monkeypatch):
    """Two kernels of one source: each checked on its first call, neither standing in for the other."""
    monkeypatch.setattr(selfcheck, "kernel_usable", {})
    q = mx.array(np.random.default_rng(2).standard_normal((1, 2, 1, 16)).astype(np.float32))
    ops.scaled_dot_product_attention(ops.rope(q, 8, 1e4, 3), q, q, 0.25)
    names = sorted([cpu_extension.ATTENTION.name, cpu_extension.ROPE.name])
    assert sorted(key[0] for key in selfcheck.kernel_usable) == names
    assert cpu_extension.ATTENTION.file == cpu_extension.ROPE.file


def batch_of_rows(per_row: list[np.ndarray], capacity: int) -> mx.array:
    """Rows' entries [1, H, S_b, D] of different lengths in one buffer [B, H, capacity, D], each row's
    first S_b its own, the rest of the buffer filled with other values (never read)."""
    H, D = per_row[0].shape[1], per_row[0].shape[3]
    buffer = np.random.default_rng(9).standard_normal((len(per_row), H, capacity, D)).astype(np.float32)
    for b, x in enumerate(per_row):
        buffer[b, :, : x.shape[2]] = x[0]
    return mx.array(buffer)


@pytest.mark.parametrize("T", [1, 4, 16, 20])  # 20: the BLAS's path, each row over its own keys too
@pytest.mark.parametrize("kv_bits", [None, 4])
def test_batch_rows_holding_their_own_key_counts_give_what_each_row_gives_alone(T, kv_bits):
    """A batch cache's rows (`row_caches.KVRows`) hold 30, 21 and 57 keys in one buffer of 64:
    attention with key_lengths gives each row what it gives over its own keys alone, to the bit,
    causal or not, through our kernel and through MLX's ops (the CPU's path without the kernel)."""
    lengths, rng = (30, 21, 57), np.random.default_rng(T)
    q = mx.array(rng.standard_normal((3, 8, T, 128)).astype(np.float32))
    k, v = ([rng.standard_normal((1, 2, n, 128)).astype(np.float32) for n in lengths] for _ in range(2))
    keys, values = batch_of_rows(k, 64), batch_of_rows(v, 64)
    if kv_bits:
        keys, values = (ops.quantize_entries(x, kv_bits, 64) for x in (keys, values))
    for causal, path in [(False, contextlib.nullcontext), (True, contextlib.nullcontext), (True, ops.differentiable)]:
        mask = "causal" if causal else None
        with path():
            got = ops.scaled_dot_product_attention(q, keys, values, 0.1, mask, lengths)
            for b, n in enumerate(lengths):
                row_keys, row_values = (ops.attention._rows(x, b, n) for x in (keys, values))
                alone = ops.scaled_dot_product_attention(q[b : b + 1], row_keys, row_values, 0.1, mask)
                assert mx.array_equal(got[b : b + 1], alone).item(), (b, causal, path)


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_the_gpu_paths_mask_gives_each_row_its_own_keys(kv_bits):
    """Where a GPU computes, a batch's rows read their key counts through a mask over one call of
    MLX's op (`attention._rows_mask`); here on the CPU that call agrees with each row alone within
    the float32 attention's tolerance (MLX's op sums the masked row in another order)."""
    lengths, rng = (5, 12), np.random.default_rng(3)
    q = mx.array(rng.standard_normal((2, 4, 3, 64)).astype(np.float32))
    keys, values = (
        batch_of_rows([rng.standard_normal((1, 2, n, 64)).astype(np.float32) for n in lengths], 16) for _ in range(2)
    )
    if kv_bits:
        keys, values = (ops.quantize_entries(x, kv_bits, 32) for x in (keys, values))
    mask = ops.attention._rows_mask(lengths, 3, 16, True)
    got = ops.attention._mlx_attention(q, keys, values, 0.2, mask)
    for b, n in enumerate(lengths):
        row_keys, row_values = (ops.attention._rows(x, b, n) for x in (keys, values))
        alone = ops.attention._mlx_attention(q[b : b + 1], row_keys, row_values, 0.2, "causal")
        np.testing.assert_allclose(np.array(got[b : b + 1]), np.array(alone), atol=ATTENTION_TOL, rtol=0)


def test_rope_of_batch_rows_at_their_own_positions_equals_each_row_alone():
    """Rotary embedding with each batch row's offset: the kernel and the pure-MLX form give each row
    what one call at its own offset gives, to the bit."""
    x = mx.array(np.random.default_rng(4).standard_normal((3, 4, 2, 128)).astype(np.float32))
    offsets = (7, 300, 0)
    for rope in (ops.rope, rotary.rope):
        together = rope(x, 64, 1e4, offsets)
        for b, offset in enumerate(offsets):
            assert mx.array_equal(together[b : b + 1], rope(x[b : b + 1], 64, 1e4, offset)).item()


def test_key_lengths_that_do_not_fit_are_refused():
    q, k, v = (mx.array(x) for x in attention_inputs(2, 4, 2, 1, 5, 16, 8, seed=0))
    for bad in [mx.array([3, 4], mx.float32), mx.array([3], mx.int32), mx.array([[3, 4]], mx.int32)]:
        with pytest.raises(ValueError, match="key_lengths"):
            cpu_extension.extension().attention(q, k, v, 0.25, False, bad)

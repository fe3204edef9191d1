"""The first-call check of the custom kernels: a kernel that fails to compile or computes
wrongly logs one warning, and the op runs the pure-MLX path with the same output as
without kernels; MLX_HYBRID_STRICT_KERNELS=1 makes it an error.

The Metal bodies run through the g++ emulation, registered as a kernel platform, so this
runs on Linux; on a Mac or an NVIDIA GPU the same check runs the real compilers.
"""

import logging
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import REFERENCE_TOL, load_fixture, reference as fixture_reference

import mlx_hybrid
from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_extension, gpu_kernels, reference, row_kernels, selfcheck
from mlx_hybrid.ops.selfcheck import linear_attention_args
from test_ops import OP_TOL, make_inputs

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the emulation")


KERNELS = (
    gpu_kernels.GATED_DELTA,
    gpu_kernels.CONV1D_SILU,
    gpu_kernels.LINEAR_ATTENTION,
    gpu_kernels.ADD_RMS_NORM,
    row_kernels.ROW_PRODUCT,
    row_kernels.ROW_ATTENTION,
)


def broken_kernel(monkeypatch, tmp_path, spec, old, new):
    """Kernel sources from tmp_path, where `spec`'s body has `old` replaced by `new`."""
    source = spec.source
    assert old in source
    (tmp_path / spec.file).write_text(source.replace(old, new))
    for other in KERNELS:
        if other.file != spec.file:
            (tmp_path / other.file).write_text(other.source)
    monkeypatch.setattr(gpu_kernels, "SOURCE_DIRS", [tmp_path])


def gated_delta_inputs():
    return [mx.array(x) for x in make_inputs(1, 4, 2, 4, 16, 16, False, seed=3)]


def run_both_ops():
    """The two ops through ops' dispatch, and what the pure-MLX forms give."""
    inputs = gated_delta_inputs()
    rule = ops.gated_delta_update(*inputs, snapshots=True)
    want_rule = reference.gated_delta_recurrent(*inputs, snapshots=True)
    rng = np.random.default_rng(0)
    x, w = (
        mx.array(rng.standard_normal((1, 4, 24)).astype(np.float32)),
        mx.array(rng.standard_normal((24, 4)).astype(np.float32)),
    )
    conv = ops.conv1d_update(x, w, snapshots=True)
    want_conv = reference.causal_conv1d_silu(x, w, snapshots=True)
    return (rule, want_rule), (conv, want_conv)


def assert_equal_results(got, want, atol):
    np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), atol=atol, rtol=0)
    np.testing.assert_allclose(np.array(got[1]), np.array(want[1]), atol=atol, rtol=0)
    for a, b in zip(got[2], want[2]):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=atol, rtol=0)


def test_sound_kernels_pass_their_check_and_run(emulated, caplog):
    with caplog.at_level(logging.WARNING, logger="mlx_hybrid"):
        (rule, want_rule), (conv, want_conv) = run_both_ops()
    assert not caplog.records
    assert all(selfcheck.kernel_usable.values()) and len(selfcheck.kernel_usable) == 2
    assert_equal_results(rule, want_rule, OP_TOL)  # the kernel against pure MLX: two float32 orders
    assert_equal_results(conv, want_conv, OP_TOL)


def test_sound_kernels_pass_their_check_in_bfloat16(emulated, caplog):
    """A GPU's default dtype: the check reads the kernels' bfloat16 outputs (the conv's) and lets
    sound kernels run; their results are the pure-MLX forms' within a bfloat16 rounding step."""
    *rule_inputs, state = gated_delta_inputs()
    rule_inputs = [x.astype(mx.bfloat16) for x in rule_inputs] + [state]
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 4, 24)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((24, 4)).astype(np.float32))
    with caplog.at_level(logging.WARNING, logger="mlx_hybrid"):
        rule = ops.gated_delta_update(*rule_inputs, snapshots=True)
        conv = ops.conv1d_update(x, w, snapshots=True)
    assert not caplog.records
    assert len(selfcheck.kernel_usable) == 2 and all(selfcheck.kernel_usable.values())
    want_rule = reference.gated_delta_recurrent(*rule_inputs, snapshots=True)
    assert_equal_results(rule, want_rule, OP_TOL)
    assert conv.out.dtype == mx.bfloat16
    got, want = (np.array(y.astype(mx.float32)) for y in (conv.out, reference.causal_conv1d_silu(x, w)[0]))
    assert (np.abs(got - want) <= 2.0**-7 * np.abs(want)).all()  # one bfloat16 step


@pytest.mark.parametrize(
    "spec,old,new,problem",
    [
        (gpu_kernels.GATED_DELTA, "= read;", "= 2.0f * read;", "differs from the pure-MLX op"),
        (gpu_kernels.CONV1D_SILU, "acc / (1.0f + metal::exp(-acc))", "acc", "differs from the pure-MLX op"),
        (gpu_kernels.GATED_DELTA, "= read;", "= read", "failed"),  # a compile error
    ],
    ids=["wrong-gated-delta", "wrong-conv", "does-not-compile"],
)
def test_broken_kernel_warns_once_and_falls_back(emulated, monkeypatch, tmp_path, caplog, spec, old, new, problem):
    broken_kernel(monkeypatch, tmp_path, spec, old, new)
    with caplog.at_level(logging.WARNING, logger="mlx_hybrid"):
        (rule, want_rule), (conv, want_conv) = run_both_ops()
        run_both_ops()  # a second call: no second warning, still the pure-MLX path
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert spec.file in warnings[0] and problem in warnings[0] and "pure-MLX path" in warnings[0]
    broken = [key for key, usable in selfcheck.kernel_usable.items() if not usable]
    assert [key[0] for key in broken] == [spec.name]
    # the fallback is the pure-MLX op itself: the broken op's output is exactly the reference
    got, want = (rule, want_rule) if spec is gpu_kernels.GATED_DELTA else (conv, want_conv)
    assert_equal_results(got, want, 0.0)


LAYER_HEADS = reference.HeadShape(1, 2, 32, 16)


def linear_attention_layer(T: int, snapshots: bool):
    """One GDN layer's call through ops, and the pure-MLX composition's result."""
    args = linear_attention_args(np.random.default_rng(T), 1, T, LAYER_HEADS, 4, False, "silu", mx.float32)
    return ops.linear_attention(*args, snapshots=snapshots), reference.linear_attention(*args, snapshots=snapshots)


def assert_same_layer(got, want, atol):
    """Output, tail, state and the per-token snapshots (where there are any) of two LayerResults."""
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        for x, y in zip(*(([a], [b]) if isinstance(a, mx.array) else (a or [], b or []))):
            np.testing.assert_allclose(np.array(x), np.array(y), atol=atol, rtol=0)


def test_a_layer_runs_as_one_kernel_token_by_token(emulated, caplog):
    """Decode steps, verify passes and short prompts take the layer body (and only it); a long
    prompt without snapshots the split ops, whose delta rule runs chunked."""
    with caplog.at_level(logging.WARNING, logger="mlx_hybrid"):
        for T, snapshots in ((1, False), (4, True)):
            got, want = linear_attention_layer(T, snapshots)
            assert_same_layer(got, want, OP_TOL)  # the body against pure MLX: two float32 orders
        assert [key[0] for key in selfcheck.kernel_usable] == [gpu_kernels.LINEAR_ATTENTION.name] * 2
        args = linear_attention_args(
            np.random.default_rng(0), 1, ops.CHUNKED_MIN_TOKENS, LAYER_HEADS, 4, False, "silu", mx.float32
        )
        ops.linear_attention(*args)  # built, not evaluated: the kernels it asks for are the point
    assert not caplog.records
    assert gpu_kernels.GATED_DELTA.name not in {key[0] for key in selfcheck.kernel_usable}  # chunked: no rule kernel
    assert gpu_kernels.CONV1D_SILU.name in {key[0] for key in selfcheck.kernel_usable}


@pytest.mark.parametrize("family", ["qwen35", "kimilinear"])
def test_models_on_the_layer_body_match_transformers_and_speculate_exactly(emulated, family):
    """Every linear-attention layer as the one body (48 tokens: all token by token), each residual +
    norm as its body: the logits are
    transformers' within REFERENCE_TOL; greedy decoding equals transformers' tokens, and greedy
    speculation (each layer's snapshots from the body, rolled back by the cache) equals it too."""
    model, tokenizer = load_fixture(family, "hf")
    ref = fixture_reference(family)
    np.testing.assert_allclose(np.array(model(mx.array(ref["input_ids"]))), ref["logits"], atol=REFERENCE_TOL, rtol=0)
    prompt = ref["prompt_ids"][0].tolist()
    want = ref["greedy_ids"][0, len(prompt) :].tolist()
    draft = "mtp" if family == "qwen35" else "ngram"
    for settings in ({"draft": None}, {"draft": draft, "num_draft_tokens": 3}):
        got = [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, prompt, max_tokens=len(want), **settings)]
        assert got == want, settings
    emulated_kernels = {key: usable for key, usable in selfcheck.kernel_usable.items() if key[1] == "emulated"}
    layer_kernels = {
        gpu_kernels.LINEAR_ATTENTION.name,
        gpu_kernels.ADD_RMS_NORM.name,
        row_kernels.ROW_PRODUCT.name,
        row_kernels.ROW_ATTENTION.name,
    }
    assert {key[0] for key in emulated_kernels} == layer_kernels and all(emulated_kernels.values())


def test_a_broken_layer_body_falls_back_to_the_split_ops(emulated, monkeypatch, tmp_path, caplog):
    broken_kernel(monkeypatch, tmp_path, gpu_kernels.LINEAR_ATTENTION, "reads[c] * inverse_rms", "reads[c] * 2.0f")
    with caplog.at_level(logging.WARNING, logger="mlx_hybrid"):
        got, want = linear_attention_layer(4, True)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "linear_attention.metal" in warnings[0], warnings
    assert selfcheck.kernel_usable[(gpu_kernels.GATED_DELTA.name, "emulated", mx.float32, 32, False, True)]
    assert_same_layer(got, want, OP_TOL)  # the split ops' kernels against pure MLX


def test_strict_mode_makes_a_broken_kernel_an_error(emulated, monkeypatch, tmp_path):
    broken_kernel(monkeypatch, tmp_path, gpu_kernels.GATED_DELTA, "= read;", "= 2.0f * read;")
    monkeypatch.setenv("MLX_HYBRID_STRICT_KERNELS", "1")
    with pytest.raises(selfcheck.KernelError, match="gated_delta.metal"):
        ops.gated_delta_update(*gated_delta_inputs())


def test_check_compares_bfloat16_outputs_to_one_rounding_step(monkeypatch, caplog):
    """A GPU's default dtype: a bfloat16 output is a float32 result rounded, so a result a hair
    off the reference's may round one bfloat16 step away and passes; ten percent off does not."""
    monkeypatch.setattr(selfcheck, "kernel_usable", {})
    monkeypatch.delenv("MLX_HYBRID_STRICT_KERNELS", raising=False)
    exact = mx.array(np.linspace(-3, 3, 37, dtype=np.float32))
    want = exact.astype(mx.bfloat16)

    def scaled_by(factor):
        return lambda platform, *variant: ([(exact * factor).astype(mx.bfloat16)], [want])

    hair = (exact * (1 + 2.0**-9)).astype(mx.bfloat16)
    assert not mx.array_equal(hair, want)  # some values do round a step away
    with caplog.at_level(logging.WARNING, logger="mlx_hybrid"):
        assert selfcheck.passed(gpu_kernels.CONV1D_SILU, scaled_by(1 + 2.0**-9), "emulated", mx.bfloat16, "hair")
        assert not caplog.records
        assert not selfcheck.passed(gpu_kernels.CONV1D_SILU, scaled_by(1.1), "emulated", mx.bfloat16, "ten percent")
    assert "differs from the pure-MLX op" in caplog.records[0].getMessage()


@pytest.mark.parametrize("spec", cpu_extension.KERNELS, ids=lambda spec: spec.name)
def test_a_cpu_kernel_that_fails_its_check_warns_and_names_what_computes_instead(spec, monkeypatch, caplog):
    """A CPU kernel's first-call check that fails (a miscompiled body): one warning naming the unit and
    what computes in its place, and the kernel refused, never an exception."""
    monkeypatch.setattr(selfcheck, "kernel_usable", {})
    monkeypatch.delenv("MLX_HYBRID_STRICT_KERNELS", raising=False)
    want = mx.ones((4,))
    with caplog.at_level(logging.WARNING, logger="mlx_hybrid"):
        assert not selfcheck.passed(spec, lambda platform: ([want * 2], [want]), "cpu")
    (record,) = caplog.records
    assert spec.file in record.getMessage() and record.getMessage().endswith(spec.fallback)


def test_the_environment_forces_the_pure_mlx_ops_from_the_start():
    """MLX_HYBRID_FORCE_REFERENCE=1 is read when the package loads: every op on its pure-MLX form,
    quantized products on MLX's own (or the matrix dequantized)."""
    import os
    import subprocess
    import sys

    code = (
        "import mlx_hybrid, mlx.core as mx\nfrom mlx_hybrid import ops\n"
        "w, s, b = mx.quantize(mx.ones((64, 64)), group_size=64, bits=4)\n"
        "ops.quantized_matmul(mx.ones((1, 64)), w, s, b, group_size=64, bits=4)\n"
        "print(ops.backend_name(), ops.backend.cpu_kernels_built())"
    )
    env = {**os.environ, "MLX_HYBRID_FORCE_REFERENCE": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["mlx-reference", "False"]


def test_a_broken_row_kernel_warns_that_rows_are_no_longer_invariant(emulated, monkeypatch, tmp_path, caplog):
    """A product body that computes wrongly: one warning naming it and what is lost, then MLX's own
    product for every call (the same bits as without the kernel)."""
    broken_kernel(monkeypatch, tmp_path, row_kernels.ROW_PRODUCT, "<T>(total)", "<T>(2.0f * total)")
    rng = np.random.default_rng(0)
    x, weight = (
        mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16) for shape in [(1, 3, 64), (24, 64)]
    )
    with caplog.at_level(logging.WARNING, logger="mlx_hybrid"):
        first, second = ops.linear(x, weight), ops.linear(x, weight)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "row_product.metal" in warnings[0] and "no longer row-invariant" in warnings[0]
    for got in (first, second):
        assert np.array_equal(np.array(got.astype(mx.float32)), np.array((x @ weight.T).astype(mx.float32)))

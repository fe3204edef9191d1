"""The gemv forwarding in front of the BLAS: products with few rows, or one column,
go through cblas_sgemv; they must be right for every operand layout, and a row must
come out with the same bits whether it is multiplied alone or with others."""

import os
import subprocess
import sys
import textwrap

import pytest

from mlx_hybrid.blas import find_openblas, gemv_forward_library

# Runs with the library preloaded; every product is checked against float64 numpy.
PRODUCTS = textwrap.dedent(
    """
    import mlx.core as mx
    import numpy as np
    from mlx_hybrid.blas import active_blas

    assert "gemv forwarding" in active_blas(), active_blas()
    rng = np.random.default_rng(0)

    def check(name, got, want):
        got = np.array(got, dtype=np.float64)
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error < 1e-5, (name, error)

    def operand(rows, cols, transposed, strided):
        # a [rows, cols] operand, stored transposed and/or as every other column of a wider array
        stored = rng.standard_normal((cols, rows) if transposed else (rows, 2 * cols if strided else cols))
        stored = stored.astype(np.float32)
        a = mx.array(stored)
        if transposed:
            return a.T, stored.T.astype(np.float64)
        if strided:
            return a[:, ::2], stored[:, ::2].astype(np.float64)
        return a, stored.astype(np.float64)

    for m, k, n in [(1, 64, 300), (1, 1024, 4096), (300, 64, 1), (1, 1, 17), (1, 5, 1), (3, 200, 700),
                    (8, 1024, 1100), (9, 64, 30)]:
        for ta in (False, True):
            for tb in (False, True):
                for strided in (False, True):
                    a, a64 = operand(m, k, ta, strided and not ta)
                    b, b64 = operand(k, n, tb, strided and not tb)
                    # poison the allocator's free buffers, so an unwritten output shows as NaN
                    mx.eval(mx.full((m, n), float("nan")))
                    check(f"{m}x{k}x{n} ta={ta} tb={tb} strided={strided}", a @ b, a64 @ b64)
                    c = mx.array(rng.standard_normal((m, n)).astype(np.float32))
                    check(f"addmm {m}x{k}x{n}", mx.addmm(c, a, b, alpha=0.5, beta=2.0),
                          2.0 * np.array(c, dtype=np.float64) + 0.5 * (a64 @ b64))
    x = mx.array(rng.standard_normal((3, 1, 96)).astype(np.float32))
    w = mx.array(rng.standard_normal((3, 96, 40)).astype(np.float32))
    check("batched rows", x @ w, np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64))

    # a verify pass (a few rows) and single decode steps (one row) give the same bits
    w = mx.array(rng.standard_normal((5000, 1024)).astype(np.float32))
    rows = mx.array(rng.standard_normal((5, 1024)).astype(np.float32))
    together = np.array(rows @ w.T)
    for i in range(5):
        assert np.array_equal(np.array(rows[i : i + 1] @ w.T)[0], together[i]), i
    print("ok")
    """
)


def test_forwarded_products_equal_float64_reference():
    openblas, library = find_openblas(), gemv_forward_library()
    if openblas is None or library is None:
        pytest.skip("needs OpenBLAS and a C compiler")
    env = dict(os.environ, LD_PRELOAD=f"{library}:{openblas}")
    result = subprocess.run([sys.executable, "-c", PRODUCTS], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"

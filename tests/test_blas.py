"""The library in front of the BLAS (csrc/gemv_forward.c): products with few rows, or
one column, are computed there; they must be right for every operand layout, and a row
must come out with the same bits whether it is multiplied alone or with others. And
OpenBLAS gets loaded by `import mlx_hybrid`, without a restart, when MLX is not yet."""

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

    mx.set_default_device(mx.cpu)  # the BLAS computes the CPU's products, on a machine with a GPU too
    assert "gemv forwarding" in active_blas(), active_blas()
    rng = np.random.default_rng(0)

    def check(name, got, want):
        got = np.array(got, dtype=np.float64)
        error = np.abs(got - want).max() / np.abs(want).max()
        # float32 sums of up to 1024 standard-normal products against float64: the error grows
        # like sqrt(depth) ulps of the result (about 2e-6 relative at 1024); a wrong stride,
        # transpose or unwritten output is off by order 1
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

    # a verify pass (a few rows) and single decode steps (one row) give the same bits, for
    # every row count, a column count that is no multiple of 4 and a depth no multiple of 8
    for depth in (1000, 1027):
        w = mx.array(rng.standard_normal((5001, depth)).astype(np.float32))
        rows = mx.array(rng.standard_normal((16, depth)).astype(np.float32))
        alone = [np.array(rows[i : i + 1] @ w.T)[0] for i in range(16)]
        for m in range(2, 17):
            together = np.array(rows[:m] @ w.T)
            for i in range(m):
                assert np.array_equal(alone[i], together[i]), (depth, m, i)
        check(f"rows {depth}", rows @ w.T, np.array(rows, dtype=np.float64) @ np.array(w, dtype=np.float64).T)
    print("ok")
    """
)


def _needs_openblas():
    openblas, library = find_openblas(), gemv_forward_library()
    if openblas is None or library is None:
        pytest.skip("needs OpenBLAS and a C compiler")
    return openblas, library


def _run(code, **env):
    # these test the loading itself: none of the suite's own BLAS settings is inherited
    unset = ("LD_PRELOAD", "MLX_HYBRID_BLAS", "MLX_HYBRID_BLAS_RESTARTED")
    environment = {k: v for k, v in os.environ.items() if k not in unset}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("loading", ["preloaded", "imported"])
def test_forwarded_products_equal_float64_reference(loading):
    openblas, library = _needs_openblas()
    if loading == "preloaded":
        result = _run(PRODUCTS, LD_PRELOAD=f"{library}:{openblas}")
    else:  # no LD_PRELOAD: `import mlx_hybrid` opens both before MLX loads
        result = _run("import mlx_hybrid\n" + PRODUCTS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_importing_mlx_hybrid_first_loads_openblas_without_a_restart():
    _needs_openblas()
    code = "import os, mlx_hybrid, mlx.core\nfrom mlx_hybrid.blas import active_blas\nprint(active_blas(), os.getpid())"
    result = _run(code + "\nprint(os.getpid())")
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("\n")[:2]
    assert first.startswith("openblas + gemv forwarding") and first.split()[-1] == second  # same process
    assert result.stderr == ""


def test_importing_mlx_first_warns_once_and_names_the_fix():
    _needs_openblas()
    result = _run("import mlx.core, mlx_hybrid\nfrom mlx_hybrid.blas import active_blas\nprint(active_blas())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "reference"
    warning = [line for line in result.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warning) == 1 and "import mlx_hybrid first" in warning[0]
    assert _run("import mlx.core, mlx_hybrid", MLX_HYBRID_BLAS="reference").stderr == ""

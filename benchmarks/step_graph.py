"""What one decode step asks of MLX: the nodes of its graph, and of those the ones that launch work.

    python benchmarks/step_graph.py                          # Qwen3.5-0.8B shape, random weights
    python benchmarks/step_graph.py --model DIR --mlx-lm     # a checkpoint, mlx-lm's step beside ours
    python benchmarks/step_graph.py --gpu-path               # the graph a GPU computes, counted here
    python benchmarks/step_graph.py --gpu-path --rows 8      # and 8 rows' step, as the engine packs them

How it counts: one greedy decode step is built (not evaluated) on a cache that holds a prompt, its
outputs are the next token and every array the caches keep, and MLX writes that graph out
(`mx.export_to_dot`). Every primitive node is counted; the views (reshape, slice, transpose,
broadcast, ...) are counted apart, as they move no data on a GPU, and a concatenate counts once per
input (a GPU copies each apart), so the rest approximates the kernels a GPU launches for the step (a
node of MLX's own may launch more than one: a matrix product through cuBLAS, a sort). The graph
depends on the device it is built for: on the CPU MLX builds mx.fast's norms, rotary embedding and
attention as their compositions and our CPU primitives replace others, so the GPU path's count is
read where a GPU computes (`gpu_check.py` does), or here with `--gpu-path`: the ops module takes its
GPU branches, and each of our kernels and each of mx.fast's fused ops stands in the graph as one
node (`gpu_path_graph`), the launch it is on a GPU.
Beside the count, the host's time to build the step's graph (the model's call, nothing evaluated):
where it approaches a step's time, decoding waits on Python rather than on the device.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001
from mlx.utils import tree_flatten

# primitives that make a view of their input where it is contiguous: no kernel on a GPU
VIEWS = frozenset(
    {
        "Reshape",
        "Broadcast",
        "Slice",
        "Transpose",
        "AsStrided",
        "ExpandDims",
        "Squeeze",
        "Split",
        "Flatten",
        "Unflatten",
        "StopGradient",
        "Depends",
    }
)
STAND_IN = "ErfInv"  # the node a kernel or fused op stands as under gpu_path_graph(): no model uses it
_NODE = re.compile(r'(\d+) \[label ="([^"]+)", shape=rectangle\]')
_EDGE_IN = re.compile(r'^"[^"]+" -> (\d+)$', re.M)
# MLX's GPU backends copy each input of a concatenate apart: a launch per input
PER_INPUT = frozenset({"Concatenate"})


def graph_nodes(outputs) -> Counter:
    """Primitive nodes (by name) of the graph that computes `outputs`, a concatenate once per input;
    evaluated arrays end it."""
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f, *outputs)
        f.seek(0)
        text = f.read()
    nodes = _NODE.findall(text)  # (id, name); a compiled primitive's id recurs where it is called again
    counts, inputs = Counter(name for _, name in nodes), Counter(_EDGE_IN.findall(text))
    for node, name in dict(nodes).items():
        if name in PER_INPUT:
            counts[name] += inputs[node] - 1
    return counts


def summary(nodes: Counter) -> dict:
    views = sum(n for name, n in nodes.items() if name in VIEWS)
    return {"nodes": sum(nodes.values()), "views": views, "launches": sum(nodes.values()) - views}


def _stand_in(inputs, shapes, dtypes) -> list:
    """Outputs of these shapes and dtypes made by one non-view node that depends on every input."""

    def zeros(shape, dtype):  # a view of a constant: no node that computes
        return mx.broadcast_to(mx.array(0, dtype), shape)

    first = mx.depends([mx.erfinv(zeros(shapes[0], dtypes[0]))], [a for a in inputs if isinstance(a, mx.array)])
    return first + [mx.depends([zeros(s, d)], first)[0] for s, d in zip(shapes[1:], dtypes[1:])]


@contextlib.contextmanager
def gpu_path_graph():
    """Inside: ops builds the graph it builds where a GPU computes (bfloat16 by default), each custom
    kernel and each of mx.fast's fused ops one stand-in node (a STAND_IN of zeros, so a prompt can
    still be evaluated here to fill a cache). Counting only: the values are not the model's."""
    from unittest import mock

    from mlx_hybrid import ops
    from mlx_hybrid.ops import gpu_kernels

    def fast(output):
        return lambda *args, **kw: _stand_in([*args, *kw.values()], *zip(*output(*args, **kw)))[0]

    like_first = lambda x, *_, **__: [(x.shape, x.dtype)]  # noqa: E731
    attention_out = lambda q, k, v, **_: [(q.shape[:-1] + v.shape[-1:], q.dtype)]  # noqa: E731
    with contextlib.ExitStack() as stack:
        for target, name, value in [
            (ops.backend, "gpu_computes", lambda: True),
            (ops.backend, "kernel_platform", lambda: "graph"),
            (ops.selfcheck, "passed", lambda *a: True),
            (mx.fast, "rms_norm", fast(like_first)),
            (mx.fast, "layer_norm", fast(like_first)),
            (mx.fast, "rope", fast(like_first)),
            (mx.fast, "scaled_dot_product_attention", fast(attention_out)),
        ]:
            stack.enter_context(mock.patch.object(target, name, value))
        stack.enter_context(
            mock.patch.dict(
                gpu_kernels.RUNNERS, graph=lambda spec, l: _stand_in(l.inputs, l.output_shapes, l.output_dtypes)
            )
        )
        yield


def mlx_hybrid_step(model, prompt: list[int]) -> tuple[Counter, float]:
    """One greedy decode step of ours, as the engine's plain step builds it: its nodes, and the
    seconds the host took to build it."""
    from mlx_hybrid.prompt import prefill

    cache = model.make_cache()
    prefill(model, prompt, cache)
    mx.eval([c.arrays for c in cache])
    started = time.perf_counter()
    logits = model(mx.array([[prompt[-1]]]), cache)
    built = time.perf_counter() - started
    return graph_nodes([logits[:, -1].argmax(-1), *[a for c in cache for a in c.arrays]]), built


def mlx_hybrid_rows_step(model, prompt: list[int], rows: int) -> tuple[Counter, float]:
    """One greedy decode step of `rows` sequences together, as the engine's step packs them (each
    row's prompt a token longer than the last, so that no two rows are alike), after one such step:
    the steady state of rows that decode together."""
    from mlx_hybrid.row_caches import packed
    from mlx_hybrid.prompt import prefill

    caches = [model.make_cache() for _ in range(rows)]
    for row, cache in enumerate(caches):
        prefill(model, prompt + [3] * row, cache)
    model(mx.array([[prompt[-1]] * rows]), packed(caches, [1] * rows))
    mx.eval([c.arrays for cache in caches for c in cache])
    started = time.perf_counter()
    logits = model(mx.array([[prompt[-1]] * rows]), packed(caches, [1] * rows))
    built = time.perf_counter() - started
    arrays = [a for cache in caches for c in cache for a in c.arrays]
    return graph_nodes([logits[0].argmax(-1), *arrays]), built


def mlx_lm_step(model, prompt: list[int]) -> tuple[Counter, float]:
    """One greedy decode step of an mlx-lm model, as its generate_step builds it (as `mlx_hybrid_step`)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    started = time.perf_counter()
    logits = model(mx.array([[prompt[-1]]]), cache=cache)
    built = time.perf_counter() - started
    states = [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)]
    return graph_nodes([logits[:, -1].argmax(-1), *states]), built


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint (default: random weights at --shape)")
    p.add_argument("--shape", default="qwen3.5-0.8b", help="a shape of benchmarks/shapes.py (default %(default)s)")
    p.add_argument("--mlx-lm", action="store_true", help="count mlx-lm's step on the same checkpoint too")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--rows", type=int, default=1, help="sequences decoded together (our step; default %(default)s)")
    p.add_argument("--top", type=int, default=12, help="list the most frequent primitives")
    p.add_argument(
        "--gpu-path",
        action="store_true",
        help=f"count the graph the GPU path builds, here (each kernel and fused op one {STAND_IN} node)",
    )
    args = p.parse_args()
    from unittest import mock

    from mlx_hybrid.ops import schedule

    # the step's graph whole: on the CPU a small model's pass queues its layers as they are built
    # (`ops.layer_built`), which a bound of 0 weights turns off
    with gpu_path_graph() if args.gpu_path else mock.patch.object(schedule, "ONE_THREAD_WEIGHTS", 0):
        count(args)


def count(args):
    from mlx_hybrid import ops

    sys.path.insert(0, str(Path(__file__).parent))
    if args.model:
        model, _ = mlx_hybrid.load(args.model)
    else:
        from shapes import SHAPES, random_model

        model = random_model(SHAPES[args.shape](), ops.default_dtype())
    prompt = list(range(3, 3 + args.prompt_tokens))
    steps = {"mlx-hybrid": mlx_hybrid_step(model, prompt)}
    if args.rows > 1:
        steps[f"mlx-hybrid, {args.rows} rows"] = mlx_hybrid_rows_step(model, prompt, args.rows)
    if args.mlx_lm:
        import mlx_lm

        steps["mlx-lm"] = mlx_lm_step(mlx_lm.load(args.model)[0], prompt)
    print(f"device {mx.default_device()}, ops {ops.backend_name()}")
    for name, (nodes, built) in steps.items():
        print(describe(name, nodes, built, args.top))


def describe(name: str, nodes: Counter, built: float, top: int = 12) -> str:
    """The counts of one step, its build time and its most frequent primitives, in two lines."""
    counts = ", ".join(f"{k} {v}" for k, v in summary(nodes).items())
    return f"{name}: {counts}, built in {built * 1e3:.1f} ms\n  " + ", ".join(
        f"{k} {v}" for k, v in nodes.most_common(top)
    )


if __name__ == "__main__":
    main()

"""What one engine step asks of the device and the host, counted on the CPU: how a machine without a
GPU sees one.

    python benchmarks/engine_step.py                  # Qwen3.5-0.8B shape (launches), tiny widths (host)
    python benchmarks/engine_step.py --rows 1 8       # which batch sizes (default 1 and 8)
    python benchmarks/engine_step.py --temp 0.8       # rows that sample (default greedy)
    python benchmarks/engine_step.py --mlx-lm bench_models/qwen3.5-0.8b   # mlx-lm's step beside ours

--mlx-lm counts mlx-lm's decode step in the same run (`pip install mlx-lm`; the checkpoint from
make_checkpoints.py, cast to bfloat16, for its launches; the fixture's HF checkpoint for its host
time): `generate_step` for one row, its `BatchGenerator` for more, each stepped a few times first.
mlx-lm runs its gated delta rule as MLX ops wherever Metal is absent (a CUDA GPU too), and
mx.fast's ops stand as one launch each, as for ours.

For plain greedy decoding, an MTP pass (k=3, the default p-min, greedy) and a DFlash pass (a random
drafter of 5 layers, blocks of 16, k=15, the default p-min, greedy), one step of rows that have decoded
together for a few steps (the steady state), through the engine's own `step`:
- launches: the kernels the GPU path launches for the step, counted as `step_graph.py --gpu-path`
  counts them (views apart, a concatenate once per input), over the graphs that the step's blocking
  reads evaluate and the graph of what the rows hold after it;
- waits: blocking reads of the device (an array's tolist, item, bool, int or float; mx.eval);
- queued: mx.async_eval calls (work started without waiting for it);
- host ms: the step's wall time less the time spent in its waits, at the fixtures' tiny widths, where
  the device's work is small (the median of --repeats steps).
Random weights under the GPU path's stand-ins compute no real values: every draft is accepted there,
and every draft is below p-min (the verify pass then cuts them all); the counts are the pass's shape.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

import mlx.core as mx  # noqa: I001

sys.path.insert(0, str(Path(__file__).parent))
from step_graph import gpu_path_graph, graph_nodes, summary  # noqa: E402

from mlx_hybrid.draft_vocab import DEFAULT_DRAFT_VOCAB  # noqa: E402
from mlx_hybrid.drafting import DEFAULT_DRAFT_P_MIN, MTPDrafter  # noqa: E402
from mlx_hybrid.drafting.dflash import DFlashDrafter  # noqa: E402
from mlx_hybrid.engine import Engine, PrefixStore  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen35" / "model.gguf"
READS = ("tolist", "item", "__bool__", "__int__", "__float__")


class DeviceUse:
    """Inside: counts blocking reads, async queues and the time spent waiting; with `graphs`, the
    nodes of the graph each read evaluates."""

    def __init__(self, graphs: bool):
        self.graphs = graphs
        self.waits = self.queued = 0
        self.wait_seconds = 0.0
        self.nodes = Counter()

    @contextlib.contextmanager
    def counting(self):
        originals = {name: getattr(mx.array, name) for name in READS}
        module = {"eval": mx.eval, "async_eval": mx.async_eval}

        def waiting(read, arrays_of):
            def counted(*args, **kwargs):
                self.waits += 1
                if self.graphs:
                    self.nodes += graph_nodes([a for a in arrays_of(args) if isinstance(a, mx.array)])
                started = time.perf_counter()
                try:
                    return read(*args, **kwargs)
                finally:
                    self.wait_seconds += time.perf_counter() - started

            return counted

        def queued(*args):
            self.queued += 1
            if self.graphs:
                self.nodes += graph_nodes([a for a in _flat(args) if isinstance(a, mx.array)])
            return module["async_eval"](*args)

        try:
            for name, read in originals.items():
                setattr(mx.array, name, waiting(read, lambda args: args[:1]))
            mx.eval, mx.async_eval = waiting(module["eval"], _flat), queued
            yield self
        finally:
            for name, read in originals.items():
                setattr(mx.array, name, read)
            mx.eval, mx.async_eval = module["eval"], module["async_eval"]


def _flat(items) -> list:
    out = []
    for item in items:
        out.extend(_flat(item) if isinstance(item, (list, tuple)) else [item])
    return out


DRAFTS = {None: "plain decode", "mtp": "MTP pass (k=3)", "dflash": "DFlash (k=15)"}


def make_drafter(model, draft: str | None):
    """The MTP head as the API's defaults set it up: p-min 0.1, over the first 32768 ids (a large
    vocabulary's reduced draft vocabulary; random weights rank no tokens); or a random DFlash drafter at
    the target's width (5 layers, blocks of 16: the released Qwen3.5 drafters' shape), the same way."""
    vocabulary = list(range(min(DEFAULT_DRAFT_VOCAB, model.args.vocab_size)))
    if draft == "mtp":
        return MTPDrafter(model, DEFAULT_DRAFT_P_MIN, vocabulary)
    if draft == "dflash":
        from dflash_decode import random_drafter

        return DFlashDrafter(
            model, random_drafter(model, 5, 16, model.norm.weight.dtype), DEFAULT_DRAFT_P_MIN, vocabulary
        )
    return None


def steady_engine(model, tokenizer, rows: int, draft: str | None, temp: float) -> Engine:
    """An engine whose `rows` rows have read their prompts and decoded together for a few steps (plain rows
    overlap their passes where a GPU computes, as the engine does there)."""
    drafter = make_drafter(model, draft)
    # the MTP head's 3 drafts, its default where a GPU computes, also for the host's time at tiny widths on
    # the CPU (where its default is 2: `ops.verified_tokens_cost_arithmetic`); a DFlash drafter's block less one
    k = drafter.default_draft_tokens if draft == "dflash" else 3
    engine = Engine(model, tokenizer, drafter, k, adaptive=False, max_batch=rows, prefix_store=PrefixStore(0))
    for row in range(rows):
        engine.submit([3 + row] * (8 + row), max_tokens=10_000, stop_tokens=[], temp=temp, seed=row)
    for _ in range(rows + 3):
        engine.step()
    return engine


def held_arrays(engine: Engine) -> list[mx.array]:
    """What the rows hold after a step: caches, drafters' caches and states, last hidden states."""
    arrays = []
    for row in engine.rows:
        arrays += [a for c in row.cache for a in c.arrays]
        drafter = row.drafter
        if isinstance(drafter, DFlashDrafter):
            arrays += [a for c in drafter.cache for a in c.arrays] + [span.states for span in drafter.pending]
        elif drafter is not None:
            arrays += [a for a in drafter.cache.arrays] + [drafter.pending_hidden]
        arrays.append(row.last_hidden)
    return [a for a in arrays if isinstance(a, mx.array)]


def launches(model, tokenizer, rows: int, draft: str | None, temp: float) -> tuple[int, DeviceUse]:
    engine = steady_engine(model, tokenizer, rows, draft, temp)
    use = DeviceUse(graphs=True)
    with use.counting():
        engine.step()
    use.nodes += graph_nodes(held_arrays(engine))
    return summary(use.nodes)["launches"], use


def host_ms(model, tokenizer, rows: int, draft: str | None, temp: float, repeats: int) -> float:
    engine = steady_engine(model, tokenizer, rows, draft, temp)
    times = []
    for _ in range(repeats):
        use = DeviceUse(graphs=False)
        with use.counting():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started - use.wait_seconds)
        mx.eval(held_arrays(engine))
    return statistics.median(times) * 1e3


def mlx_lm_step(model, rows: int):
    """One steady-state decode step of mlx-lm's (a call): `generate_step` for one row, else its
    BatchGenerator."""
    from mlx_lm.generate import BatchGenerator, generate_step

    if rows == 1:
        steps = generate_step(mx.array([3] * 8), model, max_tokens=10_000)
        for _ in range(4):
            next(steps)
        return lambda: next(steps)
    generator = BatchGenerator(model, max_tokens=10_000)
    generator.insert([[3 + row] * (8 + row) for row in range(rows)])
    for _ in range(rows + 4):
        generator.next_generated()
    return generator.next_generated


def mlx_lm_counts(checkpoint: str, rows: int, repeats: int) -> tuple[int, DeviceUse, float]:
    """(launches, the step's DeviceUse, host ms) of mlx-lm's decode step."""
    import mlx_lm

    model, _ = mlx_lm.load(checkpoint)
    model.set_dtype(mx.bfloat16)
    step, use = mlx_lm_step(model, rows), DeviceUse(graphs=True)
    with use.counting():
        step()
    tiny, _ = mlx_lm.load(str(FIXTURE.parent / "hf"))
    step, times = mlx_lm_step(tiny, rows), []
    for _ in range(repeats):
        timing = DeviceUse(graphs=False)
        with timing.counting():
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started - timing.wait_seconds)
    return summary(use.nodes)["launches"], use, statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-0.8b", help="a shape of benchmarks/shapes.py for the launches")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--temp", type=float, default=0.0, help="the rows' temperature (0: greedy)")
    p.add_argument("--mlx-lm", metavar="CHECKPOINT", help="count mlx-lm's decode step too, on this checkpoint")
    args = p.parse_args()
    from shapes import SHAPES, random_model

    tiny, tokenizer = mlx_hybrid.load(FIXTURE)
    with gpu_path_graph():
        model = random_model(SHAPES[args.shape](), mx.bfloat16)
        print(f"{'step':<18} {'rows':>4} {'launches':>9} {'waits':>6} {'queued':>7} {'host ms':>8}")
        for draft, name in DRAFTS.items():
            for rows in args.rows:
                count, use = launches(model, tokenizer, rows, draft, args.temp)
                host = host_ms(tiny, tokenizer, rows, draft, args.temp, args.repeats)
                print(f"{name:<18} {rows:>4} {count:>9} {use.waits:>6} {use.queued:>7} {host:>8.2f}")
        for rows in args.rows if args.mlx_lm else ():
            count, use, host = mlx_lm_counts(args.mlx_lm, rows, args.repeats)
            print(f"{'mlx-lm decode':<18} {rows:>4} {count:>9} {use.waits:>6} {use.queued:>7} {host:>8.2f}")


if __name__ == "__main__":
    main()

"""How a pass is evaluated on this compute path: what the host queues as it builds, and what it waits
for before building on."""

from __future__ import annotations

import mlx.core as mx

from . import backend, cpu_kernels


# Our CPU kernels run a product of fewer weights than this on the calling thread alone (csrc:
# gemv_forward.c's and int8_products.cpp's 1 << 20), leaving the other cores free.
ONE_THREAD_WEIGHTS = 1 << 20


def _host_builds_beside(widest_product: int) -> bool:
    """Whether the CPU computes a model every product of which runs on one thread, so that the host
    has a core of its own to build on while the CPU's thread computes (the decisions below)."""
    return widest_product < ONE_THREAD_WEIGHTS and not backend.gpu_computes()


def layer_built(output: mx.array, widest_product: int, evaluate: bool = False):
    """Hand a layer's output to the compute path as soon as it is built. widest_product: the most
    weights one product of the model multiplies (its `widest_product`). evaluate: compute it before
    building on (a prompt's layers, `prefill_layer_by_layer`).

    On the CPU, where every product of the model runs on one thread, the output is queued
    (`mx.async_eval`): the CPU computes this layer while the host builds the next on a free core.
    MLX lets the host run only about 100 dispatches ahead of its CPU stream (MAX_ACTIVE_TASKS tasks
    of DISPATCHES_PER_TASK, mlx/transforms.cpp and backend/cpu/encoder.h), so a pass queued whole
    returns from `async_eval` only once all but its last 50 or so ops are done: building a pass did
    not overlap computing it. The bundled model (2 cores, benchmarks/layer_queue.py, 7 alternated
    rounds): plain decoding 251 -> 307 tokens/s, MTP 300 -> 331, DFlash 269 -> 278.

    The kernels of a layer so queued keep to one thread (`cpu_kernels.keep_to_one_thread`): the
    larger jobs of a verify pass (its head's product over 4 tokens or more, attention, the delta rule
    over 8) would otherwise wake a helper on the core the host builds on. The bundled model
    (benchmarks/layer_queue.py, 9 alternated rounds): MTP 338 -> 382 tokens/s, DFlash 267 -> 313,
    plain decoding within the rounds' spread. A prompt's layers, evaluated in turn, take every core.

    Where products run on every core, the host's building would hold up one of their threads (the
    0.8B shape, queued regardless: 0.96x). Where a GPU computes, the engine queues whole passes a
    step ahead (`overlap_decode_steps`), and nothing is queued here.
    """
    queued = not evaluate and _host_builds_beside(widest_product)
    if backend.cpu_kernels_built():
        cpu_kernels.keep_to_one_thread(queued)
    if evaluate:
        mx.eval(output)
    elif queued:
        try:
            mx.async_eval(output)
        except ValueError:  # a graph being transformed (mx.grad, mx.compile), which MLX queues whole
            pass


def read_draft_verdicts_first(widest_product: int) -> bool:
    """Whether a speculative pass reads its drafts' p-min verdicts before it builds the pass that
    verifies them, and verifies the sure drafts only (a plain step where none is), rather than
    verifying every draft and cutting at the first unsure one after, in one wait a pass. Drafting
    then reads after each draft and stops at a row's first unsure one (`drafting.draft_rows`).

    Yes on the CPU where products run on every core, where the wait costs the host little and every
    token verified costs its products (the 0.8B shape, drafts that never land: 0.81x plain decoding
    verifying them, 0.98x reading first). Not where the host builds beside the CPU's one thread
    (`layer_built`): the wait would empty the queue it keeps ahead (the bundled model,
    benchmarks/layer_queue.py, 9 alternated rounds: MTP 382 -> 435 tokens/s in one wait, DFlash 313
    -> 339). Not where a GPU computes, which a wait between the two would leave idle.
    """
    return not backend.gpu_computes() and not _host_builds_beside(widest_product)


def open_drafting_with_pass(widest_product: int) -> bool:
    """Whether a greedy row's drafter takes its next round's first step while the verify pass computes
    (`Drafter.opens_from_pass`: the MTP head over every position the pass verified, each with the token
    the pass chose after it, built and queued behind the read of its tokens), rather than when that
    round drafts.

    Yes where the host builds beside the CPU's one thread (`layer_built`): the step is built while the
    host waits for the pass's last layers, where drafting that round would have built it while MLX's
    thread waited for the host (the bundled model's MTP head: a few percent at most, within the spread
    of benchmarks/layer_queue.py; drafting 1.3-1.8 ms a pass, was 1.6-1.9). Not measured where
    products run on every core or a GPU computes.
    """
    return _host_builds_beside(widest_product)


def drafts_stop_below_p_min(widest_product: int) -> bool:
    """Whether a drafter stops at its first draft under p-min by default (`drafting.DEFAULT_DRAFT_P_MIN`),
    rather than proposing every draft a round asks for (p-min 0; drafts that keep missing still back
    off, `speculative.DraftingPolicy`). A request's own p-min is always kept.

    Yes where the verdicts are read before the verify pass (`read_draft_verdicts_first`): the pass then
    verifies the sure drafts only. Not where the host builds beside the CPU's one thread (`layer_built`):
    the pass verifies every draft there, so a verdict only cuts drafts it has verified and would accept,
    and costs each draw three operations (the top logit, the log-sum-exp, the mark; the bundled model,
    eval_tiny.py's held-out prompts, `benchmarks/layer_queue.py --held-out 8 --tokens 128 --rounds 5`:
    MTP at its default settings 466 -> 562 tokens/s, DFlash 437 -> 445; docs/benchmarks.md). Where a
    GPU computes, not measured, so kept.
    """
    return not _host_builds_beside(widest_product)


def verified_tokens_cost_arithmetic(widest_product: int) -> bool:
    """Whether each token a verify pass verifies costs about a decode step's share of arithmetic, so that
    the MTP head asks for fewer drafts a round by default (`drafting.MTPDrafter`), and a block drafter
    at most 7 (`drafting.DFlashDrafter`, whose blocks are as long as its rounds ask: a 16-position
    block costs its drafter's products too).

    Yes where the host builds beside the CPU's one thread (`layer_built`): a model that small computes
    rather than waits on its weights, and its third draft, accepted about half the time, costs a head
    step and a token verified (the bundled model, held-out prompts, default settings: 1.22-1.23x plain
    decoding at 2 drafts, 1.09-1.12x at 3, examples/eval_tiny.py; the DFlash drafter at up to 7 as fast
    as at up to 15 or faster, 1.30-1.49x against 1.22-1.42x; docs/benchmarks.md). Not where
    products wait on memory (the 0.8B shape on the CPU) or a GPU computes: a token more costs a pass
    little there.
    """
    return _host_builds_beside(widest_product)


def overlap_decode_steps(widest_product: int) -> bool:
    """Whether decoding builds and queues step t+1 before handing out token t, for a model whose widest
    product multiplies `widest_product` weights.

    Yes where a GPU computes. On the CPU, where every product runs on one thread (as in
    `layer_built`): the bundled model, its layers queued as built, 307 -> 363 tokens/s
    (benchmarks/layer_queue.py, 7 alternated rounds). Not where products run on every core, from
    whose threads building the next step takes a core (2 cores, Qwen3.5-0.8B shape: 7.8 tokens/s
    stepping in turn, 7.5 overlapped).
    """
    return backend.gpu_computes() or _host_builds_beside(widest_product)


def prefill_layer_by_layer() -> bool:
    """Whether a prompt chunk is evaluated one layer at a time (the trunk's
    `hidden_states(evaluate_each_layer=True)`).

    Yes on the CPU: MLX allocates the outputs of the work it has queued ahead of the threads
    computing it, so a chunk built whole holds the intermediates of several layers (about
    twice the peak over the weights, at the same speed: benchmarks/bench_generate.py prints
    it). Where a GPU computes each layer would wait for the GPU: not measured there, so not
    done.
    """
    return not backend.gpu_computes()

"""What the commands share once their arguments are read: loading a model with its drafter, the engine
they drive and how they drive it, the rates they report."""

from __future__ import annotations

import os
import signal
import sys

from mlx_hybrid.drafting import AUTO, SpeculationSettings, resolve_draft
from mlx_hybrid.loaders import load_draft_model

from .common import launched


def describe_speculation(speculation, drafter) -> str:
    """How drafting is set up (`SpeculationSettings`, the drafter made from them), for --verbose."""
    from mlx_hybrid.draft_vocab import resolved_size
    from mlx_hybrid.drafting import DraftModelDrafter, NgramDrafter
    from mlx_hybrid.drafting.dflash import DFlashDrafter

    if drafter is None:
        return "off"
    kinds = {DFlashDrafter: "dflash", NgramDrafter: "ngram", DraftModelDrafter: "draft model"}
    kind = kinds.get(type(drafter), "mtp")
    described = f"{kind}, up to {speculation.draft_tokens_for(drafter)} drafts a round"
    if kind == "dflash":
        return described + f" (blocks of {drafter.model.args.block_size})"
    if kind != "ngram":
        size = resolved_size(speculation.draft_vocab, drafter.model.args.vocab_size)  # the MTP head's, a draft model's
        described += f" over {f'{size} tokens' if size else 'the whole vocabulary'}"
    p_min = getattr(drafter, "draft_p_min", 0)  # (n-gram lookup has no confidence)
    if p_min > 0:
        return described + f", p-min {p_min}"
    return described + (", backing off after misses" if speculation.adaptive else ", exactly k")


def load_engine(args, **options):
    """(model, tokenizer, the engine a command drives, a line describing the setup) from the model,
    draft and --kv-* arguments, the rest of the engine's options as its constructor's; for a split
    model, an engine that runs in step on every rank. Raises MlxHybridError (GenerationError for
    contradictory options)."""
    import mlx_hybrid
    from mlx_hybrid import GenerationError, ops
    from mlx_hybrid.engine import Engine, ReplicatedEngine
    from mlx_hybrid.blas import active_blas
    from mlx_hybrid.loaders.quantized import size_text
    from mlx_hybrid.parallel import launched_group

    group = launched_group()
    if args.pipeline and group is None:
        raise GenerationError("--pipeline splits a model over the processes of an mlx.launch run; this is one process")
    model, tokenizer = mlx_hybrid.load(
        args.model or mlx_hybrid.bundled_model_path(),
        dtype=args.dtype,
        compact=args.compact,
        group=group,
        pipeline=args.pipeline,
        mmproj=args.mmproj,
        mtp=args.mtp_from,
        cpu_activations=args.cpu_activations,
    )
    if args.draft_model and args.draft not in (None, "dflash"):
        raise GenerationError(f"--draft {args.draft} and --draft-model contradict each other: give one")
    draft_model = load_draft_model(args.draft_model, dtype=args.dtype) if args.draft_model else None
    draft = resolve_draft(model, args.draft or AUTO, draft_model)  # a DFlash drafter as the draft model: dflash
    speculation = SpeculationSettings(draft, draft_model, args.num_draft_tokens, args.draft_vocab, args.draft_p_min)
    drafter = speculation.drafter(model, tokenizer)  # built here: its errors are the options'
    described = (
        f"model: {model.model_type}, {model.args.num_hidden_layers} layers, weights {size_text(model.nbytes)} in memory; "
        f"linear-attention ops: {ops.backend_name()}; BLAS: {active_blas()}; "
        f"speculation: {describe_speculation(speculation, drafter)}"
        + ("; reads images" if model.has_vision else "")
        + (f"; tables of {size_text(model.mapped_nbytes)} read by rows from their files" if model.mapped_nbytes else "")
    )
    if args.kv_bits:
        described += f"; KV cache in {args.kv_bits} bits, groups of {args.kv_group_size}"
    if model.parallel is not None:
        described += f"; {model.parallel.describe()}"
    kind = Engine if model.parallel is None else ReplicatedEngine
    kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size}
    return model, tokenizer, kind.speculating(model, tokenizer, speculation, drafter, **kv, **options), described


def follow(engine, sequence, show) -> bool:
    """Hand each of `sequence`'s events to `show` until it ends; whether Ctrl-C stopped it.
    Ctrl-C cancels it: the engine ends it at its next step, keeping what it generated (and a
    checkpoint of it), and the events up to then are still shown, each whole. Ctrl-C only asks
    for the cancellation here: raised inside `show`, it would drop part of an event's text, and
    the conversation would keep an answer that is not what the model read (its checkpoint then
    no longer a prefix of the next turn)."""
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: sequence.cancel())
    except ValueError:  # not the main thread, where Python delivers Ctrl-C
        previous = None
    try:
        for event in engine.drive(sequence):
            show(event)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return sequence.finish_reason == "cancelled"


def on_every_rank(engine, command) -> int:
    """Run `command()` (which drives `engine`) while the engine steps on its own thread; under
    mlx.launch on rank 0, while the other ranks follow its engine until it is done."""
    from mlx_hybrid.engine import ReplicatedEngine

    if isinstance(engine, ReplicatedEngine) and not engine.leader:
        engine.follow()
        return 0
    # on its own thread, a step is never cut in half by Ctrl-C (which lands on this one, while
    # it waits for events), and rank 0 keeps the others in step while `command` waits (for
    # input, between a chat's turns) instead of leaving them waiting in a collective
    engine.start()
    try:
        return command()
    finally:
        engine.stop()


def decode_rate(generated: int, first_at: float | None, end: float) -> float:
    """Tokens/s after the first token (which the prompt's time pays for)."""
    return (generated - 1) / (end - first_at) if first_at and end > first_at and generated > 1 else 0.0


def percentages(rates: list[float]) -> str:
    return ", ".join(f"{rate:.0%}" for rate in rates) or "none drafted"


def run_command(main):
    """A command's entry point: OpenBLAS preferred (the process restarts once with it preloaded, where
    installed: Linux), then `main()`, quiet where its reader leaves early, its status the exit status."""
    from mlx_hybrid.blas import prefer_optimized_blas

    prefer_optimized_blas()
    exit_with(quiet_on_closed_pipe(main))


def exit_with(status: int | None):
    """End the command with `status`. A rank of an mlx.launch run ends at once, its output flushed:
    at exit MLX's ring backend joins its socket threads (`RingGroup`'s destructor), which can wait
    forever where the other rank closed its sockets first, leaving a rank that never exits after
    its work is done (seen under load with MLX 0.32.4)."""
    if launched():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError):  # a reader gone, or a stream closed: nothing to keep
                pass
        os._exit(status or 0)
    sys.exit(status)


def quiet_on_closed_pipe(command) -> int:
    """Run a command whose output may go to a reader that leaves early (`| head`): it ends
    quietly, as Unix tools do, with the status of a process that SIGPIPE ended."""
    try:
        return command()
    except BrokenPipeError:
        # stdout's last flush, at exit, would fail again: send what is left nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE

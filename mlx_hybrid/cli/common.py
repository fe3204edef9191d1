"""What the commands share (`mlx_hybrid.generate`, `.chat`, `.server`, `.convert`): their
arguments, one-line usage errors, loading a model with its drafter, the engine they drive
and how they drive it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from mlx_hybrid.drafting import AUTO, SpeculationSettings, resolve_draft
from mlx_hybrid.drafting.base import DEFAULT_DRAFT_TOKENS
from mlx_hybrid.errors import GenerationError
from mlx_hybrid.loaders import DTYPES, load_draft_model
from mlx_hybrid.processors import Grammar
from mlx_hybrid.sampling import SEED_LIMIT, SamplingParams

USAGE_ERROR = 2


def add_model_arguments(p: argparse.ArgumentParser):
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file, a Hugging Face model directory, or a hub name: org/repo (downloads only the files "
        "a model needs, into the Hugging Face cache) or org/repo:file.gguf (default: the bundled tiny Qwen3.5 "
        "trained on Python's standard library)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="weight dtype (default: float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument(
        "--compact",
        action="store_true",
        help="a --model GGUF takes about its file's size in memory where its types are not held as stored "
        "(16-bit scales; Q6_K, Q3_K, Q2_K, IQ types re-quantized to MLX's groups); slightly lossy. Where the "
        "x86-64 CPU kernels run, most types are already held as stored, exactly",
    )
    p.add_argument(
        "--cpu-activations",
        choices=["float32", "int8"],
        default=None,
        help="how a --model GGUF's quantized and 16-bit products compute on the CPU: int8 (as llama.cpp computes "
        "them: each row of activations quantized to 8 bits, integer sums; for F16 and BF16 matrices rounded to "
        "16 bits) or float32 (what its dequantized weights compute). Default: int8 for a GGUF file where this "
        "package's x86-64 CPU kernels compute it, float32 elsewhere",
    )
    p.add_argument(
        "--mmproj",
        default=None,
        metavar="FILE",
        help="a GGUF model's vision projector (llama.cpp's mmproj file), which lets it read images (default: the "
        "one mmproj*.gguf beside the model, if any)",
    )
    p.add_argument(
        "--mtp-from",
        default=None,
        metavar="PATH",
        help="take the MTP head from the checkpoint the --model was converted from (its Hugging Face directory "
        "or GGUF file): mlx-lm's and mlx-vlm's conversions drop it. Only its mtp.* tensors are read; the head "
        "is quantized as the model is",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch: give each process consecutive layers (pipeline) instead of a share of every "
        "layer's heads (tensor parallel, the default)",
    )


def seed(text: str) -> int:
    """--seed's type: an integer MLX's random keys take."""
    value = at_least(0)(text)
    if value >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64), got {value}")
    return value


def at_least(minimum: int):
    """A type for an integer flag with a lower bound (checked when the flags are read, before any loading)."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    integer.__name__ = f"integer >= {minimum}"
    return integer


BYTE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def byte_count(text: str) -> int:
    """A flag's size in bytes: an integer, or one with a binary unit (512M, 8G, 1.5G; KiB, MiB, ... too)."""
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = number[-1:] if number[-1:] in BYTE_UNITS else ""
    try:
        value = float(number[: len(number) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 2147483648, 512M or 8G, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a size >= 0, got {text!r}")
    return int(value * BYTE_UNITS[unit])


byte_count.__name__ = "size in bytes"


# the flags of the sampling settings, each a SamplingParams field: (flag, type, metavar, its
# default, what it does); the commands default to the field's default, the server to none
SAMPLING_FLAGS = [
    ("--temp", float, "T", 0.0, "sampling temperature; 0 is greedy"),
    ("--top-p", float, "P", 1.0, "nucleus sampling mass (1: off)"),
    ("--top-k", int, "K", 0, "sample among the k likeliest tokens (0: off)"),
    ("--min-p", float, "M", 0.0, "drop tokens below min-p x the top probability (0: off)"),
    ("--repetition-penalty", float, "P", 1.0,
     "divide (multiply, if negative) the logits of the last --repetition-context-size tokens by P (1: off)"),
    ("--repetition-context-size", at_least(1), "N", 20, "tokens of prompt and output the repetition penalty reads"),
    ("--presence-penalty", float, "P", 0.0, "OpenAI's presence penalty, in [-2, 2]"),
    ("--frequency-penalty", float, "P", 0.0, "OpenAI's frequency penalty, in [-2, 2]"),
]  # fmt: skip


def flag_field(flag: str) -> str:
    """The SamplingParams field a flag of SAMPLING_FLAGS sets."""
    return flag.removeprefix("--").replace("-", "_")


def add_sampling_settings(p, defaults: bool = True):
    """The SAMPLING_FLAGS; defaults=False leaves a flag not given at None (see `sampling_settings`)."""
    for flag, kind, metavar, default, what in SAMPLING_FLAGS:
        p.add_argument(
            flag, type=kind, metavar=metavar, default=default if defaults else None,
            help=f"{what} (default: {default})" if defaults else what,
        )  # fmt: skip


def sampling_settings(args) -> dict:
    """The SamplingParams fields the SAMPLING_FLAGS set (those at None left out)."""
    values = {flag_field(flag): getattr(args, flag_field(flag)) for flag, *_ in SAMPLING_FLAGS}
    return {name: value for name, value in values.items() if value is not None}


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int = 256):
    p.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default: {max_tokens})"
    )
    add_sampling_settings(p)
    p.add_argument("--seed", type=seed, default=None, help="random seed for sampling, in [0, 2**64)")


def grammar_file(kind: str):
    """A type for a flag naming a grammar file (for "regex": giving the expression): the `Grammar`
    it holds, checked (a "grammar" file is GBNF where it says `::=`, else Lark)."""

    def read(path: str) -> Grammar:
        try:
            text = Path(path).read_text() if kind != "regex" else path
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        if kind == "json_schema":
            try:
                json.loads(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(f"{path} is not JSON: {e}") from None
        try:
            return Grammar(("gbnf" if "::=" in text else "lark") if kind == "grammar" else kind, text)
        except GenerationError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return read


def add_grammar_arguments(p: argparse.ArgumentParser):
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--json-schema", type=grammar_file("json_schema"), default=None, dest="grammar", metavar="FILE",
        help="the output is JSON valid under the JSON schema in FILE",
    )  # fmt: skip
    what.add_argument(
        "--grammar", type=grammar_file("grammar"), default=None, dest="grammar", metavar="FILE",
        help="the output matches the grammar in FILE: llguidance's Lark, or llama.cpp's GBNF (rules with ::=)",
    )  # fmt: skip
    what.add_argument(
        "--regex", type=grammar_file("regex"), default=None, dest="grammar", metavar="R",
        help="the output matches the regular expression R (Rust regex syntax)",
    )  # fmt: skip


def sampling_params(args, **changes) -> SamplingParams:
    """The request settings of `add_sampling_arguments`' (and `add_grammar_arguments`') flags."""
    return SamplingParams(
        max_tokens=args.max_tokens, seed=args.seed, grammar=getattr(args, "grammar", None),
        **sampling_settings(args), **changes,
    )  # fmt: skip


def add_cache_arguments(p: argparse.ArgumentParser):
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=[4, 8],
        default=None,
        help="hold the attention layers' keys and values in 4 or 8 bits (groups of --kv-group-size features, "
        "a scale and bias each): about 3.6x (8 bits) or 6.4x (4 bits) less memory than float32 for long "
        "contexts, at the groups' rounding of the attention's inputs (default: unquantized)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=[32, 64, 128],
        default=64,
        help="features per scale of a --kv-bits cache (default: 64)",
    )


def add_draft_arguments(p: argparse.ArgumentParser):
    defaults = SpeculationSettings()  # what the API defaults to, the flags too
    # one way to say how to draft: two of these contradict each other (or repeat one another)
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--draft",
        choices=["mtp", "ngram", "dflash", "none"],
        default=None,
        help="how to draft: the model's MTP head, n-gram lookup in the prompt and output, a DFlash block "
        "drafter (--draft-model), or no speculation (default: mtp where the model has an MTP head, else none)",
    )
    how.add_argument("--mtp", action="store_const", dest="draft", const="mtp", help="the same as --draft mtp")
    how.add_argument("--no-mtp", action="store_const", dest="draft", const="none", help="the same as --draft none")
    p.add_argument(
        "--draft-model", default=None, metavar="PATH",
        help="speculative decoding with this draft model, or a DFlash drafter's directory (its config.json "
        "names DFlashDraftModel; --draft dflash may be given with it). Without it --draft dflash takes the "
        "model's own drafter: the directory <GGUF file stem>-dflash beside the file, as the bundled model has",
    )  # fmt: skip
    p.add_argument(
        "--num-draft-tokens", type=at_least(1), default=None, metavar="N",
        help=f"most tokens drafted per round (default: {DEFAULT_DRAFT_TOKENS}; a DFlash drafter's block less one)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="the MTP head or draft model drafts over the N most frequent tokens only; 0: all (default: 32768 for "
        "vocabularies over 65536, else all)",
    )
    p.add_argument(
        "--draft-p-min",
        type=float,
        default=defaults.draft_p_min,
        metavar="P",
        help=f"stop drafting when the draft's top probability is below P, and back off after misses; 0: always "
        f"draft --num-draft-tokens (default: {defaults.draft_p_min})",
    )


def launched_rank() -> int:
    """This process's rank in an mlx.launch run (0 without one), read before MLX starts."""
    return int(os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


INTERRUPTED = 128 + signal.SIGINT  # the exit status of a command Ctrl-C stopped


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit status 2, as every usage error here."""

    def error(self, message):
        sys.exit(fail(f"{message} (see {self.prog} --help)"))


def fail(message: str, code: int = USAGE_ERROR):
    rank = launched_rank()
    print(f"{f'rank {rank}: ' if rank else ''}error: {message}", file=sys.stderr)
    return code


def describe_speculation(args, drafter, draft_tokens: int) -> str:
    """How drafting is set up, for --verbose."""
    from mlx_hybrid.draft_vocab import resolved_size
    from mlx_hybrid.drafting import DraftModelDrafter, NgramDrafter
    from mlx_hybrid.drafting.dflash import DFlashDrafter

    if drafter is None:
        return "off"
    kinds = {DFlashDrafter: "dflash", NgramDrafter: "ngram", DraftModelDrafter: "draft model"}
    kind = kinds.get(type(drafter), "mtp")
    described = f"{kind}, up to {draft_tokens} drafts a round"
    if kind == "dflash":
        return described + f" (blocks of {drafter.model.args.block_size})"
    if kind != "ngram":
        size = resolved_size(args.draft_vocab, drafter.model.args.vocab_size)  # the MTP head's, a draft model's
        described += f" over {f'{size} tokens' if size else 'the whole vocabulary'}"
    return described + (f", p-min {args.draft_p_min}" if args.draft_p_min > 0 else ", exactly k")


def load_for_generation(args):
    """(model, tokenizer, the engine's drafting: (SpeculationSettings, a drafter built from them), a
    line describing the setup) from the model and draft arguments; raises MlxHybridError
    (GenerationError for contradictory options)."""
    import mlx_hybrid
    from mlx_hybrid import GenerationError, ops
    from mlx_hybrid.blas import active_blas
    from mlx_hybrid.loaders.quantized import size_text
    from mlx_hybrid.parallel import launched_group

    group = launched_group()
    if args.pipeline and group is None:
        raise GenerationError("--pipeline splits a model over the processes of an mlx.launch run; this is one process")
    model, tokenizer = mlx_hybrid.load(
        args.model or mlx_hybrid.bundled_model_path(), dtype=args.dtype, compact=args.compact, group=group,
        pipeline=args.pipeline, mmproj=args.mmproj, mtp=args.mtp_from, cpu_activations=args.cpu_activations,
    )  # fmt: skip
    if args.draft_model and args.draft not in (None, "dflash"):
        raise GenerationError(f"--draft {args.draft} and --draft-model contradict each other: give one")
    draft_model = load_draft_model(args.draft_model, dtype=args.dtype) if args.draft_model else None
    draft = resolve_draft(model, args.draft or AUTO, draft_model)  # a DFlash drafter as the draft model: dflash
    speculation = SpeculationSettings(draft, draft_model, args.num_draft_tokens, args.draft_vocab, args.draft_p_min)
    drafter = speculation.drafter(model, tokenizer)  # built here: its errors are the options'
    described = (
        f"model: {model.model_type}, {model.args.num_hidden_layers} layers, weights {size_text(model.nbytes)} in memory; "
        f"linear-attention ops: {ops.backend_name()}; BLAS: {active_blas()}; "
        f"speculation: {describe_speculation(args, drafter, speculation.draft_tokens_for(drafter))}"
        + ("; reads images" if model.has_vision else "")
        + (f"; tables of {size_text(model.mapped_nbytes)} read by rows from their files" if model.mapped_nbytes else "")
    )
    if args.kv_bits:
        described += f"; KV cache in {args.kv_bits} bits, groups of {args.kv_group_size}"
    if model.parallel is not None:
        described += f"; {model.parallel.describe()}"
    return model, tokenizer, (speculation, drafter), described


def make_engine(model, tokenizer, drafting, args, **options):
    """The engine a command drives (drafting: as `load_for_generation` gives it; its caches as the
    --kv-* flags say); for a split model, one that runs in step on every rank."""
    from mlx_hybrid.engine import Engine, ReplicatedEngine

    kind = Engine if model.parallel is None else ReplicatedEngine
    speculation, drafter = drafting
    kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size}
    return kind.speculating(model, tokenizer, speculation, drafter, **kv, **options)


def follow(engine, sequence, show) -> bool:
    """Hand each of `sequence`'s events to `show` until it ends; whether Ctrl-C stopped it.
    Ctrl-C cancels it: the engine ends it at its next step, keeping what it generated (and a
    checkpoint of it), and the events up to then are still shown."""
    try:
        for event in engine.drive(sequence):
            show(event)
    except KeyboardInterrupt:
        sequence.cancel()
        for event in sequence.stream() if not sequence.done else ():
            show(event)
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


def quiet_on_closed_pipe(command) -> int:
    """Run a command whose output may go to a reader that leaves early (`| head`): it ends
    quietly, as Unix tools do, with the status of a process that SIGPIPE ended."""
    try:
        return command()
    except BrokenPipeError:
        # stdout's last flush, at exit, would fail again: send what is left nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE

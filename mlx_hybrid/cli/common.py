"""What the commands share (`mlx_hybrid.generate`, `.chat`, `.server`, `.convert`): their arguments and
one-line usage errors (what they do with them once read: `running`)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from mlx_hybrid.drafting import SpeculationSettings
from mlx_hybrid.drafting.base import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_DRAFT_TOKENS,
    FEWER_BLOCK_DRAFT_TOKENS,
    FEWER_DRAFT_TOKENS,
)
from mlx_hybrid.errors import GenerationError
from mlx_hybrid.loaders import DTYPES
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


def add_count(p: argparse.ArgumentParser, flag: str, minimum: int, default, help: str):
    """An integer flag N of at least `minimum`."""
    p.add_argument(flag, type=at_least(minimum), default=default, metavar="N", help=help)


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
            flag,
            type=kind,
            metavar=metavar,
            default=default if defaults else None,
            help=f"{what} (default: {default})" if defaults else what,
        )


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


GRAMMAR_FLAGS = (  # flag, what its argument is read as, metavar, help
    ("--json-schema", "json_schema", "FILE", "the output is JSON valid under the JSON schema in FILE"),
    (
        "--grammar",
        "grammar",
        "FILE",
        "the output matches the grammar in FILE: llguidance's Lark, or llama.cpp's GBNF (rules with ::=)",
    ),
    ("--regex", "regex", "R", "the output matches the regular expression R (Rust regex syntax)"),
)


def add_grammar_arguments(p: argparse.ArgumentParser):
    what = p.add_mutually_exclusive_group()
    for flag, kind, metavar, help in GRAMMAR_FLAGS:
        what.add_argument(flag, type=grammar_file(kind), default=None, dest="grammar", metavar=metavar, help=help)


def sampling_params(args, **changes) -> SamplingParams:
    """The request settings of `add_sampling_arguments`' (and `add_grammar_arguments`') flags."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        seed=args.seed,
        grammar=getattr(args, "grammar", None),
        **sampling_settings(args),
        **changes,
    )


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
        "--draft-model",
        default=None,
        metavar="PATH",
        help="speculative decoding with this draft model, or a DFlash drafter's directory (its config.json "
        "names DFlashDraftModel; --draft dflash may be given with it). Without it --draft dflash takes the "
        "model's own drafter: the directory <GGUF file stem>-dflash beside the file, as the bundled model has",
    )
    add_count(
        p,
        "--num-draft-tokens",
        1,
        None,
        f"most tokens drafted per round (default: {DEFAULT_DRAFT_TOKENS}; the MTP head of a model small enough "
        f"that the CPU computes each product on one thread, as the bundled one: {FEWER_DRAFT_TOKENS}; a DFlash "
        f"drafter's block less one, on such a model at most {FEWER_BLOCK_DRAFT_TOKENS})",
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
        f"draft --num-draft-tokens (default: {DEFAULT_DRAFT_P_MIN}; for a model small enough that the CPU computes "
        "each product on one thread, as the bundled one, no floor, backing off after misses)",
    )


# where mlx.launch gives a process its rank (its ring backend's, MPI's), the first one set
RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")


def launched() -> bool:
    """Whether this process is a rank of an mlx.launch run."""
    return any(name in os.environ for name in RANK_VARIABLES)


def launched_rank() -> int:
    """This process's rank in an mlx.launch run (0 without one), read before MLX starts."""
    return next((int(os.environ[name]) for name in RANK_VARIABLES if name in os.environ), 0)


INTERRUPTED = 128 + signal.SIGINT  # the exit status of a command Ctrl-C stopped


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit status 2, as every usage error here, and whose
    description and epilog keep their lines."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message):
        sys.exit(fail(f"{message} (see {self.prog} --help)"))


def fail(message: str, code: int = USAGE_ERROR):
    rank = launched_rank()
    print(f"{f'rank {rank}: ' if rank else ''}error: {message}", file=sys.stderr)
    return code

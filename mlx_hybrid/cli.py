"""The `mlx_hybrid.generate` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from mlx_hybrid.drafting import AUTO, DEFAULT_DRAFT_P_MIN, make_drafter, resolve_draft
from mlx_hybrid.sampling import SEED_LIMIT

USAGE_ERROR = 2

DESCRIPTION = """\
Generate text with a hybrid-attention model (Qwen3.5, Qwen3.5-MoE, Qwen3-Next,
Kimi Linear) from a .gguf file or a Hugging Face checkpoint directory. The text
streams to stdout; prompt and generation speed, peak memory and draft acceptance
go to stderr at the end.

Speculative decoding is on by default where the model has an MTP head (Qwen
families): the head drafts up to --num-draft-tokens tokens a round over a reduced
vocabulary, and the model verifies them in one pass. The output is exactly the
model's own (greedy: token for token). --draft ngram drafts by looking the last
tokens up in the prompt and output (any model); --no-mtp turns speculation off.
"""

EPILOG = """\
examples:
  mlx_hybrid.generate --prompt "def parse_args("              # the bundled model, MTP on
  mlx_hybrid.generate --prompt "def parse_args(" --no-mtp     # plain decoding
  mlx_hybrid.generate --model model.gguf --prompt "def parse_args(" --draft ngram
  echo "Hello" | mlx_hybrid.generate --model ./Qwen3.5-0.8B --prompt - --chat
  mlx_hybrid.generate --chat --system "$(cat long_rules.md)" --prompt "first question" --prompt-cache-file rules.cache
  mlx.launch --hostfile macs.json -- -m mlx_hybrid.generate --model big.gguf --prompt "hi"  # split over Macs
"""


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
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weight dtype (default: float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument(
        "--compact",
        action="store_true",
        help="a --model GGUF takes about its file's size in memory (16-bit scales, Q6_K re-quantized to "
        "6 bits); slightly lossy",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch: give each process consecutive layers (pipeline) instead of a share of every "
        "layer's heads (tensor parallel, the default)",
    )


def seed(text: str) -> int:
    """--seed's type: an integer MLX's random keys take."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64), got {value}")
    return value


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int = 256):
    p.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default: {max_tokens})"
    )
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0, off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--seed", type=seed, default=None, help="random seed for sampling, in [0, 2**64)")


def add_draft_arguments(p: argparse.ArgumentParser):
    # one way to say how to draft: two of these contradict each other (or repeat one another)
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--draft",
        choices=["mtp", "ngram", "none"],
        default=None,
        help="how to draft: the model's MTP head, n-gram lookup in the prompt and output, or no speculation "
        "(default: mtp where the model has an MTP head, else none)",
    )
    how.add_argument("--mtp", action="store_const", dest="draft", const="mtp", help="the same as --draft mtp")
    how.add_argument("--no-mtp", action="store_const", dest="draft", const="none", help="the same as --draft none")
    how.add_argument("--draft-model", default=None, metavar="PATH", help="speculative decoding with this draft model")
    p.add_argument(
        "--num-draft-tokens", type=int, default=3, metavar="N", help="most tokens drafted per round (default: 3)"
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
        default=DEFAULT_DRAFT_P_MIN,
        metavar="P",
        help=f"stop drafting when the draft's top probability is below P, and back off after misses; 0: always "
        f"draft --num-draft-tokens (default: {DEFAULT_DRAFT_P_MIN})",
    )


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mlx_hybrid.generate",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(p)
    p.add_argument("--prompt", required=True, help="the prompt text, or - to read it from stdin")
    add_sampling_arguments(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    add_draft_arguments(p)
    p.add_argument(
        "--prompt-cache-file",
        default=None,
        metavar="FILE",
        help="reuse the model's state over a long prompt prefix across runs: where FILE holds a prefix of this "
        "prompt, only the rest is prefilled; then the state after this prompt's reusable part (with --chat "
        "--system: the system message, else the whole prompt) is saved to FILE",
    )
    p.add_argument("--verbose", action="store_true", help="print the model and compute path to stderr")
    return p


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


def _speculation(args, draft, drafting_model) -> str:
    """How drafting is set up, for --verbose."""
    from mlx_hybrid.draft_vocab import resolved_size

    if draft is None and not args.draft_model:
        return "off"
    kind = "draft model" if args.draft_model else draft
    described = f"{kind}, up to {args.num_draft_tokens} drafts a round"
    if kind != "ngram":
        size = resolved_size(args.draft_vocab, drafting_model.args.vocab_size)
        described += f" over {f'{size} tokens' if size else 'the whole vocabulary'}"
    return described + (f", p-min {args.draft_p_min}" if args.draft_p_min > 0 else ", exactly k")


def load_for_generation(args):
    """(model, tokenizer, drafter, a line describing the setup) from the model and draft
    arguments; raises MlxHybridError (GenerationError for contradictory options)."""
    import mlx_hybrid
    from mlx_hybrid import GenerationError, ops
    from mlx_hybrid.blas import active_blas
    from mlx_hybrid.parallel import launched_group

    group = launched_group()
    if args.pipeline and group is None:
        raise GenerationError("--pipeline splits a model over the processes of an mlx.launch run; this is one process")
    model, tokenizer = mlx_hybrid.load(
        args.model or mlx_hybrid.bundled_model_path(), dtype=args.dtype, compact=args.compact, group=group,
        pipeline=args.pipeline,
    )  # fmt: skip
    draft_model = mlx_hybrid.load(args.draft_model, dtype=args.dtype)[0] if args.draft_model else None
    draft = resolve_draft(model, args.draft or AUTO, draft_model)
    drafter = make_drafter(model, tokenizer, draft, draft_model, args.draft_vocab, args.draft_p_min)
    described = (
        f"model: {model.model_type}, {model.args.num_hidden_layers} layers; "
        f"linear-attention ops: {ops.backend_name()}; BLAS: {active_blas()}; "
        f"speculation: {_speculation(args, draft, draft_model or model)}"
    )
    if model.parallel is not None:
        described += f"; {model.parallel.describe()}"
    return model, tokenizer, drafter, described


def make_engine(model, tokenizer, drafter, args, **options):
    """The engine a command drives; for a split model, one that runs in step on every rank."""
    from mlx_hybrid.engine import Engine, ReplicatedEngine

    kind = Engine if model.parallel is None else ReplicatedEngine
    return kind(model, tokenizer, drafter, args.num_draft_tokens, adaptive=args.draft_p_min > 0, **options)


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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import mlx_hybrid

    # under mlx.launch only rank 0 reads the prompt (and prints; see on_every_rank)
    prompt = sys.stdin.read() if args.prompt == "-" and launched_rank() == 0 else args.prompt
    if not prompt.strip():
        return fail("the prompt is empty")
    if args.system is not None and not args.chat:
        return fail("--system needs --chat")
    problem = _unwritable(args.prompt_cache_file) if args.prompt_cache_file else None
    if problem:  # before the model loads and generates
        return fail(f"--prompt-cache-file {args.prompt_cache_file}: {problem}")
    try:
        model, tokenizer, drafter, described = load_for_generation(args)
        if model.parallel is not None and args.prompt_cache_file:
            return fail("--prompt-cache-file is for one process; a split model cannot use it")
        run = _Run(model, tokenizer, drafter, args)
    except mlx_hybrid.MlxHybridError as e:
        return fail(str(e))
    return on_every_rank(run.engine, lambda: run.main(prompt, described))


class _Run:
    """One request through the engine (the same one the server drives), streamed to stdout."""

    def __init__(self, model, tokenizer, drafter, args):
        from mlx_hybrid.engine import PrefixStore

        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.store = PrefixStore(1 << 62)  # only what this run saves, or its prompt cache file
        self.engine = make_engine(model, tokenizer, drafter, args, max_batch=1, prefix_store=self.store)

    def main(self, prompt, described: str) -> int:
        import mlx_hybrid
        from mlx_hybrid.prompt import chat_prompt

        args = self.args
        if args.verbose:
            print(described, file=sys.stderr)
        try:
            reusable = None  # the token count whose state --prompt-cache-file keeps
            if args.chat:
                messages = [{"role": "system", "content": args.system}] if args.system else []
                rendered = chat_prompt(self.tokenizer, messages + [{"role": "user", "content": prompt}])
                prompt = rendered.ids
                if args.system and rendered.boundaries:
                    reusable = rendered.boundaries[0]
            statistics, stopped = self.generate(prompt, reusable)
        except mlx_hybrid.MlxHybridError as e:
            return fail(str(e))
        except KeyboardInterrupt:  # before generating (the template, the prompt cache)
            print(file=sys.stderr)
            return INTERRUPTED
        print()
        if statistics is not None:
            print(statistics, file=sys.stderr)
        return INTERRUPTED if stopped else 0

    def generate(self, prompt, reusable: int | None) -> tuple[str | None, bool]:
        """Stream the text; (the statistics line(s) for stderr, whether Ctrl-C stopped it)."""
        import time

        import mlx.core as mx

        from mlx_hybrid import GenerationError
        from mlx_hybrid.generation import StreamingDetokenizer, decode_rate

        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        boundary = self._load_prompt_cache(reusable or len(ids))
        mx.reset_peak_memory()
        start = time.perf_counter()
        sequence = self.engine.submit(
            ids, self.args.max_tokens, self.args.temp, self.args.top_p, self.args.top_k, self.args.min_p,
            self.args.seed, checkpoint_at=[boundary] if boundary else (),
        )  # fmt: skip
        detokenizer = StreamingDetokenizer(self.tokenizer)
        first_at = None

        def show(event):
            nonlocal first_at
            for token in event.tokens:
                first_at = first_at or time.perf_counter()
                sys.stdout.write(detokenizer.add(token))
            sys.stdout.flush()

        stopped = follow(self.engine, sequence, show)
        sys.stdout.write(detokenizer.finalize())
        if sequence.error:
            raise GenerationError(f"generation failed: {sequence.error}")
        self._save_prompt_cache(ids, boundary)
        if not sequence.tokens:
            return None, stopped
        end = time.perf_counter()
        read = len(ids) - sequence.cached_tokens
        generated = len(sequence.tokens)
        lines = [
            f"prompt: {len(ids)} tokens"
            + (f" ({sequence.cached_tokens} from the prompt cache)" if sequence.cached_tokens else "")
            + f", {read / (first_at - start):.1f} tokens/s | generation: {generated} tokens, "
            f"{decode_rate(generated, first_at, end):.1f} tokens/s | "
            f"peak memory: {mx.get_peak_memory() / 1e9:.3f} GB"
        ]
        if stopped:
            lines.append(f"stopped by Ctrl-C after {generated} tokens")
        if sequence.finish_reason == "length" and generated < self.args.max_tokens:
            lines.append(
                f"stopped at the model's context of {self.model.args.max_position_embeddings} tokens, "
                f"after {generated} of the {self.args.max_tokens} tokens --max-tokens asked for"
            )
        if sequence.stats is not None:
            lines.append(
                f"speculative: {sequence.stats.acceptance_rate:.1%} of drafts accepted "
                f"(by position in a round: {_percentages(sequence.stats.acceptance_by_position)}), "
                f"{sequence.stats.tokens_per_pass:.2f} tokens per trunk pass"
            )
        return "\n".join(lines), stopped

    def _load_prompt_cache(self, boundary: int) -> int | None:
        """Seed the store from --prompt-cache-file; the prompt position whose state it should keep."""
        from pathlib import Path

        from mlx_hybrid.engine import load_checkpoint

        path = self.args.prompt_cache_file
        if path is None:
            return None
        if Path(path).exists():
            self.store.save(load_checkpoint(path, self.model))
        return boundary

    def _save_prompt_cache(self, ids: list[int], boundary: int | None):
        from mlx_hybrid.engine import save_checkpoint

        checkpoint = self.store.entries.get(tuple(ids[:boundary])) if boundary else None
        if checkpoint is not None:
            save_checkpoint(self.args.prompt_cache_file, checkpoint)


def _unwritable(path) -> str | None:
    """Why a file cannot be written at `path` (None: it can)."""
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        return "is a directory"
    if not path.parent.is_dir():
        return f"no directory {path.parent}"
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "not writable"
    return None


def _percentages(rates: list[float]) -> str:
    return ", ".join(f"{rate:.0%}" for rate in rates) or "none drafted"


def entry():
    from mlx_hybrid.blas import prefer_optimized_blas

    prefer_optimized_blas()  # restarts once with OpenBLAS preloaded, where installed (Linux)
    sys.exit(quiet_on_closed_pipe(main))


def quiet_on_closed_pipe(command) -> int:
    """Run a command whose output may go to a reader that leaves early (`| head`): it ends
    quietly, as Unix tools do, with the status of a process that SIGPIPE ended."""
    try:
        return command()
    except BrokenPipeError:
        # stdout's last flush, at exit, would fail again: send what is left nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE

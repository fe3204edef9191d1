"""The `mlx_hybrid.generate` command."""

from __future__ import annotations

import argparse
import os
import sys

from .common import (
    INTERRUPTED,
    ArgumentParser,
    add_cache_arguments,
    add_draft_arguments,
    add_grammar_arguments,
    add_model_arguments,
    add_sampling_arguments,
    fail,
    launched,
    launched_rank,
    sampling_params,
)
from .running import (
    decode_rate,
    follow,
    load_engine,
    on_every_rank,
    percentages,
    run_command,
)

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
  mlx_hybrid.generate --model ./Qwen3.5-0.8B --chat --image photo.jpg --prompt "What is in this picture?"
  mlx_hybrid.generate --chat --system "$(cat long_rules.md)" --prompt "first question" --prompt-cache-file rules.cache
  mlx.launch --hostfile macs.json -- -m mlx_hybrid.generate --model big.gguf --prompt "hi"  # split over Macs
"""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="mlx_hybrid.generate", description=DESCRIPTION, epilog=EPILOG)
    add_model_arguments(p)
    p.add_argument("--prompt", required=True, help="the prompt text, or - to read it from stdin")
    add_sampling_arguments(p)
    add_grammar_arguments(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image for a model that reads them (repeatable): with --chat the images come before the prompt's "
        "text in its message; without, the prompt has one <|vision_start|><|image_pad|><|vision_end|> per image",
    )
    p.add_argument("--system", default=None, help="system message for --chat")
    add_draft_arguments(p)
    add_cache_arguments(p)
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import mlx_hybrid

    # under mlx.launch only rank 0 reads the prompt (and prints; see on_every_rank)
    prompt = sys.stdin.read() if args.prompt == "-" and launched_rank() == 0 else args.prompt
    if not prompt.strip():
        return fail("the prompt is empty")
    if args.system is not None and not args.chat:
        return fail("--system needs --chat")
    if args.image and not args.chat and "<|image_pad|>" not in prompt:
        return fail(
            "--image needs --chat (the chat template places the images), or one "
            "<|vision_start|><|image_pad|><|vision_end|> per image in the prompt"
        )
    if args.image and args.prompt_cache_file:
        return fail("--prompt-cache-file keeps text prompts only; it cannot be used with --image")
    if launched() and args.prompt_cache_file:
        return fail("--prompt-cache-file is for one process; it cannot be used under mlx.launch")
    missing = [path for path in args.image if not os.path.isfile(path)]
    if missing:
        return fail(f"--image {missing[0]}: no such file")
    try:
        sampling_params(args)  # the settings' ranges, before the model loads
    except mlx_hybrid.MlxHybridError as e:
        return fail(str(e))
    problem = _unwritable(args.prompt_cache_file) if args.prompt_cache_file else None
    if problem:  # before the model loads and generates
        return fail(f"--prompt-cache-file {args.prompt_cache_file}: {problem}")
    try:
        run = _Generation(args)
    except mlx_hybrid.MlxHybridError as e:
        return fail(str(e))
    return on_every_rank(run.engine, lambda: run.main(prompt))


class _Generation:
    """The model and its engine (the one the server drives), and one request through it, streamed to stdout."""

    def __init__(self, args):
        from mlx_hybrid.engine import PrefixStore

        self.args = args
        self.store = PrefixStore(1 << 62)  # only what this run saves, or its prompt cache file
        self.model, self.tokenizer, self.engine, self.described = load_engine(
            args, max_batch=1, prefix_store=self.store
        )

    def main(self, prompt) -> int:
        import mlx_hybrid
        from mlx_hybrid.prompt import chat_prompt, user_message

        args = self.args
        if args.verbose:
            print(self.described, file=sys.stderr)
        try:
            reusable = None  # the token count whose state --prompt-cache-file keeps
            if args.chat:
                messages = [{"role": "system", "content": args.system}] if args.system else []
                rendered = chat_prompt(self.tokenizer, messages + [user_message(prompt, len(args.image))])
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
        import mlx.core as mx

        from mlx_hybrid import GenerationError
        from mlx_hybrid.timing import Stopwatch
        from mlx_hybrid.tokenizer import StreamingDetokenizer

        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        boundary = self._load_prompt_cache(reusable or len(ids))
        mx.reset_peak_memory()
        watch = Stopwatch()  # a first run's kernel builds and checks are reported apart
        sequence = self.engine.submit(
            ids,
            params=sampling_params(self.args),
            checkpoint_at=[boundary] if boundary else (),
            images=self.args.image,
        )
        detokenizer = StreamingDetokenizer(self.tokenizer)
        first_at = None

        def show(event):
            nonlocal first_at
            for token in event.tokens:
                first_at = first_at or watch.elapsed()
                sys.stdout.write(detokenizer.add(token))
            sys.stdout.flush()

        stopped = follow(self.engine, sequence, show)
        sys.stdout.write(detokenizer.finalize())
        if sequence.error:
            raise GenerationError(f"generation failed: {sequence.error}")
        self._save_prompt_cache(ids, boundary)
        if not sequence.tokens:
            return None, stopped
        end = watch.elapsed()
        read = len(sequence.prompt) - sequence.cached_tokens
        generated = len(sequence.tokens)
        lines = [
            f"prompt: {len(sequence.prompt)} tokens"
            + (f" ({sequence.cached_tokens} from the prompt cache)" if sequence.cached_tokens else "")
            + f", {read / first_at:.1f} tokens/s | generation: {generated} tokens, "
            f"{decode_rate(generated, first_at, end):.1f} tokens/s | "
            f"peak memory: {mx.get_peak_memory() / 1e9:.3f} GB"
        ]
        if watch.one_time() >= 0.05:
            lines.append(f"first use: {watch.one_time():.1f} s building and checking the kernels (not counted above)")
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
                f"(by position in a round: {percentages(sequence.stats.acceptance_by_position)}), "
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
            self.store.save(load_checkpoint(path, self.model, self.engine.make_cache()))
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


def entry():
    run_command(main)

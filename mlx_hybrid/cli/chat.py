"""The `mlx_hybrid.chat` command: an interactive chat in the terminal."""

from __future__ import annotations

import argparse
import sys

from .common import (
    ArgumentParser,
    add_cache_arguments,
    add_draft_arguments,
    add_model_arguments,
    add_sampling_arguments,
    fail,
    sampling_params,
)
from .running import (
    decode_rate,
    follow,
    load_engine,
    on_every_rank,
    run_command,
)

DESCRIPTION = """\
Chat with a hybrid-attention model in the terminal. Answers stream as they are
generated (reasoning, where the model thinks, dimmed). The conversation's state is
kept after every turn, so each turn reads only its new message: the line after each
answer says how many prompt tokens were new.

Commands: /image FILE adds an image to the next message (models that read images),
/reset starts over, /quit (or Ctrl-D) leaves, /help lists them. Ctrl-C stops an answer.
"""

HELP = """\
/image FILE   add an image to your next message (models that read images)
/reset   forget the conversation (the system message stays)
/quit    leave (Ctrl-D does too)
/help    this list
Ctrl-C stops the answer being written."""

DIM, RESET = "\033[2m", "\033[0m"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="mlx_hybrid.chat", description=DESCRIPTION)
    add_model_arguments(p)
    p.add_argument("--system", default=None, help="the system message")
    add_sampling_arguments(p, max_tokens=1024)
    add_draft_arguments(p)
    add_cache_arguments(p)
    p.add_argument("--verbose", action="store_true", help="print the model and compute path at the start")
    return p


class ChatSession:
    """The conversation, and its turns through the engine."""

    def __init__(self, engine, tokenizer, args, out=sys.stdout):
        self.engine, self.tokenizer, self.args, self.out = engine, tokenizer, args, out
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.messages = list(self.system)
        self.images = []  # of the conversation's messages, in order
        self.pending_images = []  # for the next message
        self.dim = out.isatty()

    def reset(self):
        self.messages = list(self.system)
        self.images, self.pending_images = [], []

    def add_image(self, path: str):
        """Read an image for the next message now, so that a bad file is told at once (ImageError)."""
        from mlx_hybrid.images import ImageError, read_image

        if self.tokenizer.image_processor is None:
            raise ImageError("this model takes no images")
        self.pending_images.append(read_image(path))

    def turn(self, text: str) -> str:
        """Answer one user message (streamed to out); the statistics line."""
        from mlx_hybrid.parsers import OutputParser, prompt_opens_reasoning
        from mlx_hybrid.prompt import chat_prompt, user_message
        from mlx_hybrid.timing import Stopwatch
        from mlx_hybrid.tokenizer import StreamingDetokenizer

        messages = self.messages + [user_message(text, len(self.pending_images))]
        images = self.images + self.pending_images
        rendered = chat_prompt(self.tokenizer, messages)
        sequence = self.engine.submit(
            rendered.ids, params=sampling_params(self.args), checkpoint_at=rendered.boundaries, images=images
        )
        detokenizer = StreamingDetokenizer(self.tokenizer)
        # the chat offers the model no tools: a call it writes is shown as written
        parser = OutputParser(reasoning_opened=prompt_opens_reasoning(rendered.text), tool_calls=False)
        reasoning, content = [], []
        watch, first_at = Stopwatch(), None  # a first turn's kernel builds and checks left out

        def show(event):
            nonlocal first_at
            first_at = first_at or watch.elapsed()
            text = "".join(detokenizer.add(t) for t in event.tokens)
            if event.finish_reason is not None:
                text += detokenizer.finalize()
            self._show(parser.feed(text), reasoning, content)

        if follow(self.engine, sequence, show):  # a stopped answer is kept, and checkpointed
            self.out.write(" [stopped]")
        self._show(parser.finish(), reasoning, content)
        self.out.write("\n")
        if sequence.error:
            return f"error: {sequence.error}"
        answer = {"role": "assistant", "content": "".join(content)}
        if reasoning:
            answer["reasoning_content"] = "".join(reasoning)
        self.messages = messages + [answer]
        self.images, self.pending_images = images, []
        end = watch.elapsed()
        new = len(sequence.prompt) - sequence.cached_tokens
        generated = len(sequence.tokens)
        return (
            f"[prompt: {len(sequence.prompt)} tokens, {new} new, {new / (first_at or end):.1f} tokens/s | "
            f"answer: {generated} tokens, {decode_rate(generated, first_at, end):.1f} tokens/s]"
        )

    def _show(self, delta, reasoning: list, content: list):
        if delta.reasoning:
            reasoning.append(delta.reasoning)
            self.out.write(f"{DIM}{delta.reasoning}{RESET}" if self.dim else delta.reasoning)
        if delta.content:
            if reasoning and not content:
                self.out.write("\n")
            content.append(delta.content)
            self.out.write(delta.content)
        self.out.flush()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import mlx_hybrid

    try:
        model, tokenizer, engine, described = load_engine(args, max_batch=1)
    except mlx_hybrid.MlxHybridError as e:
        return fail(str(e))
    if not tokenizer.chat_template:
        return fail("this model has no chat template; use mlx_hybrid.generate for plain text")
    # under mlx.launch rank 0 talks to the terminal; the other ranks follow its engine
    return on_every_rank(engine, lambda: _converse(ChatSession(engine, tokenizer, args), args, described))


def _converse(session: ChatSession, args, described: str) -> int:
    import mlx_hybrid

    if args.verbose:
        print(described, file=sys.stderr)
    name = args.model or mlx_hybrid.bundled_model_path().stem
    print(f"chatting with {name}; /help for commands, /quit to leave", file=sys.stderr)
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if not line:
            continue
        if line.startswith("/"):
            command = line.split()[0]
            if command in ("/quit", "/exit"):
                return 0
            if command == "/reset":
                session.reset()
                print("(the conversation starts over)", file=sys.stderr)
            elif command == "/image":
                path = line[len(command) :].strip()
                try:
                    session.add_image(path)
                    print(f"(the next message shows {path})", file=sys.stderr)
                except mlx_hybrid.MlxHybridError as e:
                    print(f"error: /image {path}: {e}", file=sys.stderr)
            elif command == "/help":
                print(HELP, file=sys.stderr)
            else:
                print(f"unknown command {command}; /help lists them", file=sys.stderr)
            continue
        try:
            print(session.turn(line), file=sys.stderr)
        except mlx_hybrid.MlxHybridError as e:  # a context overflow, a template error: the turn is dropped
            print(f"error: {e}", file=sys.stderr)
        except KeyboardInterrupt:  # before the answer began: the turn is dropped
            print("\n(stopped before answering)", file=sys.stderr)


def entry():
    run_command(main)


if __name__ == "__main__":
    entry()

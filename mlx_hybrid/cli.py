"""The `mlx_hybrid.generate` command."""

from __future__ import annotations

import argparse
import sys

USAGE_ERROR = 2

DESCRIPTION = """\
Generate text with a hybrid-attention model (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)
from a .gguf file or a Hugging Face checkpoint directory. The text streams to
stdout; prompt and generation speed and peak memory go to stderr at the end.
"""

EPILOG = """\
examples:
  mlx_hybrid.generate --prompt "def parse_args(" --mtp
  mlx_hybrid.generate --model model.gguf --prompt "def parse_args("
  echo "Hello" | mlx_hybrid.generate --model ./Qwen3.5-0.8B --prompt - --chat
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_hybrid.generate",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a Hugging Face model directory (default: the bundled tiny Qwen3.5 trained on "
        "Python's standard library)",
    )
    p.add_argument("--prompt", required=True, help="the prompt text, or - to read it from stdin")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0, off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--mtp", action="store_true", help="speculative decoding, drafting with the model's MTP head")
    p.add_argument("--draft-model", default=None, metavar="PATH", help="speculative decoding with this draft model")
    p.add_argument("--num-draft-tokens", type=int, default=3, metavar="N", help="tokens drafted per round (default: 3)")
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
    p.add_argument("--verbose", action="store_true", help="print the model and compute path to stderr")
    return p


def _fail(message: str, code: int = USAGE_ERROR):
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import mlx_hybrid
    from mlx_hybrid import ops
    from mlx_hybrid.blas import active_blas

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        return _fail("the prompt is empty")
    if args.system is not None and not args.chat:
        return _fail("--system needs --chat")
    if args.mtp and args.draft_model:
        return _fail("choose one of --mtp and --draft-model")
    try:
        model, tokenizer = mlx_hybrid.load(
            args.model or mlx_hybrid.bundled_model_path(), dtype=args.dtype, compact=args.compact
        )
        draft_model = mlx_hybrid.load(args.draft_model, dtype=args.dtype)[0] if args.draft_model else None
        if args.verbose:
            print(
                f"model: {model.model_type}, {model.args.num_hidden_layers} layers; "
                f"linear-attention ops: {ops.backend_name()}; BLAS: {active_blas()}",
                file=sys.stderr,
            )
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": prompt})
            try:
                prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except Exception as e:  # jinja2 errors, a model without a template
                return _fail(f"chat template: {e}")
        last = None
        for response in mlx_hybrid.stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=args.max_tokens,
            temp=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            draft="mtp" if args.mtp else None,
            draft_model=draft_model,
            num_draft_tokens=args.num_draft_tokens,
        ):
            sys.stdout.write(response.text)
            sys.stdout.flush()
            last = response
    except mlx_hybrid.MlxHybridError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    print()
    if last is not None:
        print(
            f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s | "
            f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s | "
            f"peak memory: {last.peak_memory:.3f} GB",
            file=sys.stderr,
        )
        if last.acceptance_rate is not None:
            print(
                f"speculative: {last.acceptance_rate:.1%} of drafts accepted, "
                f"{last.tokens_per_pass:.2f} tokens per trunk pass",
                file=sys.stderr,
            )
    return 0


def entry():
    from mlx_hybrid.blas import prefer_optimized_blas

    prefer_optimized_blas()  # restarts once with OpenBLAS preloaded, where installed (Linux)
    sys.exit(main())

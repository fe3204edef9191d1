"""The `mlx_hybrid.server` command."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mlx_hybrid.engine.prefix_store import default_budget_bytes
from mlx_hybrid.errors import GenerationError
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.server.protocol import MAX_IMAGES, MAX_REQUEST_MIB

from .common import (
    ArgumentParser,
    add_cache_arguments,
    add_count,
    add_draft_arguments,
    add_model_arguments,
    add_sampling_settings,
    byte_count,
    fail,
    launched,
    launched_rank,
    sampling_settings,
)
from .running import load_engine, on_every_rank, run_command

# On SIGTERM or Ctrl-C, how long requests in flight may go on before they are ended: uvicorn's own
# default waits for them all, which for a long prompt's prefill or a long answer is minutes.
SHUTDOWN_GRACE_S = 5

DESCRIPTION = """\
Serve a hybrid-attention model over an OpenAI-compatible HTTP API:
POST /v1/chat/completions and /v1/completions (streaming as server-sent events),
GET /v1/models and /health. Requests run together on one batch engine, with
speculative decoding per request (on by default where the model has an MTP head),
and every conversation's state is checkpointed at its message boundaries, so the
next turn reads only its new messages (usage.prompt_tokens_details.cached_tokens).

Reasoning comes back in `reasoning_content` and tool calls (Qwen3 JSON, Qwen3.5
XML, Kimi) as OpenAI `tool_calls`.

The server listens on 127.0.0.1 only. --host 0.0.0.0 opens it to the network:
anyone who can reach the port can then use the model, so set --api-key too.
"""

EPILOG = """\
examples:
  mlx_hybrid.server                                   # the bundled model on 127.0.0.1:8080
  mlx_hybrid.server --model Qwen/Qwen3.5-0.8B --max-batch 4
  mlx_hybrid.server --model unsloth/Qwen3.5-4B-GGUF:Qwen3.5-4B-Q4_K_M.gguf --port 9000
  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello"}]}'
"""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="mlx_hybrid.server", description=DESCRIPTION, epilog=EPILOG)
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    add_draft_arguments(p)
    add_cache_arguments(p)
    add_count(
        p,
        "--max-request-mib",
        1,
        MAX_REQUEST_MIB,
        f"refuse (413) a request body over N MiB, as it arrives (default: {MAX_REQUEST_MIB})",
    )
    add_count(p, "--max-images", 0, MAX_IMAGES, f"most images a request may have (default: {MAX_IMAGES})")
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="read image_url parts naming files (file: URLs, paths) inside DIR only, after following symlinks "
        "and '..' (default: no files are read; images come as data: URLs)",
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch image_url parts with http(s) URLs, except from loopback, private, link-local and reserved "
        "addresses (cloud metadata services among them), also after a redirect (default: off)",
    )
    p.add_argument(
        "--allowed-image-hosts",
        nargs="+",
        default=(),
        metavar="HOST",
        help="with --allow-remote-images: hosts fetched even though their addresses are local or private",
    )
    add_count(p, "--max-batch", 1, 8, "most requests generating at once (default: 8)")
    p.add_argument(
        "--prefix-cache-bytes",
        type=byte_count,
        default=default_budget_bytes(),
        metavar="B",
        help="memory for prompt checkpoints (bytes, or with a unit: 512M, 8G), least recently used evicted "
        "first; a checkpoint holds its session's whole attention cache, and one larger than this is not kept; "
        "0: none (default: a quarter of this machine's memory, at most 8 GiB: "
        f"here {default_budget_bytes() / 1024**3:.1f} GiB)",
    )
    p.add_argument(
        "--prefix-cache-dir",
        default=None,
        metavar="DIR",
        help="spill evicted checkpoints to DIR, where a restarted server finds them again",
    )
    add_count(p, "--max-tokens", 1, 2048, "tokens to generate for requests that set no max_tokens (default: 2048)")
    defaults = p.add_argument_group(
        "request defaults",
        "for requests that omit these fields; over the checkpoint's own recommendation (generation_config.json, "
        "GGUF general.sampling.*), which is over OpenAI's defaults (temperature 1, the rest off); GET /v1/models "
        "shows what is in force",
    )
    add_sampling_settings(defaults, defaults=False)
    p.add_argument(
        "--api-key",
        default=os.environ.get("MLX_HYBRID_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ (default: $MLX_HYBRID_API_KEY, else none)",
    )
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def flag_defaults(args) -> dict:
    """The request defaults the flags give, each checked (before the model loads)."""
    defaults = sampling_settings(args)
    for name, value in defaults.items():
        try:
            SamplingParams(**{name: value})
        except GenerationError as e:
            raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
    return defaults


def image_access_of(args):
    """What image_url parts may reach (see `images.ImageAccess`), from the flags, checked."""
    from mlx_hybrid.images import ImageAccess

    local = None
    if args.allowed_local_media_path is not None:
        local = Path(args.allowed_local_media_path).expanduser()
        if not local.is_dir():
            raise ValueError(f"--allowed-local-media-path: {local} is not a directory")
    if args.allowed_image_hosts and not args.allow_remote_images:
        raise ValueError("--allowed-image-hosts names hosts to fetch from: it needs --allow-remote-images")
    return ImageAccess(local=local, remote=args.allow_remote_images, private_hosts=tuple(args.allowed_image_hosts))


def recommended_defaults(recommended: dict) -> dict:
    """The checkpoint's recommendations; one out of range is left out, with a warning."""
    defaults = {}
    for name, value in recommended.items():
        try:
            SamplingParams(**{name: value})
            defaults[name] = value
        except GenerationError as e:
            print(f"warning: not using the checkpoint's recommended {e}", file=sys.stderr)
    return defaults


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import uvicorn

    import mlx_hybrid
    from mlx_hybrid.engine import PrefixStore
    from mlx_hybrid.server import ServedModel, create_app

    try:
        flags = flag_defaults(args)
        image_access = image_access_of(args)
    except ValueError as e:
        return fail(str(e))
    if launched() and args.prefix_cache_dir:
        return fail("--prefix-cache-dir is for one process; under mlx.launch the checkpoints stay in memory")
    problem = _cannot_listen(args.host, args.port) if launched_rank() == 0 else None
    if problem:  # before the model loads, which can take minutes
        return fail(f"cannot listen on {args.host}:{args.port}: {problem}")
    try:
        store = PrefixStore(args.prefix_cache_bytes, directory=args.prefix_cache_dir)
        model, tokenizer, engine, described = load_engine(args, max_batch=args.max_batch, prefix_store=store)
    except mlx_hybrid.MlxHybridError as e:
        return fail(str(e))
    name = args.served_model_name or args.model or mlx_hybrid.bundled_model_path().stem
    defaults = recommended_defaults(tokenizer.generation_defaults) | flags
    served = ServedModel(
        name,
        tokenizer,
        engine,
        default_max_tokens=args.max_tokens,
        sampling_defaults=defaults,
        image_access=image_access,
        max_images=args.max_images,
        context=model.args.max_position_embeddings,
    )

    def serve() -> int:
        print(f"{described}\nserving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        uvicorn.run(
            create_app(served, args.api_key, args.max_request_mib << 20),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        return 0

    return on_every_rank(engine, serve)  # under mlx.launch rank 0 serves; the others follow its engine


def _cannot_listen(host: str, port: int) -> str | None:
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except (OSError, OverflowError) as e:
        return getattr(e, "strerror", None) or str(e)
    return None


def entry():
    run_command(main)

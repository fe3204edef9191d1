"""The server under concurrent clients: aggregate tokens/s of 1, 4 and 8 clients, each with
its own chat request, against the same requests run on the engine in this process.
Run by hand:

    python benchmarks/make_checkpoints.py --out bench_models --shapes qwen3.5-0.8b
    python benchmarks/server_throughput.py bench_models/qwen3.5-0.8b
    python benchmarks/server_throughput.py          # the bundled model (trained: MTP drafts land)

The server runs with its defaults (MTP speculation on where the model has a head) and no
prefix checkpoints, so no request is served from another's. Clients use the official
`openai` client, one thread each, all sent at once; a round's aggregate tokens/s is the
completion tokens of all its requests over the time from sending the first to the last
answer (prompt reading included). The same requests then run on an `Engine` in this
process, with the same drafter, for the server's own cost. Ratios are against one client.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library


def questions(n: int) -> list[str]:
    topics = [
        "parse a config file",
        "merge two sorted lists",
        "retry a request",
        "read a CSV",
        "walk a tree",
        "cache a function",
        "format a table",
        "split a path",
    ]
    return [f"Write a Python function to {topics[i % len(topics)]} (variant {i})." for i in range(n)]


def engine_round(model, tokenizer, drafter, clients: int, tokens: int) -> tuple[float, int]:
    from mlx_hybrid.engine import Engine, PrefixStore
    from mlx_hybrid.prompt import chat_prompt

    engine = Engine(model, tokenizer, drafter, max_batch=8, prefix_store=PrefixStore(0))
    start = time.perf_counter()
    sequences = [
        engine.submit(chat_prompt(tokenizer, [{"role": "user", "content": q}]).ids, tokens) for q in questions(clients)
    ]
    engine.run()
    generated = sum(len(s.tokens) for s in sequences)
    return generated / (time.perf_counter() - start), generated


def server_round(client, name: str, clients: int, tokens: int) -> tuple[float, int]:
    def ask(question):
        messages = [{"role": "user", "content": question}]
        response = client.chat.completions.create(model=name, messages=messages, max_tokens=tokens, temperature=0)
        return response.usage.completion_tokens

    with ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        generated = sum(pool.map(ask, questions(clients)))
    return generated / (time.perf_counter() - start), generated


def start_server(model_arg: list[str]) -> tuple[subprocess.Popen, str]:
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "mlx_hybrid.server", *model_arg, "--port", str(port)]
    process = subprocess.Popen([*command, "--prefix-cache-bytes", "0", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return process, url
        except OSError:
            if process.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not come up in 10 minutes")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--tokens", type=int, default=32, help="max_tokens of each request (default: 32)")
    p.add_argument("--clients", default="1,4,8", help="client counts (default: 1,4,8)")
    args = p.parse_args()
    import openai

    from mlx_hybrid.drafting import make_drafter

    counts = [int(c) for c in args.clients.split(",")]
    model_path = args.model or str(mlx_hybrid.bundled_model_path())
    model, tokenizer = mlx_hybrid.load(model_path)
    drafter = make_drafter(model, tokenizer, "mtp" if model.has_mtp else None)
    print(
        f"{model_path}: {model.model_type}, {model.args.num_hidden_layers} layers; speculation: "
        f"{'MTP' if drafter else 'off'}; {args.tokens} tokens a request",
        flush=True,
    )
    engine_round(model, tokenizer, drafter, 1, 4)  # warm up
    alone = {c: engine_round(model, tokenizer, drafter, c, args.tokens) for c in counts}
    del model, drafter

    process, url = start_server(["--model", model_path])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        name = client.models.list().data[0].id
        server_round(client, name, 1, 4)  # warm up
        served = {c: server_round(client, name, c, args.tokens) for c in counts}
    finally:
        process.terminate()
        process.wait()

    base = served[counts[0]][0]
    print(f"\n| clients | server tok/s | vs {counts[0]} client | tokens | engine in-process tok/s | server / engine |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c in counts:
        rate, generated = served[c]
        print(f"| {c} | {rate:.2f} | {rate / base:.2f}x | {generated} | {alone[c][0]:.2f} | {rate / alone[c][0]:.2f} |")


if __name__ == "__main__":
    main()

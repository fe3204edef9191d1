"""A coding agent's session, scripted: does each request read only what is new?

    python benchmarks/agent_session.py                                   # our server alone
    python benchmarks/agent_session.py --llama-server PATH/llama-server  # and llama-server beside it

Both servers load the same GGUF file (Qwen3.5-0.8B's shape, random weights, written once under
--models with the tokenizer and tool-calling chat template of tests/fixtures/assistant) and are driven the same way, by the official `anthropic`
client over Anthropic's Messages API (llama-server has it too), streamed, greedy:
- turn 1: a system prompt of --system-tokens tokens and --tools tool schemas (as coding agents send
  them every time), and the task;
- every turn: the model must call a tool (`tool_choice: any`; the random model's calls are held to
  the schemas by each server's grammar), the agent appends the reply as it came and a tool result of
  about --result-tokens tokens, and sends the whole conversation again.
Per turn, for each server: the prompt's tokens, how many came from a checkpoint (the reply's
`cache_read_input_tokens`), the share, the time to the reply's first event after `message_start`
(its first token: the prompt read), and the server's resident memory (VmRSS, and its peak VmHWM).
Targets: from turn 2 on at least 95% of each prompt from a checkpoint, and a time to first token
that follows the turn's new tokens rather than the session's length.

llama-server runs with its prompt cache on (its defaults: `--cache-ram`, context checkpoints for
recurrent models), `--jinja` for the chat template's tools, one slot, the same context.

--kv-bits 8 (or 4) adds a third server to choose in --servers, `mlx-hybrid-kv`: ours with
`--kv-bits`, so that a quantized cache's memory and times stand beside the float32 cache's in one run.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import mlx_hybrid  # noqa: F401  (first: on Linux it loads OpenBLAS before MLX's library)

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import free_port  # noqa: E402

FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "assistant"
WORDS = (
    "file",
    "module",
    "function",
    "test",
    "error",
    "branch",
    "commit",
    "change",
    "review",
    "build",
    "path",
    "value",
    "type",
    "return",
    "class",
    "import",
    "config",
    "option",
    "format",
    "line",
    "read",
    "write",
)


def checkpoint(models: Path) -> Path:
    """The GGUF both servers load, written on first use."""
    import mlx.core as mx

    from mlx_hybrid.export import save_gguf
    from mlx_hybrid.loaders import load
    from shapes import SHAPES, random_model

    path = models / "qwen3.5-0.8b.gguf"
    if not path.exists():
        models.mkdir(parents=True, exist_ok=True)
        _, tokenizer = load(FIXTURE_TOKENIZER)
        save_gguf(random_model(SHAPES["qwen3.5-0.8b"](), mx.float32), tokenizer, path)
    return path


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."


def prose(rng: random.Random, tokens: int, tokenizer) -> str:
    """Text of about `tokens` tokens: the fewest sentences of the words above whose text encodes to
    at least that many (counted a sentence at a time, then checked on the whole text near the end:
    encoding the whole each time is quadratic, hours at 128k tokens)."""
    sentences, estimate, start = [], 0, rng.getstate()

    def count(n):
        return len(tokenizer.encode(" ".join(sentences[:n])))

    while True:
        sentences.append(sentence(rng))
        estimate += len(tokenizer.encode(" " + sentences[-1]))
        if estimate >= tokens and count(len(sentences)) >= tokens:
            n = len(sentences)
            while n > 1 and count(n - 1) >= tokens:  # where a sentence's estimate ran ahead of the whole's
                n -= 1
            rng.setstate(start)  # then draw those n again: what follows draws as after the whole-text count
            return " ".join(sentence(rng) for _ in range(n))


def tool_schemas(count: int) -> list[dict]:
    """Tools like a coding agent's, with arguments a random model can finish (enums, short strings)."""
    return [
        {
            "name": f"tool_{i}",
            "description": f"Runs step {i} of the workflow on a file of the repository.",
            "input_schema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "maxLength": 8},
                    "mode": {"type": "string", "enum": ["read", "write", "check"]},
                },
                "required": ["mode"],
            },
        }
        for i in range(count)
    ]


class Runner:
    """A server process on 127.0.0.1 and its resident memory."""

    def __init__(self, name: str, command: list[str], port: int):
        self.name, self.port = name, port
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import urllib.request

        deadline = time.time() + 600
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.process.returncode}: {' '.join(command)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{name} did not come up")

    def memory_mib(self) -> tuple[float, float]:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return tuple(int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM"))

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def session(runner: Runner, args, system: str, tools: list[dict], results: list[str]) -> list[dict]:
    import anthropic

    messages = [{"role": "user", "content": "Fix the failing test in the repository."}]
    rows = []
    for turn in range(args.turns):
        # a client a turn: no kept-alive connection the server may have closed during a long turn
        client = anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{runner.port}", api_key="unused", max_retries=0, timeout=6 * 3600
        )
        start = time.perf_counter()
        first = None
        with client.messages.stream(
            model="m",
            max_tokens=args.max_tokens,
            system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            tools=tools,
            tool_choice={"type": "any"},
            messages=messages,
            extra_body={"temperature": 0},
        ) as events:
            for event in events:
                if first is None and event.type not in ("message_start", "ping"):
                    first = time.perf_counter() - start
            reply = events.get_final_message()
        usage = reply.usage
        prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
        rss, peak = runner.memory_mib()
        rows.append(
            {
                "turn": turn + 1,
                "prompt": prompt,
                "cached": usage.cache_read_input_tokens or 0,
                "ttft": first,
                "rss": rss,
                "peak": peak,
                "stop": reply.stop_reason,
            }
        )
        print(f"  {runner.name} turn {turn + 1}: {json.dumps(rows[-1])}", flush=True)
        content = [block.model_dump(exclude_none=True) for block in reply.content]
        calls = [block for block in content if block["type"] == "tool_use"]
        messages.append({"role": "assistant", "content": content or [{"type": "text", "text": "..."}]})
        result = results[turn % len(results)]
        if calls:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call["id"], "content": result} for call in calls
                    ],
                }
            )
        else:  # the reply was cut before its call closed: the agent says so
            messages.append({"role": "user", "content": result})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=Path("bench_models/agent_session"))
    p.add_argument("--llama-server", help="llama-server's executable, to run the same session against it")
    p.add_argument(
        "--servers",
        nargs="+",
        default=["mlx-hybrid", "llama-server"],
        choices=["mlx-hybrid", "mlx-hybrid-kv", "llama-server"],
        help="which to run (llama-server: with --llama-server; mlx-hybrid-kv: with --kv-bits)",
    )
    p.add_argument("--kv-bits", type=int, choices=[4, 8], help="mlx-hybrid-kv's --kv-bits")
    p.add_argument("--prefix-cache-bytes", help="our servers' --prefix-cache-bytes (default: the server's)")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--system-tokens", type=int, default=12000)
    p.add_argument("--tools", type=int, default=15)
    p.add_argument("--result-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per reply")
    p.add_argument("--context", type=int, default=32768)
    args = p.parse_args()
    from mlx_hybrid.loaders import load

    gguf = checkpoint(args.models)
    _, tokenizer = load(FIXTURE_TOKENIZER)
    rng = random.Random(0)
    system = prose(rng, args.system_tokens, tokenizer)
    results = [prose(rng, args.result_tokens, tokenizer) for _ in range(4)]
    tools = tool_schemas(args.tools)
    commands = {
        "mlx-hybrid": lambda port: (
            [
                sys.executable,
                "-m",
                "mlx_hybrid.server",
                "--model",
                str(gguf),
                "--port",
                str(port),
                "--served-model-name",
                "m",
                "--log-level",
                "warning",
            ]
            + (["--prefix-cache-bytes", args.prefix_cache_bytes] if args.prefix_cache_bytes else [])
        )
    }
    if args.kv_bits:
        commands["mlx-hybrid-kv"] = lambda port: commands["mlx-hybrid"](port) + ["--kv-bits", str(args.kv_bits)]
    if args.llama_server:
        commands["llama-server"] = lambda port: [
            args.llama_server,
            "-m",
            str(gguf),
            "--port",
            str(port),
            "--jinja",
            "-c",
            str(args.context),
            "-np",
            "1",
            "--log-disable",
        ]
    table = {}
    for name, command in [(name, command) for name, command in commands.items() if name in args.servers]:
        port = free_port()
        try:
            runner = Runner(name, command(port), port)
        except RuntimeError as e:  # one server that fails leaves the other's table
            print(f"  {name}: {e}", flush=True)
            continue
        try:
            table[name] = session(runner, args, system, tools, results)
        finally:
            runner.stop()
    names = list(table)
    if not names:
        return
    header = ["turn", "prompt tokens"] + [
        f"{n}: {c}" for n in names for c in ("from checkpoint", "share", "first token s", "RSS / peak MiB")
    ]
    print("\n| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for i in range(args.turns):
        cells = [str(i + 1), str(table[names[0]][i]["prompt"])]
        for n in names:
            row = table[n][i]
            cells += [
                str(row["cached"]),
                f"{row['cached'] / row['prompt']:.1%}",
                f"{row['ttft']:.2f}",
                f"{row['rss']:.0f} / {row['peak']:.0f}",
            ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

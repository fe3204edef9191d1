"""The vision tower beside llama.cpp's projector on the same files, in the same run.

    python benchmarks/vision_llama_cpp.py --make bench_models/vision --llama-cpp DIR   # once
    python benchmarks/vision_llama_cpp.py --dir bench_models/vision --llama-bin DIR/build/bin

--make writes a random Qwen3.5 checkpoint with Qwen3.5-0.8B's vision tower (12 blocks of width 768,
12 heads, 3072 hidden units, a 48 x 48 position grid, out to width 1024) over a two-layer text
model of width 1024 (the tower is what is timed), as Hugging Face safetensors through transformers
(torch and transformers needed), then as `model.gguf` and `mmproj-model.gguf` by llama.cpp's own
`convert_hf_to_gguf.py` (DIR: llama.cpp's source, with its gguf-py), float32.

Then one 1024x768 image (3072 patches, 768 tokens), timed by each in a process of its own, rounds
alternating:
- mlx-hybrid: `load(model.gguf)` (the projector beside it), the image cut into patches by the
  projector's preprocessing, the tower evaluated; a warm-up, then one timed call a round;
- llama.cpp: `llama-server --mmproj -v` (2 threads, as ours) sent the image in a chat request a
  round after a warm-up one; the time between its log's lines for the image going into the
  projector ("clip_encode: copying image") and its embeddings coming out ("output embedding shape").
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen35vl"
VISION = {  # Qwen3.5-0.8B's vision_config
    "model_type": "qwen3_5_vision", "depth": 12, "hidden_size": 768, "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 3072, "num_heads": 12, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "out_hidden_size": 1024, "num_position_embeddings": 2304,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
}  # fmt: skip
TEXT = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
}
SIZE = (1024, 768)


def make(directory: Path, llama_cpp: Path):
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    hf = directory / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    config = json.loads((FIXTURE / "hf" / "config.json").read_text())
    config["text_config"] |= TEXT
    config["vision_config"] = VISION
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "preprocessor_config.json"):
        shutil.copy(FIXTURE / "hf" / name, hf)
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(AutoConfig.for_model(**config))
    state = model.state_dict()
    # transformers holds no MTP block, which llama.cpp's converter and loader want: the full-attention
    # layer's shapes (layer 1), an fc from twice the width, and its norms
    full = "model.language_model.layers.1."
    for name, p in list(state.items()):
        if name.startswith(full) and "linear_attn" not in name:
            state["mtp.layers.0." + name[len(full) :]] = torch.empty(p.shape)
    width = TEXT["hidden_size"]
    state |= {"mtp.fc.weight": torch.empty(width, 2 * width)}
    state |= {
        f"mtp.{norm}.weight": torch.empty(width) for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")
    }
    weights = {}
    for name, p in state.items():
        if "norm" in name:
            weights[name] = 1.0 + 0.1 * torch.randn(p.shape) if name.endswith("weight") else torch.zeros(p.shape)
        elif p.ndim == 1:
            weights[name] = 0.02 * torch.randn(p.shape)
        else:
            weights[name] = torch.randn(p.shape) / p[0].numel() ** 0.5
    save_file(
        {k: v.float().contiguous() for k, v in weights.items()}, hf / "model.safetensors", metadata={"format": "pt"}
    )
    sys.path.insert(0, str(FIXTURE.parent))
    from make_vision import CONVERT  # the fixtures' tokenizer named for llama.cpp's converter

    env = {"PYTHONPATH": str(llama_cpp / "gguf-py"), "PATH": "/usr/bin:/bin"}
    script = [sys.executable, "-c", CONVERT, str(llama_cpp), str(hf), "--outtype", "f32"]
    subprocess.run([*script, "--outfile", str(directory / "model.gguf")], check=True, env=env)
    subprocess.run([*script, "--mmproj", "--outfile", str(directory / "mmproj-model.gguf")], check=True, env=env)
    print(f"wrote {directory / 'model.gguf'} and {directory / 'mmproj-model.gguf'}", file=sys.stderr)


def image_bytes() -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8))
    buffer = io.BytesIO()
    photo.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def run_ours(directory: Path, rounds: int) -> list[float]:
    import mlx_hybrid  # (OpenBLAS before MLX)

    import mlx.core as mx

    from mlx_hybrid.images import read_image

    model, tokenizer = mlx_hybrid.load(directory / "model.gguf")
    image = tokenizer.image_processor(read_image(image_bytes()))
    patches = mx.array(image.patches)
    print(f"mlx-hybrid: {image.patches.shape[0]} patches, {image.num_tokens} tokens", file=sys.stderr)
    mx.eval(model.vision(patches, image.grid))  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        mx.eval(model.vision(patches, image.grid))
        times.append(time.perf_counter() - start)
    return times


def run_llama_cpp(directory: Path, rounds: int, llama_bin: Path, threads: int) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    server = subprocess.Popen(
        [
            str(llama_bin / "llama-server"),
            "-m",
            str(directory / "model.gguf"),
            "--mmproj",
            str(directory / "mmproj-model.gguf"),
            "-t",
            str(threads),
            "-c",
            "4096",
            "--port",
            str(port),
            "--no-warmup",
            "-np",
            "1",
            "-v",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/health").status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        data = "data:image/jpeg;base64," + base64.b64encode(image_bytes()).decode()
        body = {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": data}}, {"type": "text", "text": "x"}],
                }
            ],
            "max_tokens": 1,
            "cache_prompt": False,
        }
        for _ in range(rounds + 1):  # the first: a warm-up
            request = urllib.request.Request(
                url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            urllib.request.urlopen(request, timeout=900).read()
    finally:
        server.terminate()
        server.wait()
    log.seek(0)
    text = log.read()

    def seconds(stamp: str) -> float:  # the log's minutes.seconds.milliseconds.microseconds
        minutes, whole, ms, us = (int(part) for part in stamp.split("."))
        return 60 * minutes + whole + ms / 1e3 + us / 1e6

    stamp = r"(\d+\.\d+\.\d+\.\d+) D clip_encode: "
    starts = [seconds(t) for t in re.findall(stamp + "copying image", text)]
    ends = [seconds(t) for t in re.findall(stamp + "output embedding shape", text)]
    tokens = re.findall(r"total (\d+) tokens", text)
    print(f"llama.cpp: {len(starts)} encodes{', ' + tokens[0] + ' tokens' if tokens else ''}", file=sys.stderr)
    if len(starts) != rounds + 1 or len(ends) != rounds + 1:
        raise RuntimeError("llama-server's log has no image encoding times: " + text[-2000:])
    return [end - start for start, end in zip(starts[1:], ends[1:])]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make", type=Path, metavar="DIR", help="write the files into DIR and stop")
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp's source (--make: its converter)")
    p.add_argument("--dir", type=Path, default=Path("bench_models/vision"))
    p.add_argument("--llama-bin", type=Path, help="the folder of llama-server")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        if not args.llama_cpp:
            p.error("--make needs --llama-cpp (llama.cpp's source)")
        return make(args.make, args.llama_cpp)
    if args.child:
        print(json.dumps(run_ours(args.dir, 1)))
        return
    if not args.llama_bin:
        p.error("--llama-bin is needed (the folder of llama-server)")
    ours, theirs = [], []
    for _ in range(args.rounds):  # alternating, each of ours in a process of its own
        done = subprocess.run(
            [sys.executable, __file__, "--child", "--dir", str(args.dir)], stdout=subprocess.PIPE, text=True, check=True
        )
        ours += json.loads(done.stdout)
        theirs += run_llama_cpp(args.dir, 1, args.llama_bin, args.threads)
    print(f"{SIZE[0]}x{SIZE[1]} image, {args.threads} threads, medians of {args.rounds}")
    print("| runner | tower s | runs |\n| --- | --- | --- |")
    for name, times in (("mlx-hybrid", ours), ("llama.cpp (llama-server --mmproj)", theirs)):
        print(f"| {name} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |")
    print(f"llama.cpp / ours: {statistics.median(theirs) / statistics.median(ours):.2f}x")


if __name__ == "__main__":
    main()

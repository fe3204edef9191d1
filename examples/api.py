"""The Python API in a few lines: load, stream, continue a cache by hand.

python examples/api.py tests/fixtures/qwen35/model.gguf
"""

import sys

import mlx.core as mx

import mlx_hybrid

path = sys.argv[1] if len(sys.argv) > 1 else mlx_hybrid.bundled_model_path()
model, tokenizer = mlx_hybrid.load(path)

# Streaming generation: each response carries the new text and running statistics.
for response in mlx_hybrid.stream_generate(model, tokenizer, "def parse_args(", max_tokens=32):
    print(response.text, end="", flush=True)
print(f"\n{response.generation_tps:.1f} tokens/s, finish: {response.finish_reason}")

# The same with MTP speculative decoding: identical text, fewer trunk passes.
last = None
for last in mlx_hybrid.stream_generate(model, tokenizer, "def parse_args(", max_tokens=32, draft="mtp"):
    pass
print(f"MTP: {last.acceptance_rate:.0%} of drafts accepted, {last.tokens_per_pass:.2f} tokens per trunk pass")

# The model itself: logits for [B, T] ids; with a cache, calls continue a sequence.
ids = mx.array([tokenizer.encode("import os\nimport sys\n")])
cache = mlx_hybrid.make_cache(model)
logits = model(ids[:, :4], cache=cache)
logits = model(ids[:, 4:], cache=cache)
print("next token:", repr(tokenizer.decode([int(logits[0, -1].argmax())])))

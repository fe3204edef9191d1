"""The Python API in a few lines: load, stream, continue a cache by hand.

python examples/api.py tests/fixtures/qwen35/model.gguf
"""

import sys

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001

path = sys.argv[1] if len(sys.argv) > 1 else mlx_hybrid.bundled_model_path()
model, tokenizer = mlx_hybrid.load(path)

# Streaming generation: each response carries the new text and running statistics.
# Speculation with the model's MTP head is on by default where the model has one.
for response in mlx_hybrid.stream_generate(model, tokenizer, "def parse_args(", max_tokens=32):
    print(response.text, end="", flush=True)
print(f"\n{response.generation_tps:.1f} tokens/s, finish: {response.finish_reason}")
if response.acceptance_rate is not None:
    by_position = ", ".join(f"{rate:.0%}" for rate in response.acceptance_by_position)
    print(
        f"MTP: {response.acceptance_rate:.0%} of drafts accepted (by position in a round: {by_position}), "
        f"{response.tokens_per_pass:.2f} tokens per trunk pass"
    )

# draft=None: plain decoding, one trunk pass per token (the same text when greedy).
plain = mlx_hybrid.generate(model, tokenizer, "def parse_args(", max_tokens=32, draft=None)

# The model itself: logits for [B, T] ids; with a cache, calls continue a sequence.
ids = mx.array([tokenizer.encode("import os\nimport sys\n")])
cache = mlx_hybrid.make_cache(model)
logits = model(ids[:, :4], cache=cache)
logits = model(ids[:, 4:], cache=cache)
print("next token:", repr(tokenizer.decode([int(logits[0, -1].argmax())])))

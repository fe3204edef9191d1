"""Train the bundled default model: a small Qwen3.5-architecture model with its MTP head.

The corpus is the Python standard library's own source (every machine with Python
has it); 2% of the files, chosen by a hash of their path, are held out. A
byte-level BPE tokenizer is trained on the training files with `tokenizers`, then
the model (gated delta net + gated attention, 3:1) learns next-token prediction
and, through the MTP head, the token after next.

    python examples/train_tiny.py --out runs/tiny --minutes 50
    python examples/train_tiny.py --out runs/tiny --minutes 10 --resume   # continue
    python examples/train_tiny.py --out runs/tiny --export-only --install  # write files
    python examples/train_tiny.py --out runs/head --init-from BUNDLED --train mtp --minutes 15

The MTP head learns as the released Qwen3.5 heads were trained: it reads the trunk's
state after the final norm, and a chained draft the head's own output after `mtp.norm`
(see `MTPHead`). `--train mtp` trains only the head of an existing model (`--init-from`,
BUNDLED for the packaged one): the trunk, and so the model's own output, stay as they are.

Seeded and resumable (checkpoints every --save-every steps). The bundled model is
this script's defaults run for 50 minutes on a 2-core x86-64 machine with OpenBLAS
preloaded: 8.35 M parameters, 473 steps of 16 x 256 tokens (about 1.9 M tokens, 5.6 s
a step), plus about a minute for the tokenizer; final training losses 3.4 (next token)
and 2.8 (MTP, token after next). Its head was then retrained in the post-norm wiring
with the last command above (docs/speculative.md gives its acceptance). Outputs:
`tiny-qwen35.gguf` (llama.cpp's qwen35 layout, with the MTP `nextn` block) and
`hf/` (published Qwen3.5 layout); --install copies the GGUF into the package as the
default model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mlx_hybrid import ops
from mlx_hybrid.export import save_gguf, save_hf
from mlx_hybrid.models.random_weights import initialise
from mlx_hybrid.models.qwen3_5 import FULL, LINEAR, Model, ModelArgs
from mlx_hybrid.tokenizer import PRE_TOKENIZER_SPLITS, Tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HELD_OUT_EVERY = 50  # one file in 50 is held out


def model_args(vocab_size: int) -> ModelArgs:
    layers = 8
    return ModelArgs(
        model_type="qwen3_5",
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        partial_rotary_factor=0.25,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=[FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)],
        max_position_embeddings=4096,
        intermediate_size=768,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
    )


# -- corpus and tokenizer --------------------------------------------------------------


def corpus_files():
    """(training files, held-out files) of the standard library, by a stable hash of the path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    held_out = [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % HELD_OUT_EVERY == 0]
    held = set(held_out)
    return [p for p in files if p not in held], held_out


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def opening_tokens(encoded, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` texts longer than that (eval_tiny.py's prompts, from
    the held-out files; benchmarks/layer_queue.py's --held-out)."""
    return [ids[:length] for ids in encoded if len(ids) > length][:count]


def train_tokenizer(files, vocab_size: int) -> Tokenizer:
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["qwen35"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read(f) for f in files), trainer=trainer)
    return Tokenizer(tok, [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")], CHAT_TEMPLATE)


def tokenize(tokenizer: Tokenizer, files) -> np.ndarray:
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids = []
    for f in files:
        ids.extend(tokenizer.encode(read(f)))
        ids.append(eot)
    return np.array(ids, dtype=np.int32)


# -- model -------------------------------------------------------------------------------


def losses(model: Model, ids: mx.array, trunk_frozen: bool = False):
    """Mean cross-entropy of the next token (trunk; 0 when frozen, where it cannot change)
    and of the token after next (MTP head)."""
    hidden = model.hidden_states(ids[:, :-1])
    if trunk_frozen:
        hidden, trunk = mx.stop_gradient(hidden), mx.array(0.0)
    else:
        trunk = nn.losses.cross_entropy(model.logits_from_hidden(hidden), ids[:, 1:], reduction="mean")
    mtp = nn.losses.cross_entropy(model.mtp_teacher_forced(hidden[:, :-1], ids[:, 1:-1]), ids[:, 2:], reduction="mean")
    return trunk, mtp


def batch(tokens: np.ndarray, step: int, size: int, length: int, seed: int) -> mx.array:
    rng = np.random.default_rng([seed, step])  # a function of the step: resuming replays nothing
    starts = rng.integers(0, len(tokens) - length - 1, size)
    return mx.array(np.stack([tokens[s : s + length + 1] for s in starts]))


# -- main ---------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/tiny"))
    p.add_argument("--minutes", type=float, default=50.0, help="stop training after this long")
    p.add_argument("--steps", type=int, default=100_000, help="stop after this many steps")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--mtp-weight", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--init-from",
        default=None,
        metavar="MODEL",
        help="start from this model's weights and tokenizer (BUNDLED: the packaged model)",
    )
    p.add_argument(
        "--train",
        choices=("all", "mtp"),
        default="all",
        help="what learns: the whole model, or only the MTP head (the trunk frozen)",
    )
    p.add_argument("--export-only", action="store_true")
    p.add_argument("--install", action="store_true", help="copy the GGUF into the package as the default model")
    args = p.parse_args()
    from tqdm import tqdm

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    train_files, held_out = corpus_files()
    (out / "held_out.json").write_text(json.dumps([str(f) for f in held_out], indent=1))

    if args.init_from is not None and (args.resume or args.export_only):
        p.error("--init-from starts a run; --resume and --export-only continue one")
    initial = None
    tokenizer_file = out / "tokenizer.json"
    if args.init_from is not None:
        source = mlx_hybrid.bundled_model_path() if args.init_from == "BUNDLED" else args.init_from
        initial, tokenizer = mlx_hybrid.load(source, dtype="float32")
        args.vocab = initial.args.vocab_size
        tokenizer.backend.save(str(tokenizer_file))
    elif tokenizer_file.exists():
        from tokenizers import Tokenizer as HFTokenizer

        inner = HFTokenizer.from_file(str(tokenizer_file))
        tokenizer = Tokenizer(
            inner, [inner.token_to_id("<|im_end|>"), inner.token_to_id("<|endoftext|>")], CHAT_TEMPLATE
        )
    else:
        print(f"training a {args.vocab}-token BPE on {len(train_files)} files", file=sys.stderr)
        tokenizer = train_tokenizer(train_files, args.vocab)
        tokenizer._tokenizer.save(str(tokenizer_file))
    tokens_file = out / "tokens.npy"
    if not tokens_file.exists():
        np.save(tokens_file, tokenize(tokenizer, train_files))
    tokens = np.load(tokens_file)

    model = Model(model_args(args.vocab))
    if initial is not None:
        model.load_weights(list(tree_flatten(initial.parameters())))
    if args.train == "mtp":
        model.freeze()
        model.mtp.unfreeze()
    optimizer = optim.AdamW(learning_rate=args.lr, weight_decay=0.1)
    state_file = out / "state.json"
    step = 0
    if args.resume or args.export_only:
        model.load_weights(str(out / "weights.safetensors"))
        if state_file.exists() and not args.export_only:
            step = json.loads(state_file.read_text())["step"]
            optimizer.init(model.trainable_parameters())
            opt_state = mx.load(str(out / "optimizer.safetensors"))
            optimizer.state = tree_map(lambda x: x, _unflatten(opt_state))
    elif initial is None:
        initialise(model, args.seed)
    mx.eval(model.parameters())
    params = sum(p.size for _, p in tree_flatten(model.parameters()))
    print(f"{params / 1e6:.2f} M parameters, {len(tokens) / 1e6:.1f} M training tokens", file=sys.stderr)

    if not args.export_only:
        train(model, optimizer, tokens, step, args, out, tqdm)
    export(model, tokenizer, out, args.install)


def _unflatten(flat: dict):
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(flat.items()))


def learning_rate(step: int, args, time_left: float, total_time: float) -> float:
    """Warm up, hold, then cool down over the last 20% of the time budget (the run is cut by time)."""
    warmup = 50
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * max(0.05, min(1.0, time_left / (0.2 * total_time)))


def compiled_train_step(model, optimizer, loss_fn):
    """(step, state): step(*inputs) takes one optimizer step on loss_fn(model, *inputs) -> (loss, aux),
    gradients clipped to norm 1, and returns aux; compiled over the model's and the optimizer's state,
    which mx.eval(state) evaluates."""
    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    def step(*inputs):
        (_, aux), grads = value_and_grad(model, *inputs)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return aux

    return mx.compile(step, inputs=state, outputs=state), state


def train(model, optimizer, tokens, step, args, out, tqdm):
    def loss_fn(model, ids):
        trunk, mtp = losses(model, ids, trunk_frozen=args.train == "mtp")
        return trunk + args.mtp_weight * mtp, (trunk, mtp)

    train_step, state = compiled_train_step(model, optimizer, loss_fn)
    total_time = args.minutes * 60
    deadline = time.time() + total_time
    bar = tqdm(initial=step, total=args.steps, desc="training", unit="step")
    while step < args.steps and time.time() < deadline:
        optimizer.learning_rate = learning_rate(step, args, deadline - time.time(), total_time)
        with ops.differentiable():  # the ops MLX differentiates, not our kernels (no backward pass)
            trunk, mtp = train_step(batch(tokens, step, args.batch, args.length, args.seed))
        mx.eval(state, trunk, mtp)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{trunk.item():.3f}", mtp=f"{mtp.item():.3f}")
        if step % args.save_every == 0:
            save(model, optimizer, step, out)
    bar.close()
    save(model, optimizer, step, out)


def save(model, optimizer, step, out: Path):
    model.save_weights(str(out / "weights.safetensors"))
    mx.save_safetensors(str(out / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (out / "state.json").write_text(json.dumps({"step": step}))


def export(model, tokenizer, out: Path, install: bool):
    gguf_path = out / "tiny-qwen35.gguf"
    save_gguf(model, tokenizer, gguf_path, name="mlx-hybrid tiny Qwen3.5 (stdlib)")
    save_hf(model, tokenizer, out / "hf")
    print(f"wrote {gguf_path} ({gguf_path.stat().st_size / 1e6:.1f} MB) and {out / 'hf'}", file=sys.stderr)
    if install:
        target = Path(mlx_hybrid.__file__).parent / "data" / gguf_path.name
        target.parent.mkdir(exist_ok=True)
        shutil.copy(gguf_path, target)
        print(f"installed {target}", file=sys.stderr)


if __name__ == "__main__":
    main()

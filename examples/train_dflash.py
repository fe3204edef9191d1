"""Train a DFlash block drafter for the bundled model (z-lab's block-diffusion objective at CPU size).

The target stays frozen. Each step it reads windows of text once; at anchors drawn in each window the
drafter sees the target's states at its layer ids for the --context positions before the anchor and
the block [token at the anchor, mask x (B - 1)], and learns the B - 1 tokens after the anchor, draft k
weighted by exp(-(k - 1) / gamma) as in the DFlash paper (early drafts decide how many are accepted).

The texts are, half and half, the target's own greedy continuations of training-file prompts (made
first, --generate-minutes; there the labels are exactly the tokens a verify pass accepts) and the
training files themselves (train_tiny.py's split: the held-out files stay unseen).

The bundled drafter (2 layers, blocks of 16, 3.4 MB in bfloat16) is these commands on a 2-core x86-64
machine with OpenBLAS: 40 minutes reading target layers 1 and 5 (z-lab's choice for two layers of an
8-layer target; 6 minutes of continuations first, 0.92 M tokens), then 35 more with the target's last
layer added (its output after the final norm: what the MTP head reads), the first run's weights taken
where they fit (`--init-from`):

    python examples/train_dflash.py --out runs/dflash --minutes 40 --generate-minutes 6
    python examples/train_dflash.py --out runs/dflash --minutes 35 --target-layers 1 5 7 \
        --init-from runs/dflash/drafter
    python examples/train_dflash.py --out runs/dflash --target-layers 1 5 7 --export-only --install

A DFlash2 drafter (convolutions of kernel 4 over groups of 32 channels, a selector of rank 64 over the
top 8) starts from the bundled drafter, its convolutions the identity, and its selector learns along
the true path (docs/speculative.md has what it gave):

    python examples/train_dflash.py --out runs/dflash2 --minutes 35 --generate-minutes 5 --lr 1e-3 \
        --target-layers 1 5 7 --init-from mlx_hybrid/data/tiny-qwen35-dflash --dflash2 4 32 8 64

Seeded; the drafter is written every --save-every steps and at the end (`--resume` continues, with a
fresh optimizer). Outputs: `runs/dflash/drafter/` in z-lab's directory layout (config.json,
model.safetensors); --install copies it into the package beside the bundled model, where
`--draft dflash` finds it. `examples/eval_tiny.py` measures it against the MTP head.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX's library

import mlx.core as mx  # noqa: I001
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))

from mlx_hybrid import Engine, ops  # noqa: E402
from mlx_hybrid.models.dflash import (  # noqa: E402
    DFlashArgs,
    DFlashDraftModel,
    load_drafter,
    save_drafter,
    target_layer_ids,
)
from mlx_hybrid.models.random_weights import initialise  # noqa: E402
from train_tiny import compiled_train_step, corpus_files, learning_rate, tokenize  # noqa: E402

MASK_TOKEN = "<|im_start|>"  # never in the training text: the bundled vocabulary has no spare id


def drafter_args(
    target,
    tokenizer,
    layers: int,
    block: int,
    layer_ids: list[int] | None,
    dflash2: tuple[int, int, int, int] | None = None,
) -> DFlashArgs:
    """dflash2: (convolution kernel, channels a group, selector top-k, selector rank), or None for DFlash."""
    trunk = target.args
    layer_ids = layer_ids or target_layer_ids(len(target.layers), layers)
    kernel, group, top_k, rank = dflash2 or (0, 0, 0, 0)
    return DFlashArgs(
        hidden_size=trunk.hidden_size,
        intermediate_size=trunk.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=trunk.num_attention_heads,
        num_key_value_heads=trunk.num_key_value_heads,
        head_dim=trunk.head_dim,
        rms_norm_eps=trunk.rms_norm_eps,
        rope_theta=trunk.rope_theta,
        vocab_size=trunk.vocab_size,
        target_layer_ids=layer_ids,
        block_size=block,
        mask_token_id=tokenizer.token_to_id(MASK_TOKEN),
        conv_kernel_size=kernel,
        conv_group_size=group,
        selector_top_k=top_k,
        selector_rank=rank,
    )


def identity_convolutions(drafter: DFlashDraftModel):
    """DFlash2's convolutions as the identity (the current position's tap 1, every other weight 0), so that
    a DFlash2 drafter warm-started from a DFlash one first computes what it computed; training moves them."""
    weights = []
    for i, layer in enumerate(drafter.layers):
        for name in ("attention_conv", "mlp_conv"):
            conv = layer[name]
            base = mx.zeros_like(conv.base_kernel)
            base[:, 0] = 1.0
            weights += [
                (f"layers.{i}.{name}.base_kernel", base),
                (f"layers.{i}.{name}.kernel_projection.weight", mx.zeros_like(conv.kernel_projection.weight)),
            ]
    drafter.load_weights(weights, strict=False)


def warm_start(drafter: DFlashDraftModel, path: Path):
    """Take another drafter's weights where they fit: every tensor of the same name and shape, and of `fc`
    the columns of the target layers both read (the others start at zero)."""
    source = load_drafter(path)
    theirs = dict(tree_flatten(source.parameters()))
    weights = [
        (name, theirs[name])
        for name, mine in tree_flatten(drafter.parameters())
        if name in theirs and theirs[name].shape == mine.shape and name != "fc.weight"
    ]
    E, fc = drafter.args.hidden_size, mx.zeros_like(drafter.fc.weight)
    for i, layer in enumerate(drafter.args.target_layer_ids):
        if layer in source.args.target_layer_ids:
            j = source.args.target_layer_ids.index(layer)
            fc[:, i * E : (i + 1) * E] = source.fc.weight[:, j * E : (j + 1) * E]
    drafter.load_weights(weights + [("fc.weight", fc)], strict=False)  # the rest keeps its initial values


def greedy_continuations(target, tokenizer, tokens: np.ndarray, args) -> np.ndarray:
    """The target's greedy continuations of --generate-length tokens from prompts drawn from the training
    text, as one stream (prompt, continuation, end of text), for --generate-minutes."""
    from tqdm import tqdm

    rng = np.random.default_rng([args.seed, 1])
    eot = tokenizer.token_to_id("<|endoftext|>")
    stream, deadline = [], time.time() + args.generate_minutes * 60
    bar = tqdm(desc="greedy continuations", unit="tok")
    while time.time() < deadline:
        engine = Engine(target, tokenizer, max_batch=args.batch)
        starts = rng.integers(0, len(tokens) - args.prompt_length, args.batch)
        prompts = [tokens[s : s + args.prompt_length].tolist() for s in starts]
        sequences = [engine.submit(prompt, max_tokens=args.generate_length) for prompt in prompts]
        engine.run()
        for prompt, sequence in zip(prompts, sequences):
            stream.extend(prompt + sequence.tokens + [eot])
            bar.update(len(sequence.tokens))
    bar.close()
    return np.array(stream, dtype=np.int32)


def windows(streams, step: int, args) -> mx.array:
    """args.batch windows of context + block tokens, half from each stream (a function of the step)."""
    rng = np.random.default_rng([args.seed, 2, step])
    length = args.context + args.span + args.block
    rows = []
    for i in range(args.batch):
        stream = streams[i % len(streams)]
        start = rng.integers(0, len(stream) - length)
        rows.append(stream[start : start + length])
    return mx.array(np.stack(rows))


def blocks(target, drafter_args: DFlashArgs, ids: mx.array, step: int, args):
    """From windows [S, W]: the blocks' target features [N, C, L E], block ids [N, B] and labels [N, B - 1]
    at args.anchors anchors a window (anchor a: features of positions a - C .. a - 1, block from a)."""
    taps = dict.fromkeys(drafter_args.target_layer_ids)
    target.hidden_states(ids, taps=taps)
    features = target.states_at(taps, drafter_args.target_layer_ids)
    rng = np.random.default_rng([args.seed, 3, step])
    S, B, C = ids.shape[0], drafter_args.block_size, args.context
    rows = np.repeat(np.arange(S), args.anchors)
    anchors = C + rng.integers(0, args.span + 1, S * args.anchors)
    context = mx.array(anchors[:, None] + np.arange(-C, 0))
    block = mx.array(anchors[:, None] + np.arange(B))
    features = features[mx.array(rows)[:, None], context]
    tokens = ids[mx.array(rows)[:, None], block]
    block_ids = mx.concatenate([tokens[:, :1], mx.full((len(rows), B - 1), drafter_args.mask_token_id)], axis=1)
    mx.eval(features, block_ids, tokens)
    return features, block_ids, tokens[:, 1:]


def selector_loss(selector, hidden, logits, block_ids, labels):
    """DFlash2's candidate selector, taught along the true path: at each position, of the top-k candidates
    of the block's logits scored after the true previous token (what the selector's path is while its
    drafts are accepted), the true next token's cross-entropy where it is a candidate (0 where not).
    Returns (that [N, B - 1], the selector's choices [N, B - 1])."""
    candidates = selector.candidates(mx.stop_gradient(logits))[1]  # chosen by the logits, not learned through
    unary = mx.take_along_axis(logits, candidates, axis=-1)
    previous = mx.concatenate([block_ids[:, :1], labels[:, :-1]], axis=1)
    scores = selector.scores(unary, candidates, previous, selector.hidden_projection(hidden[:, 1:]))
    true = candidates == labels[..., None]
    ce = mx.logsumexp(scores, axis=-1) - (scores * true).sum(axis=-1)
    choices = mx.take_along_axis(candidates, mx.argmax(scores, axis=-1)[..., None], axis=-1)[..., 0]
    return mx.where(true.any(axis=-1), ce, 0.0), choices


def train(target, drafter: DFlashDraftModel, streams, args, out: Path):
    from tqdm import tqdm

    B = drafter.args.block_size
    weights = mx.exp(-mx.arange(B - 1) / args.gamma)

    def loss_fn(drafter, features, block_ids, labels):
        hidden = drafter.block_hidden(target.embed(block_ids), features, None)
        logits = drafter.block_logits(hidden, target.project)
        ce = nn.losses.cross_entropy(logits, labels)  # [N, B - 1]
        chosen = mx.argmax(logits, axis=-1)
        if drafter.args.dflash2:
            selector_ce, chosen = selector_loss(drafter.candidate_selector, hidden, logits, block_ids, labels)
            ce = ce + selector_ce
        hits = (chosen == labels).astype(mx.float32)
        accepted = mx.cumprod(hits, axis=1).sum(axis=1).mean()  # drafts a verify pass would keep
        loss = (ce * weights).sum() / (weights.sum() * ce.shape[0])
        return loss, (loss, accepted)

    optimizer = optim.AdamW(learning_rate=args.lr, weight_decay=0.01)
    train_step, state = compiled_train_step(drafter, optimizer, loss_fn)
    total = args.minutes * 60
    deadline = time.time() + total
    bar = tqdm(total=args.steps, desc="training the drafter", unit="step")
    step = 0
    while step < args.steps and time.time() < deadline:
        optimizer.learning_rate = learning_rate(step, args, deadline - time.time(), total)
        features, block_ids, labels = blocks(target, drafter.args, windows(streams, step, args), step, args)
        with ops.differentiable():  # the ops MLX differentiates, not our kernels (no backward pass)
            loss, accepted = train_step(features, block_ids, labels)
        mx.eval(state, loss, accepted)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", accepted=f"{accepted.item():.2f}")
        if step % args.save_every == 0:
            drafter.save_weights(str(out / "weights.safetensors"))
    bar.close()
    drafter.save_weights(str(out / "weights.safetensors"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/dflash"))
    p.add_argument("--target", default=None, help="the target model (default: the bundled one)")
    p.add_argument("--minutes", type=float, default=30.0, help="stop training after this long")
    p.add_argument("--steps", type=int, default=100_000, help="stop after this many steps")
    p.add_argument("--generate-minutes", type=float, default=8.0, help="time for the target's continuations")
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--generate-length", type=int, default=224)
    p.add_argument("--layers", type=int, default=2, help="the drafter's decoder layers")
    p.add_argument(
        "--target-layers",
        type=int,
        nargs="+",
        default=None,
        metavar="ID",
        help="the target layers it reads (default: z-lab's recipe for --layers layers)",
    )
    p.add_argument("--block", type=int, default=16, help="block size: the block's first token and B - 1 drafts")
    p.add_argument("--context", type=int, default=96, help="target positions a block sees in training")
    p.add_argument("--span", type=int, default=64, help="anchors are drawn over this many positions a window")
    p.add_argument("--anchors", type=int, default=16, help="blocks a window")
    p.add_argument("--batch", type=int, default=16, help="windows a step")
    p.add_argument("--gamma", type=float, default=7.0, help="draft k's loss weighs exp(-(k - 1) / gamma)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="start from the drafter --out holds")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        metavar="DRAFTER",
        help="start from this drafter's "
        "weights where they fit (another drafter directory, e.g. with other target layers)",
    )
    p.add_argument(
        "--dflash2",
        type=int,
        nargs=4,
        default=None,
        metavar=("KERNEL", "GROUP", "TOP_K", "RANK"),
        help="a DFlash2 drafter: its convolutions' kernel and channels a group, its selector's top-k and rank "
        "(with --init-from a DFlash drafter: its weights, the convolutions as the identity)",
    )
    p.add_argument("--export-only", action="store_true")
    p.add_argument("--install", action="store_true", help="copy the drafter into the package beside the bundled model")
    args = p.parse_args()
    if args.init_from is not None and (args.resume or args.export_only):
        p.error("--init-from starts a run; --resume and --export-only continue one")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    target, tokenizer = mlx_hybrid.load(args.target or mlx_hybrid.bundled_model_path(), dtype="float32")
    target.freeze()
    drafter = DFlashDraftModel(
        drafter_args(target, tokenizer, args.layers, args.block, args.target_layers, args.dflash2)
    )
    if args.resume or args.export_only:
        drafter.load_weights(str(out / "weights.safetensors"))
    else:
        initialise(drafter, args.seed)
        if args.init_from is not None:
            warm_start(drafter, args.init_from)
            if args.dflash2:
                identity_convolutions(drafter)
    if not args.export_only:
        tokens_file, generated_file = out / "tokens.npy", out / "generated.npy"
        if not tokens_file.exists():
            np.save(tokens_file, tokenize(tokenizer, corpus_files()[0]))
        if not generated_file.exists():
            np.save(generated_file, greedy_continuations(target, tokenizer, np.load(tokens_file), args))
        streams = [np.load(generated_file), np.load(tokens_file)]
        print(
            f"{sum(v.size for _, v in tree_flatten(drafter.parameters())) / 1e6:.2f} M parameters; "
            f"{streams[0].size / 1e3:.0f} k generated and {streams[1].size / 1e6:.1f} M training tokens",
            file=sys.stderr,
        )
        train(target, drafter, streams, args, out)
    export(drafter, target, out, args.install)


def export(drafter: DFlashDraftModel, target, out: Path, install: bool):
    save_drafter(
        drafter, out / "drafter", len(target.layers), max_position_embeddings=target.args.max_position_embeddings
    )
    print(f"wrote {out / 'drafter'}", file=sys.stderr)
    if install:
        target = mlx_hybrid.bundled_drafter_path()
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(out / "drafter", target)
        print(f"installed {target}", file=sys.stderr)


if __name__ == "__main__":
    main()

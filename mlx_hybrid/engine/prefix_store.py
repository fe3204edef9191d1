"""Prefix checkpoints: a sequence's whole state after some tokens, to resume from.

A recurrent state cannot be trimmed back to an earlier position, so a conversation can
only skip the prefill of its history where a checkpoint was saved at exactly the right
token. A `Checkpoint` holds, for its tokens: every layer's KV entries or (conv tail, S),
the trunk's last hidden state (the next token's logits come from it) and the drafter's
state (the MTP head's cache). The `PrefixStore` keeps checkpoints under a byte budget,
evicting the least recently used, optionally spilling them to a directory as
safetensors for reuse across restarts; `save_checkpoint` / `load_checkpoint` write and
read one file (the CLI's prompt cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..errors import GenerationError
from ..parallel import agreed_max

FORMAT = "mlx-hybrid-checkpoint-1"
_log = logging.getLogger("mlx_hybrid")


def default_budget_bytes() -> int:
    """The checkpoints' default memory: a quarter of the machine's, at most 8 GiB (llama-server's
    prompt cache default), 2 GiB where the machine does not say. A long session's checkpoint holds
    its whole attention cache (3.2 GB at 128k tokens of Qwen3.5-0.8B in float32), and one over the
    budget is not kept: the next turn would read the session again."""
    try:
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return 2 * 1024**3
    return min(machine // 4, 8 * 1024**3)


def model_fingerprint(model, cache=None) -> str:
    """What a checkpoint's arrays depend on: which model computed them, and how its caches hold
    them (a quantized KV cache's form: see `LayerCache.form`)."""
    args = model.args
    fingerprint = f"{args.model_type}/{args.num_hidden_layers}x{args.hidden_size}/{args.vocab_size}"
    if model.parallel is not None:  # a rank's part of the state
        fingerprint += f"/{model.parallel.describe()}, rank {model.parallel.rank}"
    forms = sorted({layer_cache.form for layer_cache in cache or ()} - {""})
    return "/".join([fingerprint, *forms])


@dataclass
class Checkpoint:
    tokens: tuple[int, ...]  # what the state has read
    layers: list[tuple]  # per trunk layer: its KV entries, or (conv tail, S)
    last_hidden: mx.array  # [1, 1, E] at the last token
    drafter: dict[str, mx.array]  # the drafter's state ({} when it keeps none)
    model: str  # model_fingerprint
    # a split model's: the largest rank's size, so that every rank keeps and evicts alike
    agreed_nbytes: int | None = None
    # what the store finds it by where the tokens do not tell the state (images: see
    # `images.ExpandedPrompt.key`); None: the tokens
    image_key: tuple[int, ...] | None = None

    @property
    def key(self) -> tuple[int, ...]:
        return self.image_key if self.image_key is not None else self.tokens

    @property
    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer] + [self.last_hidden] + list(self.drafter.values())

    @property
    def nbytes(self) -> int:
        return self.agreed_nbytes if self.agreed_nbytes is not None else sum(a.nbytes for a in self.arrays)


def capture(model, cache, tokens, last_hidden: mx.array, drafter=None, key=None) -> Checkpoint:
    """A checkpoint of one sequence: its caches after `tokens`, `last_hidden` at the last of
    them; `key`: what finds it, where not the tokens (see `Checkpoint.image_key`). Its copies are
    not made yet (`Checkpoint.nbytes` is known before): `PrefixStore.save` makes them once there is
    room, and none for one it will not keep."""
    checkpoint = Checkpoint(
        tuple(tokens),
        [layer_cache.checkpoint() for layer_cache in cache],
        last_hidden,
        drafter.checkpoint() if drafter is not None else {},
        model_fingerprint(model, cache),
        image_key=tuple(key) if key is not None else None,
    )
    if model.parallel is not None:  # every rank captures at the same points, so may agree here
        checkpoint.agreed_nbytes = agreed_max(checkpoint.nbytes, model.group)
    return checkpoint


def restore(checkpoint: Checkpoint, cache, drafter=None):
    """Put a checkpoint's state into a fresh sequence's caches (and drafter)."""
    for layer_cache, entries in zip(cache, checkpoint.layers):
        layer_cache.restore(entries)
    if drafter is not None:
        drafter.restore(checkpoint.drafter, list(checkpoint.tokens))


def save_checkpoint(path, checkpoint: Checkpoint):
    arrays = {f"layer.{i}.{j}": a for i, layer in enumerate(checkpoint.layers) for j, a in enumerate(layer)}
    arrays["last_hidden"] = checkpoint.last_hidden
    arrays |= {f"drafter.{name}": a for name, a in checkpoint.drafter.items()}
    metadata = {
        "format": FORMAT,
        "model": checkpoint.model,
        "tokens": json.dumps(list(checkpoint.tokens)),
        "layers": json.dumps([len(layer) for layer in checkpoint.layers]),
    }
    if checkpoint.image_key is not None:
        metadata["image_key"] = json.dumps(list(checkpoint.image_key))
    path = Path(path)
    partial = path.with_name(path.name + ".partial.safetensors")  # a crash leaves no half file under the name
    mx.save_safetensors(str(partial), arrays, metadata=metadata)
    os.replace(partial, path)


def load_checkpoint(path, model=None, cache=None) -> Checkpoint:
    """Read a checkpoint file; with `model`, check that this model wrote it (into caches of `cache`'s
    form)."""
    try:
        arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
        if metadata.get("format") != FORMAT:
            raise ValueError("not an mlx-hybrid checkpoint")
        counts = json.loads(metadata["layers"])
        checkpoint = Checkpoint(
            tuple(json.loads(metadata["tokens"])),
            [tuple(arrays[f"layer.{i}.{j}"] for j in range(n)) for i, n in enumerate(counts)],
            arrays["last_hidden"],
            {name[len("drafter.") :]: a for name, a in arrays.items() if name.startswith("drafter.")},
            metadata["model"],
            image_key=tuple(json.loads(metadata["image_key"])) if "image_key" in metadata else None,
        )
        # read now: a lazy load belongs to this thread's stream, and the engine may step on another
        mx.eval(checkpoint.arrays)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise GenerationError(f"cannot read the prompt cache {path}: {e}") from None
    if model is not None and checkpoint.model != model_fingerprint(model, cache):
        raise GenerationError(
            f"the prompt cache {path} was made by another model or cache form ({checkpoint.model}, "
            f"this one is {model_fingerprint(model, cache)})"
        )
    return checkpoint


class PrefixStore:
    """Checkpoints keyed by their tokens, within `max_bytes`, least recently used evicted first.

    With `directory`, evicted checkpoints are written there (as `save_checkpoint` files,
    up to `max_disk_bytes`, oldest removed first) and found again, also after a restart.
    """

    def __init__(self, max_bytes: int, directory=None, max_disk_bytes: int | None = None):
        if max_bytes < 0:
            raise GenerationError(f"the prefix cache budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], Checkpoint] = OrderedDict()  # oldest use first
        self.nbytes = 0
        self.directory = Path(directory) if directory is not None else None
        self.max_disk_bytes = max_disk_bytes
        self.on_disk: dict[tuple[int, ...], Path] = {}
        self.over_budget = 0  # checkpoints larger than the whole budget, not kept in memory
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            for path in sorted(self.directory.glob("*.safetensors"), key=lambda p: p.stat().st_mtime):
                try:
                    _, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
                    self.on_disk[tuple(json.loads(metadata.get("image_key", metadata["tokens"])))] = path
                except Exception:  # noqa: BLE001  (a stray or broken file is not a checkpoint)
                    continue

    def __len__(self):
        return len(self.entries)

    def save(self, checkpoint: Checkpoint, keep: tuple[int, ...] | None = None):
        """Keep a checkpoint, evicting the least recently used ones to make room, but never the one
        found by `keep`: where both do not fit, the new checkpoint is dropped instead."""
        if checkpoint.key in self.entries:
            self.nbytes -= self.entries.pop(checkpoint.key).nbytes
        if checkpoint.nbytes > self.max_bytes:
            if self.max_bytes and not self.over_budget:  # once: a long session makes one every turn
                _log.warning(
                    "a checkpoint of %d tokens needs %.2f GB, more than the prefix cache's %.2f GB "
                    "(--prefix-cache-bytes): not kept, so the next turn reads its prompt again; raise "
                    "the budget or hold the attention cache in 8 bits (--kv-bits 8)",
                    len(checkpoint.tokens),
                    checkpoint.nbytes / 1e9,
                    self.max_bytes / 1e9,
                )
            self.over_budget += 1
            self._spill(checkpoint)
            return
        if keep in self.entries and self.entries[keep].nbytes + checkpoint.nbytes > self.max_bytes:
            self._spill(checkpoint)
            return
        while self.nbytes + checkpoint.nbytes > self.max_bytes:  # room first: a long session's copies are GBs
            self._evict_oldest(keep)
        mx.eval(checkpoint.arrays)
        self.entries[checkpoint.key] = checkpoint
        self.nbytes += checkpoint.nbytes

    def longest_prefix(self, tokens: list[int], model=None, cache=None) -> Checkpoint | None:
        """The checkpoint of the longest saved prefix of `tokens` (all of them included; a
        prompt with images: its `ExpandedPrompt.key`); with `model`, one it made into caches of
        `cache`'s form."""
        tokens = tuple(tokens)
        fingerprint = model_fingerprint(model, cache) if model is not None else None

        def fits(key):
            return len(key) <= len(tokens) and tokens[: len(key)] == key

        best = max((key for key in self.entries if fits(key)), key=len, default=None)
        spilled = max((key for key in self.on_disk if fits(key)), key=len, default=None)
        if spilled is not None and (best is None or len(spilled) > len(best)):
            try:
                checkpoint = load_checkpoint(self.on_disk[spilled])
            except GenerationError:
                del self.on_disk[spilled]
                return self.longest_prefix(list(tokens), model, cache)
            if fingerprint is None or checkpoint.model == fingerprint:
                self.save(checkpoint)  # back in memory as the most recent, where the budget allows
                return checkpoint
        if best is None or (fingerprint is not None and self.entries[best].model != fingerprint):
            return None
        self.entries.move_to_end(best)
        return self.entries[best]

    def _evict_oldest(self, keep=None):  # its own frame: what it evicts is freed on return
        evicted = self.entries.pop(next(key for key in self.entries if key != keep))
        self.nbytes -= evicted.nbytes
        self._spill(evicted)

    def _spill(self, checkpoint: Checkpoint):
        if self.directory is None or checkpoint.key in self.on_disk:
            return
        name = hashlib.sha256(json.dumps(checkpoint.key).encode()).hexdigest()[:32]
        path = self.directory / f"{name}.safetensors"
        save_checkpoint(path, checkpoint)
        self.on_disk[checkpoint.key] = path
        if self.max_disk_bytes is not None:
            sizes = {key: p.stat().st_size for key, p in self.on_disk.items() if p.exists()}
            for key in list(self.on_disk):  # oldest first
                if sum(sizes.values()) <= self.max_disk_bytes:
                    break
                self.on_disk.pop(key).unlink(missing_ok=True)
                sizes.pop(key, None)

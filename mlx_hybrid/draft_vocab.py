"""The reduced vocabulary drafters project onto.

A drafted token costs the drafter's own layers plus a product with the output matrix:
at Qwen3.5's 248,320 tokens that matrix is 1 GB in float32, about a third of a trunk
step. Drafting over the most frequent tokens instead costs a fraction of that, and the
verify pass still runs over the whole vocabulary, so the output is unchanged: a token
outside the subset just cannot be drafted.

Which tokens, deterministically for a given tokenizer and Python version:
1. the tokenizer's special and added tokens (end tokens, `<think>`, tool-call markup),
   always;
2. then tokens by how often they occur in a reference text that every Python
   installation carries: the language reference's topics (`pydoc_data/topics.py`,
   English prose) and a fixed list of standard-library modules (code);
3. then the tokens that text never used, by BPE rank (the merge that creates a token:
   earlier merges are more frequent pairs in the tokenizer's own training data).
The ranking is computed once per tokenizer and cached in ~/.cache/mlx_hybrid.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np

from .errors import GenerationError

# The default subset when the vocabulary is larger than LARGE_VOCABULARY; smaller
# vocabularies draft over all of it (their output matrix is cheap already).
DEFAULT_DRAFT_VOCAB = 32768
LARGE_VOCABULARY = 65536

# Standard-library files of the reference text, besides the topics (missing ones are skipped).
REFERENCE_MODULES = (
    "argparse.py",
    "collections/__init__.py",
    "dataclasses.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "subprocess.py",
    "textwrap.py",
    "typing.py",
    "unittest/case.py",
    "asyncio/tasks.py",
)
_RANKING_VERSION = 1  # bump when the recipe above changes


def default_size(vocab_size: int) -> int:
    """The draft vocabulary used when none is asked for: 0 (all) for small vocabularies."""
    return DEFAULT_DRAFT_VOCAB if vocab_size > LARGE_VOCABULARY else 0


def resolved_size(requested: int | None, vocab_size: int) -> int:
    """The subset size a request asks for: None means the default, 0 the whole vocabulary."""
    if requested is None:
        return default_size(vocab_size)
    if requested < 0:
        raise GenerationError(f"draft_vocab must be >= 0, got {requested}")
    return requested


def reference_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in ("pydoc_data/topics.py", *REFERENCE_MODULES):
        try:
            parts.append((stdlib / name).read_text(encoding="utf-8"))
        except OSError:
            continue
    return "\n".join(parts)


def bpe_ranks(tokenizer_json: dict) -> dict[str, int]:
    """Each token's rank: 1 + the index of the first merge that creates it; 0 for the
    tokens no merge creates (the byte-level base tokens)."""
    model = tokenizer_json.get("model", {})
    created: dict[str, int] = {}
    for index, merge in enumerate(model.get("merges", [])):
        created.setdefault("".join(merge.split(" ", 1) if isinstance(merge, str) else merge), index + 1)
    return {token: created.get(token, 0) for token in model.get("vocab", {})}


def _cache_path(key: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_hybrid"
    return root / f"draft-vocab-{key}.npy"


@lru_cache(maxsize=4)  # per tokenizer object: serializing and hashing a 248k vocabulary is not free
def ranked_tokens(tokenizer) -> np.ndarray:
    """Every token id of `tokenizer` (a `mlx_hybrid.tokenizer.Tokenizer`), most wanted first."""
    backend = tokenizer.backend
    serialized = backend.to_str()
    key = hashlib.sha256(f"{_RANKING_VERSION}:{serialized}".encode()).hexdigest()[:16]
    path = _cache_path(key)
    if path.is_file():
        try:
            return np.load(path)
        except (OSError, ValueError):
            pass  # a damaged cache file is rebuilt below
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    counts = np.bincount(backend.encode(reference_text(), add_special_tokens=False).ids, minlength=size)
    ranks = bpe_ranks(json.loads(serialized))
    rank = np.full(size, np.iinfo(np.int64).max, np.int64)
    for token, token_id in vocab.items():
        rank[token_id] = ranks.get(token, rank[token_id])
    always = np.zeros(size, bool)
    always[list(backend.get_added_tokens_decoder())] = True
    # sort keys, last is primary: always-included first, then by count (descending), then rank, then id
    order = np.lexsort((np.arange(size), rank, -counts, ~always))
    order = order[np.isin(order, list(vocab.values()))]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(temporary, order)
        temporary.replace(path)
    except OSError:
        pass  # no cache: computed again next time
    return order


def draft_vocabulary(tokenizer, requested: int | None, vocab_size: int) -> np.ndarray | None:
    """The sorted ids of the most wanted tokens below `vocab_size`, as many as `requested`
    asks (see `resolved_size`), or None for the whole vocabulary."""
    size = resolved_size(requested, vocab_size)
    if size == 0 or size >= vocab_size:
        return None
    order = ranked_tokens(tokenizer)
    order = order[order < vocab_size]
    return np.sort(order[:size]).astype(np.int32)

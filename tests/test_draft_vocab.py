"""The reduced draft vocabulary: special tokens, then the most frequent on the reference
text (counted here the obvious way), deterministic and cached."""

from collections import Counter

import numpy as np
from conftest import load_fixture

from mlx_hybrid.draft_vocab import (
    DEFAULT_DRAFT_VOCAB,
    bpe_ranks,
    default_size,
    draft_vocabulary,
    ranked_tokens,
    reference_text,
)


def test_subset_is_the_special_tokens_then_the_most_frequent(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ranked_tokens.cache_clear()  # the in-process memo would skip the file cache under test
    _, tok = load_fixture("qwen35", "hf")
    ids = draft_vocabulary(tok, 64, 512)
    assert len(ids) == 64 and list(ids) == sorted(ids)
    special = {0, 1, 2}  # <|endoftext|>, <|im_start|>, <|im_end|>
    assert special <= set(ids.tolist())
    counts = Counter(tok.encode(reference_text()))
    kept = [counts[i] for i in ids.tolist() if i not in special]
    dropped = [counts[i] for i in range(512) if i not in set(ids.tolist())]
    assert min(kept) >= max(dropped) > 0
    # cached: a second call reads the file and agrees
    assert len(list((tmp_path / "mlx_hybrid").glob("draft-vocab-*.npy"))) == 1
    assert np.array_equal(draft_vocabulary(tok, 64, 512), ids)
    # ids past the model's vocabulary (padding rows) are never chosen
    assert draft_vocabulary(tok, 64, 300).max() < 300


def test_whole_vocabulary_and_defaults():
    _, tok = load_fixture("qwen35", "hf")
    assert draft_vocabulary(tok, 0, 512) is None and draft_vocabulary(tok, 512, 512) is None
    assert default_size(2048) == 0 and default_size(248320) == DEFAULT_DRAFT_VOCAB


def test_bpe_ranks_follow_the_merges():
    spec = {"model": {"vocab": {"a": 0, "b": 1, "ab": 2, "abb": 3}, "merges": ["a b", ["ab", "b"]]}}
    assert bpe_ranks(spec) == {"a": 0, "b": 0, "ab": 1, "abb": 2}

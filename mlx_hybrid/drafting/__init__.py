"""Drafters for speculative decoding: the model's MTP head, a draft model, n-gram lookup, a DFlash
block drafter.

Every drafter has the calls `base.Drafter` declares, made by the engine for each of its rows that
speculate (one drafter a row, `engine.rows.Row`).

Drafters that compute a distribution (MTP head, draft model) can project onto a reduced
vocabulary (`vocabulary=`, sorted token ids, see `draft_vocab`) and stop drafting once
their top probability falls below `draft_p_min`, as llama.cpp's draft p-min does.
"""

from __future__ import annotations

from .base import DEFAULT_DRAFT_P_MIN, DraftHead, Drafter, check_draft_p_min, draft_rows, sure_drafts, unmarked
from .draft_model import DraftModelDrafter
from .mtp import MTPDrafter
from .ngram import NgramDrafter
from .settings import AUTO, DRAFTS, SpeculationSettings, draft_p_min_for, make_drafter, resolve_draft

__all__ = [
    "AUTO", "DEFAULT_DRAFT_P_MIN", "DRAFTS", "DraftHead", "DraftModelDrafter", "Drafter", "MTPDrafter",
    "NgramDrafter", "SpeculationSettings", "check_draft_p_min", "draft_p_min_for", "draft_rows", "make_drafter",
    "resolve_draft", "sure_drafts", "unmarked",
]  # fmt: skip

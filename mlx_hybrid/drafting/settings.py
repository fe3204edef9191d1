"""Which drafter a request speculates with, and making it."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .. import ops
from ..draft_vocab import draft_vocabulary
from ..errors import GenerationError
from ..loaders import companion_drafter, load_draft_model
from ..models.dflash import DFlashDraftModel
from ..models.trunk import HybridModel
from .base import DEFAULT_DRAFT_P_MIN, DEFAULT_DRAFT_TOKENS, check_draft_p_min
from .dflash import DFlashDrafter
from .draft_model import DraftModelDrafter
from .mtp import MTPDrafter
from .ngram import NgramDrafter

DRAFTS = ("mtp", "ngram", "dflash")
AUTO = "auto"  # the default: the model's MTP head where it has one, else no speculation


def resolve_draft(model, draft, draft_model=None) -> str | None:
    """`draft` as make_drafter takes it, with "auto" decided and "none" as None."""
    if draft == AUTO:
        return "mtp" if draft_model is None and model.has_mtp else None
    return None if draft == "none" else draft


@dataclass(frozen=True)
class SpeculationSettings:
    """How a request's tokens are drafted, as every entry point takes it (the API's keywords of these
    names, the commands' draft options), defaulted here and nowhere else.

    draft: "auto" (the MTP head where the model has one and no draft model is given), "mtp", "ngram",
    "dflash" or None; draft_model: a model of the same vocabulary or a DFlash drafter, loaded or its
    path or hub name (loaded once, `loaders.load_draft_model`);
    num_draft_tokens: drafts a round at most (None: the drafter's default, see `draft_tokens_for`);
    draft_vocab: tokens a drafter projects onto (None: the default for the vocabulary's size, 0: all);
    draft_p_min: the draft confidence under which a drafter stops (None: the model's default, see
    `draft_p_min_for`); adaptive_drafting: back off after misses (None: on unless draft_p_min is 0,
    which asks for exactly num_draft_tokens)."""

    draft: str | None = AUTO
    draft_model: object = None
    num_draft_tokens: int | None = None
    draft_vocab: int | None = None
    draft_p_min: float | None = None
    adaptive_drafting: bool | None = None

    def draft_tokens_for(self, drafter) -> int:
        """The most drafts a round with `drafter` (one `drafter()` built): as given, else the drafter's
        default (a DFlash drafter's block less one; the MTP head's 2 where each token verified costs its
        arithmetic, `ops.verified_tokens_cost_arithmetic`; else 3)."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        return drafter.default_draft_tokens if drafter is not None else DEFAULT_DRAFT_TOKENS

    @property
    def adaptive(self) -> bool:
        """Whether rows back off after misses (see `speculative.DraftingPolicy`)."""
        return self.draft_p_min != 0 if self.adaptive_drafting is None else bool(self.adaptive_drafting)

    def drafter(self, model, tokenizer):
        """A drafter for `model` (each row gets a `fork` of it), or None for plain decoding."""
        return make_drafter(model, tokenizer, self.draft, self.draft_model, self.draft_vocab, self.draft_p_min)


def draft_p_min_for(model, draft_p_min: float | None = None) -> float:
    """draft_p_min as given, else the default for `model`'s drafters: DEFAULT_DRAFT_P_MIN, or 0 where its
    verify passes verify every draft whatever its verdict (`ops.drafts_stop_below_p_min`)."""
    if draft_p_min is not None:
        return check_draft_p_min(draft_p_min)
    return DEFAULT_DRAFT_P_MIN if ops.drafts_stop_below_p_min(model.widest_product) else 0.0


def make_drafter(model, tokenizer, draft=None, draft_model=None, draft_vocab=None, draft_p_min=None):
    """The drafter for `stream_generate`'s arguments, or None for plain decoding.

    draft: None or "none" (no speculation), "mtp", "ngram", "dflash", or "auto" (the MTP head
    where the model has one and no draft model is given, else none); draft_model: a model of
    the same vocabulary, or a DFlash drafter (`models.dflash.load_drafter`; draft "dflash" or
    none; "dflash" without one takes the model's own, `loaders.companion_drafter`), or the path or
    hub name of either. draft_vocab:
    tokens the drafter projects onto (None: the default for the vocabulary's size, 0: all).
    draft_p_min: None, the model's default (`draft_p_min_for`).
    """
    draft_p_min = draft_p_min_for(model, draft_p_min)  # given, it also decides the rows' backoff (SpeculationSettings)
    draft_model = _loaded(draft_model)
    draft = resolve_draft(model, draft, draft_model)
    if draft == "dflash" and draft_model is None:
        draft_model = companion_drafter(model)
    block_drafter = isinstance(draft_model, DFlashDraftModel)
    if draft == "dflash" or block_drafter:
        if not block_drafter:
            raise GenerationError(
                "draft='dflash' (--draft dflash) needs draft_model= (--draft-model), a DFlash drafter: its "
                "directory, loaded by mlx_hybrid.loaders.load_draft_model (a GGUF file's own drafter, the "
                "directory <file stem>-dflash beside it, is taken by itself)"
            )
        if draft not in (None, "dflash"):
            raise GenerationError(f"draft={draft!r} with a DFlash drafter as draft_model=: give draft='dflash' or none")
        vocabulary = draft_vocabulary(tokenizer, draft_vocab, model.args.vocab_size)
        return DFlashDrafter(model, draft_model, draft_p_min, vocabulary)
    if draft is not None and draft_model is not None:
        raise GenerationError("give either draft= or draft_model=, not both")
    if draft is not None and draft not in DRAFTS:
        raise GenerationError(
            f"unknown draft {draft!r} (use draft='mtp', 'ngram', 'dflash', 'auto' or None, or draft_model=)"
        )
    if draft is None and draft_model is None:
        return None
    if draft == "ngram":
        return NgramDrafter()
    drafting_model = draft_model if draft_model is not None else model
    vocabulary = draft_vocabulary(tokenizer, draft_vocab, drafting_model.args.vocab_size)
    if draft_model is not None:
        return DraftModelDrafter(draft_model, model, draft_p_min, vocabulary)
    return MTPDrafter(model, draft_p_min, vocabulary)


def _loaded(draft_model):
    """draft_model= as given, a path or hub name loaded."""
    if draft_model is None or isinstance(draft_model, (DFlashDraftModel, HybridModel)):
        return draft_model
    if isinstance(draft_model, (str, os.PathLike)):
        return _load_draft_model(os.fspath(draft_model))
    raise GenerationError(
        "draft_model= takes a loaded model or DFlash drafter, or the path or hub name of one; not a "
        f"{type(draft_model).__name__}"
    )


@functools.lru_cache(maxsize=2)  # an app's calls with the same path share one
def _load_draft_model(path: str):
    return load_draft_model(path)

"""Drafters for speculative decoding: the model's MTP head, a draft model, n-gram lookup, a DFlash
block drafter.

Every drafter has the same calls, made by the engine for each of its rows that speculate (one
drafter a row, `engine.rows.Row`):
- `prefill(tokens, hidden)` for each part of the prompt the trunk has read (hidden: its
  hidden states [1, T, E], or None), then `begin(first_token)` with the first sampled
  token; `start(prompt, prompt_hidden, first_token)` does both at once;
- `draft(k, sampler)` -> (tokens, logprobs): up to k drafted tokens as scalar arrays, and
  for each the log-distribution [V] it was drawn from (None: a point mass). Fewer than k,
  or none, when confidence runs out. `draft_rows(drafters, ks, samplers, masks)` drafts for
  several rows at once, the drafting model's steps packed into one call per step, each
  row drawn from what its grammar allows (masks);
- `update(verify_hidden, accepted)`: what the trunk accepted this round (the accepted
  drafts and the trunk's own next token), with the verify pass's hidden states (a drafter
  that `reads_layers` gets the pass's states at those layers, its `StateSpan`). The
  decoder may skip `draft` for a round; `update` is still called;
- `declines_cost`: whether drafting nothing still cost a model step (then repeated
  declines make the decoder back off, as repeated rejections do);
- `default_draft_tokens`: drafts a round where the request names no number (3; a block
  drafter's block less one); `drafts_blocks`: whether adaptive rows also adapt how many
  drafts they verify (see `speculative.DraftingPolicy`);
- `fork()`: a drafter of the same kind with no sequence yet, sharing what is fixed
  (the model, the draft vocabulary's head).

Drafters that compute a distribution (MTP head, draft model) can project onto a reduced
vocabulary (`vocabulary=`, sorted token ids, see `draft_vocab`) and stop drafting once
their top probability falls below `draft_p_min`, as llama.cpp's draft p-min does.
"""

from __future__ import annotations

from .base import DEFAULT_DRAFT_P_MIN, DraftHead, Drafter, check_draft_p_min, draft_rows, sure_drafts, unmarked
from .draft_model import DraftModelDrafter
from .mtp import MTPDrafter
from .ngram import NgramDrafter
from .settings import AUTO, DRAFTS, SpeculationSettings, make_drafter, resolve_draft

__all__ = [
    "AUTO", "DEFAULT_DRAFT_P_MIN", "DRAFTS", "DraftHead", "DraftModelDrafter", "Drafter", "MTPDrafter",
    "NgramDrafter", "SpeculationSettings", "check_draft_p_min", "draft_rows", "make_drafter", "resolve_draft",
    "sure_drafts", "unmarked",
]  # fmt: skip

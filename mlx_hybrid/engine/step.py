"""One pass of the engine over its rows, in three of a step's four parts (the fourth, advancing the
rows, is the engine's: it owns the rows' lives):

1. `build_batch`: what each row feeds (a chunk of its prompt, or its token and this round's drafts,
   drafted for all rows together), packed along the token axis;
2. `run_model`: the model over the packed batch, recording recurrent snapshots where drafts are verified;
3. `choose_tokens`: logits where tokens are chosen, the requests' processors, and each decoding row's
   accepted drafts and own token (greedy rows compared in one host sync, their drafts cut at the
   drafter's first unsure one there; sampling rows by the speculative sampling rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import mlx.core as mx

from ..cache import marks, packed, record_snapshots
from ..drafting import draft_rows
from ..speculative import accept
from .prompt_images import join_inserted
from .rows import Ahead, Row


@dataclass
class Batch:
    """The rows of one pass and what each feeds."""

    rows: list[Row]
    feeds: list  # per row: prompt tokens (a list), or its token and this round's drafts (an array)
    asked: dict  # decoding row -> (drafts asked for, the drafts' distributions)

    @property
    def lengths(self) -> list[int]:
        return [len(x) if isinstance(x, list) else x.size for x in self.feeds]

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each row's positions in the packed batch."""
        starts = [0, *accumulate(self.lengths)]
        return list(zip(starts, starts[1:]))


@dataclass
class Choice:
    """What a pass chose for one row: logits [n, V] where its tokens are chosen (None: a prompt chunk
    that does not end the prompt), and for a decoding row the tokens of its round: of the `verified`
    drafts the pass read, the first `drafted` were the round's (the rest fell below p-min)."""

    logits: mx.array | None
    accepted: list[int] | None = None
    drafted: int = 0
    verified: int = 0


def build_batch(rows: list[Row], prefill_chunk: int) -> Batch:
    """What each row feeds this pass: prompt tokens, at most `prefill_chunk` in all and up to its next
    checkpoint position, or its token and this round's drafts (built on the lazy drafts). Rows left
    without prefill budget sit the pass out."""
    budget = prefill_chunk
    inputs, asked = {}, {}
    for row in rows:
        if row.prefilling:
            if budget > 0:
                start = len(row.fed)
                end = min([len(row.sequence.prompt), start + budget] + [p for p in row.checkpoint_at if p > start])
                budget -= end - start
                inputs[row] = row.sequence.prompt[start:end]
        else:
            asked[row] = (row.plan(), [])
            inputs[row] = mx.array([row.token])
            row.drafts = []
    drafting = [row for row, (k, _) in asked.items() if k]
    if drafting:
        masks = [None if row.processor is None else row.processor.draft_mask for row in drafting]
        drafts = draft_rows([row.drafter for row in drafting], [asked[row][0] for row in drafting],
                            [row.sampler for row in drafting], masks)  # fmt: skip
        for row, (tokens, logprobs) in zip(drafting, drafts):
            if row.processor is not None and tokens:
                row.drafts = mx.stack(tokens).reshape(-1).tolist()
                allowed = row.processor.allowed_drafts(row.drafts)  # a forbidden draft is not verified
                tokens, logprobs, row.drafts = tokens[:allowed], logprobs[:allowed], row.drafts[:allowed]
            asked[row] = (asked[row][0], logprobs)
            if tokens:
                inputs[row] = mx.concatenate([inputs[row], mx.stack(tokens).reshape(-1).astype(mx.int32)])
    fed = [row for row in rows if row in inputs]
    return Batch(fed, [inputs[row] for row in fed], asked)


def run_model(model, batch: Batch, layer_by_layer: bool = False) -> mx.array:
    """The trunk's hidden states [1, tokens, E] over the packed batch (images put in where prompts have
    them); rows that verify drafts record their recurrent snapshots. layer_by_layer: evaluate each
    layer as it is built where a prompt is read (see `ops.prefill_layer_by_layer`)."""
    rows, lengths = batch.rows, batch.lengths
    for row, n in zip(rows, lengths):
        record_snapshots(row.cache, not row.prefilling and n > 1)
    ids = mx.concatenate([mx.array(x) if isinstance(x, list) else x for x in batch.feeds])[None]
    inserted = join_inserted([
        row.images.inserted(model, len(row.fed), len(row.fed) + n, start)
        for row, n, (start, _) in zip(rows, lengths, batch.spans) if row.images is not None and row.prefilling
    ])  # fmt: skip
    try:
        return model.hidden_states(
            ids, packed([row.cache for row in rows], lengths), inserted,
            evaluate_each_layer=layer_by_layer and any(row.prefilling for row in rows),
        )  # fmt: skip
    finally:
        for row in rows:
            record_snapshots(row.cache, False)


def choose_tokens(model, batch: Batch, hidden: mx.array) -> list[Choice]:
    """Per row: the logits where its tokens are chosen (every position of a decoding row, a prompt's
    last), and for decoding rows the drafts accepted and the model's own token, from the logits after
    the request's processors."""
    rows = batch.rows
    wanted = [
        list(range(s, e)) if not row.prefilling else ([e - 1] if _ends_prompt(row, e - s) else [])
        for row, (s, e) in zip(rows, batch.spans)
    ]
    positions = [p for w in wanted for p in w]
    if len(positions) == hidden.shape[1]:  # every position (decoding rows only): no gather
        logits = model.logits_from_hidden(hidden)[0]
    else:
        logits = model.logits_from_hidden(hidden[:, mx.array(positions)])[0] if positions else None
    bounds = [0, *accumulate(len(w) for w in wanted)]
    row_logits = [logits[s:e] if e > s else None for s, e in zip(bounds, bounds[1:])]
    # the model computes meanwhile, while grammars work out their masks on the host
    if logits is not None and any(row.processor is not None for row in rows):
        mx.async_eval(logits)
    scores = [
        row.processor(x, row.drafts) if row.processor is not None and not row.prefilling else x
        for row, x in zip(rows, row_logits)
    ]
    # the model's choice at every position in one op (a row whose processor changed its scores: its own)
    argmax = mx.argmax(logits, axis=-1).astype(mx.int32) if logits is not None else None
    argmaxes = [argmax[s:e] if row.processor is None and argmax is not None else None
                for row, s, e in zip(rows, bounds, bounds[1:])]  # fmt: skip
    targets = _greedy_targets(rows, batch.feeds, scores, argmaxes)
    choices = []
    for row, feed, x, scored, target in zip(rows, batch.feeds, row_logits, scores, targets):
        if row.prefilling:
            choices.append(Choice(x))
            continue
        drafts = feed[1:].tolist() if target is None else target[0]
        draft_logprobs = batch.asked[row][1]
        accepted = accept(row.sampler, drafts, scored, draft_logprobs, None if target is None else target[1])
        choices.append(Choice(x, row.until_end(accepted), len(drafts), feed.size - 1))
    return choices


def _ends_prompt(row: Row, fed_now: int) -> bool:
    """Whether a prompt chunk of `fed_now` tokens is the prompt's last."""
    return len(row.fed) + fed_now == len(row.sequence.prompt)


def _greedy_targets(rows, feeds, scores, argmaxes):
    """For greedy decoding rows, (drafts, the model's argmax at every position), in one host sync;
    where the drafter left its p-min verdicts to the pass, the drafts up to the first unsure one.
    argmaxes: per row its scores' argmax where already computed (None: computed here)."""
    parts, owners = [], []  # owners: (row, its drafts, whether its verdicts come too)
    for i, row in enumerate(rows):
        if not row.prefilling and row.sampler.greedy:
            n = feeds[i].size - 1
            verdicts = row.drafter.confidence if row.drafter is not None and n else None
            argmax = argmaxes[i] if argmaxes[i] is not None else mx.argmax(scores[i], axis=-1).astype(mx.int32)
            parts += [feeds[i][1:].astype(mx.int32)] if n else []
            parts += [argmax] + ([verdicts.astype(mx.int32)] if verdicts is not None else [])
            owners.append((i, n, verdicts is not None))
    targets = [None] * len(rows)
    if parts:
        flat, at = mx.concatenate(parts).tolist(), 0
        for i, n, judged in owners:
            drafts, argmax = flat[at : at + n], flat[at + n : at + 2 * n + 1]
            at += 2 * n + 1
            sure = n
            if judged:
                verdicts, at = flat[at : at + n], at + n
                sure = verdicts.index(0) if 0 in verdicts else n
            targets[i] = (drafts[:sure], argmax[: sure + 1])
    return targets


def queue_plain_pass(model, rows: list[Row], feeds: list[mx.array]):
    """Build one plain pass over `rows`, each fed its token [1] (lazy or known), start it computing,
    and make it each row's `ahead` (the engine reads its tokens a step later; `Row.take_back` undoes it)."""
    aheads = [Ahead(marks(row.cache), row.sampler.key) for row in rows]
    caches = packed([row.cache for row in rows], [1] * len(rows))
    hidden = model.hidden_states(mx.concatenate(feeds).astype(mx.int32)[None], caches)
    logits = model.logits_from_hidden(hidden)[0]
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)  # every greedy row's token, in one op
    for i, (row, ahead) in enumerate(zip(rows, aheads)):
        ahead.logits, ahead.hidden = logits[i : i + 1], hidden[:, i : i + 1]
        chosen = greedy[i : i + 1] if row.sampler.greedy else row.sampler(ahead.logits)
        ahead.token = chosen.reshape(1).astype(mx.int32)
        row.ahead = ahead
    mx.async_eval([ahead.token for ahead in aheads])

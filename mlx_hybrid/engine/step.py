"""One pass of the engine over its rows. A step has four parts; the first three are here, and the
fourth, advancing the rows, is the engine's, because it owns the rows' lives.

1. `build_batch` decides what each row feeds: a chunk of its prompt, or its last token and this
   round's drafts. All rows draft together. The feeds are packed along the token axis.
2. `run_model` runs the model over the packed batch. Rows that verify drafts record their recurrent
   snapshots.
3. `choose_tokens` takes the logits where tokens are chosen, applies the requests' processors, and
   decides each decoding row's accepted drafts and its own next token. Greedy rows are compared in one
   host sync; sampling rows follow the speculative sampling rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import mlx.core as mx

from ..cache import marks, record_snapshots
from ..drafting import draft_rows, sure_drafts, unmarked
from ..drafting.base import StateSpan
from ..row_caches import packed
from ..sampling import Samplers
from ..speculative import accept, draft_probabilities, sampled_rounds
from .prompt_images import join_inserted
from .rows import Ahead, Row


@dataclass
class Batch:
    """The rows of one pass and what each feeds."""

    rows: list[Row]
    feeds: list  # per row: prompt tokens (a list), or its token and this round's drafts (an array)
    asked: dict  # decoding row -> (drafts asked for, the drafts' distributions)
    ids: mx.array  # [N] int32: the feeds packed in the rows' order
    marked: mx.array  # ids with drafts marked by their p-min verdicts (`drafting.unmarked` gives ids)
    taps: dict | None = None  # trunk layer -> its output [1, N, E], where the rows' drafters read layers
    tapped: dict = field(default_factory=dict)  # layer ids -> the pass's states there [1, N, L E], made once
    prompts_held_back: bool = False  # prompt tokens wait for a pass of their own (build_batch's pass_tokens)

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
    """What a pass chose for one row.

    logits: [n, V] at the positions where the row's tokens are chosen; None for a prompt chunk that
    does not end the prompt. For a decoding row, `accepted` are the round's tokens; the pass read
    `verified` drafts, of which the first `drafted` were sure (the rest fell below p-min)."""

    logits: mx.array | None
    accepted: list[int] | None = None
    drafted: int = 0
    verified: int = 0


def build_batch(rows: list[Row], prefill_chunk: int, queue_drafts: bool = False, pass_tokens: int | None = None,
                prompts_only: bool = False, verdicts_first: bool = False) -> Batch:  # fmt: skip
    """Decide what each row feeds this pass.

    A decoding row feeds its last token and this round's drafts (still lazy arrays). A prefilling row
    feeds the next part of its prompt: at most `prefill_chunk` tokens for all rows together, and never
    past the row's next checkpoint position. A row left without budget sits the pass out.

    queue_drafts: start computing the drafts (`mx.async_eval`) while the host builds the verify pass.
    pass_tokens: the most tokens a pass with decoding rows may hold (`ops.rows_alike_pass_tokens`);
        prompt tokens beyond it wait (`Batch.prompts_held_back`).
    prompts_only: while a prompt is being read, the decoding rows sit this pass out.
    verdicts_first: read the drafts' p-min verdicts now and feed the sure drafts only
        (`ops.read_draft_verdicts_first`)."""
    prompts_only = prompts_only and any(row.prefilling for row in rows)
    feeds, asked = {}, {}  # row -> its tokens known to the host (a list), or its lazy drafts after them
    for row in rows:
        if not row.prefilling and not prompts_only:
            asked[row] = (row.plan(), [])
            feeds[row] = [row.token]
            row.drafts = []
    budget = prefill_chunk
    if pass_tokens is not None and asked:
        budget = min(budget, max(0, pass_tokens - sum(1 + k for k, _ in asked.values())))
    unread = sum(len(row.sequence.prompt) - len(row.fed) for row in rows if row.prefilling)
    held_back = budget < min(prefill_chunk, unread)
    for row in rows:
        if row.prefilling and budget > 0:
            start = len(row.fed)
            end = min([len(row.sequence.prompt), start + budget] + [p for p in row.checkpoint_at if p > start])
            budget -= end - start
            feeds[row] = row.sequence.prompt[start:end]
    drafting = [row for row, (k, _) in asked.items() if k]
    if drafting:
        masks = [None if row.processor is None else row.processor.draft_mask for row in drafting]
        drafts = draft_rows([row.drafter for row in drafting], [asked[row][0] for row in drafting],
                            [row.sampler for row in drafting], masks, verdicts_first)  # fmt: skip
        for row, (tokens, logprobs) in zip(drafting, drafts):
            if row.processor is not None and tokens:
                row.drafts = mx.stack(tokens).reshape(-1).tolist()
                allowed = row.processor.allowed_drafts(row.drafts)  # a forbidden draft is not verified
                tokens, logprobs, row.drafts = tokens[:allowed], logprobs[:allowed], row.drafts[:allowed]
            asked[row] = (asked[row][0], logprobs)
            columns = row.drafter.drafted_columns
            if columns is not None:  # the drafts marked with their verdicts, read back with the pass's
                tokens = [column[columns.row : columns.row + 1] for column in columns.columns[: len(tokens)]]
            if tokens:
                feeds[row] = (feeds[row], tokens)
        if verdicts_first:
            _keep_sure_drafts(drafting, feeds, asked)
    fed, pieces = _packed([row for row in rows if row in feeds], feeds)
    marked = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
    ids = unmarked(marked) if any(row.drafter.drafted_columns is not None for row in drafting) else marked
    if queue_drafts and drafting:
        mx.async_eval(ids)
    starts = [0, *accumulate(_fed_count(feeds[row]) for row in fed)]
    return Batch(fed, [feeds[row] if row.prefilling else ids[s:e] for row, s, e in zip(fed, starts, starts[1:])],
                 asked, ids, marked, prompts_held_back=held_back)  # fmt: skip


def _keep_sure_drafts(rows: list[Row], feeds: dict, asked: dict):
    """Read the drafts' p-min verdicts now, for all rows in one wait, and cut each row's feed at its
    first unsure draft. The feeds become host tokens. See `ops.read_draft_verdicts_first`."""
    drafted = [row for row in rows if not isinstance(feeds[row], list)]
    if not drafted:
        return
    values = mx.concatenate([t.reshape(1) for row in drafted for t in feeds[row][1]]).tolist()
    at = 0
    for row in drafted:
        count = len(feeds[row][1])
        sure = sure_drafts(values[at : at + count])
        at += count
        feeds[row] = feeds[row][0] + sure
        asked[row] = (asked[row][0], asked[row][1][: len(sure)])
        row.drafts = row.drafts[: len(sure)]


def _fed_count(feed) -> int:
    return len(feed) if isinstance(feed, list) else len(feed[0]) + len(feed[1])


def _packed(rows: list[Row], feeds: dict) -> tuple[list[Row], list[mx.array]]:
    """The rows in the order the pass packs them, and the pieces of their ids [N] (int32).

    Tokens the host knows go into one array. A drafting group whose rows all feed their drafts as drawn
    (`GroupRow`) becomes one block [R, 1 + k] of tokens and draft columns, so its launches do not grow
    with its rows; rows that feed fewer than k drafts are cut from the block in one gather. Any other
    drafting row is its own piece."""
    whole = {row: _group_columns(row, feeds[row]) for row in rows}
    blocks = {}  # a group's columns -> its rows, where every row of the group feeds its first drafts
    for row, columns in whole.items():
        if columns is not None:
            blocks.setdefault(id(columns), []).append(row)
    blocks = {key: group for key, group in blocks.items() if len(group) == _group_size(group)}
    order, parts = [], []  # parts: token lists the host knows, or lazy ids
    for row in rows:
        group = blocks.get(id(whole[row])) if whole[row] is not None else None
        if group is None:
            order.append(row)
            feed = feeds[row]
            parts += [feed] if isinstance(feed, list) else [feed[0], mx.concatenate([t.reshape(1) for t in feed[1]])]
        elif row is group[0]:
            order += group
            block = mx.array([[feeds[r][0][0]] + [0] * len(whole[row]) for r in group], mx.int32)
            for j, column in enumerate(whole[row]):  # a write a column: the tokens the host knows cost no copy
                block[:, j + 1] = column
            parts.append(_rows_cut(block, tuple(len(feeds[r][1]) for r in group)))
    return order, _host_tokens_joined(parts)


def _rows_cut(block: mx.array, drafts: tuple[int, ...]) -> mx.array:
    """A group's block [R, 1 + k] as its rows' ids side by side: row r's token and first drafts[r]."""
    if all(n == block.shape[1] - 1 for n in drafts):
        return block.reshape(-1)
    width = block.shape[1]
    return block.reshape(-1)[mx.array([r * width + i for r, n in enumerate(drafts) for i in range(1 + n)])]


def _host_tokens_joined(parts: list) -> list[mx.array]:
    """The parts as arrays, neighbouring token lists the host knows as one."""
    pieces, known = [], []
    for part in parts:
        if isinstance(part, list):
            known += part
            continue
        pieces += [mx.array(known, mx.int32)] if known else []
        pieces.append(part)
        known = []
    return pieces + ([mx.array(known, mx.int32)] if known or not pieces else [])


def _group_columns(row: Row, feed) -> list | None:
    """The draft columns of the row's group, where the row feeds its first drafts as drawn."""
    if isinstance(feed, list):  # no drafts (a prompt's tokens, or a row with no drafter)
        return None
    drafted = row.drafter.drafted_columns
    return None if drafted is None or len(feed[1]) > len(drafted.columns) else drafted.columns


def _group_size(group: list[Row]) -> int:
    """How many rows the group's columns hold, where `group` lists them in their order (else 0)."""
    drafted = [row.drafter.drafted_columns for row in group]
    in_order = all(d.row == i for i, d in enumerate(drafted))
    return drafted[0].columns[0].shape[0] if in_order else 0


def run_model(model, batch: Batch, layer_by_layer: bool = False) -> mx.array:
    """Run the trunk over the packed batch and return its hidden states [1, tokens, E].

    Images are inserted where prompts have them. Rows that verify drafts record their recurrent
    snapshots. layer_by_layer: when a prompt is read, evaluate each layer as it is built (see
    `ops.prefill_layer_by_layer`)."""
    rows, lengths = batch.rows, batch.lengths
    for row, n in zip(rows, lengths):
        record_snapshots(row.cache, not row.prefilling and n > 1)
    ids = batch.ids[None]
    inserted = join_inserted([
        row.images.inserted(model, len(row.fed), len(row.fed) + n, start)
        for row, n, (start, _) in zip(rows, lengths, batch.spans) if row.images is not None and row.prefilling
    ])  # fmt: skip
    layers = {i for row in rows if row.drafter is not None for i in row.drafter.reads_layers}
    batch.taps = dict.fromkeys(sorted(layers)) if layers else None
    try:
        return model.hidden_states(
            ids, packed([row.cache for row in rows], lengths), inserted,
            evaluate_each_layer=layer_by_layer and any(row.prefilling for row in rows), taps=batch.taps,
        )  # fmt: skip
    finally:
        for row in rows:
            record_snapshots(row.cache, False)


def choose_tokens(model, batch: Batch, hidden: mx.array, open_drafting: bool = False) -> list[Choice]:
    """Choose each row's tokens.

    A decoding row's logits are taken at every position it fed, a prompt's at its last. After the
    request's processors, a decoding row gets its accepted drafts and the model's own next token.
    open_drafting: greedy rows whose drafter can (`Drafter.opens_from_pass`) take their next round's
    first step with this pass, built while its tokens are read (`ops.open_drafting_with_pass`)."""
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
    opening = _drafting_to_open(model, batch, hidden, argmax, bounds) if open_drafting else None
    rounds = _read_rounds(batch, logits, scores, argmax, bounds, opening)
    choices = []
    for row, feed, x, round_ in zip(rows, batch.feeds, row_logits, rounds):
        if row.prefilling:
            choices.append(Choice(x))
            continue
        drafts, values = round_
        accepted = accept(drafts, values, row.sampler.greedy)
        choices.append(Choice(x, row.until_end(accepted), len(drafts), feed.size - 1))
    return choices


def drafter_states(model, batch: Batch, row: Row, hidden: mx.array, span: tuple[int, int]):
    """What the row's drafter reads of this pass at the row's positions.

    That is the trunk's hidden states, or, for a drafter that reads chosen layers
    (`Drafter.reads_layers`), its span of those layers' states. The layers' states are joined once a
    pass, so rows that draft together gather theirs at once."""
    s, e = span
    layers = row.drafter.reads_layers if row.drafter is not None else ()
    if not layers:
        return hidden[:, s:e]
    if layers not in batch.tapped:
        batch.tapped[layers] = model.states_at(batch.taps, layers)
    return StateSpan(batch.tapped[layers], s, e)


def _drafting_to_open(model, batch: Batch, hidden: mx.array, argmax: mx.array | None, bounds: list[int]):
    """What builds the next round's first drafting step of each greedy row without a processor whose
    drafter takes it with the pass (`Drafter.opens_from_pass`) and that verified drafts: over each
    position it fed, the token the model chose there; rows whose drafters draft together take it
    together. None where no row does."""
    groups = {}
    for i, (row, (s, e)) in enumerate(zip(batch.rows, batch.spans)):
        drafter = row.drafter
        opens = drafter is not None and drafter.opens_from_pass and row.sampler.greedy and row.processor is None
        if opens and not row.prefilling and e - s > 1:
            states = drafter_states(model, batch, row, hidden, (s, e))
            groups.setdefault(drafter.batch_key(), []).append((drafter, states, argmax[bounds[i] : bounds[i + 1]]))

    def open_groups():
        for group in groups.values():
            drafters, states, tokens = zip(*group)
            type(drafters[0]).open_from_pass(list(drafters), list(states), list(tokens))

    return open_groups if groups else None


def _ends_prompt(row: Row, fed_now: int) -> bool:
    """Whether a prompt chunk of `fed_now` tokens is the prompt's last."""
    return len(row.fed) + fed_now == len(row.sequence.prompt)


def _read_rounds(batch: Batch, logits: mx.array, scores: list, argmax: mx.array | None, bounds: list[int],
                 meanwhile=None) -> list:  # fmt: skip
    """For each decoding row (None for the others), its sure drafts and the values that decide them,
    all read in one host sync. meanwhile(): work built while the read waits, queued behind it.

    A greedy row gets the model's argmax at each of its positions (`bounds` gives where each row's
    start); a greedy row with a processor gets the argmax of its own scores. A sampling row gets the
    speculative sampling rule's [accepted, token] (`sampled_rounds`, for all sampling rows at once).
    The drafts are cut at the first one the drafter marked unsure. The sampling rows' random streams
    are queued with the read."""
    rows = batch.rows
    decoding = [i for i, row in enumerate(rows) if not row.prefilling]
    rounds = [None] * len(rows)
    if not decoding:
        return rounds
    parts, starts = [batch.marked, argmax], {}  # where each row's values start in the read
    sampling = [i for i in decoding if not rows[i].sampler.greedy]
    for i in decoding:
        if rows[i].sampler.greedy and rows[i].processor is not None:
            starts[i] = sum(part.size for part in parts)
            parts.append(mx.argmax(scores[i], axis=-1).astype(mx.int32))
        elif rows[i].sampler.greedy:
            starts[i] = batch.marked.size + bounds[i]
    if sampling:
        at = sum(part.size for part in parts)
        starts.update({i: at + 2 * s for s, i in enumerate(sampling)})
        samplers = Samplers([rows[i].sampler for i in sampling])
        parts.append(_sampled_rounds(batch, sampling, samplers, logits, scores, bounds).reshape(-1))
        mx.async_eval(samplers.keys())
    values = mx.concatenate(parts)
    if meanwhile is not None:
        mx.async_eval(values)
        meanwhile()
    flat = values.tolist()
    for i in decoding:
        (s, e), at = batch.spans[i], starts[i]
        drafts = sure_drafts(flat[s + 1 : e])
        rounds[i] = (drafts, flat[at : at + (len(drafts) + 1 if rows[i].sampler.greedy else 2)])
    return rounds


def _sampled_rounds(batch: Batch, sampling: list[int], samplers: Samplers, logits: mx.array, scores: list,
                    bounds: list[int]) -> mx.array:  # fmt: skip
    """The sampling rows' rounds [S, 2] (`sampled_rounds`), in operations that do not grow with the rows.

    The rows' drafts are padded to the longest, the padding marked unsure. Their scores are gathered
    from the pass's logits, or from their processors' own scores where a processor made them. Their
    drafts' distributions are gathered by drafting group (`speculative.draft_probabilities`)."""
    spans = [batch.spans[i] for i in sampling]
    counts = [e - s - 1 for s, e in spans]
    n = max(counts)
    if all(batch.rows[i].processor is None for i in sampling):
        source, firsts = logits, [bounds[i] for i in sampling]
    else:
        source, firsts = (
            mx.concatenate([scores[i] for i in sampling]),
            list(accumulate([0] + counts[:-1], lambda a, c: a + c + 1)),
        )
    positions = mx.array([[first + min(j, c) for j in range(n + 1)] for first, c in zip(firsts, counts)])
    target = samplers.log_probs(source[positions])  # [S, n + 1, V]
    if not n:
        drafts = mx.zeros((len(sampling), 0), mx.int32)
        return sampled_rounds(samplers, drafts, drafts, None, target)
    # each draft's position in the pass; a row's padding repeats a position of its own (ids, not read)
    fed = mx.array([[s + min(j + 1, c) for j in range(n)] for (s, _), c in zip(spans, counts)])
    padding = mx.array([[j >= c for j in range(n)] for c in counts])
    drafts, marked = batch.ids[fed], mx.where(padding, -1, batch.marked[fed])
    distributions = [batch.asked[batch.rows[i]][1] for i in sampling]
    return sampled_rounds(
        samplers, drafts, marked, draft_probabilities(distributions, drafts, target.shape[-1]), target
    )


def plain_round_ahead(model, rows: list[Row]) -> list[Ahead]:
    """A plain round of `rows` from the passes queued a step ahead (`Row.ahead`; a row without one queues
    it now), which it returns, once it has queued the next round's pass for the rows whose next round is
    plain too (`Row.steps_plain`; a row that drafts next round queues nothing)."""
    missing = [row for row in rows if row.ahead is None]
    if missing:
        queue_plain_pass(model, missing, [mx.array([row.token]) for row in missing])
    current = [row.ahead for row in rows]
    for row in rows:
        row.plan()  # this round's plain step (a backed-off policy counts it off)
        row.ahead = None
    going_on = [i for i, row in enumerate(rows) if row.steps_plain()]
    if going_on:
        queue_plain_pass(model, [rows[i] for i in going_on], [current[i].token for i in going_on])
    return current


def queue_plain_pass(model, rows: list[Row], feeds: list[mx.array]):
    """Build one plain pass over `rows`, each fed its token [1] (lazy or known), and start it computing.
    It becomes each row's `ahead`: the engine reads its tokens a step later, and `Row.take_back` undoes
    it."""
    aheads = [Ahead(marks(row.cache), row.sampler.key) for row in rows]
    caches = packed([row.cache for row in rows], [1] * len(rows))
    hidden = model.hidden_states(mx.concatenate(feeds).astype(mx.int32)[None], caches)
    logits = model.logits_from_hidden(hidden)[0]
    tokens = Samplers([row.sampler for row in rows]).sample(logits).astype(mx.int32)  # every row's, at once
    for i, (row, ahead) in enumerate(zip(rows, aheads)):
        ahead.logits, ahead.hidden = logits[i : i + 1], hidden[:, i : i + 1]
        ahead.token = tokens[i : i + 1]
        row.ahead = ahead
    mx.async_eval([ahead.token for ahead in aheads])

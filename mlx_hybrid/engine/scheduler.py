"""The batch engine: continuous batching of many sequences, speculation per row, prefix checkpoints.

Each step runs one model pass over every running sequence, packed along the token axis
(no padding, see `cache.RowCaches`):
- a sequence still reading its prompt feeds its next chunk (at most `prefill_chunk`
  prompt tokens a step in all, so a long prompt does not stall the others), ending at
  the positions where it asked for checkpoints;
- a decoding sequence feeds its last token and this round's drafts. The drafters of all
  rows draft together (`draft_rows`), the pass records recurrent snapshots for the rows
  that drafted, and each row then accepts, rolls back and adapts on its own, through its
  `SpeculativeDecoder`.

Where a GPU computes and every row decodes plainly (no drafter), a step builds and
queues the next pass, fed this pass's tokens before they are read, and only then reads
them (`_overlapped_pass`): the host's work overlaps the device's. A row that ends, a
cancellation or a new request takes the queued pass back (caches and random stream as
before it), so the tokens are the same either way.

Sequences join between steps and leave when they finish or are cancelled. Nothing
here knows about HTTP: `submit` gives a `Sequence` whose tokens arrive as events.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from itertools import accumulate

import mlx.core as mx

from .. import ops
from ..cache import marks, packed, record_snapshots, rewind, set_positions
from ..drafting import draft_rows
from ..errors import GenerationError
from ..prompt import PREFILL_STEP, check_context, request_ids
from ..sampling import SamplingParams
from ..speculative import (
    SpeculativeDecoder,
    SpeculativeStats,
    accept_greedy,
    check_num_draft_tokens,
)
from .prefix_store import PrefixStore, capture, restore
from .prompt_images import PromptImages, join_inserted

DEFAULT_PREFIX_CACHE_BYTES = 2 * 1024**3


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (before sampling settings), and
    the likeliest alternatives at its position, best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Event:
    """What a sequence produced in one step: new tokens, and at the end why it ended."""

    tokens: list[int]
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: str | None = None  # what went wrong, with "error"
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    drafted: int = 0  # how many of the tokens, from the first, are drafts the model accepted


@dataclass
class Sequence:
    """One request in the engine, as its submitter sees it."""

    prompt: list[int]
    max_tokens: int
    logprobs: int | None = None  # None: none; k: each token's log-probability and the top k
    cached_tokens: int = 0  # prompt tokens that came from a checkpoint
    # set once the engine has taken the sequence in and looked up its checkpoint (cached_tokens is final)
    started: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=list)  # generated so far
    finish_reason: str | None = None
    error: str | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False
    stats: SpeculativeStats | None = None  # with a drafter: drafts accepted, tokens per pass

    def cancel(self):
        """Stop generating; the engine frees the row at its next step."""
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def stream(self, timeout: float | None = None):
        """The events, as the engine produces them (for a consumer on another thread)."""
        while True:
            event = self.events.get(timeout=timeout)
            yield event
            if event.finish_reason is not None:
                return


def request_params(params: SamplingParams | None, max_tokens: int | None, settings: dict) -> SamplingParams:
    """`submit`'s settings: `params` (default: all defaults) with max_tokens and the keywords applied."""
    if max_tokens is not None:
        settings = {**settings, "max_tokens": max_tokens}
    return (params or SamplingParams()).replace(**settings)


@dataclass
class _Ahead:
    """A row's share of a pass built and queued before the tokens it reads were known."""

    marks: list  # the row's caches before the pass
    key: mx.array  # the sampler's random key before the pass
    token: mx.array | None = None  # [1] the token it chooses, lazy
    logits: mx.array | None = None  # [1, V] where it is chosen
    hidden: mx.array | None = None  # [1, 1, E] the trunk's state at the token it read


class _Row:
    """The engine's side of a sequence: caches, sampler, drafter and decoder."""

    def __init__(
        self, sequence: Sequence, decoder: SpeculativeDecoder, stop_tokens, checkpoint_at, processor=None, images=None
    ):
        self.sequence = sequence
        self.images: PromptImages | None = images
        self.decoder = decoder
        self.processor = processor  # the request's `processors.LogitsProcessor`, or None
        self.drafts: list[int] = []  # with a processor: the drafts this pass verifies
        self.stop_tokens = stop_tokens
        self.checkpoint_at = sorted(p for p in set(checkpoint_at) if 0 < p <= len(sequence.prompt))
        self.fed: list[int] = []  # tokens the caches have read
        self.last_hidden = None  # the trunk's hidden state at the last fed token [1, 1, E]
        self.ahead: _Ahead | None = None  # a queued pass that reads `decoder.token` (see `_overlapped_pass`)

    @property
    def prefilling(self) -> bool:
        return self.decoder.token is None

    @property
    def drafter(self):
        return self.decoder.drafter

    def checkpoint_key(self, tokens: list[int]) -> list[int] | None:
        """What finds a checkpoint of this row after `tokens` (None: the tokens themselves)."""
        return self.images.key_of(tokens) if self.images is not None else None


class Engine:
    """Continuous batching over one model.

    drafter: None (plain decoding) or a drafter (see `drafting.make_drafter`) that each
    sequence gets a `fork` of; num_draft_tokens and adaptive as in `SpeculativeDecoder`.
    prefix_store: where checkpoints are kept (None: a `PrefixStore` of
    `DEFAULT_PREFIX_CACHE_BYTES`; a store with max_bytes=0 keeps none in memory).
    overlap: queue each plain decoding pass before reading the previous one's tokens
    (None: where a GPU computes, `ops.overlap_decode_steps`).
    """

    def __init__(
        self,
        model,
        tokenizer,
        drafter=None,
        num_draft_tokens: int = 3,
        adaptive: bool = True,
        max_batch: int = 8,
        prefill_chunk: int = PREFILL_STEP,
        prefix_store: PrefixStore | None = None,
        overlap: bool | None = None,
    ):
        if max_batch < 1:
            raise GenerationError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1:
            raise GenerationError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.num_draft_tokens = check_num_draft_tokens(num_draft_tokens)
        self.adaptive = adaptive
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.store = prefix_store if prefix_store is not None else PrefixStore(DEFAULT_PREFIX_CACHE_BYTES)
        self.overlap = ops.overlap_decode_steps() if overlap is None else overlap
        self.prefill_layer_by_layer = ops.prefill_layer_by_layer()
        self.speculation = SpeculativeStats()  # the figures of every finished sequence that drafted
        self.waiting: queue.Queue = queue.Queue()
        self.rows: list[_Row] = []
        self._wake = threading.Event()
        self._thread = None
        self._stopping = False

    # -- requests

    def submit(
        self,
        prompt,
        max_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        checkpoint_at=(),
        drafter=None,
        events=None,
        images=None,
        allow_remote_images: bool = False,
        **settings,
    ) -> Sequence:
        """Queue a request; its tokens arrive on the returned Sequence.

        prompt: a string or token ids. params: its `SamplingParams`; `max_tokens` and any
        other field given as a keyword (`temp=`, `seed=`, ...) override it. checkpoint_at:
        prompt positions (token counts) to save checkpoints at; one is always saved at the
        end. drafter: this sequence's own drafter instead of a fork of the engine's (for
        measurements). events: where the events go, anything with a thread-safe `put`
        (default: a new `queue.Queue`). images: paths, bytes, PIL images or data / file URLs
        (http ones with allow_remote_images), one per `<|image_pad|>` of the prompt, in
        order (a chat template renders one per image part); checkpoint_at counts the
        prompt's tokens before the images' are put in.
        """
        row = self._new_row(
            prompt, request_params(params, max_tokens, settings), checkpoint_at, drafter, events,
            images, allow_remote_images,
        )  # fmt: skip
        self._enqueue(row)
        return row.sequence

    def _new_row(
        self, prompt, params: SamplingParams, checkpoint_at, drafter, events, images=None, allow_remote=False
    ) -> _Row:
        ids, max_tokens = request_ids(self.model, self.tokenizer, prompt, params.max_tokens)
        prompt_images = None
        if images:
            prompt_images = PromptImages(self.model, self.tokenizer, ids, list(images), allow_remote)
            checkpoint_at = [prompt_images.prompt.moved(p) for p in checkpoint_at if 0 <= p <= len(ids)]
            ids = prompt_images.prompt.ids
            max_tokens = min(params.max_tokens, check_context(self.model, len(ids)))
        drafter = drafter if drafter is not None else (self.drafter.fork() if self.drafter is not None else None)
        cache = self.model.make_cache()
        if prompt_images is not None:
            set_positions(cache, prompt_images.positions)
            if drafter is not None:
                drafter.use_positions(prompt_images.positions)
        decoder = SpeculativeDecoder(self.model, drafter, params.sampler(), self.num_draft_tokens, cache, self.adaptive)
        sequence = Sequence(ids, max_tokens, params.logprobs, stats=decoder.stats if drafter is not None else None)
        if events is not None:
            sequence.events = events
        stops = set(self.tokenizer.eos_token_ids if params.stop_tokens is None else params.stop_tokens)
        processor = params.processor(ids, self.model.args.vocab_size, self.tokenizer)
        return _Row(sequence, decoder, stops, checkpoint_at, processor, prompt_images)

    def _enqueue(self, row: _Row):
        self.waiting.put(row)
        self._wake.set()

    def _cancelled(self, row: _Row) -> bool:
        return row.sequence.cancelled

    @property
    def load(self) -> dict:
        """How many sequences are generating and how many wait for a slot."""
        return {"running": len(self.rows), "waiting": self.waiting.qsize()}

    @property
    def checkpoints(self) -> dict:
        """What the prefix store holds: checkpoints and their bytes in memory, its budget, files on disk."""
        store = self.store
        return {"checkpoints": len(store), "bytes": store.nbytes, "budget_bytes": store.max_bytes,
                "on_disk": len(store.on_disk)}  # fmt: skip

    # -- the loop

    def step(self) -> bool:
        """Admit what waits, then one pass over the running rows. Whether there is work left."""
        self._admit()
        self._drop_cancelled()
        if self.rows:
            try:
                self._pass()
            except Exception as e:  # noqa: BLE001  (a failed pass ends its rows, not the engine)
                for row in self.rows:
                    self._finish(row, "error", error=f"{type(e).__name__}: {e}")
                self.rows = []
        return bool(self.rows) or not self.waiting.empty()

    def run(self):
        """Step until every submitted sequence is done."""
        while self.step():
            pass

    def drive(self, sequence: Sequence):
        """Step on this thread until `sequence` ends, yielding its events as they come (for a
        command line). After `start`, the engine's thread steps and this one only reads."""
        if self._thread is not None:
            yield from sequence.stream()
            return
        while True:
            while not sequence.events.empty():
                event = sequence.events.get()
                yield event
                if event.finish_reason is not None:
                    return
            self.step()

    def start(self):
        """Step on a background thread (for a server); `stop` ends it, `start` starts it again."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="mlx-hybrid-engine", daemon=True)
            self._thread.start()

    def stop(self):
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self):
        try:
            while not self._stopping:
                if not self.step():
                    self._idle()
        finally:
            # Empty this thread's compile cache while it holds the GIL: left to the thread's
            # exit, MLX frees it after `join` has returned and, when the process is ending,
            # takes the GIL from a finalizing interpreter and aborts ("terminate called").
            mx.clear_streams()

    def _idle(self):
        """Wait for work: until a request comes, or half a second."""
        self._wake.wait(timeout=0.5)
        self._wake.clear()

    def _admit(self):
        while len(self.rows) < self.max_batch:
            try:
                row = self.waiting.get_nowait()
            except queue.Empty:
                return
            if self._cancelled(row):
                self._finish(row, "cancelled")
            elif row.sequence.max_tokens == 0:
                self._finish(row, "length")
            elif not self._resume(row):
                self.rows.append(row)
            row.sequence.started.set()

    def _resume(self, row: _Row) -> bool:
        """Start from the longest checkpoint that is a prefix of the prompt; whether that ended the row."""
        prompt = row.sequence.prompt
        checkpoint = self.store.longest_prefix(row.checkpoint_key(prompt) or prompt, self.model)
        if checkpoint is None:
            return False
        restore(checkpoint, row.decoder.cache, row.drafter)
        row.fed = list(checkpoint.tokens)
        row.last_hidden = checkpoint.last_hidden
        row.sequence.cached_tokens = len(row.fed)
        if len(row.fed) < len(row.sequence.prompt):
            return False
        # the whole prompt: its first token comes from the saved hidden state
        return self._started(row, self.model.logits_from_hidden(row.last_hidden)[0])

    def _drop_cancelled(self):
        for row in [r for r in self.rows if self._cancelled(r)]:
            if not row.prefilling:  # what it generated stays resumable (a chat's stopped answer)
                self._save(row)
            self._finish(row, "cancelled")
            self.rows.remove(row)

    def _pass(self):
        """One model pass over the rows that have tokens to feed this step."""
        if self.overlap and all(not r.prefilling and r.drafter is None and r.processor is None for r in self.rows):
            self._overlapped_pass()
            return
        for row in self.rows:
            self._take_back(row)
        inputs, asked = self._inputs(self.rows)
        rows = [row for row in self.rows if row in inputs]
        feeds = [inputs[row] for row in rows]
        lengths = [len(x) if isinstance(x, list) else x.size for x in feeds]
        for row, n in zip(rows, lengths):
            record_snapshots(row.decoder.cache, not row.prefilling and n > 1)
        ids = mx.concatenate([mx.array(x) if isinstance(x, list) else x for x in feeds])[None]
        starts = [0, *accumulate(lengths)]
        inserted = join_inserted([
            row.images.inserted(self.model, len(row.fed), len(row.fed) + n, at)
            for row, n, at in zip(rows, lengths, starts) if row.images is not None and row.prefilling
        ])  # fmt: skip
        try:
            hidden = self.model.hidden_states(
                ids, packed([row.decoder.cache for row in rows], lengths), inserted,
                evaluate_each_layer=self.prefill_layer_by_layer and any(row.prefilling for row in rows),
            )  # fmt: skip
        finally:
            for row in rows:
                record_snapshots(row.decoder.cache, False)
        spans = list(zip(starts, starts[1:]))

        # logits where a token is chosen: every position of a decoding row, a prompt's last
        wanted = [
            list(range(s, e)) if not row.prefilling else ([e - 1] if self._prompt_done(row, e - s) else [])
            for row, (s, e) in zip(rows, spans)
        ]
        positions = [p for w in wanted for p in w]
        if len(positions) == hidden.shape[1]:  # every position (decoding rows only): no gather
            logits = self.model.logits_from_hidden(hidden)[0]
        else:
            logits = self.model.logits_from_hidden(hidden[:, mx.array(positions)])[0] if positions else None
        bounds = [0, *accumulate(len(w) for w in wanted)]
        row_logits = [logits[s:e] if e > s else None for s, e in zip(bounds, bounds[1:])]
        # what a token is chosen from: the logits after the request's processors (decoding rows);
        # the model computes meanwhile, while grammars work out their masks on the host
        if logits is not None and any(row.processor is not None for row in rows):
            mx.async_eval(logits)
        chosen_from = [
            row.processor(x, row.drafts) if row.processor is not None and not row.prefilling else x
            for row, x in zip(rows, row_logits)
        ]
        choices = self._greedy_choices(rows, feeds, chosen_from)

        for row, feed, (s, e), row_logit, scores, choice in zip(rows, feeds, spans, row_logits, chosen_from, choices):
            row_hidden = hidden[:, s:e]
            if row.prefilling:
                ended = self._after_prefill(row, feed, row_hidden, row_logit)
            else:
                k, draft_logprobs = asked[row]
                if choice is not None:
                    drafts, targets = choice
                    accepted = accept_greedy(drafts, targets)
                else:
                    drafts = feed[1:].tolist()
                    sampler = row.decoder.sampler
                    accepted = row.decoder.accept_sampled(drafts, draft_logprobs, sampler.log_probs(scores))
                accepted = self._until_end(row, accepted)
                previous = row.decoder.token
                row.decoder.finish(row_hidden, accepted, len(drafts), k)
                row.fed += [previous] + accepted[:-1]
                row.last_hidden = row_hidden[:, len(accepted) - 1 : len(accepted)]
                ended = self._emit(row, accepted, row_logit)
            if ended:
                self.rows.remove(row)

    @staticmethod
    def _until_end(row: _Row, accepted: list[int]) -> list[int]:
        """The accepted tokens up to the first that ends the row (a stop token, max_tokens), so that
        the caches keep, as after plain decoding, everything before that last token and nothing past
        it: the row's checkpoint is then a prefix of the conversation's next turn, whatever end token
        the chat template writes there instead."""
        room = row.sequence.max_tokens - len(row.sequence.tokens)
        for i, token in enumerate(accepted):
            if token in row.stop_tokens or i + 1 >= room:
                return accepted[: i + 1]
        return accepted

    def _overlapped_pass(self):
        """Plain decoding with the next pass queued before this one's tokens are read. Each
        row's `ahead` is the pass that reads its `decoder.token`; the step queues the pass
        that reads the tokens it chooses, then reads them."""
        rows = list(self.rows)
        missing = [row for row in rows if row.ahead is None]
        if missing:
            self._queue_pass(missing, [mx.array([row.decoder.token]) for row in missing])
        current = [row.ahead for row in rows]
        self._queue_pass(rows, [ahead.token for ahead in current])
        tokens = mx.concatenate([ahead.token for ahead in current]).tolist()
        for row, ahead, token in zip(rows, current, tokens):
            previous = row.decoder.token
            row.decoder.finish(ahead.hidden, [token], 0, 0)
            row.fed.append(previous)
            row.last_hidden = ahead.hidden
            if self._emit(row, [token], ahead.logits):
                self.rows.remove(row)

    def _queue_pass(self, rows, feeds):
        """Build one plain pass over `rows`, each fed its token [1] (lazy or known), start it
        computing, and make it each row's `ahead`."""
        aheads = [_Ahead(marks(row.decoder.cache), row.decoder.sampler.key) for row in rows]
        caches = packed([row.decoder.cache for row in rows], [1] * len(rows))
        hidden = self.model.hidden_states(mx.concatenate(feeds).astype(mx.int32)[None], caches)
        logits = self.model.logits_from_hidden(hidden)[0]
        for i, (row, ahead) in enumerate(zip(rows, aheads)):
            ahead.logits, ahead.hidden = logits[i : i + 1], hidden[:, i : i + 1]
            ahead.token = row.decoder.sampler(ahead.logits).reshape(1).astype(mx.int32)
            row.ahead = ahead
        mx.async_eval([ahead.token for ahead in aheads])

    def _take_back(self, row: _Row):
        """Undo the row's queued pass: its caches and random stream as before it."""
        if row.ahead is not None:
            rewind(row.decoder.cache, row.ahead.marks)
            row.decoder.sampler.key = row.ahead.key
            row.ahead = None

    def _inputs(self, rows):
        """What each row feeds this pass: prompt tokens (a list), or its last token and this
        round's drafts (an array, built on the lazy drafts); and for decoding rows the drafts
        asked for and their distributions. Rows left without prefill budget sit the step out."""
        budget = self.prefill_chunk
        inputs, asked = {}, {}
        for row in rows:
            if row.prefilling:
                if budget > 0:
                    start = len(row.fed)
                    end = min([len(row.sequence.prompt), start + budget] + [p for p in row.checkpoint_at if p > start])
                    budget -= end - start
                    inputs[row] = row.sequence.prompt[start:end]
            else:
                asked[row] = (row.decoder.plan(row.sequence.max_tokens - len(row.sequence.tokens)), [])
                inputs[row] = mx.array([row.decoder.token])
                row.drafts = []
        drafting = [row for row, (k, _) in asked.items() if k]
        if drafting:
            drafters = [row.drafter for row in drafting]
            samplers = [row.decoder.sampler for row in drafting]
            masks = [None if row.processor is None else row.processor.draft_mask for row in drafting]
            drafts = draft_rows(drafters, [asked[row][0] for row in drafting], samplers, masks)
            for row, (tokens, logprobs) in zip(drafting, drafts):
                if row.processor is not None and tokens:
                    row.drafts = mx.stack(tokens).reshape(-1).tolist()
                    allowed = row.processor.allowed_drafts(row.drafts)  # a forbidden draft is not verified
                    tokens, logprobs, row.drafts = tokens[:allowed], logprobs[:allowed], row.drafts[:allowed]
                asked[row] = (asked[row][0], logprobs)
                if tokens:
                    inputs[row] = mx.concatenate([inputs[row], mx.stack(tokens).reshape(-1).astype(mx.int32)])
        return inputs, asked

    def _prompt_done(self, row, fed_now: int) -> bool:
        return len(row.fed) + fed_now == len(row.sequence.prompt)

    def _greedy_choices(self, rows, feeds, row_logits):
        """For greedy decoding rows, (drafts, the trunk's argmax at every position), in one host sync."""
        parts, owners = [], []
        for i, row in enumerate(rows):
            if not row.prefilling and row.decoder.sampler.greedy:
                parts += [feeds[i][1:].astype(mx.int32), mx.argmax(row_logits[i], axis=-1).astype(mx.int32)]
                owners.append(i)
        choices = [None] * len(rows)
        if parts:
            flat, at = mx.concatenate(parts).tolist(), 0
            for j, i in enumerate(owners):
                n_drafts, n_targets = parts[2 * j].size, parts[2 * j + 1].size
                choices[i] = (flat[at : at + n_drafts], flat[at + n_drafts : at + n_drafts + n_targets])
                at += n_drafts + n_targets
        return choices

    def _after_prefill(self, row: _Row, tokens: list[int], hidden: mx.array, logits) -> bool:
        """After a chunk of the prompt; whether the row ended (its first token may end it)."""
        row.fed += tokens
        row.last_hidden = hidden[:, -1:]
        if row.drafter is not None:
            row.drafter.prefill(tokens, hidden)
        mx.eval(hidden)  # a chunk at a time bounds the activations, as `prompt.prefill` does
        if len(row.fed) in row.checkpoint_at:
            self._save(row)
        return logits is not None and self._started(row, logits)

    def _started(self, row: _Row, logits: mx.array) -> bool:
        """The prompt is read: the first token from its last position's logits [1, V]."""
        scores = row.processor(logits[-1:], []) if row.processor is not None else logits[-1:]
        first = int(row.decoder.sampler(scores[-1]))
        row.decoder.begin(first)
        return self._emit(row, [first], logits[-1:])

    def _emit(self, row: _Row, accepted: list[int], logits: mx.array) -> bool:
        """Hand out a round's tokens (accepted drafts, then the model's own token), up to a stop
        token or max_tokens; whether the row ended. logits [>= n, V]: where each was chosen."""
        sequence = row.sequence
        out, reason = [], None
        for token in accepted:
            out.append(token)
            if row.processor is not None and not row.processor.accept([token]):
                sequence.tokens += out
                self._finish(row, "error", out, error="the grammar refused a token it had allowed")
                return True
            if token in row.stop_tokens:
                reason = "stop"
                break
            if len(sequence.tokens) + len(out) >= sequence.max_tokens:
                reason = "length"
                break
            if row.processor is not None and row.processor.finished:
                reason = "stop"  # the grammar is complete and allows nothing more, as plain decoding ends
                break
        sequence.tokens += out
        logprobs = (
            _token_logprobs(out, logits[: len(out)], sequence.logprobs) if sequence.logprobs is not None else None
        )
        drafted = min(len(out), len(accepted) - 1)
        if reason is None:
            sequence.events.put(Event(out, logprobs=logprobs, drafted=drafted))
            return False
        self._save(row)
        self._finish(row, reason, out, logprobs=logprobs, drafted=drafted)
        return True

    def _save(self, row: _Row):
        self._take_back(row)  # a checkpoint holds what the row has read, not a pass queued past it
        key = row.checkpoint_key(row.fed)
        self.store.save(capture(self.model, row.decoder.cache, row.fed, row.last_hidden, row.drafter, key))

    def _finish(self, row: _Row, reason: str, tokens=(), error: str | None = None, logprobs=None, drafted=0):
        sequence = row.sequence
        if sequence.stats is not None:
            self.speculation.merge(sequence.stats)
        sequence.finish_reason, sequence.error = reason, error
        sequence.events.put(Event(list(tokens), reason, error, logprobs, drafted))


def _token_logprobs(tokens: list[int], logits: mx.array, top: int) -> list[TokenLogprob]:
    """Each token's log-probability under logits [n, V] (float32), and the top alternatives."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    if top:
        best = mx.argsort(-logprobs, axis=-1)[:, :top]
        best_logprobs = mx.take_along_axis(logprobs, best, axis=-1)
        best, best_logprobs = best.tolist(), best_logprobs.tolist()
    else:
        best, best_logprobs = [[]] * len(tokens), [[]] * len(tokens)
    return [
        TokenLogprob(token, logprob, list(zip(ids, values)))
        for token, logprob, ids, values in zip(tokens, chosen.tolist(), best, best_logprobs)
    ]

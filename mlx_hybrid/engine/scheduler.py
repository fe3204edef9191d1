"""The batch engine: continuous batching of many sequences, speculation per row, prefix checkpoints.

Each step runs one model pass over every running sequence, packed along the token axis without
padding. A sequence still reading its prompt feeds its next chunk: at most `prefill_chunk` prompt
tokens a step for all sequences, each chunk ending where its sequence asked for a checkpoint. A
decoding sequence feeds its last token and this round's drafts. All rows draft together; then each
row accepts, rolls back and adapts on its own (`rows.Row`). Every decoding row computes what it
would compute alone (`step.build_batch`).

A step builds the packed batch, runs the model and chooses tokens (`step`), then advances the rows
(`_advance`). Where no row drafts (no drafter, or its policy has backed off) and
`ops.overlap_decode_steps` says so (a GPU, or a CPU whose products each run on one thread), it queues
the next pass before it reads this pass's tokens (`_overlapped_pass`); the tokens are the same either
way.

Sequences join between steps and leave when they finish or are cancelled. Nothing here knows about
HTTP: `submit` gives a `Sequence` whose tokens arrive as events.
"""

from __future__ import annotations

import queue
import threading

import mlx.core as mx

from .. import ops
from ..cache import check_kv_quantization, set_positions
from ..drafting import SpeculationSettings
from ..drafting.base import StateSpan
from ..errors import GenerationError
from ..prompt import PREFILL_STEP, check_context, request_ids
from ..sampling import SamplingParams
from ..speculative import DraftingPolicy, SpeculativeStats, check_num_draft_tokens
from .prefix_store import PrefixStore, capture, default_budget_bytes, restore
from .prompt_images import PromptImages
from .rows import Row
from .sequence import Event, Sequence, request_params, token_logprobs
from .step import Batch, Choice, build_batch, choose_tokens, drafter_states, plain_round_ahead, run_model


class Engine:
    """Continuous batching over one model.

    drafter: None (plain decoding) or a drafter (see `drafting.make_drafter`) that each
    sequence gets a `fork` of; num_draft_tokens and adaptive as in `speculative.DraftingPolicy`.
    prefix_store: where checkpoints are kept (None: a `PrefixStore` of
    `prefix_store.default_budget_bytes()`; a store with max_bytes=0 keeps none in memory).
    overlap: queue each plain decoding pass before reading the previous one's tokens, and a
    speculative round's drafts before building the pass that verifies them
    (None: as `ops.overlap_decode_steps` decides for the model).
    kv_bits, kv_group_size: every sequence's attention layers hold their keys and values in 4 or 8
    bits, in groups of kv_group_size features (`cache.QuantizedKVCache`); None: in the compute dtype.
    """

    def __init__(self, model, tokenizer, drafter=None, num_draft_tokens: int = 3, adaptive: bool = True,
                 max_batch: int = 8, prefill_chunk: int = PREFILL_STEP, prefix_store: PrefixStore | None = None,
                 overlap: bool | None = None, kv_bits: int | None = None, kv_group_size: int = 64):  # fmt: skip
        if kv_bits is not None:
            check_kv_quantization(kv_bits, kv_group_size, model.kv_features)
        if max_batch < 1:
            raise GenerationError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1:
            raise GenerationError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.weights_bytes = model.nbytes  # (summed once: /health asks for it on every poll)
        # (a request's own drafter is checked as its row is made, `new_row`)
        most = drafter.max_draft_tokens if drafter is not None else None
        self.num_draft_tokens = check_num_draft_tokens(num_draft_tokens, most)
        self.adaptive = adaptive
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.store = prefix_store if prefix_store is not None else PrefixStore(default_budget_bytes())
        self.overlap = ops.overlap_decode_steps(model.widest_product) if overlap is None else overlap
        self.verdicts_first = ops.read_draft_verdicts_first(model.widest_product)
        self.open_drafting = ops.open_drafting_with_pass(model.widest_product)
        self.prefill_layer_by_layer = ops.prefill_layer_by_layer()
        self.pass_tokens = ops.rows_alike_pass_tokens(model)
        self.prompts_due = False  # the next pass feeds the prompts held back by the last
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.speculation_stats = SpeculativeStats()  # the figures of every finished sequence that drafted
        self.waiting: queue.Queue = queue.Queue()
        self.rows: list[Row] = []
        self._wake = threading.Event()
        self._thread = None
        self._stopping = False

    @classmethod
    def speculating(cls, model, tokenizer, speculation: SpeculationSettings, drafter=None, **options):
        """An engine drafting as `speculation` says (drafter: one built from it already), the rest of
        the options as the constructor's."""
        if drafter is None:
            drafter = speculation.drafter(model, tokenizer)
        return cls(model, tokenizer, drafter, speculation.draft_tokens_for(drafter), speculation.adaptive, **options)

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
        row = self.new_row(
            prompt, request_params(params, max_tokens, settings), checkpoint_at, drafter, events,
            images, allow_remote_images,
        )  # fmt: skip
        self.enqueue(row)
        return row.sequence

    # -- what an engine in step with others (`ReplicatedEngine`) extends: how a request becomes a
    # row, how a row is queued, whether it was cancelled, how an idle engine waits

    def new_row(
        self, prompt, params: SamplingParams, checkpoint_at, drafter, events, images=None, allow_remote=False
    ) -> Row:
        """The row of a request (arguments as `submit`'s), not yet queued."""
        ids, max_tokens = request_ids(self.model, self.tokenizer, prompt, params.max_tokens)
        prompt_images = None
        if images:
            prompt_images = PromptImages(self.model, self.tokenizer, ids, list(images), allow_remote)
            checkpoint_at = [prompt_images.prompt.moved(p) for p in checkpoint_at if 0 <= p <= len(ids)]
            ids = prompt_images.prompt.ids
            max_tokens = min(params.max_tokens, check_context(self.model, len(ids)))
        drafter = drafter if drafter is not None else (self.drafter.fork() if self.drafter is not None else None)
        cache = self.make_cache()
        if prompt_images is not None:
            set_positions(cache, prompt_images.positions)
            if drafter is not None:
                drafter.use_positions(prompt_images.positions)
        policy = (
            DraftingPolicy(self.num_draft_tokens, self.adaptive, self.adaptive and drafter.drafts_blocks,
                           drafter.max_draft_tokens)
            if drafter is not None else None
        )  # fmt: skip
        sequence = Sequence(ids, max_tokens, params.logprobs, stats=policy.stats if policy is not None else None)
        if events is not None:
            sequence.events = events
        stops = set(self.tokenizer.eos_token_ids if params.stop_tokens is None else params.stop_tokens)
        processor = params.processor(ids, self.model.args.vocab_size, self.tokenizer)
        return Row(sequence, cache, params.sampler(), stops, checkpoint_at, drafter, policy, processor, prompt_images)

    def make_cache(self) -> list:
        """A new sequence's caches, in this engine's form."""
        return self.model.make_cache(self.kv_bits, self.kv_group_size)

    def enqueue(self, row: Row):
        """Queue a row; it joins the running ones at the next step."""
        self.waiting.put(row)
        self._wake.set()

    def is_cancelled(self, row: Row) -> bool:
        """Whether the row's request was cancelled (it then leaves at the next step)."""
        return row.sequence.cancelled

    @property
    def occupancy(self) -> dict:
        """How many sequences are generating and how many wait for a slot."""
        return {"running": len(self.rows), "waiting": self.waiting.qsize()}

    @property
    def load(self) -> dict:
        """`occupancy`'s former name."""
        return self.occupancy

    @property
    def speculation(self) -> SpeculativeStats:
        """`speculation_stats`' former name."""
        return self.speculation_stats

    @property
    def memory(self) -> dict:
        """The bytes of the model's weights, of the tables it reads by rows from their files (mapped: page
        cache, not the process's memory), and of everything MLX holds now (weights, caches, checkpoints
        in memory) and has held at most."""
        return {"weights_bytes": self.weights_bytes, "mapped_bytes": self.model.mapped_nbytes,
                "active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory()}  # fmt: skip

    @property
    def checkpoints(self) -> dict:
        """What the prefix store holds: checkpoints and their bytes in memory, its budget, files on disk."""
        store = self.store
        return {"checkpoints": len(store), "bytes": store.nbytes, "budget_bytes": store.max_bytes,
                "on_disk": len(store.on_disk), "over_budget": store.over_budget}  # fmt: skip

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
                    self.idle()
        finally:
            # Empty this thread's compile cache while it holds the GIL: left to the thread's
            # exit, MLX frees it after `join` has returned and, when the process is ending,
            # takes the GIL from a finalizing interpreter and aborts ("terminate called").
            mx.clear_streams()

    def idle(self):
        """Wait for work: until a request comes, or half a second."""
        self._wake.wait(timeout=0.5)
        self._wake.clear()

    def _admit(self):
        while len(self.rows) < self.max_batch:
            try:
                row = self.waiting.get_nowait()
            except queue.Empty:
                return
            if self.is_cancelled(row):
                self._finish(row, "cancelled")
            elif row.sequence.max_tokens == 0:
                self._finish(row, "length")
            elif not self._resume(row):
                self.rows.append(row)
            row.sequence.started.set()

    def _resume(self, row: Row) -> bool:
        """Start from the longest checkpoint that is a prefix of the prompt; whether that ended the row."""
        prompt = row.sequence.prompt
        checkpoint = self.store.longest_prefix(row.checkpoint_key(prompt) or prompt, self.model, row.cache)
        if checkpoint is None:
            return False
        restore(checkpoint, row.cache, row.drafter)
        row.fed = list(checkpoint.tokens)
        row.last_hidden = checkpoint.last_hidden
        row.sequence.cached_tokens = len(row.fed)
        row.prompt_checkpoint = checkpoint.key
        if len(row.fed) < len(row.sequence.prompt):
            return False
        # the whole prompt: its first token comes from the saved hidden state
        return self._started(row, self.model.logits_from_hidden(row.last_hidden)[0])

    def _drop_cancelled(self):
        for row in [r for r in self.rows if self.is_cancelled(r)]:
            if not row.prefilling:  # what it generated stays resumable (a chat's stopped answer)
                self._save(row)
            self._finish(row, "cancelled")
            self.rows.remove(row)

    def _pass(self):
        """One model pass over the rows that have tokens to feed this step, in four parts."""
        if self.overlap and all(not r.prefilling and r.processor is None and r.steps_plain() for r in self.rows):
            self._overlapped_pass()
            return
        for row in self.rows:
            row.take_back()
        batch = build_batch(
            self.rows, self.prefill_chunk, self.overlap, self.pass_tokens, self.prompts_due, self.verdicts_first
        )
        self.prompts_due = batch.prompts_held_back
        hidden = run_model(self.model, batch, self.prefill_layer_by_layer)
        self._advance(batch, hidden, choose_tokens(self.model, batch, hidden, self.open_drafting))

    def _advance(self, batch: Batch, hidden: mx.array, choices: list[Choice]):
        """Each row after the pass: a prompt chunk read (and maybe its first token), or a round's
        tokens accepted, the caches rolled back to them and handed out; rows that end leave."""
        for row, feed, (s, e), choice in zip(batch.rows, batch.feeds, batch.spans, choices):
            row_hidden, states = hidden[:, s:e], drafter_states(self.model, batch, row, hidden, (s, e))
            if row.prefilling:
                ended = self._after_prefill(row, feed, row_hidden, choice.logits, states)
            else:
                row.advance(row_hidden, choice.accepted, choice.drafted, batch.asked[row][0], choice.verified, states)
                ended = self._emit(row, choice.accepted, choice.logits)
            if ended:
                self.rows.remove(row)

    def _overlapped_pass(self):
        """Plain decoding with the next pass queued before this one's tokens are read
        (`step.plain_round_ahead`)."""
        rows = list(self.rows)
        current = plain_round_ahead(self.model, rows)
        tokens = mx.concatenate([ahead.token for ahead in current]).tolist()
        for row, ahead, token in zip(rows, current, tokens):
            row.advance(ahead.hidden, [token], 0, 0)
            if self._emit(row, [token], ahead.logits):
                self.rows.remove(row)

    def _after_prefill(self, row: Row, tokens: list[int], hidden: mx.array, logits, states) -> bool:
        """After a chunk of the prompt (states: what its drafter reads of it, `step.drafter_states`);
        whether the row ended (its first token may end it)."""
        row.fed += tokens
        row.last_hidden = hidden[:, -1:]
        if row.drafter is not None:
            row.drafter.prefill(tokens, states)
        # a chunk at a time bounds the activations
        mx.eval(hidden, states.states if isinstance(states, StateSpan) else states)
        if len(row.fed) in row.checkpoint_at:
            self._save(row)
        return logits is not None and self._started(row, logits)

    def _started(self, row: Row, logits: mx.array) -> bool:
        """The prompt is read: the first token from its last position's logits [1, V]."""
        scores = row.processor(logits[-1:], []) if row.processor is not None else logits[-1:]
        first = int(row.sampler(scores[-1]))
        row.begin(first)
        return self._emit(row, [first], logits[-1:])

    def _emit(self, row: Row, accepted: list[int], logits: mx.array) -> bool:
        """Hand out a round's tokens (`Row.handed_out`); whether the row ended. logits [>= n, V]: where
        each was chosen."""
        sequence = row.sequence
        out, reason = row.handed_out(accepted)
        sequence.tokens += out
        if reason == "error":
            self._finish(row, reason, out, error="the grammar refused a token it had allowed")
            return True
        logprobs = token_logprobs(out, logits[: len(out)], sequence.logprobs) if sequence.logprobs is not None else None
        accepted_drafts = min(len(out), len(accepted) - 1)
        if reason is None:
            sequence.events.put(Event(out, logprobs=logprobs, accepted_drafts=accepted_drafts))
            return False
        self._save(row)
        self._finish(row, reason, out, logprobs=logprobs, accepted_drafts=accepted_drafts)
        return True

    def _save(self, row: Row):
        """A checkpoint of what the row has read. One in its prompt is what the conversation's next
        turn resumes from; one after its answer serves that turn only where the template renders the
        answer back as generated (not a reply cut by max_tokens, not a thinking model's under Qwen's
        templates), so where the budget holds only one of them (a long session's) it keeps the prompt's."""
        row.take_back()  # a checkpoint holds what the row has read, not a pass queued past it
        checkpoint = capture(self.model, row.cache, row.fed, row.last_hidden, row.drafter, row.checkpoint_key(row.fed))
        if row.prefilling:
            self.store.save(checkpoint)
            row.prompt_checkpoint = checkpoint.key
        else:
            self.store.save(checkpoint, keep=row.prompt_checkpoint)

    def _finish(self, row: Row, reason: str, tokens=(), error: str | None = None, logprobs=None, accepted_drafts=0):
        sequence = row.sequence
        if sequence.stats is not None:
            self.speculation_stats.merge(sequence.stats)
        sequence.finish_reason, sequence.error = reason, error
        sequence.events.put(Event(list(tokens), reason, error, logprobs, accepted_drafts))

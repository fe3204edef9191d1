"""The engine of a model split over several ranks: every rank runs the same steps.

Each pass of a split model is a collective, so every rank must run the same passes over
the same rows. Rank 0 (the leader) takes the requests, as a server or a chat does; before
each step it sends the others what changed since the last one (new requests with their
resolved token ids and seeds, cancellations), and they replay it and step with it. The
rest follows by itself: the logits are the same on every rank, so sampling, accepting
drafts, rolling back and saving checkpoints come out the same everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import mlx.core as mx
import numpy as np

from ..errors import GenerationError
from ..sampling import SamplingParams
from .scheduler import Engine
from .sequence import request_params

# Control messages, sent in place of a payload's length
STOP = -1  # the leader has stopped: the others return
IDLE = -2  # nothing to do: every rank sleeps a moment before the next message


def broadcast_message(message, group):
    """Rank 0's message on every rank (the others pass None): None (no news) or a control
    code (STOP, IDLE) in one collective of one number, anything else JSON-able in two."""
    leader = group.rank() == 0
    control = leader and isinstance(message, int) and message < 0
    data = json.dumps(message).encode() if leader and message is not None and not control else b""
    length = mx.array([message if control else len(data)], dtype=mx.int32)
    length = mx.distributed.all_sum(length, group=group).item()
    if length <= 0:
        return length if length < 0 else None
    payload = mx.array(np.frombuffer(data, dtype=np.uint8)) if leader else mx.zeros((length,), dtype=mx.uint8)
    received = np.array(mx.distributed.all_sum(payload, group=group))  # evaluated on every rank, the leader's too
    return message if leader else json.loads(received.tobytes().decode())


# How long every rank sleeps when the leader has nothing to do. A rank waiting in a ring
# collective spins a core (MLX's ring backend polls its sockets), so an idle engine meets
# at this pace instead of waiting for work inside one; a request waits at most this long.
IDLE_SECONDS = 0.05


class _Discard:
    """Where a follower's events go: its leader's sequences report to the clients."""

    def put(self, _event):
        pass


class ReplicatedEngine(Engine):
    """An `Engine` in step over `model.group`: rank 0 calls `submit` and steps (`start`,
    `drive`, `run`), the other ranks call `follow`; `stop` on rank 0 ends every rank's."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.group = model.group
        self.leader = self.group.rank() == 0
        self._lock = threading.Lock()
        self._news = []  # the leader's rows and their requests, not yet announced
        self._sequences = {}  # request number -> sequence, while it runs
        self._cancels = set()  # request numbers whose cancellation every rank knows
        self._numbered = 0
        self._stopped = False

    def submit(
        self,
        prompt,
        max_tokens=None,
        *,
        params=None,
        checkpoint_at=(),
        drafter=None,
        events=None,
        images=None,
        **settings,
    ):
        """As `Engine.submit`, on rank 0 only, with the engine's own drafter and no images."""
        if not self.leader:
            raise GenerationError("only rank 0 takes requests; the other ranks follow it")
        if images:
            raise GenerationError("a model split over processes takes no images")
        if drafter is not None:
            raise GenerationError("a split model's requests use the engine's drafter")
        params = request_params(params, max_tokens, settings)
        if params.seed is None:  # drawn here, so that every rank samples alike
            params = params.replace(seed=int.from_bytes(os.urandom(4), "little") >> 1)
        row = self.new_row(prompt, params, checkpoint_at, None, events)
        request = {  # the prompt as token ids: the tokenizer's work done once
            "prompt": row.sequence.prompt, "params": dataclasses.asdict(params), "checkpoint_at": list(checkpoint_at),
        }  # fmt: skip
        with self._lock:
            row.number, request["number"] = self._numbered, self._numbered
            self._numbered += 1
            self._news.append((row, request))
        self._wake.set()
        return row.sequence

    def step(self) -> bool:
        if not self.leader:
            raise GenerationError("the other ranks step with `follow`")
        self._check_running()
        with self._lock:
            news, self._news = self._news, []
        cancels = [n for n, sequence in self._sequences.items() if sequence.cancelled and n not in self._cancels]
        if not (news or cancels or self.rows or not self.waiting.empty()):
            broadcast_message(IDLE, self.group)
            time.sleep(IDLE_SECONDS)
            return False
        message = {"submit": [request for _, request in news], "cancel": cancels} if news or cancels else None
        broadcast_message(message, self.group)
        for row, _ in news:
            self._admit_row(row)
        return self._step(cancels)

    def follow(self):
        """On ranks other than 0: replay rank 0's requests and step with it, until it stops."""
        while True:
            message = broadcast_message(None, self.group)
            if message == STOP:
                return
            if message == IDLE:
                time.sleep(IDLE_SECONDS)
                continue
            message = message or {}
            for request in message.get("submit", []):
                number = request.pop("number")
                params = SamplingParams(**request["params"])
                row = self.new_row(request["prompt"], params, request["checkpoint_at"], None, _Discard())
                row.number = number
                self._admit_row(row)
            self._step(message.get("cancel", []))

    def start(self):
        self._check_running()
        super().start()

    def stop(self):
        super().stop()
        if self.leader and not self._stopped:
            self._stopped = True
            broadcast_message(STOP, self.group)

    def _check_running(self):
        if self._stopped:  # the other ranks returned from `follow`: a step would wait for them forever
            raise GenerationError("this split engine has stopped, and the other ranks with it")

    def idle(self):
        pass  # an idle step has slept already, in step with the other ranks

    def _admit_row(self, row):
        self._sequences[row.number] = row.sequence
        self.waiting.put(row)

    def _step(self, cancels) -> bool:
        self._cancels.update(cancels)
        more = super().step()
        for number in [n for n, sequence in self._sequences.items() if sequence.done]:
            del self._sequences[number]
            self._cancels.discard(number)
        return more

    def enqueue(self, row):
        raise AssertionError("requests reach a replicated engine through submit or follow")

    def is_cancelled(self, row) -> bool:
        return row.number in self._cancels

    @property
    def occupancy(self) -> dict:
        """As the engine's, counting the requests announced to the ranks but not yet taken in."""
        with self._lock:
            announced = len(self._news)
        return {"running": len(self.rows), "waiting": self.waiting.qsize() + announced}

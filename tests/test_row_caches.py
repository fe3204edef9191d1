"""A recurrent mixer declares its state only through its step (`row_caches.recurrent`); batching rows,
snapshots, rollback and checkpoints come from the rows' owner. Shown on a toy mixer, a diagonal linear
recurrence, against the recurrence written the slow obvious way in numpy."""

import mlx.core as mx
import numpy as np

from mlx_hybrid.cache import RecurrentCache, record_snapshots, rollback
from mlx_hybrid.row_caches import RecurrentStep, RowStates, batch_of, packed, recurrent

WIDTH = 8
# The mixer's ops are elementwise float32 (a sigmoid, products and sums); numpy's sigmoid and MLX's
# differ by a few ulp, which the recurrence carries along: 1e-5 is far above that, far below a
# wrong state (a skipped or repeated token moves the outputs by 1e-2 or more).
NUMPY_TOL = 1e-5


class DiagonalRecurrence:
    """h_t = a_t h_{t-1} + (1 - a_t) x_t per channel, a_t = sigmoid(w x_t + c); out_t = h_t x_t. Its state
    is (h [B, D]), and its step is all it says about it."""

    def __init__(self, w: mx.array, c: mx.array):
        self.w, self.c = w, c

    @classmethod
    def random(cls):
        rng = np.random.default_rng(0)
        return cls(*(mx.array(rng.standard_normal(WIDTH).astype(np.float32)) for _ in range(2)))

    def __call__(self, x: mx.array, cache) -> mx.array:
        return recurrent(self.step, cache, x)

    def step(self, x: mx.array, state: tuple | None, record: bool) -> RecurrentStep:
        h = state[0] if state is not None else mx.zeros((x.shape[0], x.shape[2]))
        outs, snapshots = [], []
        for t in range(x.shape[1]):
            a = mx.sigmoid(self.w * x[:, t] + self.c)
            h = a * h + (1 - a) * x[:, t]
            outs.append(h * x[:, t])
            snapshots.append(h)
        return RecurrentStep(mx.stack(outs, axis=1), (h,), (snapshots,) if record else None)

    def numpy(self, tokens: list) -> np.ndarray:
        """Outputs [T, WIDTH] of a whole sequence from a fresh state, one token at a time."""
        w, c, h, outs = np.array(self.w), np.array(self.c), np.zeros(WIDTH, np.float32), []
        for x in tokens:
            a = 1 / (1 + np.exp(-(w * x + c)))
            h = a * h + (1 - a) * x
            outs.append(h * x)
        return np.stack(outs)


def _array(tokens: list[np.ndarray]) -> mx.array:
    """One sequence's inputs [1, T, WIDTH]."""
    return mx.array(np.stack(tokens))[None]


def _inputs(seed: int, count: int) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).standard_normal((count, WIDTH)).astype(np.float32))


def test_a_toy_mixer_gets_batching_snapshots_rollback_and_checkpoints():
    """Four rows with prompts of different lengths; decode steps of all rows as one batch; rows 0 and 2
    verifying 4 tokens while 1 and 3 decode, rolled back to different tokens; row 1 leaving; a row's
    checkpoint taken out of the batch. Each step's outputs equal the same calls on the row alone, to
    the bit, and the numpy recurrence over the tokens each row kept."""
    mixer = DiagonalRecurrence.random()
    alone, together = [RecurrentCache() for _ in range(4)], [RecurrentCache() for _ in range(4)]
    kept = [_inputs(row, 3 + row) for row in range(4)]  # each row's tokens so far
    for row in range(4):
        for caches in (alone, together):
            mixer(_array(kept[row]), caches[row])
    fresh = iter(_inputs(100, 1000))

    def step(lengths: dict[int, int], keeps: dict[int, int] = {}):
        rows = sorted(lengths)
        feeds = {row: [next(fresh) for _ in range(lengths[row])] for row in rows}
        want = []
        for caches in (alone, together):
            for row in rows:
                record_snapshots([caches[row]], lengths[row] > 1)
        for row in rows:
            want.append(mixer(_array(feeds[row]), alone[row])[0])
        caches = packed([[together[r]] for r in rows], [lengths[r] for r in rows])[0]
        got = mixer(_array(sum((feeds[r] for r in rows), [])), caches)[0]
        assert mx.array_equal(got, mx.concatenate(want)).item(), lengths
        at = 0
        for row in rows:  # the outputs of the tokens fed, after the tokens kept before them
            n = lengths[row]
            reference = mixer.numpy(kept[row] + feeds[row])[-n:]
            np.testing.assert_allclose(np.array(got[at : at + n]), reference, atol=NUMPY_TOL, rtol=0)
            at += n
            for caches in (alone, together):
                record_snapshots([caches[row]], False)
                if n > 1:
                    rollback([caches[row]], keep=keeps[row], recorded=n)
            kept[row] += feeds[row][: keeps.get(row, n)]

    step({0: 1, 1: 1, 2: 1, 3: 1})
    step({0: 1, 1: 1, 2: 1, 3: 1})
    assert isinstance(batch_of(together[0]), RowStates) and batch_of(together[0]) is batch_of(together[3]), "one batch"
    step({0: 4, 1: 1, 2: 4, 3: 1}, keeps={0: 2, 2: 4})
    step({0: 1, 1: 1, 2: 1, 3: 1})
    step({0: 1, 2: 1, 3: 1})
    step({0: 3, 2: 3, 3: 3}, keeps={0: 1, 2: 1, 3: 1})  # all keep the same token's state
    step({0: 1, 2: 1, 3: 1})

    # a row's checkpoint, out of the batch, continues as the row does
    resumed = RecurrentCache()
    resumed.restore(together[2].checkpoint())
    x = _array(_inputs(7, 2))
    assert mx.array_equal(mixer(x, resumed), mixer(x, alone[2])).item()

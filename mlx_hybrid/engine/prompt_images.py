"""A request's images as its row carries them: the prompt with their tokens, the rotary
positions those give, and their embeddings, computed by the vision tower when the prefill
first reaches them and let go when it has passed them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..images import IMAGE_PAD, ImageError, expand_image_pads, read_image
from ..models.vision import image_rope_positions


class PromptImages:
    def __init__(self, model, tokenizer, ids: list[int], images: list, allow_remote: bool = False):
        if not model.has_vision:
            raise ImageError(
                "this model takes no images: its checkpoint has no vision tower (for a GGUF model, give the "
                "projector file beside it, mmproj-*.gguf, or --mmproj)"
            )
        pad = tokenizer.token_to_id(IMAGE_PAD)
        if pad is None or tokenizer.image_processor is None:
            raise ImageError(f"the tokenizer has no {IMAGE_PAD} token or no image processor for this model")
        prepared = []
        for i, image in enumerate(images):
            try:
                prepared.append(tokenizer.image_processor(read_image(image, allow_remote)))
            except ImageError as e:
                raise ImageError(f"image {i + 1}: {e}") from None
        self.prompt = expand_image_pads(ids, prepared, pad)
        merge = model.vision.args.spatial_merge_size
        self.positions = image_rope_positions(
            len(self.prompt.ids), [(start, image.grid) for start, image in zip(self.prompt.starts, prepared)], merge
        )
        self.slots = self.prompt.slots
        self.key = self.prompt.key()
        self._features = None

    def inserted(self, model, begin: int, end: int, at: int):
        """For prompt tokens begin .. end - 1, fed from position `at` of the packed input: the
        image tokens among them as (positions [n], embeddings [n, E]), or None."""
        first, last = np.searchsorted(self.slots, [begin, end])
        if first == last:
            return None
        if self._features is None:
            self._features = model.image_features(self.prompt.images)
            mx.eval(self._features)
        if last == len(self.slots):  # the last image token: not needed again
            features, self._features = self._features, None
        else:
            features = self._features
        return at + self.slots[first:last] - begin, features[first:last]

    def key_of(self, fed: list[int]) -> list[int]:
        """The checkpoint key of a state that has read `fed` (the prompt, then generated tokens)."""
        return self.key[: len(fed)] + fed[len(self.key) :]


def join_inserted(parts: list) -> tuple[mx.array, mx.array] | None:
    """The rows' `inserted` parts as one for the packed input."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return mx.array(np.concatenate([at for at, _ in parts])), mx.concatenate([rows for _, rows in parts])

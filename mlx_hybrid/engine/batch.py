"""`batch_generate`: many prompts through the engine at once."""

from __future__ import annotations

from ..drafting import AUTO, DEFAULT_DRAFT_P_MIN, adaptive, make_drafter
from ..errors import GenerationError
from ..sampling import SEED_LIMIT, SamplingParams
from .prefix_store import PrefixStore
from .scheduler import Engine


def batch_generate(
    model,
    tokenizer,
    prompts: list,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    draft: str | None = AUTO,
    num_draft_tokens: int = 3,
    draft_vocab: int | None = None,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    max_batch: int = 8,
    adaptive_drafting: bool | None = None,
    images: list | None = None,
    **settings,
) -> list[str]:
    """The generated text for each prompt (strings or token ids), decoded together.

    Arguments as `stream_generate`'s (other `SamplingParams` fields and `response_format=`
    as keywords, each sequence with its own penalties and grammar); with a seed, sequence
    i samples from seed + i (each has its own stream). Up to `max_batch` sequences run at once; the rest join as
    others finish. Greedy output is that of each prompt alone. images: per prompt, its
    images (a list, or None), as `stream_generate` takes them.
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise GenerationError("prompts must be a non-empty list of strings or token id lists")
    if images is not None and (not isinstance(images, (list, tuple)) or len(images) != len(prompts)):
        raise GenerationError("images must list each prompt's images (or None), one entry per prompt")
    params = SamplingParams().replace(
        max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, **settings
    )
    drafter = make_drafter(model, tokenizer, draft, None, draft_vocab, draft_p_min)
    engine = Engine(
        model, tokenizer, drafter, num_draft_tokens, adaptive=adaptive(adaptive_drafting, draft_p_min),
        max_batch=max_batch, prefix_store=PrefixStore(0),
    )  # fmt: skip
    sequences = [
        engine.submit(
            prompt, params=params if seed is None else params.replace(seed=(seed + i) % SEED_LIMIT),
            images=images[i] if images is not None else None,
        )  # fmt: skip
        for i, prompt in enumerate(prompts)
    ]
    engine.run()
    texts = []
    for sequence in sequences:
        if sequence.error is not None:
            raise GenerationError(f"generation failed: {sequence.error}")
        tokens = sequence.tokens[:-1] if sequence.finish_reason == "stop" else sequence.tokens
        texts.append(tokenizer.decode(tokens))
    return texts

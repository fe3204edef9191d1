"""The Python API's generation: `stream_generate`, `generate` and `batch_generate`, each through the
batch engine (`engine.Engine`), the one way tokens are produced."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from .drafting import SpeculationSettings
from .engine import Engine, PrefixStore
from .engine.sequence import request_params
from .errors import GenerationError
from .prompt import prefill
from .sampling import SEED_LIMIT, SamplingParams
from .timing import Stopwatch
from .tokenizer import StreamingDetokenizer

__all__ = ["GenerationResponse", "batch_generate", "generate", "prefill", "stream_generate"]


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response
    token: int
    from_draft: bool  # accepted from a draft rather than sampled from the trunk
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop", "length" or None while generating
    acceptance_rate: float | None = None  # speculative decoding: accepted / drafted
    tokens_per_pass: float | None = None  # speculative decoding: tokens per trunk pass
    # speculative decoding: per draft position in a round, the share of drafts accepted
    acceptance_by_position: list[float] | None = None


def stream_generate(
    model, tokenizer, prompt, max_tokens: int = 256, *, images=None, **settings
) -> Iterator[GenerationResponse]:
    """Generate from `prompt` (a string or token ids), yielding one `GenerationResponse` per token.

    Keyword settings (an unknown one is an error that names it):
    - sampling, `SamplingParams`' fields: `temp` (0, the default, is greedy), `top_p`, `top_k`,
      `min_p`, `seed`, `logit_bias`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`,
      `repetition_context_size`, `grammar` (a `Grammar`), or OpenAI's `response_format`
      ({"type": "json_schema", ...});
    - speculation, `SpeculationSettings`' fields: `draft`, `draft_model`, `num_draft_tokens`,
      `draft_vocab`, `draft_p_min`, `adaptive_drafting` (see below);
    - the KV cache: `kv_bits` (4 or 8) holds the attention layers' keys and values in that many bits,
      in groups of `kv_group_size` features (default 64). It saves memory on long contexts; the
      attention's inputs then carry the groups' rounding.

    images: for a model with a vision tower, one image per `<|image_pad|>` in the prompt, in order:
    paths, bytes, PIL images or data URLs. Render such a prompt with the chat template, from messages
    with `{"type": "image"}` parts (see `Engine.submit`).

    The last response has `finish_reason` "stop" (an end token) or "length" (max_tokens, or the end
    of the model's context).

    Speculative decoding is on by default where the model has an MTP head (`draft="auto"`);
    `draft=None` turns it off. The drafters:
    - `draft="mtp"`: the model's own MTP head;
    - `draft="ngram"`: the last tokens looked up in the prompt and the output;
    - `draft_model=`: another model with the same vocabulary, or a DFlash block drafter (loaded, or a
      directory or hub name; `draft="dflash"` alone takes the model's own, beside its file).
    A round drafts up to `num_draft_tokens` (default 3; the MTP head of a model whose products the CPU
    computes each on one thread, as the bundled one's, 2: `ops.verified_tokens_cost_arithmetic`; a
    DFlash drafter's block less one, on such a model at most 7). The MTP head and draft models project
    onto the `draft_vocab` most frequent tokens (default 32768 when the vocabulary is larger than
    65536, else all; 0: all). Drafting stops when a draft's top probability falls below `draft_p_min`
    (default 0.1; none for a model whose products the CPU computes each on one thread, whose verify
    passes verify every draft anyway: `ops.drafts_stop_below_p_min`), and `adaptive_drafting` backs off
    after rejections (on unless `draft_p_min` is given as 0, so that `draft_p_min=0` drafts exactly
    `num_draft_tokens` every round).
    The output follows the model's distribution exactly; greedy output is plain decoding's,
    token for token. The responses then carry `from_draft`, `acceptance_rate`, `tokens_per_pass` and
    `acceptance_by_position`.

    The tokens come from the batch engine's step, as for `batch_generate`, the commands and the
    server, with this sequence its only row, stepped on the caller's thread.
    """
    params, speculation, cache = request_settings(max_tokens, settings)
    engine = Engine.speculating(model, tokenizer, speculation, max_batch=1, prefix_store=PrefixStore(0), **cache)
    mx.reset_peak_memory()
    watch = Stopwatch()  # a first call's kernel builds and checks are not the prompt's time
    sequence = engine.submit(prompt, params=params, images=images)
    detokenizer = StreamingDetokenizer(tokenizer)
    n, first_at, prompt_tps, stats = 0, None, 0.0, sequence.stats
    for event in engine.drive(sequence):
        if event.error is not None:
            raise GenerationError(f"generation failed: {event.error}")
        now = watch.elapsed()
        if first_at is None:
            first_at = now
            prompt_tps = len(sequence.prompt) / now
        for i, token in enumerate(event.tokens):
            n += 1
            finish = event.finish_reason if i == len(event.tokens) - 1 else None
            text = detokenizer.add(token) + (detokenizer.finalize() if finish else "")
            elapsed = now - first_at
            yield GenerationResponse(
                text=text,
                token=token,
                from_draft=i < event.accepted_drafts,
                prompt_tokens=len(sequence.prompt),
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=n / elapsed if elapsed > 0 else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                acceptance_rate=stats.acceptance_rate if stats else None,
                tokens_per_pass=stats.tokens_per_pass if stats else None,
                acceptance_by_position=stats.acceptance_by_position if stats else None,
            )


# the engine's cache settings an API call takes (see `Engine`): a quantized KV cache
CACHE_SETTINGS = ("kv_bits", "kv_group_size")


def request_settings(max_tokens: int, settings: dict) -> tuple[SamplingParams, SpeculationSettings, dict]:
    """An API call's keywords apart: the speculation settings and the cache settings by their
    names, the rest sampling settings (an unknown keyword is an error that names it)."""
    names = {field.name for field in dataclasses.fields(SpeculationSettings)}
    speculation = SpeculationSettings(**{name: settings[name] for name in settings if name in names})
    cache = {name: settings[name] for name in CACHE_SETTINGS if name in settings}
    sampling = {name: value for name, value in settings.items() if name not in names and name not in cache}
    return request_params(None, max_tokens, sampling), speculation, cache


def batch_generate(
    model, tokenizer, prompts: list, max_tokens: int = 256, *, max_batch: int = 8, images=None, **settings
) -> list[str]:
    """The generated text for each prompt (strings or token ids), decoded together.

    Settings as `stream_generate`'s, each sequence with its own penalties and grammar; with a seed,
    sequence i samples from seed + i (each has its own stream). Up to `max_batch` sequences run at
    once; the rest join as others finish. Greedy output is that of each prompt alone. images: per
    prompt, its images (a list, or None), as `stream_generate` takes them.
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise GenerationError("prompts must be a non-empty list of strings or token id lists")
    if images is not None and (not isinstance(images, (list, tuple)) or len(images) != len(prompts)):
        raise GenerationError("images must list each prompt's images (or None), one entry per prompt")
    params, speculation, cache = request_settings(max_tokens, settings)
    engine = Engine.speculating(
        model, tokenizer, speculation, max_batch=max_batch, prefix_store=PrefixStore(0), **cache
    )
    seed = params.seed
    sequences = [
        engine.submit(
            prompt,
            params=params if seed is None else params.replace(seed=(seed + i) % SEED_LIMIT),
            images=images[i] if images is not None else None,
        )
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


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """The whole generated text (see `stream_generate` for the arguments)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))

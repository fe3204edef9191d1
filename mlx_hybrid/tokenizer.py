"""Tokenizers from `tokenizer.json` or from GGUF metadata, chat templates, and text as tokens stream.

From GGUF, the stored tokens and merges become a `tokenizers` byte-level BPE whose
pre-tokenizer is the split that llama.cpp uses for `tokenizer.ggml.pre`, behind the
normalizer the published `tokenizer.json` files of that family apply (NFC for Qwen2,
Qwen3 and Qwen3.5, which llama.cpp skips), so that both paths give the same ids.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .chat_template import apply_chat_template
from .errors import ModelLoadError

# llama.cpp's split expressions, by `tokenizer.ggml.pre`
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 keeps combining marks with their letters
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Kimi K2 (tiktoken): Han runs apart, cased words, digit groups of up to three
_KIMI_K2_SPLIT = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
PRE_TOKENIZER_SPLITS = {
    "qwen2": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
    "kimi-k2": _KIMI_K2_SPLIT,
}

# Unicode normalization before the split, by `tokenizer.ggml.pre`, as the published
# tokenizer.json files of those families declare it (Kimi's tiktoken tokenizer has none).
PRE_TOKENIZER_NORMALIZERS = {"qwen2": "NFC", "qwen35": "NFC"}

# Special tokens that end a generation wherever the vocabulary has them, from GGUF or
# HF alike (llama.cpp derives its end-of-generation set from token texts the same way):
# a base Qwen model ends a document with <|endoftext|>, a chat turn with <|im_end|>.
END_TOKEN_TEXTS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "[EOS]",
)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the others for the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_level_alphabet()

# GGUF token types
_CONTROL, _USER_DEFINED = 3, 4


# the sampling defaults a checkpoint may recommend, as `SamplingParams` names them:
# generation_config.json's names, and GGUF's general.sampling.* keys
HF_SAMPLING_DEFAULTS = {
    "temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}  # fmt: skip
GGUF_SAMPLING_DEFAULTS = {
    "general.sampling.temp": "temp", "general.sampling.top_p": "top_p", "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p", "general.sampling.penalty_repeat": "repetition_penalty",
    "general.sampling.penalty_last_n": "repetition_context_size",
}  # fmt: skip


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's end tokens and chat template, and the
    sampling defaults its checkpoint recommends (`generation_defaults`: SamplingParams names).
    For a model with a vision tower, `image_processor` (an `images.ImageProcessor`) turns
    images into its patches, as a Hugging Face processor pairs the two."""

    image_processor = None

    def __init__(
        self,
        tokenizer,
        eos_token_ids,
        chat_template=None,
        bos_token=None,
        add_bos_token=False,
        generation_defaults=None,
    ):
        self.generation_defaults = dict(generation_defaults or {})
        self._tokenizer = tokenizer
        special = tokenizer.get_added_tokens_decoder()
        end_tokens = {i for i, token in special.items() if token.special and token.content in END_TOKEN_TEXTS}
        self.eos_token_ids = sorted(set(eos_token_ids) | end_tokens)
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.add_bos_token = add_bos_token
        self._bos_id = tokenizer.token_to_id(bos_token) if bos_token else None

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self._bos_id is not None:
            ids = [self._bos_id] + ids
        return ids

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """`encode(text)`, and for each token the offset in text where it ends."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids, ends = encoding.ids, [end for _, end in encoding.offsets]
        if self.add_bos_token and self._bos_id is not None:
            ids, ends = [self._bos_id] + ids, [0] + ends
        return ids, ends

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str):
        return self._tokenizer.token_to_id(token)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for, also when they are part of a character (where
        `decode` gives U+FFFD)."""
        piece = self._tokenizer.id_to_token(token) or ""
        try:
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        except KeyError:  # an added token, stored as plain text
            return piece.encode()

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes one token stands for, added tokens' texts included (computed once)."""
        return max(len(self.token_bytes(i)) for i in range(self.vocab_size))

    def apply_chat_template(self, conversation=None, **settings):
        """Hugging Face's `apply_chat_template`, its keywords with their meanings and defaults: token
        ids unless tokenize=False, add_generation_prompt False unless given, return_dict=True for
        {"input_ids", "attention_mask"} (see `chat_template.apply_chat_template`)."""
        if conversation is None and "messages" in settings:  # this method's earlier name for it
            conversation = settings.pop("messages")
        return apply_chat_template(self, conversation, **settings)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the model the tools it is given (asked once)."""
        try:
            return _PROBE_NAME in self.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL], tokenize=False
            )
        except Exception:  # noqa: BLE001  (a template that fails here fails the request itself, with its message)
            return True

    @functools.cached_property
    def rendered_tool_call(self) -> str:
        """The chat template's rendering of an assistant turn that calls a tool, which shows how
        it writes calls (`tool_grammars.tool_call_style`); "" where it cannot render one (asked once)."""
        call = {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {"probe_key": "v"}}}
        turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            return self.apply_chat_template(turn, tools=[_PROBE_TOOL], tokenize=False)
        except Exception:  # noqa: BLE001  (a template that cannot render a call writes no known format)
            return ""

    def is_special_token(self, text: str) -> bool:
        """Whether text is one special token (which ordinary text never encodes to)."""
        added = self._tokenizer.get_added_tokens_decoder().get(self._tokenizer.token_to_id(text))
        return added is not None and added.special and added.content == text

    # -- construction ------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: Path, config: dict) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        file = path / "tokenizer.json"
        settings = _read_json(path / "tokenizer_config.json")
        if file.is_file():
            try:
                tokenizer = HFTokenizer.from_file(str(file))
            except Exception as e:
                raise ModelLoadError(f"{file}: unreadable tokenizer ({e})") from None
        elif (path / "tiktoken.model").is_file():  # Kimi's, as Moonshot publishes it
            tokenizer = _tiktoken_bpe(path / "tiktoken.model", settings)
        else:
            raise ModelLoadError(f"{path}: no tokenizer.json (nor a tiktoken.model)")
        template = settings.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        eos = set()
        generation = _read_json(path / "generation_config.json")
        for source in (config.get("text_config", {}), config, generation):
            eos.update(_as_list(source.get("eos_token_id")))
        defaults = {ours: generation[theirs] for theirs, ours in HF_SAMPLING_DEFAULTS.items() if theirs in generation}
        if generation.get("do_sample") is False:  # transformers then decodes greedily, whatever the temperature
            defaults["temp"] = 0.0
        eos_token = _token_text(settings.get("eos_token"))
        if eos_token and tokenizer.token_to_id(eos_token) is not None:
            eos.add(tokenizer.token_to_id(eos_token))
        return cls(
            tokenizer,
            eos,
            template,
            bos_token=_token_text(settings.get("bos_token")),
            add_bos_token=bool(settings.get("add_bos_token", False)),
            generation_defaults=defaults,
        )

    @classmethod
    def from_gguf(cls, meta) -> "Tokenizer":
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ModelLoadError(
                f"unsupported GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} (only byte-level BPE, 'gpt2')"
            )
        pre = meta.get("tokenizer.ggml.pre", "qwen2")
        if pre not in PRE_TOKENIZER_SPLITS:
            raise ModelLoadError(
                f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))})"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        tokenizer = _byte_level_bpe(
            tokens,
            merges,
            pre,
            special=[t for t, k in zip(tokens, types) if k == _CONTROL],
            user_defined=[t for t, k in zip(tokens, types) if k == _USER_DEFINED],
        )
        eos = _as_list(meta.get("tokenizer.ggml.eos_token_id")) + _as_list(meta.get("tokenizer.ggml.eot_token_id"))
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            tokenizer,
            eos,
            meta.get("tokenizer.chat_template"),
            bos_token=tokens[bos_id] if bos_id is not None else None,
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            generation_defaults={
                ours: meta.get(key) for key, ours in GGUF_SAMPLING_DEFAULTS.items() if meta.get(key) is not None
            },
        )


def _byte_level_bpe(tokens, merges, pre: str, special=(), user_defined=(), whole_pieces: bool = False):
    """A `tokenizers` byte-level BPE: tokens by id (byte-level strings), merges in priority order,
    the split of llama.cpp's `pre` name behind its family's normalizer. whole_pieces: a piece that is
    one token is that token before any merge (tiktoken's rule; `ignore_merges`)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    bpe = models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, ignore_merges=whole_pieces)
    tokenizer = HFTokenizer(bpe)
    if pre in PRE_TOKENIZER_NORMALIZERS:
        tokenizer.normalizer = getattr(normalizers, PRE_TOKENIZER_NORMALIZERS[pre])()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    return tokenizer


# Kimi's tiktoken tokenizer (its `tokenization_kimi.py`): 256 special-token ids after the ranks
# of `tiktoken.model`, named by tokenizer_config.json's added_tokens_decoder, the rest reserved
TIKTOKEN_SPECIAL_IDS = 256


def _tiktoken_bpe(path: Path, settings: dict):
    """A `tokenizers` BPE that encodes as tiktoken does with `path` (one `base64(bytes) rank` line a
    token) and Kimi's split, special tokens allowed in text: ranks become ids, each token's merges
    are every split of it into two tokens, in the order of the merged token's rank (tiktoken merges
    the adjacent pair whose concatenation ranks lowest)."""
    import base64

    char_of_byte = {b: c for c, b in _BYTE_OF_CHAR.items()}
    try:
        ranks = {}
        for line in path.read_text().splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a tiktoken file ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelLoadError(f"{path}: the ranks are not 0 .. {len(ranks) - 1}")
    text = {piece: "".join(char_of_byte[b] for b in piece) for piece in ranks}
    merges = []
    for piece, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in ranks and piece[i:] in ranks]
        merges += [(text[a], text[b]) for a, b in sorted(splits, key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))]
    named = {int(i): _token_text(t) for i, t in (settings.get("added_tokens_decoder") or {}).items()}
    base = len(ranks)
    special = [named.get(i, f"<|reserved_token_{i}|>") for i in range(base, base + TIKTOKEN_SPECIAL_IDS)]
    tokens = [text[piece] for piece in sorted(ranks, key=ranks.get)] + special
    return _byte_level_bpe(tokens, merges, "kimi-k2", special=special, whole_pieces=True)


_PROBE_NAME = "probe_tool_x7"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "parameters": {"type": "object"}}}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def _as_list(value):
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _token_text(token):
    return token.get("content") if isinstance(token, dict) else token


class StreamingDetokenizer:
    """Emits new text as tokens arrive, holding back incomplete UTF-8 sequences. End tokens
    add no text (what ends a generation is not part of it)."""

    # byte-level BPE decodes piecewise, so a segment can restart after any clean emission
    SEGMENT = 16

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.end_tokens = set(tokenizer.eos_token_ids)
        self.segment: list[int] = []
        self.segment_text = ""

    def add(self, token: int) -> str:
        if token in self.end_tokens:
            return ""
        self.segment.append(token)
        text = self.tokenizer.decode(self.segment)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.segment_text) :]
        self.segment_text = text
        if len(self.segment) >= self.SEGMENT:
            self.segment, self.segment_text = [], ""
        return new

    def finalize(self) -> str:
        """What is still held back at the end (an incomplete character decodes as U+FFFD)."""
        rest = self.tokenizer.decode(self.segment)[len(self.segment_text) :] if self.segment else ""
        self.segment, self.segment_text = [], ""
        return rest

"""Tokenizers built from GGUF metadata against the checkpoints' tokenizer.json, and Kimi's tiktoken
files against tiktoken."""

import json
import shutil
import unicodedata

import pytest
from tokenizers import Tokenizer as HFTokenizer

import mlx_hybrid
from conftest import FIXTURES
from mlx_hybrid.loaders import gguf_file
from mlx_hybrid.prompt import chat_prompt
from mlx_hybrid.tokenizer import StreamingDetokenizer, Tokenizer

# code, prose, CJK, emoji and ZWJ sequences, decomposed accents, special-token strings
# inside text, runs of whitespace, other scripts and symbols
TEXTS = [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser()\n    return parser.parse_args(argv)\n",
    "for i in range(10):\n\tprint(i ** 2, end=' ')\n",
    'class Foo(Bar):\n    """Docstring."""\n\n    x: int = 42\n',
    "if (a && b) || !c { return x->y[0]; }",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    '<html><body><p class="x">Hi &amp; bye</p></body></html>',
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man... isn't it? They'll see; we'd know.",
    "Hello, World! HELLO WORLD hello world HeLLo",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -2.5e-10 1,000,000 0xFF 0b1010",
    "Dates 2026-11-23, times 09:41:05, phone +1 (555) 123-4567.",
    "你好，世界！今天天气很好。",
    "日本語のテキストです。カタカナとひらがな。",
    "한국어 문장입니다. 안녕하세요!",
    "混合 mixed 文本 text 123 数字",
    "Emoji: 😀 😃 😄 👍🏽 🎉",
    "ZWJ family: 👨‍👩‍👧‍👦 and 🏳️‍🌈 and 👩🏾‍💻",
    "Flags 🇫🇷🇩🇪🇯🇵 keycaps 1️⃣ #️⃣",
    "Café naïve résumé façade coöperate",
    unicodedata.normalize("NFD", "Café naïve résumé façade coöperate"),
    unicodedata.normalize("NFD", "Ångström Zürich São Paulo Kraków"),
    "e\u0301 a\u0300 o\u0308 n\u0303 (combining marks after letters)",
    unicodedata.normalize("NFD", "한국어"),
    "Ελληνικά κείμενα και Русский текст и עברית",
    "العربية نص تجريبي",
    "हिन्दी पाठ और বাংলা",
    "Tabs\tand\t\ttabs\nnewlines\n\n\nand\r\nCRLF\r\n",
    "    leading spaces and trailing spaces    ",
    "multiple     spaces      between       words",
    "\n\n\n",
    " ",
    "a",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <|im_end|>after",
    "<|im_start|><|im_end|><|endoftext|>",
    "not special: <|im_start |> <im_end> |im_end|",
    "<think>\nreasoning\n</think>\n\nanswer",
    "Math: ∑_{i=1}^{n} x_i² ≤ √(a·b) ± ∞ ≠ ∅ ∈ ℝ",
    "Quotes “smart” ‘single’ «guillemets» — en–dash … ellipsis",
    "URLs https://example.com/path?q=1&r=2#frag and emails a.b@c.de",
    'JSON: {"key": [1, 2.5, null, true, "str\\n"]}',
    "Regex: ^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)$",
    "Mixed\u00a0non-breaking\u2009thin\u200bzero-width spaces",
    "Ligatures ﬁ ﬂ and fullwidth ＡＢＣ１２３ and ① ⅳ",
    "Control chars \x07 \x1b[31mred\x1b[0m",
    "Repeated!!!!!!! ??????? ........ ------",
    "CamelCaseIdentifier snake_case_identifier kebab-case-identifier SCREAMING_CASE",
    "中文标点：“引号”、《书名》——破折号……省略号",
    "Tiếng Việt có dấu: Xin chào thế giới",
    "Deutsch: Straße, Größe, Übermäßig; Français: œuvre, à côté",
]


# The published tokenizer.json files of each family normalize like this; the fixtures'
# files were written without a normalizer, so the test gives them the published one.
PUBLISHED_NORMALIZER = {"qwen35": "NFC", "qwen35moe": "NFC", "qwen3next": "NFC", "kimilinear": None}


def gguf_tokenizer(family):
    return Tokenizer.from_gguf(gguf_file.Metadata(gguf_file.open_gguf(FIXTURES / family / "model.gguf")))


def published_tokenizer_json(family):
    spec = json.loads((FIXTURES / family / "hf" / "tokenizer.json").read_text())
    if PUBLISHED_NORMALIZER[family]:
        spec["normalizer"] = {"type": PUBLISHED_NORMALIZER[family]}
    return HFTokenizer.from_str(json.dumps(spec))


def test_corpus_is_varied():
    assert len(TEXTS) >= 40
    assert any(unicodedata.normalize("NFC", t) != t for t in TEXTS)  # needs normalization
    assert any("\u200d" in t for t in TEXTS) and any("<|im_end|>" in t for t in TEXTS)


@pytest.mark.parametrize("family", ["qwen35", "qwen35moe", "qwen3next", "kimilinear"])
def test_gguf_tokenizer_matches_tokenizer_json(family):
    """Ids and round trips equal on every text, normalization included."""
    ours, theirs = gguf_tokenizer(family), published_tokenizer_json(family)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ids) == (
            unicodedata.normalize(PUBLISHED_NORMALIZER[family], text) if PUBLISHED_NORMALIZER[family] else text
        )


@pytest.mark.parametrize("family", ["qwen35", "qwen35moe", "qwen3next", "kimilinear"])
def test_fixture_tokenizer_json_differs_only_by_its_missing_normalizer(family):
    ours = gguf_tokenizer(family)
    theirs = HFTokenizer.from_file(str(FIXTURES / family / "hf" / "tokenizer.json"))
    for text in TEXTS:
        if unicodedata.normalize("NFC", text) == text:
            assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("family", ["qwen35", "qwen35moe", "qwen3next", "kimilinear"])
def test_end_tokens_agree_between_gguf_and_hf(family):
    import mlx_hybrid

    gguf = mlx_hybrid.load(FIXTURES / family / "model.gguf")[1].eos_token_ids
    hf = mlx_hybrid.load(FIXTURES / family / "hf")[1].eos_token_ids
    assert gguf == hf
    vocab = HFTokenizer.from_file(str(FIXTURES / family / "hf" / "tokenizer.json"))
    assert {vocab.token_to_id("<|im_end|>"), vocab.token_to_id("<|endoftext|>")} <= set(gguf)


def test_generation_stops_at_every_end_token():
    """<|endoftext|> ends a generation as <|im_end|> does, from either source."""
    import mlx_hybrid

    for source in ("model.gguf", "hf"):
        model, tok = mlx_hybrid.load(FIXTURES / "qwen35" / source)
        for end in (0, 2):  # <|endoftext|>, <|im_end|>
            # a prompt whose greedy continuation is forced to the end token: bias the LM head
            responses = list(mlx_hybrid.stream_generate(_ends_with(model, end), tok, "def", max_tokens=8))
            assert [r.token for r in responses] == [end] and responses[-1].finish_reason == "stop"


def _ends_with(model, token):
    """A copy of `model` whose output favours `token` everywhere."""
    import copy

    import mlx.core as mx

    forced = copy.copy(model)
    project = model.project

    def biased(x):
        logits = project(x)
        return logits + 1e4 * (mx.arange(logits.shape[-1]) == token)

    forced.project = biased
    return forced


def test_special_tokens_are_single_ids():
    reader = gguf_file.open_gguf(FIXTURES / "qwen35" / "model.gguf")
    tok = Tokenizer.from_gguf(gguf_file.Metadata(reader))
    assert tok.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tok.eos_token_ids == [0, 2]  # <|endoftext|> and <|im_end|>


def test_chat_template_from_gguf_and_hf_agree():
    import mlx_hybrid

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = {
        source: mlx_hybrid.load(FIXTURES / "qwen35" / source)[1].apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        for source in ("model.gguf", "hf")
    }
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered["model.gguf"] == rendered["hf"] == expected


# -- apply_chat_template as Hugging Face's ------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen35", "assistant"])
def test_apply_chat_template_gives_what_transformers_gives(name):
    """Text, ids and dict, case by case, against transformers' own (tests/fixtures/make_chat_template_refs.py):
    its keywords with its meanings (add_generation_prompt off unless asked, continue_final_message,
    tools, batches, truncation, template variables), ids by default."""
    from fixtures.make_chat_template_refs import TOKENIZERS, cases

    refs = json.loads((FIXTURES / "chat_template_refs.json").read_text())[name]
    tokenizer = mlx_hybrid.load(TOKENIZERS[name])[1]
    for case, keywords in cases().items():
        keywords = dict(keywords)
        conversation = keywords.pop("conversation")
        assert tokenizer.apply_chat_template(conversation, tokenize=False, **keywords) == refs[case]["text"], case
        assert tokenizer.apply_chat_template(conversation, **keywords) == refs[case]["ids"], case
        assert tokenizer.apply_chat_template(conversation, return_dict=True, **keywords) == refs[case]["dict"], case


def test_either_prompt_form_generates_the_same_tokens():
    """mlx-lm's usual call (ids) and the text form give the same prompt and the same tokens."""
    import mlx.core as mx

    model, tokenizer = mlx_hybrid.load(FIXTURES / "qwen35" / "model.gguf")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def parse_args("}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert isinstance(text, str) and ids == tokenizer.encode(text) and ids == chat_prompt(tokenizer, messages).ids
    tensors = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="mlx", return_dict=True
    )
    assert tensors["input_ids"].tolist() == [ids] and tensors["attention_mask"].dtype == mx.int32
    outputs = [mlx_hybrid.generate(model, tokenizer, prompt, max_tokens=12, draft=None) for prompt in (text, ids)]
    assert outputs[0] == outputs[1] and outputs[0]


@pytest.mark.parametrize(
    "keywords,refusal",
    [
        (dict(return_tensors="pt"), "return_tensors must be one of np, mlx"),
        (dict(padding="max_length", max_length=64), "padding='max_length' is not supported"),
        (dict(return_assistant_tokens_mask=True, return_dict=True), "return_assistant_tokens_mask"),
        (dict(tokenizer_kwargs={"add_special_tokens": True}), "tokenizer_kwargs"),
        (dict(add_generation_prompt=True, continue_final_message=True), "not compatible"),
        (dict(tools=[len]), "tools are JSON schemas"),
    ],
)
def test_apply_chat_template_refuses_what_it_cannot_honour(keywords, refusal):
    tokenizer = mlx_hybrid.load(FIXTURES / "qwen35" / "hf")[1]
    with pytest.raises(ValueError, match=refusal):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], **keywords)


# -- Kimi's tiktoken tokenizer (tiktoken.model + tokenizer_config.json, no tokenizer.json) -------

# the split of Kimi's tokenization_kimi.py, as published (not read from the package)
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_TEXTS = [
    "[BOS]<|im_user|>user<|im_middle|>hi<|im_end|>[EOS] and <|reserved_token_300|>",
    "not special: [EOS ] <|im_middle |> [bos]",
    "digit groups 1 12 123 1234 12345 1234567890",
    "long whitespace" + " " * 40 + "\n" * 5 + "\t" * 7 + "end",
    "HTTPServer XMLHttpRequest iPhone McDonald's DON'T we'll",
]
TIKTOKEN = FIXTURES / "kimilinear" / "tiktoken"


@pytest.fixture
def kimi_tiktoken_checkpoint(tmp_path):
    """Kimi Linear as Moonshot publishes it: the fixture's weights beside tiktoken.model and its
    tokenizer_config.json, no tokenizer.json."""
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(FIXTURES / "kimilinear" / "hf" / name, tmp_path / name)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(TIKTOKEN / name, tmp_path / name)
    return tmp_path


def tiktoken_encoding():
    """tiktoken's own Encoding of the same files, as tokenization_kimi.py builds it."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(TIKTOKEN / "tiktoken.model"))
    named = json.loads((TIKTOKEN / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    named = {int(i): token["content"] for i, token in named.items()}
    special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + 256)}
    return tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def test_kimi_tiktoken_encodes_as_tiktoken_and_decodes_back(kimi_tiktoken_checkpoint):
    """Every text of the corpus (Han runs, digit groups, cased words, contractions, emoji, CRLF, long
    whitespace, special-token texts) to tiktoken's ids with allowed_special="all", back to the same
    text, and streamed token by token to the same text less the end tokens."""
    config = json.loads((kimi_tiktoken_checkpoint / "config.json").read_text())
    ours = Tokenizer.from_hf_dir(kimi_tiktoken_checkpoint, config)
    theirs = tiktoken_encoding()
    for text in TEXTS + KIMI_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, allowed_special="all"), text
        assert ours.decode(ids) == text
        stream = StreamingDetokenizer(ours)
        streamed = "".join(stream.add(t) for t in ids) + stream.finalize()
        assert streamed == ours.decode([t for t in ids if t not in ours.eos_token_ids])  # end tokens add no text


def test_kimi_tiktoken_checkpoint_loads_and_chats(kimi_tiktoken_checkpoint):
    """The checkpoint loads; a chat renders from tokenizer_config.json's template to tiktoken's ids of
    the same rendering; [EOS] (config) and <|im_end|> end a generation."""
    from jinja2 import Template

    model, tokenizer = mlx_hybrid.load(kimi_tiktoken_checkpoint, dtype="float32")
    messages = [{"role": "user", "content": "def 你好 1234"}, {"role": "assistant", "content": "ok"}]
    template = json.loads((TIKTOKEN / "tokenizer_config.json").read_text())["chat_template"]
    rendered = Template(template).render(messages=messages, add_generation_prompt=True)
    ids = chat_prompt(tokenizer, messages).ids
    assert ids == tiktoken_encoding().encode(rendered, allowed_special="all")
    assert {tokenizer.token_to_id("[EOS]"), tokenizer.token_to_id("<|im_end|>")} <= set(tokenizer.eos_token_ids)
    assert len(mlx_hybrid.generate(model, tokenizer, ids, max_tokens=4, draft=None)) >= 0

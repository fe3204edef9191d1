"""Tokenizers built from GGUF metadata against the checkpoints' tokenizer.json."""

import pytest
from tokenizers import Tokenizer as HFTokenizer

from conftest import FIXTURES
from mlx_hybrid.loaders import gguf_file
from mlx_hybrid.tokenizer import Tokenizer

TEXTS = [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser()\n\treturn parser.parse_args(argv)\n",
    "    \n\n\n        x  =  1   # runs of   whitespace\r\n\t\t",
    "Grüße, naïve café — ½ × π ≈ 3.14159; 日本語のテキスト, 한국어, Ελληνικά, русский",
    "emoji: 🐍🚀👩‍💻 flags 🇫🇷 and skin tones 👍🏽",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567890 and 3.5e-10, 0xDEADBEEF, i'll we're they've I'M",
    "",
]


@pytest.mark.parametrize("family", ["qwen35", "qwen35moe", "qwen3next", "kimilinear"])
def test_gguf_tokenizer_matches_tokenizer_json(family):
    reader = gguf_file.open_gguf(FIXTURES / family / "model.gguf")
    ours = Tokenizer.from_gguf(gguf_file.Metadata(reader))
    theirs = HFTokenizer.from_file(str(FIXTURES / family / "hf" / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text


def test_special_tokens_are_single_ids():
    reader = gguf_file.open_gguf(FIXTURES / "qwen35" / "model.gguf")
    tok = Tokenizer.from_gguf(gguf_file.Metadata(reader))
    assert tok.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tok.eos_token_ids == [2]


def test_chat_template_from_gguf_and_hf_agree():
    import mlx_hybrid

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = {
        source: mlx_hybrid.load(FIXTURES / "qwen35" / source)[1].apply_chat_template(messages)
        for source in ("model.gguf", "hf")
    }
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered["model.gguf"] == rendered["hf"] == expected

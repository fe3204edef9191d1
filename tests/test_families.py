"""A model family is its model file and one record (`loaders.families.Family`). Shown on a toy family
defined here and nowhere in the package: a decoder of diagonal linear recurrences (the mixer of
test_row_caches) registered from one record, loaded from a Hugging Face directory and from a GGUF file,
computing what numpy computes, and run by the engine (rows batched, speculation rolled back) with
nothing else added."""

import json
import shutil
import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_hybrid
from conftest import FIXTURES
from mlx_hybrid.loaders import families
from mlx_hybrid.loaders.common import Rule
from mlx_hybrid.models.layers import LINEAR, Linear, RMSNorm
from mlx_hybrid.models.trunk import HybridModel, TrunkArgs
from test_row_caches import DiagonalRecurrence

# The model file of the toy family: its arguments, its layer, its model ---------------------------------

FLOAT32_PARAMS = ()


@dataclass
class ModelArgs(TrunkArgs):
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096


class DiagonalLayer(nn.Module):
    """h + out_proj(diagonal recurrence over in_proj(norm(h))): the recurrence's w and c are its
    `decay_weight` and `decay_bias`."""

    layer_type = LINEAR

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.in_proj = Linear(args.hidden_size, args.hidden_size, bias=False)
        self.out_proj = Linear(args.hidden_size, args.hidden_size, bias=False)
        self.decay_weight = mx.zeros((args.hidden_size,))
        self.decay_bias = mx.zeros((args.hidden_size,))

    def __call__(self, h: mx.array, cache=None) -> mx.array:
        mixer = DiagonalRecurrence(self.decay_weight, self.decay_bias)
        return h + self.out_proj(mixer(self.in_proj(self.norm(h)), cache))


class Model(HybridModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args, [DiagonalLayer(args) for _ in range(args.num_hidden_layers)])

    @property
    def kv_features(self) -> tuple[int, ...]:
        return ()


# Its record ------------------------------------------------------------------------------------------


def hf_args(config: dict, module, has_mtp: bool, has_vision: bool = False) -> ModelArgs:
    return ModelArgs(**{k: config[k] for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")})


def hf_rules(layout: str) -> list:
    return [Rule(r"model\.(?P<name>.+)", "{name}"), Rule(r"lm_head\.weight", "lm_head.weight")]


def gguf_args(meta, module, tensor_shapes: dict, model_type: str) -> ModelArgs:
    vocab = len(meta.get("tokenizer.ggml.tokens"))
    return ModelArgs(model_type, vocab, meta.require("embedding_length"), meta.require("block_count"))


GGUF_RULES = [
    Rule(r"token_embd\.weight", "embed_tokens.weight"),
    Rule(r"output_norm\.weight", "norm.weight"),
    Rule(r"output\.weight", "lm_head.weight"),
    Rule(r"(?P<name>layers\.\d+\..+)", "{name}"),
]

TOY = families.Family(
    "toy_diagonal",
    sys.modules[__name__],
    hf_args,
    hf_rules,
    gguf=families.GGUFArchitecture("toy-diagonal", gguf_args, GGUF_RULES),
)

# -----------------------------------------------------------------------------------------------------

WIDTH, LAYERS = 8, 2
# float32 throughout; the sigmoid and the norm's rsqrt differ by a few ulp between numpy and MLX, and
# the recurrence and two layers carry them: 1e-4 on logits of size ~1 is far above that and far below
# a wrong state (a token skipped or fed twice moves them by 1e-2 or more).
NUMPY_TOL = 1e-4


def _weights(vocab: int) -> dict[str, np.ndarray]:
    """The toy's parameters by our names, random."""
    rng = np.random.default_rng(0)
    weights = {
        "embed_tokens.weight": rng.standard_normal((vocab, WIDTH)),
        "norm.weight": 1 + rng.random(WIDTH),
        "lm_head.weight": rng.standard_normal((vocab, WIDTH)) / 3,
    }
    for i in range(LAYERS):
        weights |= {
            f"layers.{i}.norm.weight": 1 + rng.random(WIDTH),
            f"layers.{i}.in_proj.weight": rng.standard_normal((WIDTH, WIDTH)) / 3,
            f"layers.{i}.out_proj.weight": rng.standard_normal((WIDTH, WIDTH)) / 3,
            f"layers.{i}.decay_weight": rng.standard_normal(WIDTH),
            f"layers.{i}.decay_bias": rng.standard_normal(WIDTH),
        }
    return {name: w.astype(np.float32) for name, w in weights.items()}


def numpy_logits(weights: dict, ids: list[int]) -> np.ndarray:
    """The toy's logits [T, V], the slow obvious way: token by token, layer by layer."""

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x) + 1e-6) * w

    states = [np.zeros(WIDTH, np.float32) for _ in range(LAYERS)]
    logits = []
    for token in ids:
        h = weights["embed_tokens.weight"][token]
        for i in range(LAYERS):
            x = weights[f"layers.{i}.in_proj.weight"] @ norm(h, weights[f"layers.{i}.norm.weight"])
            a = 1 / (1 + np.exp(-(weights[f"layers.{i}.decay_weight"] * x + weights[f"layers.{i}.decay_bias"])))
            states[i] = a * states[i] + (1 - a) * x
            h = h + weights[f"layers.{i}.out_proj.weight"] @ (states[i] * x)
        logits.append(weights["lm_head.weight"] @ norm(h, weights["norm.weight"]))
    return np.stack(logits)


@pytest.fixture
def toy_files(tmp_path):
    """The toy registered, and its weights as a Hugging Face directory and as a GGUF file (the qwen35
    fixture's tokenizer in each)."""
    import gguf

    families.register(TOY)
    try:
        vocab = json.loads((FIXTURES / "qwen35" / "hf" / "config.json").read_text())["text_config"]["vocab_size"]
        weights = _weights(vocab)
        directory = tmp_path / "hf"
        directory.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(FIXTURES / "qwen35" / "hf" / name, directory / name)
        config = {"model_type": "toy_diagonal", "vocab_size": vocab, "hidden_size": WIDTH, "num_hidden_layers": LAYERS}
        (directory / "config.json").write_text(json.dumps(config))
        hf_names = {name: name if name.startswith("lm_head") else "model." + name for name in weights}
        mx.save_safetensors(
            str(directory / "model.safetensors"), {hf_names[k]: mx.array(v) for k, v in weights.items()}
        )

        path = tmp_path / "toy.gguf"
        reader = gguf.GGUFReader(str(FIXTURES / "qwen35" / "model.gguf"))
        writer = gguf.GGUFWriter(str(path), "toy-diagonal")
        writer.add_block_count(LAYERS)
        writer.add_embedding_length(WIDTH)
        for name, field in reader.fields.items():
            if name.startswith("tokenizer."):
                array = field.types[0] == gguf.GGUFValueType.ARRAY
                writer.add_key_value(
                    name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None
                )
        outer = {
            "embed_tokens.weight": "token_embd.weight",
            "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight",
        }
        for name, w in weights.items():
            writer.add_tensor(outer.get(name) or name.replace("layers.", "blk.", 1), w)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        yield weights, directory, path
    finally:
        families.FAMILIES.remove(TOY)


def test_a_family_from_one_record_loads_from_both_formats_and_runs_in_the_engine(toy_files):
    weights, directory, path = toy_files
    prompts = [[3, 14, 15, 9, 2, 6], [5, 3], [5, 8, 9, 7, 9]]
    for source in (directory, path):
        model, tokenizer = mlx_hybrid.load(source, dtype="float32")
        assert type(model) is Model
        for ids in prompts:
            np.testing.assert_allclose(
                np.array(model(mx.array([ids]))[0]), numpy_logits(weights, ids), atol=NUMPY_TOL, rtol=0
            )
        # the engine: rows batched equal each row alone, and n-gram speculation (rolled back where
        # its drafts miss) equals plain decoding
        alone = [mlx_hybrid.generate(model, tokenizer, ids, max_tokens=12, temp=0.0) for ids in prompts]
        together = mlx_hybrid.batch_generate(model, tokenizer, prompts, max_tokens=12, temp=0.0)
        assert together == alone
        rates = []
        for ids in prompts:
            plain = [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, ids * 3, 16, temp=0.0)]
            drafted = list(mlx_hybrid.stream_generate(model, tokenizer, ids * 3, 16, temp=0.0, draft="ngram"))
            assert [r.token for r in drafted] == plain
            rates.append(drafted[-1].acceptance_rate)
        assert any(0 < rate < 1 for rate in rates), f"drafts both kept and rolled back: {rates}"


def test_a_name_taken_is_refused(toy_files):
    with pytest.raises(ValueError, match="toy_diagonal"):
        families.register(TOY)
    with pytest.raises(mlx_hybrid.ModelLoadError, match="unsupported architecture 'toy'"):
        families.family("toy")

"""Logit bias, penalties and grammars: each token chosen as a slow reference loop chooses it,
the same with speculation (every drafter, k = 1..4) and per row in batches; grammars hold."""

import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import mlx_hybrid
from conftest import FAMILIES, QWEN_FAMILIES, SOURCES, load_fixture, reference, reference_processing
from mlx_hybrid.engine import Engine, PrefixStore
from mlx_hybrid.processors import Grammar
from mlx_hybrid.prompt import prefill

N = 40


def prompt_for(family):
    return reference(family)["prompt_ids"][0].tolist()


def settings_for(family, source):
    """Every processor at once; the bias pushes down the plain greedy run's first two tokens
    and up a token it never chose, so that every part changes the output."""
    plain = greedy(family, source)
    never = next(t for t in range(3, 500) if t not in plain)
    return dict(
        logit_bias={plain[0]: -100, plain[1]: -3.5, never: 2.0},
        presence_penalty=1.2,  # large: few tokens repeat in 40 from these random models
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        repetition_context_size=40,  # the qwen35 fixture repeats a token only 30 tokens apart
    )


def greedy(family, source, draft=None, k=3, **settings):
    model, tok = load_fixture(family, source)
    responses = mlx_hybrid.stream_generate(
        model, tok, prompt_for(family), max_tokens=N, draft=draft, num_draft_tokens=k, stop_tokens=(), **settings
    )
    return [r.token for r in responses]


def reference_greedy(family, source, **settings):
    """One token at a time through plain caches, the formulas applied in numpy."""
    model, _ = load_fixture(family, source)
    prompt = prompt_for(family)
    cache = model.make_cache()
    logits = model.logits_from_hidden(prefill(model, prompt, cache)[:, -1:])[0, -1]
    output = []
    for _ in range(N):
        output.append(int(np.argmax(reference_processing(np.array(logits), prompt, output, **settings))))
        logits = model(mx.array([[output[-1]]]), cache)[0, -1]
    return output


@pytest.mark.parametrize("part", ["bias", "penalties", "repetition", "all"])
def test_processed_greedy_equals_the_reference_loop(family, source, part):
    settings = settings_for(family, source)
    chosen = {
        "bias": ["logit_bias"],
        "penalties": ["presence_penalty", "frequency_penalty"],
        "repetition": ["repetition_penalty", "repetition_context_size"],
        "all": list(settings),
    }[part]
    settings = {name: settings[name] for name in chosen}
    got = greedy(family, source, **settings)
    assert got == reference_greedy(family, source, **settings)
    assert got != greedy(family, source)  # the processors changed something


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_processed_greedy_equals_plain(family, source, k):
    """Verify position j counts the round's first j drafts: MTP and n-gram output is plain output."""
    settings = settings_for(family, source)
    plain = greedy(family, source, **settings)
    for draft in ["ngram"] + (["mtp"] if family in QWEN_FAMILIES else []):
        assert greedy(family, source, draft, k, **settings) == plain, draft


def test_rows_of_a_batch_keep_their_own_processors():
    family, source = "qwen35", "hf"
    model, tok = load_fixture(family, source)
    settings = settings_for(family, source)
    variants = [{}, settings, {"presence_penalty": 1.5}, {"logit_bias": settings["logit_bias"]}]
    engine = Engine(model, tok, mlx_hybrid.drafting.make_drafter(model, tok, "mtp"), prefix_store=PrefixStore(0))
    sequences = [engine.submit(prompt_for(family), max_tokens=N, stop_tokens=(), **v) for v in variants]
    engine.run()
    assert [s.tokens for s in sequences] == [greedy(family, source, **v) for v in variants]


# -- grammars

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def generated(family, source, draft=None, max_tokens=120, **settings):
    model, tok = load_fixture(family, source)
    responses = list(
        mlx_hybrid.stream_generate(model, tok, prompt_for(family), max_tokens=max_tokens, draft=draft, **settings)
    )
    tokens = [r.token for r in responses]
    ended_by_end_token = responses[-1].finish_reason == "stop" and tokens[-1] in tok.eos_token_ids
    return tok.decode(tokens[:-1] if ended_by_end_token else tokens), responses[-1], tokens


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_json_schema_holds_and_speculation_keeps_the_output(family, source):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    text, last, tokens = generated(family, source, response_format=response_format)
    assert last.finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    for draft in ["ngram"] + (["mtp"] if family in QWEN_FAMILIES else []):  # the same tokens, to the last
        assert generated(family, source, draft, response_format=response_format)[2] == tokens, draft


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_regex_lark_gbnf_and_json_object_hold(temp):
    family, source = "qwen3next", "model.gguf"
    cases = [
        (Grammar("regex", r"[a-z]{2,6}-[0-9]{1,3}"), lambda t: re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", t)),
        (Grammar("lark", 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,2}/'),
         lambda t: re.fullmatch(r"yes|no|maybe \d{1,2}", t)),
        (Grammar("gbnf", 'root ::= "(" [a-c]+ ")" | "none"'), lambda t: re.fullmatch(r"\([a-c]+\)|none", t)),
        (Grammar("json_object"), lambda t: isinstance(json.loads(t), dict)),
    ]  # fmt: skip
    for grammar, holds in cases:
        text, last, _ = generated(family, source, "mtp", temp=temp, seed=3, grammar=grammar, max_tokens=200)
        if grammar.kind != "json_object":  # a random model may wander inside a string until max_tokens
            assert last.finish_reason == "stop", grammar
            assert holds(text), (grammar, text)


def test_a_draft_the_grammar_forbids_is_not_verified():
    """n-gram drafts from a prompt of digits under a grammar of letters: every draft is cut
    before the verify pass, so no pass verifies any draft."""
    model, tok = load_fixture("qwen35", "hf")
    engine = Engine(model, tok, mlx_hybrid.drafting.make_drafter(model, tok, "ngram"), prefix_store=PrefixStore(0))
    digits = tok.encode("12 12 12 12 12 12 12 12")
    sequence = engine.submit(digits, max_tokens=20, grammar=Grammar("regex", "[a-z]{20,}"))
    engine.run()
    assert re.fullmatch("[a-z]+", tok.decode(sequence.tokens))
    assert sequence.stats.drafted == 0 and sequence.stats.passes > 0


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_the_mtp_head_drafts_from_what_the_grammar_allows(temp):
    """With the grammar's mask the head drafts only digits, and a sampled draft's distribution
    (what the acceptance rule divides by) has no mass elsewhere; without it, it drafts other text."""
    from mlx_hybrid.drafting import draft_rows, make_drafter
    from mlx_hybrid.sampling import SamplingParams

    model, tok = load_fixture("qwen35", "hf")
    prompt = prompt_for("qwen35")
    params = SamplingParams(temp=temp, seed=3, grammar=Grammar("regex", "[0-9]{30}"))

    def drafts(masked: bool):
        drafter = make_drafter(model, tok, "mtp", draft_vocab=0, draft_p_min=0.0)
        hidden = prefill(model, prompt, model.make_cache())
        drafter.start(prompt, hidden, 7)  # "7" as the first token: the grammar took it
        processor = params.processor(prompt, model.args.vocab_size, tok)
        assert processor.accept(tok.encode("7"))
        [(tokens, logprobs)] = draft_rows(
            [drafter], [4], [params.sampler()], [processor.draft_mask if masked else None]
        )
        return [int(t) for t in tokens], logprobs

    digits = {t for t in range(model.args.vocab_size) if re.fullmatch("[0-9]+", tok.decode([t]))}
    tokens, logprobs = drafts(masked=True)
    assert len(tokens) == 4 and set(tokens) <= digits
    if temp:
        for q in logprobs:
            outside = np.array([t not in digits for t in range(model.args.vocab_size)])
            assert np.all(np.isneginf(np.array(q)[outside]))
    assert not set(drafts(masked=False)[0]) <= digits


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(grammar=("lark", "start: (")), "invalid lark grammar"),
        (dict(grammar=("regex", "[a-")), "invalid regex grammar"),
        (dict(grammar=("gbnf", "root ::= [")), "invalid gbnf grammar"),
        (dict(grammar=("json_schema", '{"type": "string", "pattern": "(["}')), "invalid json_schema grammar"),
        (dict(grammar=("xml", "<a/>")), "grammar kind must be one of"),
        (dict(response_format={"type": "json_schema", "json_schema": {}}), "json_schema needs a schema"),
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(logit_bias={10**7: 1}), "outside the vocabulary"),
        (dict(logit_bias={"x": 1}), "not a token id"),
        (dict(repetition_penalty=-1), "repetition_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(grammar=("regex", "a"), response_format={"type": "json_object"}), "not both"),
        (dict(temperature=0.5), "unknown setting 'temperature'"),
    ],
)
def test_bad_settings_are_refused_by_name(settings, message):
    model, tok = load_fixture("qwen35", "hf")
    with pytest.raises(mlx_hybrid.GenerationError, match=re.escape(message)):
        if isinstance(settings.get("grammar"), tuple):
            settings = settings | {"grammar": Grammar(*settings["grammar"])}
        mlx_hybrid.generate(model, tok, "x", max_tokens=4, **settings)


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_a_reasoning_budget_closes_the_reasoning_and_speculation_keeps_it(family):
    """A prompt that opens <think>: the first `budget` tokens are what the model writes unbounded,
    then `</think>` as the tokenizer writes it, token by token; drafts verified against it alike."""
    model, tok = load_fixture(family, "hf")
    prompt = prompt_for(family) + tok.encode("<think>")
    budget, close = 5, tok.encode("</think>")

    def run(draft=None, **settings):
        responses = mlx_hybrid.stream_generate(
            model, tok, prompt, max_tokens=16, draft=draft, stop_tokens=(), **settings
        )
        return [r.token for r in responses]

    plain, bounded = run(), run(reasoning_budget=budget)
    assert bounded[:budget] == plain[:budget]
    assert bounded[budget : budget + len(close)] == close and plain[budget : budget + len(close)] != close
    for draft in ("ngram", "mtp"):
        assert run(draft, reasoning_budget=budget) == bounded, draft

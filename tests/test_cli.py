"""The mlx_hybrid.generate command on the fixtures: text on stdout, statistics on stderr."""

from conftest import FIXTURES, load_fixture
from test_errors import assert_usage_error, run_cli

import mlx_hybrid
from mlx.utils import tree_flatten
from mlx_hybrid import ops


def greedy_text(family, source, prompt, n):
    model, tok = load_fixture(family, source)
    return mlx_hybrid.generate(model, tok, prompt, max_tokens=n, draft=None)


def test_cli_generates_the_api_text():
    result = run_cli(
        "--model",
        str(FIXTURES / "qwen35" / "model.gguf"),
        "--prompt",
        "def parse_args(",
        "--max-tokens",
        "12",
        "--dtype",
        "float32",  # greedy_text's dtype (a GPU's default is bfloat16)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == greedy_text("qwen35", "model.gguf", "def parse_args(", 12).rstrip("\n")
    assert "generation: 12 tokens" in result.stderr and "peak memory" in result.stderr


def test_cli_compact_loading():
    path = FIXTURES / "qwen35" / "model-Q4_K_M.gguf"
    result = run_cli("--model", str(path), "--compact", "--prompt", "def f(", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    model, tok = mlx_hybrid.load(path, compact=True)
    assert result.stdout.rstrip("\n") == mlx_hybrid.generate(model, tok, "def f(", max_tokens=8).rstrip("\n")
    hf = run_cli("--model", str(FIXTURES / "qwen35" / "hf"), "--compact", "--prompt", "hi")
    assert_usage_error(hf, "compact loading applies to GGUF files")


def test_cli_takes_llama_cpps_8_bit_activations():
    """--cpu-activations int8 (the default for a GGUF file here) and float32 compute as load() does with them;
    a checkpoint it does not compute is refused by name."""
    path = FIXTURES / "qwen35" / "model-Q8_0.gguf"
    texts = {}
    for activations in ("int8", "float32"):
        result = run_cli(
            "--model", str(path), "--cpu-activations", activations, "--prompt", "class A:", "--max-tokens", "8"
        )
        assert result.returncode == 0, result.stderr
        model, tok = mlx_hybrid.load(path, cpu_activations=activations)
        texts[activations] = mlx_hybrid.generate(model, tok, "class A:", max_tokens=8).rstrip("\n")
        assert result.stdout.rstrip("\n") == texts[activations]
    assert texts["int8"] != texts["float32"]  # (this prompt's 8 tokens tell the two apart)
    default = run_cli("--model", str(path), "--prompt", "class A:", "--max-tokens", "8")
    assert default.stdout.rstrip("\n") == texts["int8"]
    refused = run_cli("--model", str(FIXTURES / "qwen35" / "hf"), "--cpu-activations", "int8", "--prompt", "hi")
    assert_usage_error(refused, "computes with float activations")


def test_cli_with_kimi_and_stdin_prompt():
    result = run_cli(
        "--model", str(FIXTURES / "kimilinear" / "hf"), "--prompt", "-", "--max-tokens", "8", stdin="import os\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == greedy_text("kimilinear", "hf", "import os\n", 8).rstrip("\n")


def test_cli_speculative_decoding_reports_acceptance_and_keeps_the_text():
    args = ["--model", str(FIXTURES / "qwen35moe" / "hf"), "--prompt", "class A:", "--max-tokens", "16"]
    plain = run_cli(*args)
    for extra in (
        ["--mtp", "--num-draft-tokens", "2"],
        ["--draft-model", str(FIXTURES / "qwen35moe" / "model.gguf")],
        ["--draft-model", str(FIXTURES / "dflash" / "qwen35moe-b16-l0-2")],  # a DFlash drafter: blocks of 16
        ["--draft", "dflash", "--draft-model", str(FIXTURES / "dflash" / "qwen35moe-b16-l0-2")],
    ):
        spec = run_cli(*args, *extra)
        assert spec.returncode == 0, spec.stderr
        assert spec.stdout == plain.stdout
        assert "of drafts accepted" in spec.stderr and "tokens per trunk pass" in spec.stderr
    wrong = run_cli(*args, "--draft", "dflash")
    assert_usage_error(wrong, "needs draft_model=")
    both = run_cli(*args, "--draft", "mtp", "--draft-model", str(FIXTURES / "dflash" / "qwen35moe-b16-l0-2"))
    assert_usage_error(both, "--draft mtp and --draft-model contradict each other")


def test_cli_takes_a_gguf_files_own_dflash_drafter_beside_it(tmp_path):
    """--draft dflash with no --draft-model: the drafter in <file stem>-dflash beside the GGUF file (as
    the bundled model ships its own), drafting whole blocks; the text plain decoding gives."""
    import shutil

    shutil.copy(FIXTURES / "qwen35" / "model.gguf", tmp_path / "m.gguf")
    shutil.copytree(FIXTURES / "dflash" / "qwen35-b8-l0-2", tmp_path / "m-dflash")
    args = ["--model", str(tmp_path / "m.gguf"), "--prompt", "def f(", "--max-tokens", "16", "--verbose"]
    plain, spec = run_cli(*args, "--draft", "none"), run_cli(*args, "--draft", "dflash")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "speculation: dflash, up to 7 drafts a round (blocks of 8)" in spec.stderr


def test_cli_chat_template_and_verbose():
    result = run_cli(
        "--model",
        str(FIXTURES / "qwen3next" / "model.gguf"),
        "--prompt",
        "hi",
        "--chat",
        "--system",
        "be brief",
        "--max-tokens",
        "4",
        "--verbose",
        "--dtype",
        "float32",
    )
    assert result.returncode == 0, result.stderr
    model, tok = load_fixture("qwen3next", "model.gguf")
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert result.stdout.rstrip("\n") == mlx_hybrid.generate(model, tok, prompt, max_tokens=4).rstrip("\n")
    assert f"linear-attention ops: {ops.backend_name()}" in result.stderr and "BLAS:" in result.stderr
    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))  # (the float32 file's, as loaded)
    assert f"weights {weights / 1e6:.1f} MB in memory" in result.stderr
    # MTP by default, 2 drafts a round where each verified token costs its arithmetic (a model this small on
    # the CPU), every draft proposed (the pass verifies them all there); a 512-token vocabulary drafts over
    # all of it
    assert (
        "speculation: mtp, up to 2 drafts a round over the whole vocabulary, backing off after misses" in result.stderr
    )


def test_cli_help_explains_the_options():
    result = run_cli("--help")
    assert result.returncode == 0
    for option in (
        "--model",
        "--prompt",
        "--draft",
        "--no-mtp",
        "--draft-model",
        "--num-draft-tokens",
        "--draft-vocab",
        "--draft-p-min",
        "--chat",
        "--temp",
        "--mtp-from",
    ):
        assert option in result.stdout
    assert "Kimi Linear" in result.stdout


def test_cli_takes_the_mtp_head_from_the_original_checkpoint():
    """mlx-lm's conversion has no head: --mtp-from the original gives it one (drafts are made and
    verified, the text is plain decoding's); a checkpoint without a head is a usage error."""
    conversion = ["--model", str(FIXTURES / "qwen35" / "mlx-lm-4bit"), "--prompt", "class A:", "--max-tokens", "12"]
    plain, drafted = run_cli(*conversion), run_cli(*conversion, "--mtp-from", str(FIXTURES / "qwen35" / "hf"))
    assert plain.returncode == drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout
    assert "of drafts accepted" in drafted.stderr and "of drafts accepted" not in plain.stderr
    assert_usage_error(run_cli(*conversion, "--mtp-from", str(FIXTURES / "kimilinear" / "hf")), "has no MTP head")


def test_cli_speculates_by_default_where_there_is_a_head_and_drafts_ngrams_for_kimi():
    qwen = ["--model", str(FIXTURES / "qwen35" / "hf"), "--prompt", "class A:", "--max-tokens", "16"]
    default, plain = run_cli(*qwen), run_cli(*qwen, "--no-mtp")
    assert default.returncode == plain.returncode == 0, default.stderr
    assert default.stdout == plain.stdout
    assert "of drafts accepted" in default.stderr and "of drafts accepted" not in plain.stderr
    kimi = ["--model", str(FIXTURES / "kimilinear" / "model.gguf"), "--prompt", "import os\n", "--max-tokens", "24"]
    plain, ngram = run_cli(*kimi), run_cli(*kimi, "--draft", "ngram", "--num-draft-tokens", "4")
    assert plain.returncode == ngram.returncode == 0, ngram.stderr
    assert ngram.stdout == plain.stdout and "of drafts accepted" in ngram.stderr
    assert_usage_error(run_cli(*kimi, "--draft", "mtp"), "no MTP head")
    assert_usage_error(run_cli(*qwen, "--draft-p-min", "2"), "draft_p_min must be in [0, 1]")
    assert_usage_error(run_cli(*qwen, "--draft-vocab", "-1"), "draft_vocab must be >= 0")


def test_cli_prompt_cache_file_reuses_a_long_system_prompt(tmp_path):
    """Run 1 saves the state after the system message; run 2, another question, prefills only its own part."""
    cache = tmp_path / "rules.cache"
    model_args = ["--model", str(FIXTURES / "qwen35" / "hf"), "--chat", "--system", "def rules(): " * 20]
    model, tok = load_fixture("qwen35", "hf")
    for question in ("first question", "another one"):
        result = run_cli(*model_args, "--prompt", question, "--max-tokens", "6", "--prompt-cache-file", str(cache))
        assert result.returncode == 0, result.stderr
        messages = [{"role": "system", "content": "def rules(): " * 20}, {"role": "user", "content": question}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert result.stdout.rstrip("\n") == mlx_hybrid.generate(model, tok, prompt, max_tokens=6).rstrip("\n")
        assert cache.exists()
    system_tokens = len(tok.apply_chat_template(messages[:1]))
    assert f"({system_tokens} from the prompt cache)" in result.stderr
    other_model = run_cli(
        "--model", str(FIXTURES / "kimilinear" / "hf"), "--prompt", "x", "--prompt-cache-file", str(cache)
    )
    assert_usage_error(other_model, "made by another model")


def test_cli_constrains_with_a_schema_a_gbnf_grammar_or_a_regex_and_penalizes(tmp_path):
    import json
    import re

    import jsonschema

    model = str(FIXTURES / "qwen35" / "model.gguf")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "answer.gbnf").write_text('root ::= "yes" | "no" | "(" [a-c]+ ")"')
    for flags, holds in [
        (["--json-schema", str(tmp_path / "schema.json")], lambda text: jsonschema.validate(json.loads(text), schema)),
        (["--grammar", str(tmp_path / "answer.gbnf")], lambda text: re.fullmatch(r"yes|no|\([a-c]+\)", text)),
        (["--regex", "[a-z]{2,6}-[0-9]{1,3}"], lambda text: re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", text)),
    ]:
        result = run_cli("--model", model, "--prompt", "x", "--max-tokens", "60", *flags)
        assert result.returncode == 0, result.stderr
        assert holds(result.stdout.rstrip("\n")) is not False, result.stdout
    settings = ["--presence-penalty", "1.5", "--frequency-penalty", "2", "--repetition-penalty", "2"]
    result = run_cli("--model", model, "--prompt", "def parse_args(", "--max-tokens", "24", *settings)
    model_, tok = load_fixture("qwen35", "model.gguf")
    want = mlx_hybrid.generate(
        model_,
        tok,
        "def parse_args(",
        max_tokens=24,
        draft=None,
        presence_penalty=1.5,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
    )
    assert result.stdout.rstrip("\n") == want.rstrip("\n") != greedy_text("qwen35", "model.gguf", "def parse_args(", 24)


def test_cli_holds_the_kv_cache_in_the_bits_asked_for():
    """--kv-bits 4: the API's text with kv_bits=4 (which differs from the float32 cache's here), said
    with --verbose; a group that does not divide the model's heads is a usage error naming it."""
    args = ["--model", str(FIXTURES / "qwen35" / "hf"), "--prompt", "class A:", "--max-tokens", "24"]
    result = run_cli(*args, "--kv-bits", "4", "--kv-group-size", "32", "--verbose", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    model, tok = load_fixture("qwen35", "hf")
    want = mlx_hybrid.generate(model, tok, "class A:", max_tokens=24, kv_bits=4, kv_group_size=32)
    assert result.stdout.rstrip("\n") == want.rstrip("\n") != greedy_text("qwen35", "hf", "class A:", 24)
    assert "KV cache in 4 bits, groups of 32" in result.stderr
    assert_usage_error(run_cli(*args, "--kv-bits", "8"), "kv_group_size 64 does not divide")
    assert_usage_error(run_cli(*args, "--kv-bits", "6"), "--kv-bits: invalid choice")


def test_a_first_calls_kernel_checks_are_not_counted_as_its_prompt(monkeypatch):
    """The kernels' first-use checks (and a first run's build) are timed apart: on a fresh
    install they took the prompt's rate to 0.1 tokens/s for a 5-token prompt."""
    import time

    from mlx_hybrid.ops import selfcheck
    from mlx_hybrid.timing import Stopwatch

    model, tok = load_fixture("qwen35", "model.gguf")
    check, delay, checks = selfcheck._check, 0.5, []

    def slow_check(*args):
        checks.append(args[0].name)
        time.sleep(delay)  # a check as slow as a first run's (MLX compiles the ops it compares with)
        return check(*args)

    monkeypatch.setattr(selfcheck, "_check", slow_check)
    monkeypatch.setattr(selfcheck, "kernel_usable", {})  # every variant checks again on first use
    watch = Stopwatch()
    responses = list(mlx_hybrid.stream_generate(model, tok, "def parse_args(", max_tokens=4))
    assert checks and watch.one_time() >= delay * len(checks)
    prompt_seconds = responses[0].prompt_tokens / responses[0].prompt_tps
    # a 5-token prompt of the tiny fixture takes milliseconds; without the exclusion it took the
    # checks' seconds
    assert prompt_seconds < delay

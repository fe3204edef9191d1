import signal
import socket
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX, as for users

import mlx.core as mx
import numpy as np
import pytest

from emulation import emulate
from mlx_hybrid import ops
from mlx_hybrid.ops import cpu_extension, cpu_quantized, gpu_kernels, selfcheck

# The processes tests start (CLIs, chat, mlx.launch) take Ctrl-C as in a terminal: a test
# run started in the background without job control inherits SIGINT ignored, and would
# pass that on to every process it starts (exec keeps an ignored signal, not a handler).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The files that take longest, longest first: xdist hands each worker a whole file at a time, in
# collection order (pyproject's `--no-loadscope-reorder`), so these start at once and the last files
# to run are short ones, not a worker left alone with a minutes-long file.
LONGEST_FILES = [
    "test_distributed.py", "test_speculative.py", "test_row_kernel_models.py", "test_cli.py", "test_server.py",
    "test_kernels.py", "test_qwen4_exp.py", "test_processors.py", "test_agent_apis.py", "test_bundled.py",
]  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order


FIXTURES = Path(__file__).parent / "fixtures"
QWEN_FAMILIES = ["qwen35", "qwen35moe", "qwen3next"]  # with MTP heads
FAMILIES = QWEN_FAMILIES + ["kimilinear"]
SOURCES = ["model.gguf", "hf"]

_models = {}

# The fixtures' float32 floor, relative: their trunk logits (scale ~17) agree with transformers
# to ~1e-3 (fixtures/README.md). The same model summing in another order (another BLAS kernel,
# another number of rows, AVX2 or AVX-512) moves results within that band, so comparisons of
# two summation orders hold to this share of the compared values' scale.
FLOAT32_FLOOR = 6e-5

# Our logits against transformers' (torch's float32 kernels, another summation order and
# other transcendental functions): measured at most 3.0e-4 over the four families and both
# formats on logits of scale ~17 (qwen35moe, where a router's near-tie amplifies rounding);
# the fixtures' README expects agreement around 1e-3. 3e-3 leaves room for other CPUs' kernels
# while a wrong layer (a missing norm, a swapped gate) moves logits by 1e-1 or more.
REFERENCE_TOL = 3e-3


def assert_close_to_floor(got, want):
    """got and want, computed in different summation orders, agree to the float32 floor."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=FLOAT32_FLOOR * max(float(np.abs(want).max()), 1.0), rtol=0)


def assert_every_instruction_set_agrees(products):
    """products() -> arrays: the same bits from each build of our CPU kernels this CPU runs (AVX2;
    AVX-512 where it has it)."""
    extension = cpu_quantized.extension()
    results = {}
    try:
        for name in extension.instruction_sets():
            extension.use_instruction_set(name)
            results[name] = [np.array(product) for product in products()]
    finally:
        extension.use_instruction_set(None)
    first, *others = results.values()
    for other in others:
        for a, b in zip(first, other):
            np.testing.assert_array_equal(a, b)


def load_fixture(family: str, source: str):
    """Load a fixture model once per test session."""
    key = (family, source)
    if key not in _models:
        _models[key] = mlx_hybrid.load(FIXTURES / family / source, dtype="float32")
    return _models[key]


def function_tool(name: str, properties: dict, required: list[str] | None = None) -> dict:
    """An OpenAI chat-completions tool: the function `name` taking an object of `properties`."""
    parameters = {"type": "object", "properties": properties}
    if required is not None:
        parameters["required"] = required
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(family: str, name: str = "ref.npz"):
    return np.load(FIXTURES / family / name)


@pytest.fixture
def on_the_cpu():
    """The CPU as the default device for the test: our CPU kernels' tests run there on a machine
    with a GPU too (where ops send a GPU's work to its own kernels)."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


def cpu_kernel_tests():
    """The marks of our CPU kernels' test modules: skipped where the kernels do not build, run on
    the CPU (`on_the_cpu`). Called at a module's import, so that only those modules build them."""
    return [
        pytest.mark.skipif(cpu_extension.extension() is None, reason="the CPU kernels do not build here"),
        pytest.mark.usefixtures("on_the_cpu"),
    ]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(params=SOURCES)
def source(request):
    return request.param


def reference_processing(
    logits,
    prompt,
    output,
    logit_bias=None,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    repetition_context_size=20,
):
    """The logit processors' formulas (llama.cpp's repetition penalty, OpenAI's bias and
    presence / frequency penalties), written the slow obvious way in numpy float32, one token at a time."""
    x = np.array(logits, dtype=np.float32)
    for token, bias in (logit_bias or {}).items():
        x[token] += np.float32(bias)
    if repetition_penalty != 1.0:
        for token in set((prompt + output)[-repetition_context_size:]):
            factor = np.float32(repetition_penalty)
            x[token] = x[token] / factor if x[token] > 0 else x[token] * factor
    for token in set(output):
        x[token] -= np.float32(frequency_penalty * output.count(token) + presence_penalty)
    return x


# Chat templates that write tool calls as the released checkpoints' templates do (Qwen3.5's XML is
# fixtures/make_assistant.py's TEMPLATE): tools in a system turn, each call in the model's format.
_TOOLS_TURN = """\
{%- if tools %}<|im_start|>system
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}"""
TOOL_TEMPLATES = {
    "json": _TOOLS_TURN
    + """\
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}""",
    "kimi": _TOOLS_TURN
    + """\
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or '' }}
{%- if m.tool_calls %}<|tool_calls_section_begin|>
{%- for call in m.tool_calls %}<|tool_call_begin|>functions.{{ call.function.name }}:{{ loop.index0 }}\
<|tool_call_argument_begin|>{{ call.function.arguments | tojson }}<|tool_call_end|>
{%- endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}""",
}


@pytest.fixture
def emulated(monkeypatch):
    """The GPU's kernels (metal/'s bodies) run on the 'emulated' platform, the g++ emulation; checks
    start afresh. Everything else computes as on this CPU."""

    def run(spec, launch):  # outputs in their dtypes, as a GPU's runner gives them
        return [mx.array(o).astype(d) for o, d in zip(emulate(spec, launch)[0], launch.output_dtypes)]

    monkeypatch.setitem(gpu_kernels.RUNNERS, "emulated", run)
    monkeypatch.setattr(ops.backend, "kernel_platform", lambda: "emulated")
    monkeypatch.setattr(selfcheck, "kernel_usable", {})
    monkeypatch.delenv("MLX_HYBRID_STRICT_KERNELS", raising=False)

"""`mlx_hybrid.chat` driven in a real terminal (pexpect): streaming, history, checkpoints per turn."""

import os
import re
import signal
import sys

import pexpect
import pytest

import mlx_hybrid
from conftest import FIXTURES, load_fixture
from mlx_hybrid.cli.running import follow
from mlx_hybrid.engine import Engine, PrefixStore
from mlx_hybrid.parsers import parse_output
from mlx_hybrid.prompt import chat_prompt

STATS = re.compile(r"\[prompt: (\d+) tokens, (\d+) new, [\d.]+ tokens/s \| answer: (\d+) tokens")
SYSTEM = "You write Python."


@pytest.fixture(scope="module")
def bundled():
    return mlx_hybrid.load(mlx_hybrid.bundled_model_path())


def greedy(model, tokenizer, ids, max_tokens):
    return [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, ids, max_tokens=max_tokens, draft="none")]


def spawn(*args):
    child = pexpect.spawn(
        sys.executable, ["-m", "mlx_hybrid.chat", *args], encoding="utf-8", timeout=120, dimensions=(50, 200)
    )
    child.expect(">>> ")
    return child


def ask(child, text):
    """(what the terminal showed as the answer, prompt tokens, new prompt tokens)."""
    child.sendline(text)
    child.expect(STATS)
    shown = child.before.split(text, 1)[1]
    prompt, new = int(child.match[1]), int(child.match[2])
    child.expect(">>> ")
    return shown.replace("\r\n", "\n").strip("\n"), prompt, new


def test_two_turns_the_second_reads_only_its_new_message(bundled):
    model, tokenizer = bundled
    child = spawn("--system", SYSTEM, "--max-tokens", "24")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def parse_args("}]
    turn_1 = chat_prompt(tokenizer, first).ids
    generated = greedy(model, tokenizer, turn_1, 24)
    answer = parse_output(tokenizer.decode([t for t in generated if t not in tokenizer.eos_token_ids])).content

    shown, prompt, new = ask(child, "def parse_args(")
    assert shown == answer.strip("\n") and (prompt, new) == (len(turn_1), len(turn_1))

    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "class Config:"}]
    turn_2 = chat_prompt(tokenizer, second).ids
    shown, prompt, new = ask(child, "class Config:")
    # everything up to turn 1's last token came from its checkpoint
    assert prompt == len(turn_2) and new == len(turn_2) - (len(turn_1) + len(generated) - 1)
    expected = greedy(model, tokenizer, turn_2, 24)
    expected_text = tokenizer.decode([t for t in expected if t not in tokenizer.eos_token_ids])
    assert shown == parse_output(expected_text).content.strip("\n")

    child.sendline("/help")
    child.expect("/reset")
    child.expect(">>> ")
    child.sendline("/reset")
    child.expect("starts over")
    child.expect(">>> ")
    _, prompt, new = ask(child, "def parse_args(")
    # the same first turn again: it was checkpointed where its messages end, before the answer's prompt
    messages_end = len(tokenizer.apply_chat_template(first))
    assert prompt == len(turn_1) and new == len(turn_1) - messages_end > 0
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_an_answer_stopped_with_ctrl_c_is_kept_and_the_next_turn_reads_only_what_is_new(bundled):
    model, tokenizer = bundled
    child = spawn("--max-tokens", "3000", "--no-mtp")
    child.sendline("def parse_args(")
    child.expect_exact("def parse_args(")  # the terminal's echo
    child.expect(r"\S{4}")  # the answer is streaming
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect(STATS)
    prompt_1, generated = int(child.match[1]), int(child.match[3])
    assert 0 < generated < 3000
    child.expect(">>> ")
    _, prompt_2, new = ask(child, "class Config:")
    # everything up to the stopped answer's last token came from the checkpoint it left
    assert new == prompt_2 - (prompt_1 + generated - 1)
    assert new < 20
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_end_of_input_leaves_and_bad_options_are_usage_errors():
    child = spawn("--max-tokens", "4")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    child = pexpect.spawn(sys.executable, ["-m", "mlx_hybrid.chat", "--model", "/no/such/model"], encoding="utf-8")
    child.expect("error: ")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2


def test_image_command_shows_an_image_to_the_next_message():
    """/image FILE: the next message's prompt holds the image's tokens; a bad file is told and dropped."""
    fixture = FIXTURES / "qwen35vl"
    model, tokenizer = load_fixture("qwen35vl", "hf")
    child = spawn("--model", str(fixture / "hf"), "--max-tokens", "4", "--no-mtp")
    child.sendline(f"/image {fixture / 'missing.png'}")
    child.expect("error: /image .*cannot read the image")
    child.sendline(f"/image {fixture / 'image_a.png'}")
    child.expect(r"\(the next message shows")
    content = [{"type": "image"}, {"type": "text", "text": "def area():"}]
    expected = len(chat_prompt(tokenizer, [{"role": "user", "content": content}]).ids) + 29  # 30 tokens for the pad
    _, prompt, new = ask(child, "def area():")
    assert prompt == new == expected
    child.sendline("/quit")
    child.expect(pexpect.EOF)


@pytest.mark.parametrize("checkpoint", ["assistant", "bundled"])
def test_chat_prompt_boundaries_equal_the_prefix_by_prefix_reference(checkpoint):
    """Where checkpoints go: the first message's end and the last four's, each where the rendering
    of the messages so far is a prefix of the prompt, text and tokens alike (the slow obvious way:
    each prefix rendered and tokenized on its own). The history holds reasoning, which Qwen3.5's
    template drops before the last user message: those ends are not boundaries."""
    import json

    path = FIXTURES / "assistant" if checkpoint == "assistant" else mlx_hybrid.bundled_model_path()
    _, tokenizer = mlx_hybrid.load(path)
    conversations = json.loads((FIXTURES / "assistant" / "conversations.json").read_text())
    messages = [{"role": "system", "content": "You write Python."}]
    for i in range(6):
        messages.append({"role": "user", "content": f"Question {i}: " + "why " * i})
        messages.append({"role": "assistant", "content": f"Answer {i}.", "reasoning_content": f"Thought {i}."})
    messages.append({"role": "user", "content": "Thanks."})
    options = {"tools": conversations["tools"]} if checkpoint == "assistant" else {}
    rendered = chat_prompt(tokenizer, messages, **options)

    expected = []
    for end in [1, *range(len(messages) - 3, len(messages) + 1)]:
        prefix = tokenizer.apply_chat_template(messages[:end], tokenize=False, **options)
        prefix_ids = tokenizer.encode(prefix)
        if rendered.text.startswith(prefix) and rendered.ids[: len(prefix_ids)] == prefix_ids:
            expected.append(len(prefix_ids))
    assert rendered.ids == tokenizer.encode(rendered.text)
    assert rendered.boundaries == sorted(set(expected)) and len(expected) >= 2


@pytest.mark.parametrize("checkpoint", ["assistant", "bundled"])
@pytest.mark.parametrize("document", ["The build reads its config. " * 20, "The build reads its configura"])
def test_a_mark_inside_a_message_is_a_boundary_another_question_resumes_from(checkpoint, document):
    """A client's mark (Anthropic's cache_control) after a document, inside the user's message that
    goes on with a question: a boundary there, at most two tokens before where two prompts with other
    questions stop sharing tokens (the reference: their longest common token prefix, computed directly),
    and none past it, also where the mark cuts a word."""
    path = FIXTURES / "assistant" if checkpoint == "assistant" else mlx_hybrid.bundled_model_path()
    _, tokenizer = mlx_hybrid.load(path)

    def rendered(question, marks):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": document + question}]
        return chat_prompt(tokenizer, messages, marks=marks)

    first, second = (rendered(q, [(1, len(document))]) for q in ("tion: which file?", " What is it?"))
    shared = next(i for i, (a, b) in enumerate(zip(first.ids, second.ids)) if a != b)
    unmarked = rendered("tion: which file?", [])
    (added,) = set(first.boundaries) - set(unmarked.boundaries)
    assert shared - 2 <= added <= shared
    assert first.ids[:added] == second.ids[:added]
    # without the mark the second question could resume only from the system prompt's end
    assert max(b for b in unmarked.boundaries if b <= shared) < shared - 10


def test_ctrl_c_while_an_event_is_shown_stops_the_answer_without_cutting_the_event(bundled):
    # Ctrl-C lands wherever the main thread is: here in the middle of showing an event. The event
    # must still be shown whole (the chat keeps what it showed as the answer, and the next turn
    # resumes from the answer's checkpoint only if that is what the model read), and the answer
    # must stop there.
    model, tokenizer = bundled
    engine = Engine(model, tokenizer, None, prefix_store=PrefixStore(0))
    sequence = engine.submit(tokenizer.encode("def parse_args("), max_tokens=200)
    shown = []

    def show(event):
        shown.append([event.tokens])
        if len(shown) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        shown[-1].append(event.finish_reason)  # the rest of showing it

    engine.start()  # as the commands run it: stepping on its own thread
    try:
        assert follow(engine, sequence, show)
    finally:
        engine.stop()
    assert all(len(parts) == 2 for parts in shown), shown
    assert shown[-1][1] == "cancelled" and len(shown) < 10
    assert [t for parts in shown for t in parts[0]] == sequence.tokens

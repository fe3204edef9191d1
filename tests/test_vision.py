"""Images for Qwen3.5 (dense and MoE): preprocessing, the vision tower, MRoPE positions and
every way a prompt comes in, against the transformers references of the image fixtures
(`fixtures/make_vision.py`: HF checkpoints, and llama.cpp's GGUF + mmproj of the same weights)."""

import base64
import io
import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import openai
import pytest
from PIL import Image

import mlx_hybrid
from conftest import FIXTURES, REFERENCE_TOL, load_fixture, reference
from mlx_hybrid.cache import set_positions
from mlx_hybrid.drafting import make_drafter
from mlx_hybrid.engine import Engine, PrefixStore
from mlx_hybrid.images import ImageError, expand_image_pads, read_image
from mlx_hybrid.models.vision import image_rope_positions
from mlx_hybrid.prompt import chat_prompt
from test_server import Server

VISION_FAMILIES = ["qwen35vl", "qwen35moevl"]
SOURCES = ["hf", "model.gguf"]  # the GGUF finds mmproj.gguf beside it
PROMPTS = {"one": 1, "two": 2}  # the references' prompts and how many images each shows

# The vision tower against transformers' in float32: a few blocks of float32 products,
# measured 2.5e-6 on outputs of scale ~2; 1e-4 (the bound) still catches a wrong
# position grid or rotary axis, which moves outputs by 1e-1.
TOWER_TOL = 1e-4


def images_of(family: str) -> list:
    return [FIXTURES / family / "image_a.png", FIXTURES / family / "image_b.png"]


def unexpanded(ids: list[int], pad: int) -> list[int]:
    """The reference's prompt with each image's run of pad tokens back to one, as the chat template renders it."""
    return [t for i, t in enumerate(ids) if not (t == pad and i > 0 and ids[i - 1] == pad)]


def case(family: str, source: str, key: str):
    model, tokenizer = load_fixture(family, source)
    ref = reference(family)
    ids = ref[f"ids_{key}"][0].tolist()
    pad = tokenizer.token_to_id("<|image_pad|>")
    return model, tokenizer, ref, unexpanded(ids, pad), images_of(family)[: PROMPTS[key]], ids


@pytest.mark.parametrize("family", VISION_FAMILIES)
@pytest.mark.parametrize("source", SOURCES)
def test_preprocessing_matches_transformers(family, source):
    """Patches and grids as transformers' PIL processor gives them (both resample the same uint8 image
    with Pillow; rescale and normalise round at most one float32 ulp apart)."""
    _, tokenizer = load_fixture(family, source)
    ref = reference(family)
    prepared = [tokenizer.image_processor(read_image(path)) for path in images_of(family)]
    assert [list(p.grid) for p in prepared] == ref["grid_thw_two"].tolist()
    np.testing.assert_allclose(np.concatenate([p.patches for p in prepared]), ref["pixel_values_two"], atol=1e-6)


@pytest.mark.parametrize("family", VISION_FAMILIES)
@pytest.mark.parametrize("source", SOURCES)
def test_vision_tower_matches_transformers(family, source):
    model, tokenizer = load_fixture(family, source)
    ref = reference(family)
    out = model.vision(mx.array(ref["pixel_values_one"]), tuple(ref["grid_thw_one"][0].tolist()))
    np.testing.assert_allclose(np.array(out), ref["vision_one"], atol=TOWER_TOL, rtol=0)


@pytest.mark.parametrize("family", VISION_FAMILIES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("key", PROMPTS)
def test_logits_with_images_match_transformers(family, source, key):
    """One pass over a prompt with images: their tokens' embeddings and 3-D positions."""
    model, tokenizer, ref, prompt, paths, ids = case(family, source, key)
    np.testing.assert_allclose(
        logits_with_images(model, tokenizer, prompt, paths, ids), ref[f"logits_{key}"], atol=REFERENCE_TOL, rtol=0
    )


def logits_with_images(model, tokenizer, prompt: list[int], paths: list, ids: list[int]) -> np.ndarray:
    """One pass's logits over `prompt` with its images, whose expanded ids must be the reference's `ids`."""
    prepared = [tokenizer.image_processor(read_image(p)) for p in paths]
    expanded = expand_image_pads(prompt, prepared, tokenizer.token_to_id("<|image_pad|>"))
    assert expanded.ids == ids
    cache = model.make_cache()
    set_positions(cache, image_rope_positions(len(ids), [(s, p.grid) for s, p in zip(expanded.starts, prepared)], 2))
    inserted = (mx.array(expanded.slots), model.image_features(prepared))
    return np.array(model.logits_from_hidden(model.hidden_states(mx.array(ids)[None], cache, inserted)))


def test_rope_positions_follow_transformers():
    """transformers' `get_rope_index` for text, an image of 4 x 6 merged tokens, text: the image at
    (start, start + row, start + column), the text after it from start + max(4, 6)."""
    positions = image_rope_positions(3 + 24 + 2, [(3, (1, 8, 12))], merge=2)
    table = positions.table
    assert table[:, :3].tolist() == [[0, 1, 2]] * 3
    assert table[:, 3].tolist() == [3, 3, 3] and table[:, 3 + 23].tolist() == [3, 6, 8]
    assert table[:, 27:].tolist() == [[9, 10]] * 3
    assert positions.shift == 11 - 29
    assert positions.span(29, 2) == 11  # decoding: plain positions from 11
    assert positions.shifted(1).span(28, 1) == 11  # the MTP head's last prompt pair


@pytest.mark.parametrize("family", VISION_FAMILIES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("key", PROMPTS)
@pytest.mark.parametrize("draft", [None, "mtp", "ngram"])
def test_greedy_with_images_matches_transformers(family, source, key, draft):
    """Plain and speculative decoding (MTP drafting every round, n-grams) give transformers' 24 greedy tokens."""
    model, tokenizer, ref, prompt, paths, ids = case(family, source, key)
    tokens = [
        r.token
        for r in mlx_hybrid.stream_generate(
            model, tokenizer, prompt, max_tokens=24, images=paths, draft=draft, draft_p_min=0.0
        )
    ]
    assert tokens == ref[f"greedy_{key}"][0, len(ids) :].tolist()


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_dflash_drafting_with_images_matches_transformers(family):
    """A DFlash drafter (the qwen35 fixture's, which fits these targets' width and depth) over a prompt
    with two images, every block verified whole: transformers' 24 greedy tokens. The drafter reads
    the target's states at the image positions too, and numbers its own positions by token."""
    from mlx_hybrid.models.dflash import load_drafter

    model, tokenizer, ref, prompt, paths, ids = case(family, "hf", "two")
    drafter = load_drafter(FIXTURES / "dflash" / "qwen35-b8-l0-2")
    responses = list(
        mlx_hybrid.stream_generate(
            model, tokenizer, prompt, max_tokens=24, images=paths, draft="dflash", draft_model=drafter, draft_p_min=0.0
        )
    )
    assert [r.token for r in responses] == ref["greedy_two"][0, len(ids) :].tolist()
    assert responses[-1].tokens_per_pass is not None  # it drafted


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_batch_mixing_images_and_text_equals_each_alone(family):
    """Rows with images, without, packed into one pass with prefill chunks that split an image."""
    model, tokenizer = load_fixture(family, "hf")
    ref = reference(family)
    pad = tokenizer.token_to_id("<|image_pad|>")
    text = ref["ids_one"][0, -12:].tolist()
    alone = [r.token for r in mlx_hybrid.stream_generate(model, tokenizer, text, max_tokens=24, draft="mtp")]
    engine = Engine(model, tokenizer, make_drafter(model, tokenizer, "mtp"), prefill_chunk=20)
    sequences = [
        engine.submit(unexpanded(ref["ids_two"][0].tolist(), pad), 24, images=images_of(family)),
        engine.submit(text, 24),
        engine.submit(unexpanded(ref["ids_one"][0].tolist(), pad), 24, images=images_of(family)[:1]),
    ]
    engine.run()
    assert sequences[0].tokens == ref["greedy_two"][0, ref["ids_two"].shape[1] :].tolist()
    assert sequences[1].tokens == alone
    assert sequences[2].tokens == ref["greedy_one"][0, ref["ids_one"].shape[1] :].tolist()


def _turn(engine, tokenizer, messages, images):
    rendered = chat_prompt(tokenizer, messages)
    sequence = engine.submit(rendered.ids, 8, checkpoint_at=rendered.boundaries, images=images)
    engine.run()
    return sequence


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_second_turn_about_an_image_resumes_from_its_checkpoint(family):
    model, tokenizer = load_fixture(family, "model.gguf")
    image = images_of(family)[0]
    engine = Engine(model, tokenizer, make_drafter(model, tokenizer, "mtp"))
    first = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "def area(shape):"}]}]
    one = _turn(engine, tokenizer, first, [image])
    answer = tokenizer.decode(one.tokens[:-1] if one.finish_reason == "stop" else one.tokens)
    second = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and the perimeter?"},
    ]
    two = _turn(engine, tokenizer, second, [image])
    # the checkpoint at the end of the first message: the image's 30 tokens where its one pad was
    # (the random answer's text does not encode back to the same tokens, so it is read again)
    assert two.cached_tokens == chat_prompt(tokenizer, first).boundaries[-1] + 29
    fresh = _turn(Engine(model, tokenizer, prefix_store=PrefixStore(0)), tokenizer, second, [image])
    assert two.tokens == fresh.tokens and fresh.cached_tokens == 0
    # another image at the same place: the checkpoint after the first image is not this one's
    other = _turn(engine, tokenizer, second, [images_of(family)[1]])
    start = other.prompt.index(tokenizer.token_to_id("<|image_pad|>"))
    assert other.cached_tokens <= start


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_bad_images_are_one_clear_error():
    model, tokenizer = load_fixture("qwen35vl", "hf")
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}])
    good = (FIXTURES / "qwen35vl" / "image_a.png").read_bytes()
    huge = _png(Image.new("1", (10_000, 9_000)))  # 90 million pixels: refused before decoding
    cases = {
        b"not an image": "not an image",
        good[: len(good) // 2]: "cannot be decoded",
        huge: "too many pixels",
        "data:image/png;base64,@@@": "malformed",
        "http://127.0.0.1:1/x.png": "remote image URLs are off",
        FIXTURES / "nothing.png": "cannot read",
    }
    for image, message in cases.items():
        with pytest.raises(ImageError, match=message):
            mlx_hybrid.generate(model, tokenizer, prompt.ids, max_tokens=2, images=[image])
    with pytest.raises(ImageError, match="2 images"):
        mlx_hybrid.generate(model, tokenizer, prompt.ids, max_tokens=2, images=[good, good])
    text_model, text_tokenizer = load_fixture("qwen35", "hf")
    with pytest.raises(ImageError, match="takes no images"):
        mlx_hybrid.generate(text_model, text_tokenizer, "x", max_tokens=2, images=[good])


def test_server_reads_image_urls():
    """The official client: an image_url data URL, streamed and not, equals the run in this process."""
    family = "qwen35vl"
    model, tokenizer = load_fixture(family, "hf")
    data = base64.b64encode(images_of(family)[0].read_bytes()).decode()
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "def main():"},
    ]
    rendered = chat_prompt(tokenizer, [{"role": "user", "content": [{"type": "image"}, content[1]]}])
    want = mlx_hybrid.generate(model, tokenizer, rendered.ids, max_tokens=12, images=images_of(family)[:1])
    name = str(FIXTURES / family / "hf")
    server = Server("--model", name, "--no-mtp")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        messages = [{"role": "user", "content": content}]
        reply = client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0)
        assert reply.choices[0].message.content == want
        assert reply.usage.prompt_tokens == len(rendered.ids) - 1 + 30  # the image's 30 tokens
        stream = client.chat.completions.create(
            model=name, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == want
        truncated = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        broken = [{"role": "user", "content": [truncated]}]
        with pytest.raises(openai.BadRequestError, match="image 1"):
            client.chat.completions.create(model=name, messages=broken, max_tokens=2)
    finally:
        assert server.stop()


@pytest.mark.parametrize("family", VISION_FAMILIES)
@pytest.mark.parametrize("layout", ["mlx-vlm", "mlx-vlm-4bit"])
def test_mlx_vlm_conversions_see_images_as_mlx_vlm_does(family, layout):
    """Directories as mlx-vlm's convert wrote them (the tower under `vision_tower.`, its patch kernel
    in MLX's conv3d layout; tests/fixtures/make_mlx_vlm_conversions.py): the tower's output is
    transformers' (mlx-vlm leaves it unquantized here), and greedy decoding about two images gives
    the tokens mlx-vlm decoded on the same directory (`mlx_vlm_greedy.json`)."""
    directory = FIXTURES / family / layout
    record = json.loads((directory / "mlx_vlm_greedy.json").read_text())
    model, tokenizer = mlx_hybrid.load(directory, dtype="float32")
    ref = reference(family)
    out = model.vision(mx.array(ref["pixel_values_one"]), tuple(ref["grid_thw_one"][0].tolist()))
    np.testing.assert_allclose(np.array(out), ref["vision_one"], atol=TOWER_TOL, rtol=0)
    responses = mlx_hybrid.stream_generate(
        model,
        tokenizer,
        tokenizer.encode(record["prompt"]),
        max_tokens=len(record["greedy_ids"]),
        images=images_of(family),
        draft=None,
    )
    assert [r.token for r in responses] == record["greedy_ids"]


def test_server_reads_only_the_images_its_operator_allows(tmp_path):
    """By default the server reads images from data URLs only: a file: URL or a bare path is one 400,
    the same whether the file exists (an image, a secret) or not, and nothing is read. With
    --allowed-local-media-path DIR it reads files inside DIR, not `..` or a symlink out of it; with
    --allow-remote-images it still fetches nothing from this machine's own addresses."""
    family = "qwen35vl"
    name = str(FIXTURES / family / "hf")
    image = images_of(family)[0]
    secret = tmp_path / "secret.png"
    secret.write_bytes(image.read_bytes())
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(image.read_bytes())
    (allowed / "link.png").symlink_to(secret)

    def ask(client, url):
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "def"}]
        messages = [{"role": "user", "content": content}]
        return client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0)

    def refusal(client, url) -> str:
        with pytest.raises(openai.BadRequestError) as refused:
            ask(client, url)
        return refused.value.body["message"]

    server = Server("--model", name, "--no-mtp")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        refusals = {refusal(client, url) for url in (f"file://{secret}", "file:///nonexistent.png", str(secret))}
        assert len(refusals) == 1 and "local image files are not read here" in refusals.pop()
        assert "remote image URLs are off" in refusal(client, f"{server.url}/health")
        data = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        from_data = ask(client, data).choices[0].message.content
    finally:
        assert server.stop()
    server = Server("--model", name, "--no-mtp", "--allowed-local-media-path", str(allowed), "--allow-remote-images")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        assert ask(client, f"file://{allowed / 'a.png'}").choices[0].message.content == from_data
        assert ask(client, str(allowed / "a.png")).choices[0].message.content == from_data
        for outside in (f"file://{allowed}/../secret.png", str(allowed / "link.png"), str(secret)):
            assert "--allowed-local-media-path" in refusal(client, outside)
        for own in (f"{server.url}/health", f"http://localhost:{server.port}/x.png", "http://169.254.169.254/x"):
            assert "local or private addresses are refused" in refusal(client, own)
        assert server.health()["status"] == "ok"
    finally:
        assert server.stop()


PUBLIC = "8.8.8.8"  # what the name resolves to at first; nothing is ever sent there (see `connections`)


@pytest.fixture
def image_hosts(monkeypatch):
    """Two HTTP servers on 127.0.0.1 standing in for a public host (serving a picture, or a redirect
    to `/redirect?to=URL`) and for this machine's own address (a secret), behind a resolver for
    `images.example` that answers PUBLIC on its first lookup and 127.0.0.1 after (DNS rebinding).
    Connections are made by `socket.create_connection`, recorded: PUBLIC goes to the first server,
    127.0.0.1 to the second, anything else is refused (no packet leaves this machine)."""
    import http.server
    import socket
    import threading
    from urllib.parse import parse_qs, urlparse

    picture = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(picture, format="PNG")
    secret = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 0, 0)).save(secret, format="PNG")

    def handler(body: bytes):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                target = parse_qs(urlparse(self.path).query).get("to")
                self.send_response(302 if target else 200)
                if target:
                    self.send_header("Location", target[0])
                self.send_header("Content-Length", "0" if target else str(len(body)))
                self.end_headers()
                if not target:
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        return Handler

    servers = {
        address: http.server.HTTPServer(("127.0.0.1", 0), handler(body))
        for address, body in ((PUBLIC, picture.getvalue()), ("127.0.0.1", secret.getvalue()))
    }
    for server in servers.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    lookups, connections = [], []
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.create_connection

    def getaddrinfo(host, port, *args, **kwargs):
        if host != "images.example":
            return real_getaddrinfo(host, port, *args, **kwargs)
        lookups.append(host)
        address = PUBLIC if len(lookups) == 1 else "127.0.0.1"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    def create_connection(address, *args, **kwargs):
        host, port = address
        ip = host if host in servers else socket.getaddrinfo(host, port)[0][4][0]  # a name: resolved again
        connections.append(ip)
        if ip not in servers:
            raise ConnectionRefusedError(f"the test connects nowhere but 127.0.0.1 ({ip})")
        return real_connect(("127.0.0.1", servers[ip].server_port), *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    yield picture.getvalue(), lookups, connections
    for server in servers.values():
        server.shutdown()


def test_the_address_checked_is_the_address_fetched(image_hosts):
    """A server with --allow-remote-images refuses this machine's own and private addresses. A name
    that resolves to a public address for the check and to 127.0.0.1 for the fetch is fetched from
    the address that was checked; a redirect to loopback is refused, and one to another scheme."""
    from mlx_hybrid.images import ImageAccess

    picture, lookups, connections = image_hosts
    served = ImageAccess(local=None, remote=True)  # what a server with --allow-remote-images reads
    image = read_image("http://images.example:8000/picture.png", served)
    assert lookups == ["images.example"] and connections == [PUBLIC]  # resolved once, connected there
    assert image.getpixel((0, 0)) == (200, 10, 10)  # the public host's picture, not the secret

    for redirect in ("http://127.0.0.1:8000/secret.png", "http://images.example:8000/secret.png"):
        connections.clear()
        with pytest.raises(ImageError, match="local or private addresses are refused"):
            read_image(f"http://{PUBLIC}:8000/redirect?to={redirect}", served)
        assert connections == [PUBLIC]  # the redirect's target was never connected to
    with pytest.raises(ImageError, match="only http"):  # urllib would follow it to an FTP server, unchecked
        read_image(f"http://{PUBLIC}:8000/redirect?to=ftp://10.0.0.1/secret.png", served)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--allowed-local-media-path", "/nonexistent-dir"], "is not a directory"),
        (["--allowed-image-hosts", "intranet"], "needs --allow-remote-images"),
    ],
)
def test_image_intake_flags_are_checked(flags, message):
    """A wrong image-intake flag is a usage error before the model loads."""
    result = subprocess.run(
        [sys.executable, "-m", "mlx_hybrid.server", *flags], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr

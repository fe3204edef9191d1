"""Split models over real ranks: `mlx.launch --backend ring` over 127.0.0.1, each rank a process.

Every rank also loads the whole model, so each comparison is against the single-process
model computed on the same machine (see distributed_check.py).
"""

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import free_port

HERE = Path(__file__).parent
# the launcher installed beside this interpreter (a venv's bin/, on PATH or not), else PATH's
LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")

pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")

# Tensor parallel: heads and feed-forward units of every fixture divide by 2 (not by 3).
# Pipelines: every family from both formats over 2 and 3 ranks (4 layers each).
RUNS = {
    ("tensor", 2): [
        "qwen35/hf", "qwen35/model.gguf", "qwen35moe/hf", "qwen35moe/model.gguf", "qwen3next/hf",
        "qwen3next/model.gguf", "kimilinear/hf", "kimilinear/model.gguf", "qwen35moe/model-Q4_K_M.gguf",
    ],
    ("pipeline", 2): ["qwen35/hf", "qwen35moe/model.gguf", "qwen3next/model.gguf", "kimilinear/hf"],
    ("pipeline", 3): ["qwen35/model.gguf", "qwen35moe/hf", "qwen3next/hf", "kimilinear/model.gguf"],
}  # fmt: skip

# Each split layer, fed the same input, is within float32 rounding of the whole one (measured
# at most 1.0e-5 on outputs of scale 3 to 10, in a gated delta layer, whose recurrence carries
# the split products' rounding through 48 tokens; two float32 forms of such a layer on the same
# input, our CPU kernel and MLX's ops, differ by up to 5.5e-6). Across the 4 layers the
# random-weight fixtures amplify rounding about 10x per layer: on logits of scale ~17, summing
# in another order moves the single-process model itself by up to 1.6e-4 (two rows in a batch
# instead of one) or 2.9e-4 (the reference BLAS instead of OpenBLAS). Tensor parallel sums each
# product in parts, so its logits are held to that floor (split, measured up to 3.5e-4: qwen35moe,
# whose router's near-ties amplify rounding most); a pipeline computes the same sums. A
# quantized file's prefill products go through the BLAS as well (dequantized tiles): there the
# single-process model moves by up to 7.1e-4 between the two BLAS's, and split by 3.5e-4.
LAYER_TOLERANCE = 2e-5
LOGITS_TOLERANCE = {"tensor": 4e-4, "pipeline": 1e-4}
QUANTIZED_LOGITS_TOLERANCE = 7.5e-4


def launch(ranks: int, *args, timeout=600) -> subprocess.CompletedProcess:
    command = [LAUNCH, "--backend", "ring", "-n", str(ranks), "--python", sys.executable, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)


@pytest.fixture(scope="module", params=list(RUNS), ids=lambda run: f"{run[0]}-{run[1]}")
def results(request):
    mode, ranks = request.param
    done = launch(ranks, str(HERE / "distributed_check.py"), mode, *RUNS[request.param])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by_spec = {}
    for line in lines:
        by_spec.setdefault(line["spec"], {})[line["rank"]] = line
    assert sorted(by_spec) == sorted(RUNS[request.param])
    assert all(sorted(per_rank) == list(range(ranks)) for per_rank in by_spec.values())
    return mode, ranks, by_spec


def test_logits_match_the_single_process_model(results):
    mode, ranks, by_spec = results
    if mode == "tensor":
        assert all(len(r["layer_diffs"]) >= 4 for per_rank in by_spec.values() for r in per_rank.values())
    for spec, per_rank in by_spec.items():
        tolerance = QUANTIZED_LOGITS_TOLERANCE if "-Q" in spec else LOGITS_TOLERANCE[mode]
        for rank, r in per_rank.items():
            assert r["describe"] == f"{'tensor parallel' if mode == 'tensor' else 'pipeline'} over {ranks} ranks"
            assert r["logits_diff"] <= tolerance, (spec, rank, r["logits_diff"])
            assert max(r["layer_diffs"], default=0) <= LAYER_TOLERANCE, (spec, rank, r["layer_diffs"])
            if "mtp_diff" in r:
                assert r["mtp_diff"] <= tolerance, (spec, rank, r["mtp_diff"])


def test_greedy_tokens_equal_plain_speculative_and_served(results):
    _, _, by_spec = results
    for spec, per_rank in by_spec.items():
        for rank, r in per_rank.items():
            assert len(r["plain_whole"][0]) == 24
            assert r["plain"] == r["plain_whole"], (spec, rank)
            assert r["speculative"] == r["plain_whole"], (spec, rank)
            if spec.startswith("qwen"):  # a DFlash drafter: lossless over tensor-split layers, refused by a pipeline
                if r["describe"].startswith("pipeline"):
                    assert "a pipeline's other ranks" in r["dflash_refused"], (spec, rank)
                else:
                    assert r["dflash"] == r["plain_whole"], (spec, rank)
            if spec.endswith(".gguf") and r["describe"].startswith("tensor"):  # a product's parts summed: refused
                assert "a tensor-parallel split sums its ranks' parts" in r["int8_refused"], (spec, rank)
    # rank 0 serving the first model from the engine's thread, as a server does
    served = [(spec, per_rank[0]) for spec, per_rank in by_spec.items() if "engine_thread" in per_rank[0]]
    assert len(served) == 1
    spec, first = served[0]
    assert first["engine_thread"]["tokens"] == first["plain_whole"][0], spec
    assert first["engine_thread"]["restart"] == "this split engine has stopped, and the other ranks with it", spec


def test_every_rank_samples_the_same_tokens(results):
    # accept/rollback and sampling decided alike everywhere: the same seed, the same logits
    _, _, by_spec = results
    for spec, per_rank in by_spec.items():
        sampled = [r["sampled"] for r in per_rank.values()]
        assert all(len(tokens) == 24 for tokens in sampled[0]), spec
        assert all(s == sampled[0] for s in sampled), spec


def test_memory_per_rank_is_about_one_over_n(results):
    mode, ranks, by_spec = results
    for spec, per_rank in by_spec.items():
        if "Q4_K" in spec:
            continue  # expert columns of the tiny fixture cut inside quantization groups: dequantized
        # beyond what is held whole by design (a pipeline's MTP head), nothing is held twice but
        # norms, routers and MLA's latent projection; each rank holds its layers' share
        first = per_rank[0]
        whole = first["whole_bytes"] - first["replicated_bytes"]
        held = [(r["split_bytes"] - r["replicated_bytes"]) / whole for r in per_rank.values()]
        assert sum(held) <= 1.1, (spec, held)
        most = 1 / ranks if mode == "tensor" else -(-first["layers"] // ranks) / first["layers"]
        assert max(held) <= most + 0.05, (spec, held)
        peaks = [r["split_load_peak"] / r["whole_load_peak"] for r in per_rank.values()]
        # loading adds one whole tensor being cut and one layer's experts being stacked; at
        # these tiny sizes (tensors of a few KB) that is much of the model
        assert max(peaks) < most + 0.45, (spec, peaks)


# -- the commands under mlx.launch ------------------------------------------------------

QWEN_GGUF = str(HERE / "fixtures" / "qwen35" / "model.gguf")


def launch_command(ranks: int, *args) -> subprocess.CompletedProcess:
    """`mlx.launch ... -- -m mlx_hybrid.<command> args` (after `--`, mlx.launch passes on --verbose)."""
    return launch(ranks, "--", "-m", *args, timeout=300)


def single(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_generate_prints_once_the_single_process_text(split):
    args = ["mlx_hybrid.generate", "--model", QWEN_GGUF, "--prompt", "def parse(", "--max-tokens", "16"]
    alone = single(*args)
    assert alone.returncode == 0, alone.stderr
    done = launch_command(2, *args, "--verbose", *(["--pipeline"] if split == "pipeline" else []))
    assert done.returncode == 0, done.stderr
    assert done.stdout == alone.stdout  # rank 0's text, once
    described = "tensor parallel over 2 ranks" if split == "tensor" else "pipeline over 2 ranks"
    assert done.stderr.count(described) == 1, done.stderr


def test_generate_with_ranks_started_by_hand(tmp_path):
    # MLX's ring backend without mlx.launch: each process names its rank and the hostfile
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
    args = ["mlx_hybrid.generate", "--model", QWEN_GGUF, "--prompt", "def parse(", "--max-tokens", "16", "--verbose"]
    ranks = [
        subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=os.environ | {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)})
        for rank in range(2)
    ]  # fmt: skip
    try:
        (out_0, err_0), (out_1, err_1) = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], err_0 + err_1
    assert out_0 == single(*args).stdout and (out_1, err_1) == ("", "")
    assert "tensor parallel over 2 ranks" in err_0


def test_splits_that_cannot_work_are_clear_errors():
    args = ["mlx_hybrid.generate", "--model", QWEN_GGUF, "--prompt", "def parse(", "--max-tokens", "4"]
    done = launch_command(3, *args)
    assert "error: 2 linear-attention key heads cannot be split evenly over 3 ranks" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    done = launch_command(5, *args, "--pipeline")
    assert "error: a pipeline over 5 ranks needs at least 5 layers; the model has 4" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    alone = single(*args, "--pipeline")
    assert alone.returncode == 2 and "--pipeline splits a model over the processes" in alone.stderr


def test_a_split_engine_counts_requests_not_yet_announced_to_the_other_ranks():
    # what the server's /health reports (`Engine.occupancy`): a request rank 0 took is waiting before
    # the step that announces it (a group of one rank stands for the split: no launch needed)
    import mlx.core as mx

    import mlx_hybrid
    from mlx_hybrid.engine.replicated import ReplicatedEngine

    model, tokenizer = mlx_hybrid.load(QWEN_GGUF)
    model.shard(mx.distributed.init())
    engine = ReplicatedEngine(model, tokenizer)
    engine.submit(tokenizer.encode("def parse("), max_tokens=2)
    assert engine.occupancy == engine.load == {"running": 0, "waiting": 1}
    engine.run()
    assert engine.occupancy == {"running": 0, "waiting": 0}


def test_chat_under_mlx_launch_keeps_its_ranks_in_step_between_turns():
    args = ["mlx_hybrid.chat", "--model", QWEN_GGUF, "--max-tokens", "12"]
    turns = ["def parse(\n", "class Config:\n/quit\n"]  # mlx.launch does not pass on the end of input
    alone = subprocess.run([sys.executable, "-m", *args], input="".join(turns), capture_output=True, text=True)
    assert alone.returncode == 0, alone.stderr
    command = [LAUNCH, "--backend", "ring", "-n", "2", "--python", sys.executable, "--", "-m", *args]
    chat = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors = queue.Queue()  # stderr's lines, read on a thread so that every wait has a timeout
    reader = threading.Thread(target=lambda: [errors.put(line) for line in chat.stderr], daemon=True)
    reader.start()
    try:
        chat.stdin.write(turns[0])
        chat.stdin.flush()
        while not errors.get(timeout=120).startswith("[prompt:"):  # the first answer is done
            pass
        time.sleep(1)  # the user thinks: rank 0's engine idles, rank 1 follows it
        chat.stdin.write(turns[1])
        chat.stdin.flush()
        chat.wait(timeout=120)
    finally:
        if chat.poll() is None:  # mlx.launch ends its ranks on SIGINT (not on SIGTERM)
            chat.send_signal(signal.SIGINT)
            chat.wait(timeout=30)
    reader.join(timeout=30)
    assert chat.stdout.read() == alone.stdout
    later = []
    while not errors.empty():
        later.append(errors.get())
    assert sum(line.startswith("[prompt:") for line in later) == 1, later  # the second turn's


def test_server_under_mlx_launch_serves_from_rank_0():
    from test_server import Server

    import mlx_hybrid

    model, tokenizer = mlx_hybrid.load(QWEN_GGUF)
    launcher = (LAUNCH, "--backend", "ring", "-n", "2", "--python", sys.executable, "--")
    server = Server("--model", QWEN_GGUF, "--served-model-name", "m", launcher=launcher)
    ranks = rank_processes(f"mlx_hybrid.server --port {server.port}")
    assert sorted(ranks.values()) == [0, 1]
    try:
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        prompts = ["def read_config(", "import os\n", "class Parser:"]
        for prompt in prompts:  # one after another, then all at once (a batch)
            answer = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
            expected = mlx_hybrid.generate(model, tokenizer, prompt, max_tokens=12, draft="none")
            assert answer.choices[0].text == expected
        streams = [client.completions.create(model="m", prompt=p, max_tokens=12, stream=True) for p in prompts]
        assert all("".join(c.choices[0].text for c in s) for s in streams)
        # the last chunk of a stream leaves before the engine retires its row: idle soon after
        deadline = time.monotonic() + 10
        while server.health()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.health()["running"] == 0
    finally:
        # rank 0 shuts its server down; its engine tells rank 1 to stop, and mlx.launch ends
        leader = next(pid for pid, rank in ranks.items() if rank == 0)
        os.kill(leader, signal.SIGTERM)
        server.process.wait(timeout=30)
    assert rank_processes(f"mlx_hybrid.server --port {server.port}") == {}, "ranks left running"


def rank_processes(pattern: str) -> dict[int, int]:
    """pid -> MLX_RANK of the processes whose command line holds pattern."""
    found = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in map(int, found):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((v for k, _, v in (e.partition(b"=") for e in environ) if k == b"MLX_RANK"), None)
        if rank is not None:
            ranks[pid] = int(rank)
    return ranks

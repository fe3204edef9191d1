"""Run under `mlx.launch --backend ring -n N`: each rank loads the fixture models split over
the group and, in the same process, whole; prints one JSON line per model comparing them.

usage: distributed_check.py tensor|pipeline FAMILY/FILE ...   (FILE: hf or a .gguf name)
"""

import os
import sys

# Each rank on a core of its own, before MLX starts its threads: the ring backend's threads wait for
# a peer by spinning, and ranks that share the cores spin while the rank they wait for is descheduled
# (a collective then takes milliseconds; pinned, the tensor-parallel check took 16 s instead of 26 on 2 cores)
if hasattr(os, "sched_setaffinity") and "MLX_RANK" in os.environ:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(os.environ["MLX_RANK"]) % len(cores)]})

import mlx_hybrid  # noqa: I001  (before MLX: it picks the BLAS)

import gc
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_hybrid.drafting import make_drafter
from mlx_hybrid.errors import GenerationError, ModelLoadError
from mlx_hybrid.models.dflash import load_drafter
from mlx_hybrid.engine import Engine, ReplicatedEngine

FIXTURES = Path(__file__).parent / "fixtures"
NEW_TOKENS = 24


def parameter_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def load_measured(path, **split):
    """(model, tokenizer, the peak memory its loading added)."""
    gc.collect()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    model, tokenizer = mlx_hybrid.load(path, **split)
    return model, tokenizer, mx.get_peak_memory() - before


def generate(model, tokenizer, prompts, draft=None, block_drafter=None) -> dict:
    """Each prompt's tokens, greedy, and with `draft` also drafting with it greedy ("speculative")
    and sampled, and with a DFlash drafter greedy ("dflash"): all rows in one batch through the
    engine (a split model's step waits on the ranks' sums, so one batch of them all costs what one
    row does)."""
    ways = {"plain": (None, {})}
    if draft:
        drafter = make_drafter(model, tokenizer, draft, draft_p_min=0.0)
        ways |= {"speculative": (drafter, {}), "sampled": (drafter, {"temp": 0.8, "seed": 7})}
    if block_drafter is not None:
        ways["dflash"] = (make_drafter(model, tokenizer, "dflash", block_drafter, draft_p_min=0.0), {})
    engine = Engine(model, tokenizer, num_draft_tokens=3, adaptive=False)
    sequences = {
        way: [
            engine.submit(p, NEW_TOKENS, stop_tokens=[], drafter=d.fork() if d is not None else None, **settings)
            for p in prompts
        ]
        for way, (d, settings) in ways.items()
    }
    engine.run()
    return {way: [s.tokens for s in rows] for way, rows in sequences.items()}


def on_the_engine_thread(model, tokenizer, prompt) -> dict:
    """Rank 0 serves one request from a `ReplicatedEngine` on its thread while the others
    follow, as the server does; then a second `start` must be refused, not wait forever."""
    engine = ReplicatedEngine(model, tokenizer)
    if not engine.leader:
        engine.follow()
        return {}
    engine.start()
    tokens = [t for event in engine.submit(prompt, NEW_TOKENS, stop_tokens=[]).stream() for t in event.tokens]
    engine.stop()
    try:
        engine.start()
        restart = "started"
    except mlx_hybrid.GenerationError as e:
        restart = str(e)
    return {"tokens": tokens, "restart": restart}


def layer_by_layer(model, whole, ids) -> list[float]:
    """Each split layer against the whole one, both fed the single-process model's input to
    that layer: what the split itself changes, before the layers after it amplify it.
    The MTP head (last, where there is one) is fed the whole trunk's output."""
    h, diffs = whole.embed(ids), []
    for split_layer, whole_layer in zip(model.layers, whole.layers):
        out = whole_layer(h, None)
        diffs.append(mx.abs(split_layer(h, None) - out).max().item())
        h = out
    if whole.has_mtp:
        inputs = (whole.mtp_input(h[:, :-1]), whole.embed(ids[:, 1:]))
        diffs.append(mx.abs(model.mtp(*inputs)[0] - whole.mtp(*inputs)[0]).max().item())
    return diffs


def check(group, mode: str, spec: str, serve: bool) -> dict:
    family, file = spec.split("/")
    path = FIXTURES / family / file
    ref = np.load(FIXTURES / family / "ref.npz")
    model, tokenizer, split_load_peak = load_measured(path, group=group, pipeline=mode == "pipeline")
    # the whole model computing as the split one: a tensor-parallel split's products take float32 activations
    whole, _, whole_load_peak = load_measured(path, **({} if mode == "pipeline" else {"cpu_activations": "float32"}))

    ids = mx.array(ref["input_ids"])
    logits_diff = mx.abs(model(ids) - whole(ids)).max().item()
    layer_diffs = layer_by_layer(model, whole, ids) if mode == "tensor" else []
    prompts = [ref["prompt_ids"][0].tolist(), ref["input_ids"][0, :20].tolist()]
    draft = "mtp" if model.has_mtp else "ngram"
    # a DFlash drafter made for this family's fixture (the last by name: a DFlash2 one): its tokens where
    # the split can tap the layers (tensor parallel), its refusal where it cannot (a pipeline)
    blocks = sorted(d for d in (FIXTURES / "dflash").iterdir() if d.name.startswith(family + "-"))
    block_drafter, refused = load_drafter(blocks[-1]) if blocks else None, None
    if block_drafter is not None and mode == "pipeline":
        try:
            make_drafter(model, tokenizer, "dflash", block_drafter)
        except GenerationError as error:
            refused = str(error)
        block_drafter = None
    int8_refused = None  # llama.cpp's 8-bit activations asked of a tensor-parallel split
    if mode == "tensor" and path.suffix == ".gguf":
        try:
            mlx_hybrid.load(path, group=group, cpu_activations="int8")
        except ModelLoadError as error:
            int8_refused = str(error)
    result = {
        "rank": group.rank(),
        "spec": spec,
        "describe": model.parallel.describe(),
        "logits_diff": logits_diff,
        "layer_diffs": layer_diffs,
        "split_bytes": parameter_bytes(model),
        "whole_bytes": parameter_bytes(whole),
        # a pipeline keeps the MTP head whole on every rank
        "replicated_bytes": parameter_bytes(whole.mtp) if mode == "pipeline" and whole.has_mtp else 0,
        "layers": len(whole.layers),
        "split_load_peak": split_load_peak,
        "whole_load_peak": whole_load_peak,
        **generate(model, tokenizer, prompts, draft, block_drafter),
        "dflash_refused": refused,
        "int8_refused": int8_refused,
        "plain_whole": generate(whole, tokenizer, prompts)["plain"],
    }
    if serve:
        result["engine_thread"] = on_the_engine_thread(model, tokenizer, prompts[0])
    if model.has_mtp:
        result["mtp_diff"] = mx.abs(model.mtp_logits(ids) - whole.mtp_logits(ids)).max().item()
    return result


def main():
    group = mx.distributed.init()
    mode, specs = sys.argv[1], sys.argv[2:]
    # the engine's thread is the same for every family: served from the first model only
    for index, spec in enumerate(specs):
        # one write, the line and its end (print writes them apart where Python's output is unbuffered, as
        # under mlx.launch, and the ranks' lines could interleave there)
        sys.stdout.write(json.dumps(check(group, mode, spec, serve=index == 0)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

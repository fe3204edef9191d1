"""`load(path)`: a `.gguf` file, a Hugging Face directory or a hub name -> (model, tokenizer)."""

from __future__ import annotations

import functools
import json
import logging
import math
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from .. import ops
from ..errors import ModelLoadError
from ..images import ImageProcessor
from ..models.dflash import load_drafter
from ..parallel import PIPELINE, TENSOR
from ..quantized_tensor import CPU_ACTIVATIONS, QuantizedTensor
from ..tokenizer import Tokenizer
from . import families, gguf_file, gguf_projector, hf, hf_config, hub, safetensors_files
from .cpu_activations import set_cpu_activations, whole_products
from .memory import memory_available
from .mtp_head import attach_mtp_head
from .row_tables import take_row_tables
from .common import RankPart, fill_model, rename
from .quantized import dequantized_notice, held_bytes, size_text

_log = logging.getLogger("mlx_hybrid")

# The default model: a small Qwen3.5 trained with its MTP head (examples/train_tiny.py).
BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "data" / "tiny-qwen35.gguf"
# A GGUF file's own DFlash drafter, found beside it: `<file stem>-dflash/` (see `companion_drafter`).
DRAFTER_SUFFIX = "-dflash"
# The bundled model's (examples/train_dflash.py): `--draft dflash` takes it when no drafter is named.
BUNDLED_DRAFTER = BUNDLED_MODEL.with_name(BUNDLED_MODEL.stem + DRAFTER_SUFFIX)

# Files at least this large get a progress bar while their tensors load.
PROGRESS_MIN_BYTES = 256 << 20

# the weights' dtypes by name (`load`'s dtype=, the commands' --dtype)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def resolve_dtype(dtype):
    if dtype is None:
        return ops.default_dtype()
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
        return DTYPES[dtype]
    return dtype


def bundled_model_path() -> Path:
    """The GGUF shipped inside the package, used when no model is named."""
    if not BUNDLED_MODEL.is_file():
        raise ModelLoadError(f"the bundled model is missing ({BUNDLED_MODEL}); name a model with --model")
    return BUNDLED_MODEL


def bundled_drafter_path() -> Path:
    """The DFlash drafter shipped beside the bundled model."""
    return BUNDLED_DRAFTER


def load(
    path,
    dtype=None,
    progress: bool | None = None,
    dequantize: bool = False,
    compact: bool = False,
    group=None,
    pipeline: bool = False,
    mmproj=None,
    mtp=None,
    cpu_activations: str | None = None,
):
    """Load a model and its tokenizer from a `.gguf` file, an HF checkpoint directory, or a
    Hugging Face hub name (`org/repo`, `org/repo:file.gguf`; see `loaders.hub`).

    dtype: compute dtype of the weights ("float32", "bfloat16", "float16" or an
    mx.Dtype); float32 on the CPU and bfloat16 on a GPU by default. Linear-attention
    state is float32 whatever this is. progress: show a progress bar (default: for
    large files on a terminal). GGUF tensors stay as the file stores them where our CPU
    kernels multiply them (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS,
    IQ3_S, IQ3_XXS and the IQ2 types: their blocks as they are, the grids decoded as they multiply;
    F16 and BF16 matrices in 16 bits under a float32 dtype: exact, about the file's size),
    elsewhere quantized where MLX's affine groups hold them exactly (Q8_0 .. Q5_K, IQ3_S; float32
    scales), unless dequantize=True; other types are dequantized to dtype, each named in a
    warning. compact=True (GGUF only) trades exactness for memory where a type is not held as
    stored: 16-bit scales, and the types MLX's groups do not hold re-quantized instead of
    dequantized (see `loaders.quantized`).

    mtp: the checkpoint the model was converted from (an HF directory or a GGUF file), to take the
    MTP head from where the model has none (mlx-lm's and mlx-vlm's conversions drop it): only its
    `mtp.*` tensors are read; the head is quantized as the model is. A head of another shape is refused.

    cpu_activations: how a GGUF file's quantized products compute where the CPU computes. "int8", as
    llama.cpp computes them on x86: each row of activations quantized to the type's 8-bit blocks and
    multiplied in integers, every quantized GGUF type, for products of up to the type's row limit
    (`ops.int8_row_limit`: 32 to 128 rows, any for Q4_K, Q6_K, Q4_0 and experts; decode steps,
    verify passes and batches; a prompt's longer products take float32 ones), and F16 and BF16 matrices
    with 16-bit activations (`ops.HALF_ROWS` rows; the bundled model's);
    refused by name where it is not computed (a Hugging Face or MLX checkpoint, a GPU, a CPU without
    this package's kernels, tensors re-quantized by compact=True). "float32": each product computes what
    the file's dequantized weights compute. None (the default): the file's own runtime's arithmetic,
    "int8" for a GGUF file where it is computed (every quantized tensor of a GGUF type, each product
    whole in one process: alone or in a pipeline's layers), else "float32" (a tensor-parallel split sums
    its ranks' parts of each product).

    group: an `mx.distributed` group of several ranks (`mx.distributed.init()` under
    `mlx.launch`) to split the model over: tensor parallel, or consecutive layers per rank
    with pipeline=True (see `mlx_hybrid.parallel`). Each rank reads only its part.
    """
    path = hub.resolve(path) if hub.is_hub_name(path) else Path(path).expanduser()
    dtype = resolve_dtype(dtype)
    if cpu_activations is not None and cpu_activations not in CPU_ACTIVATIONS:
        raise ModelLoadError(f"cpu_activations must be one of {', '.join(CPU_ACTIVATIONS)}, got {cpu_activations!r}")
    if compact and dequantize:
        raise ValueError("compact and dequantize exclude each other")
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_dir():
        if mmproj:
            raise ModelLoadError(f"{path}: mmproj applies to GGUF models (an HF checkpoint holds its vision tower)")
        if compact:
            raise ModelLoadError(f"{path}: compact loading applies to GGUF files, not Hugging Face directories")
        model, tokenizer = _load_hf(path, dtype, progress, _Split(group, pipeline))
    elif path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
    else:
        model, tokenizer = _load_gguf(
            path, dtype, progress, _Split(group, pipeline), keep_quantized=not dequantize, compact=compact,
            mmproj=mmproj, whole_blocks=cpu_activations == "int8" or (
                cpu_activations is None and whole_products(group, pipeline) and ops.int8_activations_computed()),
        )  # fmt: skip
    if mtp is not None:
        if group is not None and group.size() > 1:
            raise ModelLoadError("an MTP head from another checkpoint is not taken by a split model")
        _attach_mtp_head(model, Path(mtp).expanduser(), dtype)
    set_cpu_activations(model, cpu_activations, path, whole_products(group, pipeline), dtype)
    model.loaded_from = path.resolve()
    ops.allow_memory_for(model.nbytes)
    return model, tokenizer


class _Split:
    """How to split a model being built: over which group, how."""

    def __init__(self, group, pipeline: bool):
        self.group = group if group is not None and group.size() > 1 else None
        self.mode = PIPELINE if pipeline else TENSOR

    def apply(self, model) -> RankPart | None:
        """Split the model's (not yet filled) parameters; the part of the checkpoint this rank reads."""
        if self.group is None:
            return None
        return RankPart(model, model.shard(self.group, self.mode))


class _Checkpoint(NamedTuple):
    """What a loader reads of a checkpoint before building a model: its architecture's module, its
    model arguments, its tensor table, and its tensors as (name, read) pairs, read when called."""

    module: object
    args: object
    rules: list
    tensors: object
    count: int
    row_tables: dict = {}  # tables read by rows where they lie (`row_tables`), by name


def load_draft_model(path, dtype=None):
    """A draft model for speculation (`draft_model=`), from what `load` reads, or a DFlash block drafter
    (a directory whose config.json names `DFlashDraftModel`; see `models.dflash`)."""
    resolved = hub.resolve(path) if hub.is_hub_name(path) else Path(path).expanduser()
    if is_block_drafter(resolved):
        return load_drafter(resolved, resolve_dtype(dtype))
    return load(path, dtype=dtype)[0]


def companion_drafter(model):
    """The DFlash drafter shipped with a model loaded from a GGUF file `X.gguf` (as the bundled model's):
    the directory `X-dflash` beside it, loaded in the model's compute dtype; None where there is none."""
    source = getattr(model, "loaded_from", None)
    if source is None or not source.is_file():
        return None
    path = source.with_name(source.stem + DRAFTER_SUFFIX)
    return _drafter_at(path, model.norm.weight.dtype) if is_block_drafter(path) else None  # the compute dtype


@functools.lru_cache(maxsize=4)  # a few MB each; an app's calls share one
def _drafter_at(path: Path, dtype):
    return load_drafter(path, dtype)


def is_block_drafter(path: Path) -> bool:
    """Whether `path` is a DFlash drafter's directory (DFlash2 ones too, which loading refuses by name)."""
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.exists():
        return False
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    return any(str(name).startswith("DFlash") for name in architectures)


def _read_hf(path: Path, dtype=None) -> tuple[_Checkpoint, dict, list]:
    """An HF directory's checkpoint, its config and its safetensors files; with dtype (the compute
    dtype), a ModelLoadError before anything is read where even the fewer of each tensor's bytes as
    stored and in dtype would not fit in memory (a 16-bit checkpoint computed in float32 takes twice
    its size: that is not counted, so a model is never refused that would fit)."""
    config = hf_config.read_config(path)
    model_type = hf_config.model_type_of(config)
    family = families.family(model_type)
    files = safetensors_files.safetensor_files(path)
    tensors = safetensors_files.read_tensors(files)
    row_tables = take_row_tables(tensors, files, family.row_tables) if family.row_tables else {}
    rules = family.hf_rules(hf.detect_layout(tensors))
    quantization = config.get("quantization") or config.get("quantization_config")
    if quantization:
        tensors = safetensors_files.group_quantized(tensors, quantization)
    args = family.hf_args(
        config, family.module, has_mtp=any(name.startswith("mtp.") for name in tensors),
        has_vision=hf.has_vision_tower(tensors),
    )  # fmt: skip
    if dtype is not None:
        needed = sum(
            sum(part.nbytes for part in (t.weight, t.scales, t.biases))
            if isinstance(t, QuantizedTensor)
            else min(t.nbytes, t.size * dtype.size)
            for t in tensors.values()
        )  # (quantized: as it is)
        _refuse_what_does_not_fit(path, needed, sum(f.stat().st_size for f in files))
    # popped as read: a split model keeps only its parts, so the whole tensors must go
    read = ((name, (lambda name=name: tensors.pop(name))) for name in list(tensors))
    return _Checkpoint(family.module, args, rules, read, len(tensors), row_tables), config, files


def _load_hf(path: Path, dtype, progress, split: _Split):
    checkpoint, config, files = _read_hf(path, dtype if split.group is None else None)
    module, args = checkpoint.module, checkpoint.args
    model = _build(module, args)
    part = split.apply(model)
    total = sum(f.stat().st_size for f in files)
    with _progress_bar(checkpoint.count, total, progress, path.name) as bar:
        weights, unmatched = rename(checkpoint.tensors, checkpoint.rules, args, bar, part)
    _reject_unmatched(unmatched, path)
    try:
        weights = model.take_stored_values(weights)
        fill_model(model, weights, dtype, module.FLOAT32_PARAMS, source=str(path))
        model.take_row_tables(checkpoint.row_tables)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    tokenizer = Tokenizer.from_hf_dir(path, config)
    if model.has_vision:
        try:
            tokenizer.image_processor = ImageProcessor.from_hf_dir(path)
        except (ValueError, TypeError, OSError) as e:
            raise ModelLoadError(f"{path}/preprocessor_config.json: {e}") from None
    return model, tokenizer


def _load_gguf(path: Path, dtype, progress, split: _Split, keep_quantized: bool, compact: bool, mmproj=None,
               whole_blocks: bool = False):  # fmt: skip
    # compact scales: bfloat16 for a bfloat16 model (products stay in it), else float16
    compact_scales = (mx.bfloat16 if dtype == mx.bfloat16 else mx.float16) if compact else None
    checkpoint, meta = _read_gguf(path, keep_quantized, compact_scales, dtype, whole_blocks, split.group is None)
    module, args = checkpoint.module, checkpoint.args
    projector = _projector_path(path, mmproj, args.model_type)
    if projector is not None:
        args.vision, image_processor, vision_weights = gguf_projector.read_mmproj(projector, args.hidden_size)
    model = _build(module, args)
    part = split.apply(model)
    with _progress_bar(checkpoint.count, path.stat().st_size, progress, path.name) as bar:
        weights, unmatched = rename(checkpoint.tensors, checkpoint.rules, args, bar, part)
    _reject_unmatched(unmatched, path)
    if projector is not None:
        weights |= vision_weights
    fill_model(model, weights, dtype, module.FLOAT32_PARAMS, source=str(path))
    tokenizer = Tokenizer.from_gguf(meta)
    if projector is not None:
        tokenizer.image_processor = image_processor
    return model, tokenizer


def _attach_mtp_head(model, source: Path, dtype):
    """`model.mtp` from `source`'s `mtp.*` tensors (see `mtp_head.attach_mtp_head`)."""
    if not source.exists():
        raise ModelLoadError(f"{source}: no such file or directory (the MTP head's checkpoint)")
    if model.has_mtp:
        raise ModelLoadError(f"the model has an MTP head of its own; it takes none from {source}")
    if not hasattr(model.args, "mtp_num_hidden_layers"):
        raise ModelLoadError(f"{model.model_type} models have no MTP head to take from {source}")
    if source.is_dir():
        checkpoint = _read_hf(source)[0]
    elif source.suffix.lower() == ".gguf":
        checkpoint = _read_gguf(source)[0]
    else:
        raise ModelLoadError(f"{source}: expected a .gguf file or a Hugging Face model directory (the MTP head's)")
    attach_mtp_head(model, checkpoint, source, dtype)


def _read_gguf(path: Path, keep_quantized: bool = True, compact_scales=None, dtype=None,
               whole_blocks: bool = False, holds_all: bool = False) -> tuple[_Checkpoint, object]:  # fmt: skip
    """A GGUF file's checkpoint and its metadata; with dtype (the compute dtype), a warning for
    each quantized type it will dequantize, and where this process holds the whole model
    (holds_all), a ModelLoadError before anything is read if it does not fit in memory."""
    reader = gguf_file.open_gguf(path)
    meta = gguf_file.Metadata(reader)
    family = families.gguf_family(meta.arch, path)
    module, rules = family.module, family.gguf.rules
    shapes = gguf_file.tensor_shapes(reader)
    args = family.gguf.args(meta, module, shapes, family.model_type)
    tensors = gguf_file.block_names(reader, args.num_hidden_layers, keep_quantized, compact_scales, whole_blocks)
    if dtype is not None:
        stored = [(t.tensor_type.name, math.prod(t.shape), t.n_bytes) for t in reader.tensors]
        compact = compact_scales is not None
        for line in dequantized_notice(stored, dtype, compact) if keep_quantized else ():
            _log.warning("mlx_hybrid: %s: %s", path.name, line)
        if holds_all:
            needed = sum(
                held_bytes(name, elements, size, dtype, compact, keep_quantized) for name, elements, size in stored
            )
            _refuse_what_does_not_fit(path, needed, path.stat().st_size)
    return _Checkpoint(module, args, rules, tensors, len(shapes)), meta


def _refuse_what_does_not_fit(path: Path, needed: int, stored: int):
    """A model larger than the memory left is refused before it is read (the system would otherwise
    end the process part-way through the load); stored: its files' bytes."""
    memory = memory_available()
    if memory is not None and needed > memory[0]:
        raise ModelLoadError(
            f"{path}: the model takes {size_text(needed)} in memory once loaded ({size_text(stored)} on disk), "
            f"more than the {size_text(memory[0])} available ({size_text(memory[1])} in all): free memory, or take a "
            "smaller quantization of it")  # fmt: skip


def _projector_path(path: Path, mmproj, model_type: str) -> Path | None:
    if mmproj is False:
        return None
    if mmproj is not None:
        projector = Path(mmproj).expanduser()
        if not projector.is_file():
            raise ModelLoadError(f"{projector}: no such projector file")
    else:
        projector = gguf_projector.find_mmproj(path)
    if projector is not None and not hasattr(families.family(model_type).module.ModelArgs, "vision"):
        if mmproj is None:
            return None  # a projector beside a model that takes no images is another model's
        raise ModelLoadError(f"{path}: {model_type} models take no images")
    return projector


def _build(module, args):
    try:
        return module.Model(args)
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"inconsistent model settings: {e}") from None


def _reject_unmatched(unmatched, path):
    if unmatched:
        shown = ", ".join(unmatched[:5])
        raise ModelLoadError(f"{path}: tensors this loader does not know: {shown}")


@contextmanager
def _progress_bar(count: int, total_bytes: int, progress, name: str):
    if progress is None:
        progress = total_bytes >= PROGRESS_MIN_BYTES
    if not progress:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=count, desc=f"loading {name}", unit="tensor", leave=False, disable=None) as bar:
        yield bar

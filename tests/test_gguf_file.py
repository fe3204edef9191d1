"""Our GGUF header reader against gguf's own (gguf.GGUFReader) on every fixture file."""

import gguf
import numpy as np
import pytest
from conftest import FIXTURES

from mlx_hybrid.errors import ModelLoadError
from mlx_hybrid.loaders import gguf_file

GGUF_FILES = sorted(FIXTURES.glob("*/*.gguf"))


@pytest.mark.parametrize("path", GGUF_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_metadata_and_tensors_match_gguf_reader(path):
    ours, theirs = gguf_file.open_gguf(path), gguf.GGUFReader(str(path))
    assert list(ours.metadata) == [key for key in theirs.fields if not key.startswith("GGUF.")]
    for key, value in ours.metadata.items():
        assert value == theirs.fields[key].contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, want in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.data_offset, mine.n_bytes) == (
            want.name,
            want.tensor_type,
            want.data_offset,
            want.n_bytes,
        )
        assert tuple(mine.shape) == tuple(int(d) for d in want.shape)
        assert mine.data.dtype == want.data.dtype and mine.data.shape == want.data.shape
        assert np.array_equal(mine.data, want.data, equal_nan=True)


def test_a_big_endian_file_is_refused_by_name(tmp_path):
    data = bytearray((FIXTURES / "qwen35" / "model.gguf").read_bytes())
    data[4:8] = (3).to_bytes(4, "big")  # as gguf's writer stores the version of a big-endian file
    path = tmp_path / "big.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="big-endian"):
        gguf_file.open_gguf(path)


def test_every_value_type_reads_back_as_gguf_writer_wrote_it(tmp_path):
    """Scalars of each type, strings, and arrays of numbers, strings and arrays (gguf's own
    reader flattens the last: its contents() of [[1, 2], [3]] is [1, 2, 3])."""
    values = {
        "x.u8": (1, "uint8"),
        "x.i16": (-2, "int16"),
        "x.u64": (2**40, "uint64"),
        "x.f64": (0.25, "float64"),
        "x.bool": (True, "bool"),
        "x.text": ("bé", "string"),
        "x.floats": ([0.5, -1.0], "array"),
        "x.words": (["a", "<|im_end|>"], "array"),
        "x.nested": ([[1, 2], [3]], "array"),
    }
    writer = gguf.GGUFWriter(str(tmp_path / "values.gguf"), "qwen35")
    for key, (value, kind) in values.items():
        getattr(writer, f"add_{kind}")(key, value)
    writer.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = gguf_file.open_gguf(tmp_path / "values.gguf")
    assert {k: v for k, v in ours.metadata.items() if k.startswith("x.")} == {k: v for k, (v, _) in values.items()}
    np.testing.assert_array_equal(ours.tensors[0].data, np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.parametrize("dequantize", [False, True])
@pytest.mark.parametrize(
    "family, name",
    [
        ("qwen35", "model.gguf"),
        ("qwen35", "model-Q8_0.gguf"),
        ("qwen35moe", "model-Q4_K_M.gguf"),
        ("qwen3next", "model-Q4_K_M.gguf"),
    ],
)
def test_a_model_that_does_not_fit_in_memory_is_refused_before_it_is_read(family, name, dequantize, monkeypatch):
    """The loader's estimate is the loaded model's bytes: one byte less available is refused by name,
    with both sizes; exactly enough loads."""
    import mlx_hybrid
    from mlx.utils import tree_flatten

    from mlx_hybrid import loaders

    path = FIXTURES / family / name
    model, _ = mlx_hybrid.load(path, dequantize=dequantize)
    needed = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    monkeypatch.setattr(loaders, "memory_available", lambda: (needed - 1, 8 << 30))
    with pytest.raises(
        ModelLoadError,
        match=rf"takes {needed / 1e6:.1f} MB in memory once loaded \(.* on disk\), more "
        rf"than the {(needed - 1) / 1e6:.1f} MB available \(8.59 GB in all\)",
    ):
        mlx_hybrid.load(path, dequantize=dequantize)
    monkeypatch.setattr(loaders, "memory_available", lambda: (needed, 8 << 30))
    mlx_hybrid.load(path, dequantize=dequantize)


def _cgroup_files(directory, files: dict):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_a_control_groups_memory_limit_bounds_what_is_available(tmp_path, monkeypatch):
    """A container's limit, which /proc/meminfo does not show, as the kernel lays its files out: the
    tightest of the group's and its ancestors', less what the group uses but its page cache (v2:
    memory.max, memory.current, memory.stat's `file`; v1: memory.limit_in_bytes, memory.usage_in_bytes,
    `total_cache`); none where no limit is set; and memory_available at most that."""
    from mlx_hybrid.loaders import memory

    GiB = 1 << 30
    v2 = tmp_path / "v2"
    _cgroup_files(
        v2 / "user.slice",
        {
            "memory.max": f"{4 * GiB}\n",
            "memory.current": f"{3 * GiB}\n",
            "memory.stat": f"anon {2 * GiB}\nfile {GiB}\n",
        },
    )
    _cgroup_files(
        v2 / "user.slice" / "app",
        {"memory.max": "max\n", "memory.current": f"{GiB}\n", "memory.stat": "anon 1\nfile 0\n"},
    )
    assert memory.cgroup_memory(v2, "0::/user.slice/app\n") == (2 * GiB, 4 * GiB)
    _cgroup_files(v2 / "user.slice" / "app", {"memory.max": f"{3 * GiB}\n", "memory.current": f"{5 * GiB // 2}\n"})
    assert memory.cgroup_memory(v2, "0::/user.slice/app\n") == (GiB // 2, 3 * GiB)  # the tighter child
    # a container's own view: its group is the root it sees
    assert memory.cgroup_memory(v2 / "user.slice", "0::/\n") == (2 * GiB, 4 * GiB)
    v1 = tmp_path / "v1"
    _cgroup_files(
        v1 / "memory" / "docker",
        {
            "memory.limit_in_bytes": f"{8 * GiB}\n",
            "memory.usage_in_bytes": f"{6 * GiB}\n",
            "memory.stat": f"cache 5\ntotal_cache {2 * GiB}\n",
        },
    )
    _cgroup_files(v1 / "memory" / "docker" / "abc", {"memory.limit_in_bytes": "9223372036854771712\n"})
    membership = "4:memory:/docker/abc\n3:cpuset:/\n"
    assert memory.cgroup_memory(v1, membership) == (4 * GiB, 8 * GiB)
    assert (
        memory.cgroup_memory(v1, "3:cpuset:/\n") is None and memory.cgroup_memory(tmp_path / "none", "0::/\n") is None
    )
    machine = memory.memory_available()
    monkeypatch.setattr(memory, "cgroup_memory", lambda: (GiB // 4, GiB // 2))
    if machine is not None:  # Linux
        assert memory.memory_available() == (min(machine[0], GiB // 4), min(machine[1], GiB // 2))


def test_a_checkpoint_directory_that_does_not_fit_is_refused_before_it_is_read(monkeypatch):
    """A Hugging Face directory: its tensors' bytes (the float32 fixture's, computed in float32) against
    the memory left."""
    import mlx_hybrid
    from mlx_hybrid import loaders

    path = FIXTURES / "qwen35" / "hf"
    stored = sum(
        p.nbytes
        for p in loaders.safetensors_files.read_tensors(loaders.safetensors_files.safetensor_files(path)).values()
    )
    monkeypatch.setattr(loaders, "memory_available", lambda: (stored - 1, 8 << 30))
    with pytest.raises(ModelLoadError, match=rf"takes {stored / 1e6:.1f} MB in memory once loaded"):
        mlx_hybrid.load(path, dtype="float32")
    monkeypatch.setattr(loaders, "memory_available", lambda: (stored, 8 << 30))
    mlx_hybrid.load(path, dtype="float32")  # exactly enough: it loads

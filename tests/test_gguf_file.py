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
            want.name, want.tensor_type, want.data_offset, want.n_bytes
        )  # fmt: skip
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

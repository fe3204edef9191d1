import socket
from pathlib import Path

import mlx_hybrid  # first: on Linux it loads OpenBLAS before MLX, as for users

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
QWEN_FAMILIES = ["qwen35", "qwen35moe", "qwen3next"]  # with MTP heads
FAMILIES = QWEN_FAMILIES + ["kimilinear"]
SOURCES = ["model.gguf", "hf"]

_models = {}


def load_fixture(family: str, source: str):
    """Load a fixture model once per test session."""
    key = (family, source)
    if key not in _models:
        _models[key] = mlx_hybrid.load(FIXTURES / family / source, dtype="float32")
    return _models[key]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(family: str, name: str = "ref.npz"):
    return np.load(FIXTURES / family / name)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(params=SOURCES)
def source(request):
    return request.param

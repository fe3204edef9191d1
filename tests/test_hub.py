"""Models by hub name, offline, from a cache laid out the way huggingface_hub lays it out:
hub/models--ORG--NAME/{refs/main, snapshots/COMMIT/FILE -> ../../blobs/HASH}."""

import hashlib
import os
import shutil

import pytest

from conftest import FIXTURES
from test_cli import greedy_text
from test_errors import assert_usage_error, run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_cache(hf_home, repo_id, files):
    """files: {name in the repository: local file to store}."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for name, source in files.items():
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, blob)
        link = repo / "snapshots" / COMMIT / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    hf_home = tmp_path / "hf"
    hf_dir = FIXTURES / "qwen35" / "hf"
    add_to_cache(hf_home, "test-org/Qwen35-Tiny", {f.name: f for f in hf_dir.iterdir()})
    add_to_cache(hf_home, "test-org/Qwen35-Tiny-GGUF", {"model-Q8_0.gguf": FIXTURES / "qwen35" / "model-Q8_0.gguf"})
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    # huggingface_hub reads these once, at its import, which an earlier test may have caused (mlx-lm's
    # and transformers' imports do): the in-process calls see the test's cache too
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home


def test_repository_name_loads_the_cached_checkpoint(offline_hub):
    # greedy_text computes in float32, where a GPU's default is bfloat16
    args = ["--prompt", "def parse_args(", "--max-tokens", "10", "--no-mtp", "--dtype", "float32"]
    result = run_cli("--model", "test-org/Qwen35-Tiny", *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == greedy_text("qwen35", "hf", "def parse_args(", 10).rstrip("\n")


def test_gguf_file_of_a_repository(offline_hub):
    args = ["--prompt", "def f(", "--max-tokens", "6", "--dtype", "float32"]
    result = run_cli("--model", "test-org/Qwen35-Tiny-GGUF:model-Q8_0.gguf", *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == greedy_text("qwen35", "model-Q8_0.gguf", "def f(", 6).rstrip("\n")


def test_names_not_cached_offline_are_a_clear_error(offline_hub):
    assert_usage_error(run_cli("--model", "test-org/Missing", "--prompt", "x"), "not in the Hugging Face cache")
    assert_usage_error(
        run_cli("--model", "test-org/Qwen35-Tiny-GGUF:other.gguf", "--prompt", "x"), "not in the Hugging Face cache"
    )


def test_a_local_path_wins_over_a_hub_name(offline_hub, tmp_path, monkeypatch):
    local = tmp_path / "test-org" / "Qwen35-Tiny"
    shutil.copytree(FIXTURES / "qwen35moe" / "hf", local)
    monkeypatch.chdir(tmp_path)
    args = ["--prompt", "class A:", "--max-tokens", "6", "--no-mtp", "--dtype", "float32"]
    result = run_cli("--model", "test-org/Qwen35-Tiny", *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == greedy_text("qwen35moe", "hf", "class A:", 6).rstrip("\n")

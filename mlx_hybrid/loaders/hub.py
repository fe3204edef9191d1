"""Models by Hugging Face hub name, resolved to local paths through `huggingface_hub`.

- `org/repo`: a checkpoint directory (Hugging Face or MLX-community layout); only the
  files a model needs are downloaded (weights, configs, tokenizer, chat template).
- `org/repo:file.gguf`: one GGUF file of a repository.

Downloads go to huggingface_hub's cache with its progress bars, and a cached copy is
used as it is; with HF_HUB_OFFLINE=1 nothing is downloaded, and a name that is not
cached is a clear error. A local path of the same spelling always wins.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ModelLoadError

_REPO_ID = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+"
HUB_NAME = re.compile(rf"^(?P<repo>{_REPO_ID})(?::(?P<file>[^:]+\.gguf))?$")

# What a checkpoint directory needs: no other weight formats, no remote code.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def is_hub_name(spec) -> bool:
    return isinstance(spec, str) and HUB_NAME.match(spec) is not None and not Path(spec).expanduser().exists()


def resolve(spec: str) -> Path:
    """The local path of hub name `spec`, downloading what is missing."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    match = HUB_NAME.match(spec)
    repo, filename = match["repo"], match["file"]
    try:
        if filename:
            return Path(hf_hub_download(repo, filename))
        return Path(snapshot_download(repo, allow_patterns=CHECKPOINT_FILES))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{spec}: not in the Hugging Face cache, and it cannot be downloaded now (offline, or HF_HUB_OFFLINE=1)"
        ) from None
    except GatedRepoError:
        raise ModelLoadError(f"{spec}: a gated repository; accept its terms on the hub and log in first") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{spec}: no such repository on the Hugging Face hub (or it is private)") from None
    except EntryNotFoundError:
        raise ModelLoadError(f"{spec}: the repository has no file {filename!r}") from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelLoadError(f"{spec}: could not download ({type(e).__name__}: {e})") from None

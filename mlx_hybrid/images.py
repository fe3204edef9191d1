"""Images in: reading what users bring (paths, bytes, PIL images, data and file URLs), the
checkpoint's preprocessing (transformers' PIL image processor for Qwen3.5: resize within the
pixel bounds to multiples of patch x merge, rescale, normalise, cut into patches), and the
prompt's image tokens: each `<|image_pad|>` the chat template renders becomes as many as
the image has merged patches.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import json
import math
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

from .errors import GenerationError

IMAGE_PAD = "<|image_pad|>"
# An image larger than this (before resizing) is refused rather than decoded: 2.5x the
# pixels of an 8K frame, far above what any checkpoint's bounds keep.
MAX_SOURCE_PIXELS = 80_000_000


class ImageError(GenerationError):
    """An image that cannot be read or used."""


@dataclass(frozen=True)
class ImageProcessor:
    """A checkpoint's `preprocessor_config.json` (Qwen3.5's values by default)."""

    min_pixels: int = 65536
    max_pixels: int = 16777216
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_config(cls, config: dict) -> ImageProcessor:
        size = config.get("size") or {}
        values = {
            "min_pixels": config.get("min_pixels", size.get("shortest_edge", cls.min_pixels)),
            "max_pixels": config.get("max_pixels", size.get("longest_edge", cls.max_pixels)),
        }
        for name in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor"):
            if name in config:
                values[name] = config[name]
        for name in ("image_mean", "image_std"):
            if name in config:
                values[name] = tuple(config[name])
        unsupported = [k for k in ("do_resize", "do_rescale", "do_normalize") if config.get(k) is False]
        if unsupported:
            raise ValueError(f"preprocessor settings not supported: {', '.join(f'{k}=false' for k in unsupported)}")
        return cls(**values)

    @classmethod
    def from_hf_dir(cls, path: Path) -> ImageProcessor:
        config_path = Path(path) / "preprocessor_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls.from_config(config)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `smart_resize`: multiples of patch x merge, pixels within the bounds."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > 200:
            raise ImageError(f"the image's aspect ratio ({width}x{height}) is beyond 200:1")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def __call__(self, image) -> ImagePatches:
        """An RGB PIL image -> its patches [t h w, C T P P] on its grid (t, h, w)."""
        from PIL import Image

        h, w = self.resized_size(image.height, image.width)
        if (w, h) != image.size:
            image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
        pixels = np.asarray(image, dtype=np.float32) * np.float32(self.rescale_factor)
        pixels = (pixels - np.float32(self.image_mean)) / np.float32(self.image_std)
        P, M, T = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // P, w // P
        # channels first, 2 x 2 blocks of neighbouring patches consecutive, the frame repeated T times
        blocks = pixels.transpose(2, 0, 1).reshape(3, gh // M, M, P, gw // M, M, P).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], T, P, P))
        patches = np.ascontiguousarray(patches.reshape(gh * gw, 3 * T * P * P))
        return ImagePatches(patches, (1, gh, gw), merge=M)


@dataclass
class ImagePatches:
    patches: np.ndarray  # [t h w, C T P P] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    merge: int = 2
    digest: str = field(init=False)  # what a checkpoint key keeps of it

    def __post_init__(self):
        self.digest = hashlib.sha256(self.patches.tobytes() + repr(self.grid).encode()).hexdigest()

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // self.merge**2


@dataclass(frozen=True)
class ImageAccess:
    """What an image named by a path or URL may reach; data URLs, bytes and PIL images are always read.

    local: True, any file (the Python API and the commands: their caller is the user); a directory,
    files that resolve inside it only (symlinks and `..` followed first: a server's
    --allowed-local-media-path); None, no file. remote: http(s) URLs are fetched, but not from
    loopback, private, link-local or reserved addresses (cloud metadata services among them), nor
    redirected there, unless private_addresses (the user's own call) or the host is one of
    `private_hosts` (a server's --allowed-image-hosts).
    """

    local: bool | Path | None = True
    remote: bool = False
    private_addresses: bool = False
    private_hosts: tuple[str, ...] = ()


# one message whether or not the file exists: a client learns nothing of the server's disk
LOCAL_FILES_REFUSED = (
    "local image files are not read here: send the image as a data: URL (a server's operator can allow "
    "one directory with --allowed-local-media-path DIR)"
)


def read_image(source, access: ImageAccess | bool = ImageAccess()):
    """A PIL RGB image from a path, bytes, a PIL image, or a data / file / http(s) URL, as `access`
    allows (a bool, the Python API's: whether http(s) URLs are fetched, from any address; any file read)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(access, bool):
        access = ImageAccess(remote=access, private_addresses=True)
    if isinstance(source, Image.Image):
        image = source
    else:
        data = _image_bytes(source, access)
        try:
            with warnings.catch_warnings():  # the size is checked below, before decoding
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
            _check_size(image)
            image.load()
        except Image.DecompressionBombError:
            raise ImageError(f"the image has too many pixels (more than {MAX_SOURCE_PIXELS})") from None
        except UnidentifiedImageError:
            raise ImageError("not an image (no format Pillow reads)") from None
        except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
            raise ImageError(f"the image cannot be decoded: {e}") from None
    _check_size(image)
    return image.convert("RGB")


def _check_size(image):
    if image.width * image.height > MAX_SOURCE_PIXELS:
        raise ImageError(f"the image has too many pixels ({image.width}x{image.height}, at most {MAX_SOURCE_PIXELS})")
    if image.width < 1 or image.height < 1:
        raise ImageError("the image is empty")


def _image_bytes(source, access: ImageAccess) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if not isinstance(source, (str, Path)):
        raise ImageError(f"an image is a path, bytes, a PIL image or a URL, not {type(source).__name__}")
    text = str(source)
    if text.startswith("data:"):
        header, _, payload = text.partition(",")
        if not header.endswith(";base64"):
            raise ImageError("a data URL image must be base64 encoded (data:image/...;base64,...)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the data URL's base64 payload is malformed") from None
    url = urlparse(text)
    if url.scheme in ("http", "https"):
        if not access.remote:
            raise ImageError("remote image URLs are off (allow them with --allow-remote-images)")
        return _fetch(text, access)
    # another scheme is refused; the user's own call (any file) may still name a path that looks like
    # one; where files are restricted, not even whether it exists is told
    if url.scheme not in ("", "file") and (access.local is not True or not Path(text).exists()):
        raise ImageError(f"unsupported image URL scheme {url.scheme!r}")
    path = _local_path(Path(unquote(url.path)) if url.scheme == "file" else Path(text).expanduser(), access)
    try:
        return path.read_bytes()
    except OSError as e:
        raise ImageError(f"cannot read the image {path}: {e.strerror or e}") from None


def _local_path(path: Path, access: ImageAccess) -> Path:
    """The file to read, if `access` allows it; else one message, whether or not it exists."""
    if access.local is True:
        return path
    if not access.local:
        raise ImageError(LOCAL_FILES_REFUSED)
    root, resolved = Path(access.local).resolve(), path.resolve()
    if not resolved.is_relative_to(root):
        raise ImageError(f"image files are read from {root} only (--allowed-local-media-path)")
    return resolved


def _fetch(url: str, access: ImageAccess, limit: int = 32 << 20) -> bytes:
    from urllib.request import build_opener

    if urlparse(url).scheme not in ("http", "https") or not urlparse(url).hostname:
        raise ImageError(f"not an http(s) image URL: {url}")
    # where private addresses are refused, each connection (a redirect's too) resolves its host
    # once, checks every address and connects to a checked one (a name that resolves elsewhere the
    # second time cannot slip through), with no proxy between: a proxy would resolve it again
    handlers = [] if access.private_addresses else _checked_handlers(access)
    try:
        with build_opener(*handlers).open(url, timeout=20) as response:
            data = response.read(limit + 1)
    except OSError as e:
        raise ImageError(f"cannot fetch the image {url}: {e}") from None
    if len(data) > limit:
        raise ImageError(f"the image at {url} is larger than {limit >> 20} MiB")
    return data


def _checked_handlers(access: ImageAccess) -> list:
    """urllib handlers whose connections go only to addresses `_checked_address` allows. The
    connection keeps the host's name for the Host header and for TLS (server name, certificate)."""
    import http.client
    from urllib.request import HTTPHandler, HTTPRedirectHandler, HTTPSHandler, ProxyHandler

    def checked(connection_class):
        class Checked(connection_class):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                # http.client opens its socket through this attribute (HTTPS wraps it after)
                self._create_connection = self._connect_checked

            def _connect_checked(self, address, *args):
                host, port = address
                return socket.create_connection((_checked_address(host, port, access), port), *args)

        return Checked

    class CheckedHTTP(HTTPHandler):
        def http_open(self, request):
            return self.do_open(checked(http.client.HTTPConnection), request)

    class CheckedHTTPS(HTTPSHandler):
        def https_open(self, request):
            return self.do_open(checked(http.client.HTTPSConnection), request)

    class HttpRedirects(HTTPRedirectHandler):  # an ftp: redirect would connect unchecked
        def redirect_request(self, request, fp, code, message, headers, new_url):
            if urlparse(new_url).scheme not in ("http", "https"):
                raise ImageError(f"the image URL redirects to {new_url}: only http(s) URLs are fetched")
            return super().redirect_request(request, fp, code, message, headers, new_url)

    return [ProxyHandler({}), CheckedHTTP(), CheckedHTTPS(), HttpRedirects()]


def _checked_address(host: str, port: int, access: ImageAccess) -> str:
    """The address to connect to for `host`: resolved once, refused if any of its addresses is
    loopback, private, link-local or reserved (unless the operator allowed the host by name)."""
    if host in access.private_hosts:
        return host
    try:
        addresses = [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError):
        raise ImageError(f"cannot resolve the image's host {host}") from None
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if any((ip.is_loopback, ip.is_private, ip.is_link_local, ip.is_reserved, ip.is_multicast, ip.is_unspecified)):
            raise ImageError(
                f"image URLs to local or private addresses are refused ({host}); "
                "a server's operator can allow a host with --allowed-image-hosts"
            )
    if not addresses:
        raise ImageError(f"cannot resolve the image's host {host}")
    return addresses[0]


@dataclass
class ExpandedPrompt:
    """A prompt's ids with each image's pad token expanded to its tokens."""

    ids: list[int]
    images: list[ImagePatches]
    starts: list[int]  # where each image's tokens begin
    # per token of the prompt before expansion, and its end: how many tokens were added before it
    inserted_before: list[int] = field(default_factory=list)

    def moved(self, index: int) -> int:
        """Where token `index` of the prompt before expansion (or its end) is now."""
        return index + self.inserted_before[index]

    @property
    def slots(self) -> np.ndarray:
        """The prompt positions of the image tokens, in order."""
        return np.concatenate([np.arange(s, s + image.num_tokens) for s, image in zip(self.starts, self.images)])

    def key(self) -> list[int]:
        """The ids with each image's first token replaced by a negative marker of its pixels:
        a checkpoint key that tells images apart."""
        key = list(self.ids)
        for start, image in zip(self.starts, self.images):
            key[start] = -1 - int(image.digest[:15], 16)
        return key


def expand_image_pads(ids: list[int], images: list[ImagePatches], pad_id: int) -> ExpandedPrompt:
    """Put each image's tokens where the prompt has its `<|image_pad|>` (one per image, in order)."""
    pads = [i for i, t in enumerate(ids) if t == pad_id]
    if len(pads) != len(images):
        raise ImageError(
            f"the prompt has {len(pads)} image placeholders ({IMAGE_PAD}) for {len(images)} images: give the "
            f"images as image parts of the chat messages, or put one <|vision_start|>{IMAGE_PAD}<|vision_end|> "
            "per image in the prompt"
        )
    out, starts, inserted_before, added = [], [], [], 0
    for i, token in enumerate(ids):
        inserted_before.append(added)
        if token == pad_id:
            image = images[len(starts)]
            starts.append(len(out))
            out += [pad_id] * image.num_tokens
            added += image.num_tokens - 1
        else:
            out.append(token)
    return ExpandedPrompt(out, images, starts, inserted_before + [added])

"""Turning user media into RGB pixels: image sources (PIL, path, data URI, URL, bytes, array) and video files.

Decoded sources follow transformers' `load_image` (EXIF transpose, then `convert("RGB")`); in-memory PIL images
and arrays follow its `convert_to_rgb` (alpha composited onto white). Paths, URLs, data URIs and encoded bytes are
read under a `MediaPolicy` (what sources are allowed, time and size limits). Decoded pixels count against one
budget shared by every decode in the process (`DECODE_BUDGET`): a decode reserves its estimate from the header, before
any pixel is decoded, and gives it back once the pixels are reduced to the size the caller wants. Errors are one-line
`QwenrtError`s.
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import io
import os
import stat
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qwenrt.errors import QueueFullError, QwenrtError
from qwenrt.files import open_regular, read_bytes
from qwenrt.vision.fetch import check_url, fetch

MIB = 1 << 20
DECODE_BYTES_PER_PIXEL = 12  # Pillow keeps 4 bytes a pixel: the decoded image, its upright copy, its RGB copy
FRAME_BYTES_PER_PIXEL = 12  # one video frame at a time: decoded (YUV), as an RGB array, and Pillow's copy to resize
PILLOW_BLOCK_BYTES = 64 * MIB  # over glibc's 32 MiB mmap ceiling, so a large image's blocks go back to the OS


@dataclass(frozen=True)
class MediaPolicy:
    """Where images and videos may come from, and how much of them is read.

    The Python API and the CLI use DEFAULT_POLICY (the user's own machine: local files and any address allowed);
    a server passes a strict one, e.g. `MediaPolicy.strict()`. Every limit is refused with one QwenrtError.
    """

    allow_files: bool = True  # local paths
    file_root: str | os.PathLike | None = None  # when set, local files only under this directory (links resolved)
    allow_urls: bool = True  # http(s) downloads
    allow_private_addresses: bool = True  # False: refuse hosts resolving to loopback/private/link-local/... (SSRF)
    allowed_domains: tuple[str, ...] | None = None  # when set, URL hosts must be one of these or their subdomains
    allow_data_uris: bool = True
    download_seconds: float = 30.0  # the whole download, redirects included (not per read)
    max_redirects: int = 5
    max_bytes: int = 64 * MIB  # an image's encoded size: file, download or data URI
    max_video_bytes: int = 4096 * MIB  # a video file's size
    max_pixels: int = 50_000_000  # one decoded image or video frame (checked before decoding)
    max_frames: int = 100_000  # video frames read from a file (decoded or counted)
    max_video_pixels: int = 1 << 30  # all the sampled frames of one video together, before resizing
    max_decode_bytes: int | None = 1024 * MIB  # decoded pixels of every image/video being prepared in this process
    decode_wait_seconds: float = 60.0  # how long a decode waits for room in that budget before it is refused

    @classmethod
    def strict(cls, file_root: str | os.PathLike | None = None, allowed_domains: tuple[str, ...] | None = None,
               **limits) -> MediaPolicy:
        """For requests from others: no local files (unless under `file_root`), no private or loopback addresses,
        URLs only from `allowed_domains` when given."""
        return cls(allow_files=file_root is not None, file_root=file_root, allow_private_addresses=False,
                   allowed_domains=None if allowed_domains is None else tuple(d.lower() for d in allowed_domains),
                   **limits)


DEFAULT_POLICY = MediaPolicy()
ResizeTo = Callable[[int, int], tuple[int, int]]  # (height, width) -> the (height, width) to resize to


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / MIB:.1f} MiB"


class DecodeBudget:
    """Memory for decoded pixels, shared by every image and video this process prepares (all of a server's requests):
    a decode waits, in turn, while what is reserved would pass its policy's `max_decode_bytes`."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._reserved = 0
        self._turns: collections.deque[object] = collections.deque()

    @property
    def reserved(self) -> int:
        return self._reserved

    @contextlib.contextmanager
    def hold(self, nbytes: int, policy: MediaPolicy, what: str):
        """`nbytes` reserved for the with block. One that alone passes the limit is refused; one that finds no room
        within `policy.decode_wait_seconds` gets a QueueFullError (the server says 429: try again later)."""
        limit = policy.max_decode_bytes
        if limit is None:
            yield
            return
        if nbytes > limit:
            raise QwenrtError(f"{what} needs {_size(nbytes)} to decode; the limit is {_size(limit)}")
        self._reserve(nbytes, limit, policy.decode_wait_seconds, what)
        try:
            yield
        finally:
            with self._changed:
                self._reserved -= nbytes
                self._changed.notify_all()

    def _reserve(self, nbytes: int, limit: int, seconds: float, what: str) -> None:
        """First come, first served, so a large decode is not starved by a stream of small ones."""
        turn, deadline = object(), time.monotonic() + seconds
        with self._changed:
            self._turns.append(turn)
            try:
                while self._turns[0] is not turn or self._reserved + nbytes > limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise QueueFullError(f"{what}: other images and videos held the decoding memory "
                                             f"({_size(limit)}) for {seconds:g} s; try again later")
                    self._changed.wait(left)
                self._reserved += nbytes
            finally:
                self._turns.remove(turn)
                self._changed.notify_all()


DECODE_BUDGET = DecodeBudget()


def _pil():
    try:
        import PIL.Image
        import PIL.ImageOps
    except ImportError:
        raise QwenrtError("image input needs Pillow: pip install 'qwenrt[vision]'") from None
    if PIL.Image.core.get_block_size() < PILLOW_BLOCK_BYTES:  # 16 MiB blocks stay in each thread's malloc arena
        PIL.Image.core.set_block_size(PILLOW_BLOCK_BYTES)  # once freed: six decoding threads kept +2.4 GB
    return PIL


def describe(source) -> str:
    """A source for a one-line message: cut to 80 characters, control characters and lone surrogates escaped."""
    text = source if isinstance(source, str) else f"<{type(source).__name__}>"
    text = text if len(text) <= 80 else text[:77] + "..."
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def local_media_path(text: str, policy: MediaPolicy, what: str) -> Path:
    """A local media path the policy allows (inside its root, links resolved); it need not exist. A path the OS
    cannot take (a NUL, a lone surrogate) is refused here rather than by the first call that would raise."""
    if not policy.allow_files:
        raise QwenrtError(f"{what} {describe(text)}: local files are not allowed here")
    try:
        encoded = os.fsencode(text)
    except UnicodeError:
        raise QwenrtError(f"{what} {describe(text)}: the path is not valid Unicode (a lone surrogate)") from None
    if b"\0" in encoded:
        raise QwenrtError(f"{what} {describe(text)}: the path holds a NUL character")
    path = Path(text).expanduser()
    if policy.file_root is None:
        return path
    root = Path(policy.file_root).resolve()
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as e:
        raise QwenrtError(f"{what} {describe(text)}: cannot resolve the path ({e})") from None
    if resolved != root and root not in resolved.parents:
        raise QwenrtError(f"{what} {describe(text)}: only files under {root} are allowed")
    return resolved


def _data_uri(text: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_data_uris:
        raise QwenrtError("image data URIs are not allowed here")
    header, _, payload = text.partition(",")
    if not header.endswith(";base64") or not payload:
        raise QwenrtError(f"image data URI {describe(text)} is not a base64 data URI")
    if len(payload) > policy.max_bytes * 4 // 3 + 4:
        raise QwenrtError(f"image data URI holds more than the limit of {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload)  # lenient like transformers: stray characters are skipped
    except (binascii.Error, ValueError) as e:
        raise QwenrtError(f"image data URI {describe(text)} is not valid base64: {e}") from None


def preflight_media(source, policy: MediaPolicy = DEFAULT_POLICY, what: str = "media") -> None:
    """Refuse what can be refused without reading or downloading: a disallowed kind of source, a local file that
    is missing or not a regular file (e.g. before a model loads)."""
    if not isinstance(source, (str, os.PathLike)):
        return
    text = os.fspath(source)
    if text.startswith(("http://", "https://")):
        check_url(text, policy, f"{what} {describe(text)}")
    elif text.startswith("data:"):
        if not policy.allow_data_uris:
            raise QwenrtError("image data URIs are not allowed here")
    else:
        path = local_media_path(text, policy, what)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise QwenrtError(f"{what} file not found: {describe(text)}") from None
        except OSError as e:
            raise QwenrtError(f"cannot read {what} file {describe(text)}: {e.strerror}") from None
        if not stat.S_ISREG(mode):
            raise QwenrtError(f"{what} {describe(text)} is not a regular file")


def _source_bytes(source: str | os.PathLike, policy: MediaPolicy) -> bytes:
    """The encoded bytes behind a path, a `data:` URI or an http(s) URL."""
    text = os.fspath(source)
    if text.startswith(("http://", "https://")):
        return fetch(text, policy, f"image {describe(text)}")
    if text.startswith("data:"):
        return _data_uri(text, policy)
    return read_bytes(local_media_path(text, policy, "image"), policy.max_bytes, "image file")


@contextlib.contextmanager
def _pillow_errors(what: str):
    """Pillow's failures on bad data as one-line QwenrtErrors."""
    PIL = _pil()
    try:
        yield
    except PIL.UnidentifiedImageError:
        raise QwenrtError(f"cannot decode image {what}: not an image format Pillow recognises") from None
    except (PIL.Image.DecompressionBombError, OSError, ValueError, SyntaxError, EOFError) as e:
        raise QwenrtError(f"cannot decode image {what}: {' '.join(str(e).split())}") from None


def _decode(data: bytes, what: str, policy: MediaPolicy, resize_to: ResizeTo | None, resample: int):
    """The header first (the pixel limit, then the decode budget), then the pixels: upright, RGB, resized."""
    PIL = _pil()
    with _pillow_errors(what), warnings.catch_warnings():  # the policy's pixel limit below is the one that applies
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        image = PIL.Image.open(io.BytesIO(data))
    if image.width * image.height > policy.max_pixels:
        raise QwenrtError(f"image {what} is {image.width}x{image.height} pixels; the limit is "
                          f"{policy.max_pixels} pixels")
    with DECODE_BUDGET.hold(image.width * image.height * DECODE_BYTES_PER_PIXEL, policy, f"image {what}"):
        with _pillow_errors(what):
            image.load()
            rgb = PIL.ImageOps.exif_transpose(image).convert("RGB")
        del image  # the decoded pixels go before the resize needs room
        fitted = _fit(rgb, what, resize_to, resample)
        del rgb  # the full-size pixels go before their reservation does
    return fitted


def _fit(image, what: str, resize_to: ResizeTo | None, resample: int):
    """An RGB image that has pixels, resized to `resize_to(height, width)` when given."""
    if image.width < 1 or image.height < 1:
        raise QwenrtError(f"image {what} has zero size ({image.width}x{image.height})")
    if resize_to is None:
        return image
    height, width = resize_to(image.height, image.width)
    return image.resize((width, height), resample=resample)


def _composite_rgb(image):
    """RGB with any transparency composited onto white (transformers' convert_to_rgb for PIL inputs)."""
    PIL = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _array_rgb(array: np.ndarray) -> np.ndarray:
    """uint8 [H, W] / [H, W, 1|3|4] -> [H, W, 3]; alpha blended onto white and rounded, as transformers does."""
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (1, 3, 4)):
        raise QwenrtError(f"image arrays must be uint8 [H, W] or [H, W, 1|3|4], got {array.dtype} {list(array.shape)}")
    if array.ndim == 2:
        array = array[..., None]
    if array.shape[-1] == 1:
        return np.repeat(array, 3, axis=-1)
    if array.shape[-1] == 4:
        alpha = array[..., 3:4] / 255
        return np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return array


def load_image(source, policy: MediaPolicy = DEFAULT_POLICY, resize_to: ResizeTo | None = None, resample: int = 3):
    """A PIL RGB image from a PIL image, a path, a `data:` URI, an http(s) URL, encoded bytes or a uint8 array;
    paths, URLs and encoded bytes are read under `policy` and decoded within the decode budget. With `resize_to`,
    it is resized (PIL filter `resample`, 3 = bicubic) before the full-size pixels are given back."""
    PIL = _pil()
    if isinstance(source, PIL.Image.Image):
        return _fit(_composite_rgb(source), describe(source), resize_to, resample)
    if isinstance(source, np.ndarray):
        return _fit(PIL.Image.fromarray(_array_rgb(source)), describe(source), resize_to, resample)
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) > policy.max_bytes:
            raise QwenrtError(f"image of {len(source)} bytes is over the limit of {policy.max_bytes}")
        return _decode(bytes(source), f"<{len(source)} bytes>", policy, resize_to, resample)
    if isinstance(source, (str, os.PathLike)):
        return _decode(_source_bytes(source, policy), describe(os.fspath(source)), policy, resize_to, resample)
    raise QwenrtError(f"unsupported image input type {type(source).__name__}")


def resize_rgb(pixels: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [height, width, 3] with a PIL filter (3 = bicubic), as transformers resizes."""
    PIL = _pil()
    return np.asarray(PIL.Image.fromarray(pixels).resize((width, height), resample=resample))


def load_frame(frame) -> np.ndarray:
    """One video frame (PIL image or uint8 array) -> uint8 [H, W, 3]."""
    PIL = _pil()
    if isinstance(frame, PIL.Image.Image):
        frame = np.asarray(_composite_rgb(frame))
    elif isinstance(frame, np.ndarray):
        frame = _array_rgb(frame)
    else:
        raise QwenrtError(f"video frames must be PIL images or uint8 arrays, got {type(frame).__name__}")
    if frame.shape[0] < 1 or frame.shape[1] < 1:
        raise QwenrtError(f"video frame has zero size ({frame.shape[1]}x{frame.shape[0]})")
    return frame


def decode_video_file(path: str | os.PathLike, sample_indices, policy: MediaPolicy = DEFAULT_POLICY,
                      frame_size: Callable[[int, int, int], tuple[int, int]] | None = None, resample: int = 3
                      ) -> tuple[list[np.ndarray], list[int], float | None]:
    """Decode a video file with PyAV: (sampled frames uint8 [H, W, 3], their indices, the stream's fps or None).

    `sample_indices(total_frames, fps) -> list[int]` picks the frames to keep; only those are converted to RGB and
    decoding stops after the last. A stream that does not state its frame count has its packets counted first (a
    pass that decodes nothing). `frame_size(sampled_frames, height, width) -> (h, w)`, when given, is the size each
    kept frame is resized to (PIL filter `resample`) as soon as it is decoded, so the full-size frames are never held
    together. The file is read under `policy` (regular files only, frame and pixel limits, the decode budget).
    """
    name = describe(os.fspath(path))
    try:
        import av
    except ImportError:
        raise QwenrtError(f"decoding video file {name} needs PyAV: pip install av") from None
    fd = open_regular(local_media_path(os.fspath(path), policy, "video"), "video file")
    with os.fdopen(fd, "rb") as file:
        if os.fstat(fd).st_size > policy.max_video_bytes:
            raise QwenrtError(f"video file {name} is over the limit of {policy.max_video_bytes} bytes")
        try:
            with av.open(file) as container:
                stream = container.streams.video[0]
                rate = stream.average_rate or stream.guessed_rate
                fps = float(rate) if rate else None
                width, height = stream.codec_context.width, stream.codec_context.height
                if width * height > policy.max_pixels:
                    raise QwenrtError(f"video file {name} has {width}x{height} frames; the limit is "
                                      f"{policy.max_pixels} pixels")
                total = stream.frames if 0 < stream.frames <= policy.max_frames else None
                if total is None:
                    total = _count_packets(container, stream, policy, name)
            wanted = sample_indices(total, fps) if total else []
            if len(wanted) * width * height > policy.max_video_pixels:
                raise QwenrtError(f"video file {name}: {len(wanted)} sampled {width}x{height} frames exceed the "
                                  f"limit of {policy.max_video_pixels} pixels")
            size = frame_size(len(wanted), height, width) if frame_size is not None and wanted else (height, width)
            need = width * height * FRAME_BYTES_PER_PIXEL + len(wanted) * size[0] * size[1] * 3
            file.seek(0)
            with DECODE_BUDGET.hold(need, policy, f"video file {name}"), av.open(file) as container:
                frames = _decode_frames(container, container.streams.video[0], wanted, (height, width), size,
                                        resample, name)
        except (av.error.FFmpegError, IndexError, OSError, ValueError) as e:
            raise QwenrtError(f"cannot decode video file {name}: {' '.join(str(e).split())}") from None
    if not wanted:
        raise QwenrtError(f"video file {name} has no frames")
    missing = [i for i in wanted if i not in frames]
    if missing:
        raise QwenrtError(f"video file {name} ended before frame {missing[0]}")
    return [frames[i] for i in wanted], wanted, fps


def _count_packets(container, stream, policy: MediaPolicy, name: str) -> int:
    """Frames of a stream whose header does not say: its packets, counted without decoding."""
    count = 0
    for packet in container.demux(stream):
        if packet.size:
            count += 1
            if count > policy.max_frames:
                raise QwenrtError(f"video file {name} has more than {policy.max_frames} frames")
    return count


def _decode_frames(container, stream, wanted: list[int], stated: tuple[int, int], size: tuple[int, int],
                   resample: int, name: str) -> dict[int, np.ndarray]:
    """The `wanted` frames (uint8 [h, w, 3], (h, w) = `size`) by index, decoding no further than the last. Every
    frame must have the (height, width) the stream `stated`: the one the pixel limit and the decode budget were
    checked for."""
    frames, keep = {}, set(wanted)
    for i, frame in enumerate(container.decode(stream)):
        if not wanted or i > wanted[-1]:
            break
        if (frame.height, frame.width) != stated:
            raise QwenrtError(f"video file {name} has a {frame.width}x{frame.height} frame in a stream of "
                              f"{stated[1]}x{stated[0]} frames")
        if i in keep:
            pixels = frame.to_ndarray(format="rgb24")
            frames[i] = pixels if size == stated else resize_rgb(pixels, *size, resample)
    return frames

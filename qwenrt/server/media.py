"""Where images and video in a chat request may come from, under the server's one strict `MediaPolicy`: `data:`
URIs and http(s) URLs to public addresses; local files (`file://` URLs or paths) only under the directory the
operator allowed (vLLM's --allowed-local-media-path). What can be refused without reading or downloading is refused
here, naming the part; the engine reads the rest under the same policy."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from qwenrt.errors import QwenrtError
from qwenrt.multimodal import IMAGE_PART_TYPES, VIDEO_PART_TYPES
from qwenrt.server.errors import APIError
from qwenrt.vision.fetch import check_url
from qwenrt.vision.media import MediaPolicy, local_media_path


def _local_path(source: str, policy: MediaPolicy, param: str) -> str:
    if not policy.allow_files:
        raise APIError(400, f"{param}: local files are not served (start the server with --allowed-local-media-path "
                            "to allow a directory); use a data: URI or an http(s) URL", param)
    try:
        path = unquote(urlsplit(source).path) if source.startswith("file:") else source
        return str(local_media_path(path, policy, param))
    except ValueError:  # a file: URL urllib cannot split
        raise APIError(400, f"{param}: not a valid file URL", param) from None
    except QwenrtError as e:
        raise APIError(400, str(e), param) from None


def _check_url(source: str, policy: MediaPolicy, param: str) -> None:
    """What the policy says of the URL itself (scheme, domain, port); its addresses are checked when it is fetched."""
    try:
        check_url(source, policy, param)
    except QwenrtError as e:
        raise APIError(400, str(e), param) from None


def _source(part: dict, kind: str, param: str):
    value = part.get(kind)
    if isinstance(value, dict):
        value, param = value.get("url"), f"{param}.{kind}.url"
    else:
        param = f"{param}.{kind}"
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: expected a URL string", param)
    return value, param


def check_media(messages: list[dict], policy: MediaPolicy) -> list[dict]:
    """Messages with every image/video source checked (and local ones resolved); raises APIError naming the part."""
    checked = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            checked.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            kind = part.get("type")
            param = f"messages[{m}].content[{p}]"
            if kind in IMAGE_PART_TYPES or kind in VIDEO_PART_TYPES:
                source, where = _source(part, kind, param)
                video = kind in VIDEO_PART_TYPES
                if video and source.startswith(("data:", "http://", "https://")):
                    raise APIError(400, f"{where}: video is read from local files only", where)
                if source.startswith(("http://", "https://")):
                    _check_url(source, policy, where)
                elif not source.startswith("data:"):
                    source = _local_path(source, policy, where)
                part = {"type": "video" if video else "image", "video" if video else "image": source}
            elif kind != "text":
                raise APIError(400, f"{param}.type: unsupported content part type {kind!r} (text, image_url, "
                                    "video_url)", f"{param}.type")
            parts.append(part)
        checked.append({**message, "content": parts})
    return checked

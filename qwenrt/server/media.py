"""Where images and video in a chat request may come from: `data:` URIs and http(s) URLs always; local files
(`file://` URLs or paths) only under the directory the operator allowed (vLLM's --allowed-local-media-path)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from qwenrt.multimodal import IMAGE_PART_TYPES, VIDEO_PART_TYPES
from qwenrt.server.errors import APIError


def _local_path(source: str, allowed: Path | None, param: str) -> str:
    path = unquote(urlparse(source).path) if source.startswith("file:") else source
    if allowed is None:
        raise APIError(400, f"{param}: local files are not served (start the server with --allowed-local-media-path "
                            "to allow a directory); use a data: URI or an http(s) URL", param)
    resolved = Path(os.path.realpath(path))
    if not resolved.is_relative_to(allowed):
        raise APIError(400, f"{param}: {path} is outside the allowed media directory {allowed}", param)
    return str(resolved)


def _source(part: dict, kind: str, param: str):
    value = part.get(kind)
    if isinstance(value, dict):
        value, param = value.get("url"), f"{param}.{kind}.url"
    else:
        param = f"{param}.{kind}"
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: expected a URL string", param)
    return value, param


def check_media(messages: list[dict], allowed: Path | None) -> list[dict]:
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
                if source.startswith("data:") or source.startswith(("http://", "https://")):
                    if video:
                        raise APIError(400, f"{where}: video is read from local files only", where)
                else:
                    source = _local_path(source, allowed, where)
                part = {"type": "video" if video else "image", "video" if video else "image": source}
            elif kind != "text":
                raise APIError(400, f"{param}.type: unsupported content part type {kind!r} (text, image_url, "
                                    "video_url)", f"{param}.type")
            parts.append(part)
        checked.append({**message, "content": parts})
    return checked

"""GGUF file names: split sets (`NAME-0000i-of-0000N.gguf`), quantization tags (`...-Q4_K_M.gguf`), and which of a
hub repo's files a model name `OWNER/REPO:TAG` (llama.cpp's `-hf owner/repo:quant`) or `OWNER/REPO/PATH.gguf`
means."""

from __future__ import annotations

import re
from dataclasses import dataclass

from qwenrt.errors import QwenrtError

SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
HUB_GGUF = re.compile(r"^([\w-][\w.-]*/[\w.-]+)(?::([\w.-]+)|/([^:]+\.gguf))$", re.IGNORECASE)
# files beside the model that llama.cpp's downloader never takes for it: vision projectors, importance matrices,
# draft models
SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)  # llama.cpp's: the name's last part, "Q4_K_M" in "x-Q4_K_M"
LISTED = 20  # names an error message shows at most


@dataclass(frozen=True)
class HubGGUF:
    """A GGUF model on the hub: the file of `repo` tagged `tag`, or its file at path `file`."""

    repo: str
    tag: str | None = None
    file: str | None = None


def hub_gguf(name: str) -> HubGGUF | None:
    """`OWNER/REPO:TAG` or `OWNER/REPO/PATH.gguf` parsed; None for any other name."""
    m = HUB_GGUF.match(name)
    return HubGGUF(m.group(1), m.group(2), m.group(3)) if m else None


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def is_model_file(path: str) -> bool:
    """Whether `path` is a .gguf file of a model, not one of the files beside it (SIDECARS)."""
    base = _base(path).lower()
    return base.endswith(".gguf") and not any(s in base for s in SIDECARS)


def split_sets(paths: list[str]) -> dict[str, list[str]]:
    """The .gguf files among `paths` grouped into sets, {first part: its parts in order}: a split set's parts
    together, any other file alone."""
    sets: dict[tuple, list[str]] = {}
    for path in sorted(p for p in paths if p.lower().endswith(".gguf")):
        m = SPLIT.match(path)
        sets.setdefault((m.group(1), m.group(3)) if m else (path,), []).append(path)
    return {parts[0]: parts for parts in sets.values()}


def quant_tag(path: str) -> str:
    """The tag a file's name ends with ("Q4_K_M" for x-Q4_K_M-00001-of-00002.gguf), else its name."""
    base = _base(path)
    split = SPLIT.match(base)
    tag = TAG.search(split.group(1) if split else base[:-len(".gguf")])
    return tag.group(1).upper() if tag else base


def quant_tags(files: list[str]) -> list[str]:
    """The tags of the model files among `files` (vision projectors and other sidecars aside), sorted."""
    return sorted({quant_tag(first) for first in split_sets([f for f in files if is_model_file(f)])})


def is_tagged(path: str, tag: str) -> bool:
    """Whether the name carries `tag` (any case) as a whole part: Q4_K in x-Q4_K.gguf, not in x-Q4_K_M.gguf."""
    return re.search(rf"(?:^|[-.]){re.escape(tag)}(?=[-.])", _base(path), re.IGNORECASE) is not None


def _some(names: list[str]) -> str:
    more = f", and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more


def pick(spec: HubGGUF, files: list[str], where: str = "") -> list[str]:
    """The repo files `spec` means, from the repo's file list `files`: the one model file tagged spec.tag (vision
    projectors and other sidecars aside), or spec.file; all parts of a split set. `where` qualifies the list in
    messages (e.g. " in the local cache")."""
    if spec.file is not None:
        sets = split_sets(files)
        chosen = [first for first, parts in sets.items() if spec.file in parts]
        if not chosen:
            listed = _some(list(sets)) or "none"
            raise QwenrtError(f"{spec.repo} has no file {spec.file}{where}; its GGUF files: {listed}")
        return sets[chosen[0]]
    sets = split_sets([f for f in files if is_model_file(f)])
    if not sets:
        raise QwenrtError(f"{spec.repo} has no GGUF model files{where}")
    chosen = [first for first in sets if is_tagged(first, spec.tag)]
    if not chosen:
        raise QwenrtError(f"{spec.repo} has no GGUF file tagged {spec.tag}{where}; it has {_some(quant_tags(files))}")
    if len(chosen) > 1:
        raise QwenrtError(f"{spec.repo}: {len(chosen)} GGUF files are tagged {spec.tag}{where} ({_some(chosen)}); "
                          f"name one as {spec.repo}/PATH")
    return sets[chosen[0]]


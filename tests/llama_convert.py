"""llama.cpp's own Hugging Face -> GGUF converter (convert_hf_to_gguf.py), for checking qwenrt's GGUF support
against the files llama.cpp users make, and llama.cpp's tokenizer test data for Qwen3.5 and for Qwen2's tokenizer,
which Qwen3-VL and Qwen3-Next keep (models/ggml-vocab-qwen35.gguf, ggml-vocab-qwen2.gguf: vocabulary-only files, with
the test's texts in .inp and llama.cpp's token ids for them in .out).

The converter is pure Python. Its source comes from $QWENRT_LLAMA_CPP_SRC (a llama.cpp source tree) or from the
llama-cpp-python sdist on PyPI (which vendors llama.cpp with Qwen3.5 support), downloaded once into
~/.cache/qwenrt-tests/ (the converter, its conversion/ package, its gguf-py and the vocabulary test files: ~8 MB of
the 76 MB archive).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
CACHE = Path.home() / ".cache" / "qwenrt-tests" / "llama.cpp-0.3.36"
VOCAB = "models/ggml-vocab-qwen35.gguf"  # and its .inp and .out beside it
VOCAB_QWEN2 = "models/ggml-vocab-qwen2.gguf"
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", VOCAB, VOCAB_QWEN2)
VENDORED = "vendor/llama.cpp/"

# run the converter; where `pre` is given, answer its pre-tokenizer check with it (the converter recognises a
# tokenizer by hashing its output on a test text: a small tokenizer with Qwen3.5's rules is not the one it knows).
# Qwen2's vocabulary (Qwen3-VL's, Qwen3-Next's) is read as with sentencepiece installed and no tokenizer.model: the
# converter tries sentencepiece first and takes the BPE on its FileNotFoundError, where a missing module raises another
RUNNER = """
import sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base, conversion.qwen
conversion.qwen.Qwen2Model.set_vocab = lambda self: self._set_vocab_gpt2()
if pre:
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
convert_hf_to_gguf.main()
"""


def converter_source() -> Path:
    """A directory holding convert_hf_to_gguf.py, conversion/, gguf-py/ and models/ggml-vocab-qwen{35,2}.gguf*."""
    given = os.environ.get("QWENRT_LLAMA_CPP_SRC")
    if given:
        return Path(given)
    if not all((CACHE / name).is_file() for name in ("convert_hf_to_gguf.py", VOCAB + ".out", VOCAB_QWEN2 + ".out")):
        _fetch()
    return CACHE


def _fetch() -> None:
    """KEEP's files of the sdist into CACHE: a new cache whole, an older one (from before the vocabulary files)
    given only what it lacks, as other test runs may be reading it."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", tmp], check=True)
        archive = next(Path(tmp).glob("*.tar.gz"))
        staging = CACHE.with_name(CACHE.name + ".partial")
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                inner = member.name.split("/", 1)[-1]
                if inner.startswith(VENDORED) and inner[len(VENDORED):].startswith(KEEP) and member.isfile():
                    member.name = inner[len(VENDORED):]
                    tar.extract(member, staging, filter="data")
    if not CACHE.exists():
        staging.rename(CACHE)
        return
    for file in sorted(f for f in staging.rglob("*") if f.is_file()):
        if not (CACHE / file.relative_to(staging)).exists():
            os.renames(file, CACHE / file.relative_to(staging))
    shutil.rmtree(staging, ignore_errors=True)


def convert(checkpoint: Path, out: Path, outtype: str, pre: str | None = None, *options: str) -> Path:
    """Convert checkpoint directory -> GGUF file `out` (outtype f32, f16, bf16 or q8_0) with llama.cpp's converter
    (options: more of its flags, e.g. --vocab-only, or --mmproj for the vision projector file)."""
    src = converter_source()
    subprocess.run([sys.executable, "-c", RUNNER, str(src), pre or "", str(checkpoint), "--outtype", outtype,
                    "--outfile", str(out), *options], check=True, capture_output=True, text=True)
    return out

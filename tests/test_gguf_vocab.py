"""qwenrt's tokenizer built from a GGUF file's metadata against llama.cpp's own tokenizer tests for the `qwen35`
and `qwen2` pre-tokenizers (tests/test-tokenizer-0.cpp on models/ggml-vocab-qwen35.gguf and ggml-vocab-qwen2.gguf,
151,936-token vocabularies; qwen2 is Qwen3-VL's and Qwen3-Next's): the texts of each .inp file against the ids of its
.out file, which llama.cpp's tokenizer gives (no BOS added; none of the texts holds special-token text).

One difference, kept on purpose: Qwen's tokenizers normalize text to NFC first (their tokenizer.json, transformers'
tokenizers, Qwen's own tiktoken encoder) and qwenrt does so for a GGUF file too; llama.cpp does not. The texts
NFC changes (a letter followed by a combining accent) differ, and only those: without NFC, qwenrt gives llama.cpp's
ids for every text."""

from __future__ import annotations

import dataclasses
import json
import unicodedata

import pytest

from qwenrt.gguf.metadata import Metadata, tokenizer_parts
from qwenrt.gguf.reader import FileReader
from qwenrt.tokenizer import Tokenizer
from tests.llama_convert import VOCAB, VOCAB_QWEN2, converter_source

SEPARATOR = "\n__ggml_vocab_test__\n"  # between the .inp texts, and after the last


@pytest.fixture(scope="module", params=[VOCAB, VOCAB_QWEN2], ids=["qwen35", "qwen2"])
def vocab(request):
    return converter_source() / request.param


@pytest.fixture(scope="module")
def cases(vocab) -> list[tuple[str, list[int]]]:
    """(text, llama.cpp's ids) of each test, read as test-tokenizer-0.cpp reads them."""
    texts = vocab.with_name(vocab.name + ".inp").read_bytes().decode("utf-8").split(SEPARATOR)
    ids = vocab.with_name(vocab.name + ".out").read_text("utf-8").split("\n")
    assert texts[-1] == "" and ids[-1] == "" and len(texts) == len(ids)
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts[:-1], ids[:-1])]


@pytest.fixture(scope="module")
def parts(vocab):
    return tokenizer_parts(Metadata(FileReader(vocab, "r").fields, vocab))


# per file: its number of texts, and the first characters of those NFC changes (the qwen2 test has none)
EXPECTED = {VOCAB: (50, ["e\u0301", "re\u0301sume\u0301", "a\u0300" * 4]), VOCAB_QWEN2: (46, [])}


def test_every_text_of_llama_cpps_test_encodes_to_its_ids_but_for_nfc(vocab, cases, parts):
    count, normalized = next(v for name, v in EXPECTED.items() if vocab.name == name.rsplit("/", 1)[-1])
    ours = Tokenizer(parts)
    assert len(cases) == count and not any("<|" in text for text, _ in cases)
    differ = [text for text, ids in cases if ours.encode(text) != ids]
    assert differ == [text for text, _ in cases if unicodedata.normalize("NFC", text) != text]
    assert [text[:8] for text in differ] == normalized
    assert all(ours.encode(text) == ours.encode(unicodedata.normalize("NFC", text)) for text in differ)
    backend = json.loads(parts.backend_json) | {"normalizer": None}
    unnormalized = Tokenizer(dataclasses.replace(parts, backend_json=json.dumps(backend)))
    assert all(unnormalized.encode(text) == ids for text, ids in cases)

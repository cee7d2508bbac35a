"""Hostile or broken GGUF files get one line each, before any weight is read: not GGUF, truncated, a tensor past
the end, an overflowing shape, the wrong architecture, a missing tensor, metadata of the wrong type, a metadata
array longer than the file, an unreadable tensor type, a split set with a part missing."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from qwenrt.default_model import default_model_path
from qwenrt.errors import QwenrtError
from qwenrt.inspect import inspect_checkpoint
from tests.llama_convert import convert
from tests.test_checkpoint_errors import expect_error


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return convert(default_model_path(), tmp_path_factory.mktemp("gguf") / "tiny.gguf", "f32", "qwen35")


def rewrite(src, dst, drop=(), fields=None, tensor_types=None):
    """A copy of GGUF file src with tensors `drop` left out, metadata `fields` ({key: (value, type, sub_type)})
    replaced or added, and the tensors in `tensor_types` ({name: raw type}) relabelled."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    fields = fields or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in fields:
            continue
        kinds = field.types
        writer.add_key_value(key, field.contents(), kinds[0], kinds[-1] if kinds[0] == GGUFValueType.ARRAY else None)
    for key, (value, kind, sub) in fields.items():
        writer.add_key_value(key, value, kind, sub)
    for t in reader.tensors:
        if t.name in drop:
            continue
        kind = (tensor_types or {}).get(t.name, t.tensor_type)
        writer.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(n) for n in t.shape])) if
                          kind != t.tensor_type else None, raw_dtype=kind if kind != t.tensor_type else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def tensor_info_offset(data: bytes, name: str) -> int:
    """Where tensor `name`'s info (after its name: n_dims u32, dims u64 each, type u32, offset u64) starts."""
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded)
    return at + 8 + len(encoded)


def test_not_gguf_or_missing(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + bytes(28))
    expect_error(bad, f"{bad}: not a readable GGUF file")
    expect_error(tmp_path / "Missing.GGUF", "GGUF file not found")
    expect_error("org/model.gguf", "GGUF file not found")  # a .gguf name is never a hub repo id
    with pytest.raises(QwenrtError, match="not a readable GGUF file"):
        inspect_checkpoint(bad)


def test_truncated_and_tensors_past_the_end(good, tmp_path):
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    expect_error(cut, f"{cut}: not a readable GGUF file (tensor 'blk.6.nextn.enorm.weight' lies past the end of the "
                      "file (truncated?))")
    for where, value, name in ((4 + 8 + 4, 1 << 40, "offset"), (4, 1 << 62, "shape")):
        edited = bytearray(data)
        at = tensor_info_offset(data, "blk.0.ssm_a") + where  # ssm_a: 1-D, so dims is one u64
        edited[at:at + 8] = struct.pack("<Q", value)
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(bytes(edited))
        expect_error(bad, f"{bad}: not a readable GGUF file (tensor 'blk.0.ssm_a' ",
                     "lies past the end" if name == "offset" else "has an impossible shape")


def test_wrong_architecture_missing_tensor_and_unknown_tensor(good, tmp_path):
    llama = rewrite(good, tmp_path / "llama.gguf", fields={"general.architecture": ("llama", GGUFValueType.STRING,
                                                                                      None)})
    expect_error(llama, "GGUF architecture 'llama' is not supported (supported: qwen35, qwen35moe")
    missing = rewrite(good, tmp_path / "missing.gguf", drop=("blk.1.ssm_a",))
    expect_error(missing, f"{missing}: missing 1 tensor(s): blk.1.ssm_a")
    no_mtp = rewrite(good, tmp_path / "mtp.gguf", drop=("blk.6.nextn.eh_proj.weight",))
    expect_error(no_mtp, "the MTP block is incomplete: missing blk.6.nextn.eh_proj.weight")


def test_metadata_of_the_wrong_type_or_too_long(good, tmp_path):
    typed = rewrite(good, tmp_path / "typed.gguf", fields={"qwen35.block_count": ("seven", GGUFValueType.STRING,
                                                                                   None)})
    expect_error(typed, "GGUF metadata key 'qwen35.block_count' must be an integer, got STRING")
    data = bytearray(good.read_bytes())
    key = b"tokenizer.ggml.token_type"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4  # value type, item type, then count
    data[at:at + 8] = struct.pack("<Q", 1 << 50)
    huge = tmp_path / "huge.gguf"
    huge.write_bytes(bytes(data))
    expect_error(huge, f"{huge}: not a readable GGUF file (a metadata array of {1 << 50} INT32 runs past the end")


def test_a_tensor_type_qwenrt_does_not_read_is_named(good, tmp_path):
    # 4 F32 values are 16 bytes; as Q2_K that is not even a block, so the type check must come before any read
    bad = rewrite(good, tmp_path / "q2k.gguf", tensor_types={"blk.0.ssm_a": GGMLQuantizationType.I32})
    expect_error(bad, "tensor 'blk.0.ssm_a' is I32, a type qwenrt does not read (it reads F32, F16, BF16, Q8_0")


def test_a_split_set_with_a_part_missing(tmp_path):
    first = tmp_path / "model-00001-of-00002.gguf"
    first.write_bytes(b"GGUF")
    expect_error(first, "split GGUF part(s) missing: model-00002-of-00002.gguf")

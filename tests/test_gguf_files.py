"""Where GGUF files come from: a hub repo's file by its quantization tag (`OWNER/REPO:Q4_K_M`: any case, vision
projectors aside, every part of a split set) or by its path (`OWNER/REPO/PATH.gguf`), only those downloaded, found
in the cache with HF_HUB_OFFLINE set; and split `-0000i-of-0000N.gguf` sets, which load as their whole file. No
network: the hub's listing and download are faked."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGUFValueType, GGUFWriter

import qwenrt
from qwenrt.catalog import pull
from qwenrt.default_model import default_model_path
from qwenrt.errors import QwenrtError
from qwenrt.gguf.names import HubGGUF, hub_gguf, pick
from qwenrt.gguf.reader import FileReader
from qwenrt.hub import resolve_model_path
from tests.llama_convert import convert
from tests.test_cli import qwenrt_cli
from tests.test_sources import REVISION

REPO = "someone/Qwen3.5-Tiny-GGUF"
# an unsloth-style repo: quantizations side by side, vision projectors, a split set in a folder
LISTING = [".gitattributes", "README.md", "config.json", "Qwen3.5-Tiny-BF16.gguf", "Qwen3.5-Tiny-Q4_K_M.gguf",
           "Qwen3.5-Tiny-Q4_K_S.gguf", "Qwen3.5-Tiny-UD-Q4_K_XL.gguf", "Qwen3.5-Tiny-Q8_0.gguf", "mmproj-BF16.gguf",
           "mmproj-F16.gguf", "Q6_K/Qwen3.5-Tiny-Q6_K-00002-of-00002.gguf",
           "Q6_K/Qwen3.5-Tiny-Q6_K-00001-of-00002.gguf"]
PARTS = ["Q6_K/Qwen3.5-Tiny-Q6_K-00001-of-00002.gguf", "Q6_K/Qwen3.5-Tiny-Q6_K-00002-of-00002.gguf"]
PROMPT = [[5, 77, 301, 12, 9, 450, 33, 2, 101, 260, 17, 88]]


def test_the_names_of_hub_gguf_files():
    assert hub_gguf("someone/repo:Q4_K_M") == HubGGUF("someone/repo", tag="Q4_K_M")
    assert hub_gguf("someone/repo/Q6_K/x-00001-of-00002.gguf") == HubGGUF("someone/repo",
                                                                          file="Q6_K/x-00001-of-00002.gguf")
    for other in ("someone/repo", "someone/model.gguf", "./someone/repo/x.gguf", "/abs/repo/x.gguf", "~/repo/x.gguf",
                  "someone/repo:", "someone/repo:a:b", "someone/repo/x.safetensors"):
        assert hub_gguf(other) is None, other


def test_a_tag_picks_the_one_model_file_carrying_it():
    def files(tag):
        return pick(HubGGUF(REPO, tag=tag), LISTING)

    assert files("q4_k_m") == ["Qwen3.5-Tiny-Q4_K_M.gguf"]  # not Q4_K_S or Q4_K_XL
    assert files("BF16") == ["Qwen3.5-Tiny-BF16.gguf"]  # not mmproj-BF16
    assert files("UD-Q4_K_XL") == files("Q4_K_XL") == ["Qwen3.5-Tiny-UD-Q4_K_XL.gguf"]
    assert files("Q6_K") == PARTS
    assert pick(HubGGUF(REPO, file=PARTS[1]), LISTING) == PARTS  # a part by its path: the whole set
    assert pick(HubGGUF(REPO, file="mmproj-F16.gguf"), LISTING) == ["mmproj-F16.gguf"]  # named: taken as is


def test_no_file_or_several_carry_the_tag_in_one_line():
    with pytest.raises(QwenrtError, match=rf"^{REPO} has no GGUF file tagged Q4_K; it has BF16, Q4_K_M, Q4_K_S, "
                                          r"Q4_K_XL, Q6_K, Q8_0$"):
        pick(HubGGUF(REPO, tag="Q4_K"), LISTING)
    twice = LISTING + ["old/Qwen3.5-Tiny-Q8_0.gguf"]
    with pytest.raises(QwenrtError, match=rf"^{REPO}: 2 GGUF files are tagged Q8_0 \(Qwen3.5-Tiny-Q8_0.gguf, "
                                          rf"old/Qwen3.5-Tiny-Q8_0.gguf\); name one as {REPO}/PATH$"):
        pick(HubGGUF(REPO, tag="Q8_0"), twice)
    with pytest.raises(QwenrtError, match=rf"^{REPO} has no GGUF model files in the local cache$"):
        pick(HubGGUF(REPO, tag="F16"), ["README.md", "mmproj-F16.gguf"], " in the local cache")
    with pytest.raises(QwenrtError, match=rf"^{REPO} has no file Q8_0.gguf; its GGUF files: Q6_K/Qwen3.5-Tiny-Q6_K-"
                                          r"00001-of-00002.gguf, Qwen3.5-Tiny-BF16.gguf, .*, mmproj-F16.gguf$"):
        pick(HubGGUF(REPO, file="Q8_0.gguf"), LISTING)


def split(whole, first, max_tensors: int, small_first_shard: bool = False) -> list:
    """GGUF file `whole` rewritten as a split set named after `first` (NAME.gguf -> NAME-0000i-of-0000N.gguf) of at
    most `max_tensors` tensors a part, as llama.cpp's gguf-split writes it: the metadata in the first part, the
    split.no / split.count / split.tensors.count keys in every part. Returns the parts."""
    reader = FileReader(whole)
    writer = GGUFWriter(first, reader.fields["general.architecture"].contents(), split_max_tensors=max_tensors,
                        small_first_shard=small_first_shard)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            kind = field.types
            writer.add_key_value(key, field.contents(), kind[0], kind[-1] if kind[0] == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)  # quantized data: its bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(first)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The built-in model as llama.cpp's converter writes it (Q8_0 blocks and F32 norms)."""
    return convert(default_model_path(), tmp_path_factory.mktemp("gguf") / "tiny.gguf", "q8_0", "qwen35")


@pytest.fixture(scope="module")
def whole(tiny_gguf):
    model, _ = qwenrt.load(tiny_gguf, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor(PROMPT)).float()


@pytest.mark.parametrize("small_first_shard", [False, True])
def test_a_split_set_loads_as_its_whole_file(tiny_gguf, whole, tmp_path, small_first_shard):
    parts = split(tiny_gguf, tmp_path / "tiny.gguf", 40, small_first_shard)
    assert len(parts) > 2 and parts[0].name == f"tiny-00001-of-{len(parts):05d}.gguf"
    for named in (parts[0], parts[-1]):  # the first part, or any
        model, tokenizer = qwenrt.load(named, dtype=torch.float32)
        with torch.inference_mode():
            assert torch.equal(model(torch.tensor(PROMPT)).float(), whole)
        assert tokenizer is not None


@pytest.fixture
def fake_hub(tiny_gguf, tmp_path, monkeypatch):
    """huggingface_hub's listing and download faked: LISTING served, each .gguf a copy of the tiny model (the Q6_K
    set its split parts), downloads into a snapshot folder and recorded in the returned list."""
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    snapshot, fetched = tmp_path / "snapshot", []
    parts = split(tiny_gguf, tmp_path / "tiny.gguf", 60)
    sources = {f: tiny_gguf for f in LISTING if f.endswith(".gguf")} | dict(zip(PARTS, parts))

    def list_repo_files(repo, revision=None):
        if repo != REPO:
            raise RepositoryNotFoundError("404", response=SimpleNamespace(headers={}, status_code=404, request=None))
        return LISTING

    def hf_hub_download(repo, filename, revision=None, local_files_only=False):
        fetched.append((filename, revision, local_files_only))
        (snapshot / filename).parent.mkdir(parents=True, exist_ok=True)
        return str(shutil.copyfile(sources[filename], snapshot / filename))

    def snapshot_download(repo, revision=None, allow_patterns=None, local_files_only=False):
        (snapshot / "config.json").write_text("{}")  # as some GGUF repos have one
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    snapshot.mkdir()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return fetched


def test_a_tag_downloads_that_file_only_and_loads_it(fake_hub, whole):
    model, tokenizer = qwenrt.load(f"{REPO}:q8_0", dtype=torch.float32, revision="v1")
    assert fake_hub == [("Qwen3.5-Tiny-Q8_0.gguf", "v1", False)] and tokenizer is not None
    with torch.inference_mode():
        assert torch.equal(model(torch.tensor(PROMPT)).float(), whole)
    fake_hub.clear()
    qwenrt.load(f"{REPO}:Q6_K", dtype=torch.float32)  # a split set: every part
    assert fake_hub == [(PARTS[0], None, False), (PARTS[1], None, False)]
    fake_hub.clear()
    qwenrt.load(f"{REPO}/{PARTS[1]}", dtype=torch.float32)
    assert fake_hub == [(PARTS[0], None, False), (PARTS[1], None, False)]
    fake_hub.clear()
    pulled = pull(f"{REPO}:Q8_0")
    assert fake_hub == [("Qwen3.5-Tiny-Q8_0.gguf", None, False)]
    assert pulled.startswith(f"{REPO}:Q8_0: ") and pulled.endswith("/snapshot/Qwen3.5-Tiny-Q8_0.gguf")


def test_a_missing_tag_or_file_or_a_gguf_repo_alone_is_one_line_and_downloads_nothing(fake_hub):
    with pytest.raises(QwenrtError, match=f"^{REPO} has no GGUF file tagged IQ4_XS; it has BF16, Q4_K_M"):
        qwenrt.load(f"{REPO}:IQ4_XS")
    with pytest.raises(QwenrtError, match=f"^{REPO} has no file Q8_0/x.gguf; its GGUF files: "):
        qwenrt.load(f"{REPO}/Q8_0/x.gguf")
    with pytest.raises(QwenrtError, match=r"^GGUF file not found: models/tiny/x.gguf \(nor a file of a hub repo "
                                          r"models/tiny\)$"):  # a local path mistyped
        qwenrt.load("models/tiny/x.gguf")
    with pytest.raises(QwenrtError, match="^someone/nothing:Q8_0: no such repository on the hub"):
        qwenrt.load("someone/nothing:Q8_0")
    with pytest.raises(QwenrtError, match=rf"^{REPO} holds GGUF files, not a checkpoint: name one as {REPO}:QUANT "
                                          r"\(it has BF16, Q4_K_M, Q4_K_S, Q4_K_XL, Q6_K, Q8_0\)$"):
        qwenrt.load(REPO)  # the repo alone: its checkpoint, which it does not have
    with pytest.raises(QwenrtError, match=f"^{REPO} holds GGUF files, not a checkpoint"):
        pull(REPO)
    assert fake_hub == []


@pytest.fixture
def cached_repo(tiny_gguf, tmp_path):
    """REPO in a Hugging Face cache at tmp_path/hub as huggingface_hub lays it out, holding its Q8_0 file and a vision
    projector; returns the Q8_0 file's path."""
    snapshot = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    shutil.copyfile(tiny_gguf, snapshot / "Qwen3.5-Tiny-Q8_0.gguf")
    (snapshot / "mmproj-F16.gguf").write_bytes(b"GGUF")  # never opened
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(REVISION)
    return snapshot / "Qwen3.5-Tiny-Q8_0.gguf"


def test_offline_a_tag_is_found_in_the_cache(cached_repo, tmp_path):
    """HF_HUB_OFFLINE set: the repo's cached files are the list; what is not there is named in one line."""
    env = {"HF_HUB_CACHE": tmp_path / "hub", "HF_HUB_OFFLINE": "1"}
    found = qwenrt_cli("inspect", f"{REPO}:Q8_0", "--json", "--no-finite-check", **env)
    assert found.returncode == 0 and str(cached_repo) in found.stdout, found
    missing = qwenrt_cli("run", f"{REPO}:Q4_K_M", "hi", **env)
    assert missing.returncode == 1 and missing.stderr == (f"qwenrt: error: {REPO} has no GGUF file tagged Q4_K_M in "
                                                          "the local cache; it has Q8_0\n"), missing
    absent = qwenrt_cli("pull", "someone/elsewhere:Q8_0", **env)
    assert absent.returncode == 1 and absent.stderr.startswith(
        "qwenrt: error: someone/elsewhere:Q8_0: not in the local cache and HF_HUB_OFFLINE is set; fetch it where "
        "there is network (`qwenrt pull someone/elsewhere:Q8_0`)"), absent


def test_with_the_hub_unreachable_the_cache_is_used(cached_repo, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    def unreachable(repo, revision=None):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", unreachable)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert resolve_model_path(f"{REPO}:q8_0") == resolve_model_path(f"{REPO}/Qwen3.5-Tiny-Q8_0.gguf") == cached_repo
    with pytest.raises(QwenrtError, match=r"^someone/elsewhere:Q8_0: not in the local cache and the hub cannot be "
                                          r"reached \(no network\?\)"):
        resolve_model_path("someone/elsewhere:Q8_0")

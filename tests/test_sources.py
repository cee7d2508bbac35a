"""Model and media sources: the hub cache (offline), `qwenrt list` and `pull`, image URLs served on loopback."""

import functools
import http.server
import json
import shutil
import threading

import numpy as np
import pytest
from PIL import Image

import qwenrt
from qwenrt.default_model import DEFAULT_MODEL, default_model_path
from qwenrt.errors import QwenrtError
from qwenrt.units import human
from qwenrt.vision import load_image
from tests.test_cli import qwenrt_cli


REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root, repo, files_from):
    """Lay a checkpoint out as huggingface_hub's cache does: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo_dir = root / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files_from, repo_dir / "snapshots" / REVISION)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(REVISION)


def test_hub_repo_id_from_cache_offline(chat_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fake_hub_cache(tmp_path, "Qwen/Qwen3.5-Tiny", chat_ckpt[0])
    model, tok = qwenrt.load("Qwen/Qwen3.5-Tiny", dtype="float32")
    assert tok is not None and model.config.text.vocab_size == 248320
    with pytest.raises(QwenrtError, match="not in the local cache and HF_HUB_OFFLINE is set"):
        qwenrt.load("Qwen/Not-Downloaded")


def test_list_shows_the_builtin_model_and_the_qwen35_checkpoints_in_the_hub_cache(tmp_path):
    fake_hub_cache(tmp_path, "someone/tiny-qwen", default_model_path())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fake_hub_cache(tmp_path, "someone/llama", tmp_path / "other")  # not a model qwenrt runs: not listed
    snapshot = tmp_path / "hub" / "models--someone--tiny-qwen" / "snapshots" / REVISION
    size = sum(p.stat().st_size for p in default_model_path().iterdir())
    listed = qwenrt_cli("list", "--json", HF_HUB_CACHE=tmp_path / "hub")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == [
        {"name": DEFAULT_MODEL, "model_type": "qwen3_5_text", "size": size, "path": str(default_model_path()),
         "source": "built-in"},
        {"name": "someone/tiny-qwen", "model_type": "qwen3_5_text", "size": size, "path": str(snapshot),
         "source": "hf-cache"}]
    table = qwenrt_cli("list", HF_HUB_CACHE=tmp_path / "hub").stdout.splitlines()
    assert [line.split() for line in table] == [["NAME", "TYPE", "SIZE", "PATH"],
                                               [DEFAULT_MODEL, "qwen3_5_text", human(size, "B"), str(default_model_path())],
                                               ["someone/tiny-qwen", "qwen3_5_text", human(size, "B"), str(snapshot)]]
    empty = qwenrt_cli("list", HF_HUB_CACHE=tmp_path / "nowhere")
    assert empty.returncode == 0 and len(empty.stdout.splitlines()) == 2


def test_pull_takes_only_qwen35_repos_and_refuses_offline_with_one_line(tmp_path):
    """No network here: what pull fetches is found in the cache, as HF_HUB_OFFLINE makes huggingface_hub look."""
    fake_hub_cache(tmp_path, "someone/tiny-qwen", default_model_path())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fake_hub_cache(tmp_path, "someone/llama", tmp_path / "other")
    env = {"HF_HUB_CACHE": tmp_path / "hub", "HF_HUB_OFFLINE": "1"}
    pulled = qwenrt_cli("pull", "someone/tiny-qwen", **env)  # already there: found offline
    size = sum(p.stat().st_size for p in default_model_path().iterdir())
    snapshot = tmp_path / "hub" / "models--someone--tiny-qwen" / "snapshots" / REVISION
    assert pulled.returncode == 0 and pulled.stdout == f"someone/tiny-qwen: {human(size, 'B')} in {snapshot}\n", pulled
    missing = qwenrt_cli("pull", "someone/not-here", **env)
    assert missing.returncode == 1 and missing.stdout == "", missing
    assert missing.stderr.startswith("qwenrt: error: someone/not-here: not in the local cache and HF_HUB_OFFLINE is "
                                     "set; fetch it where there is network") and missing.stderr.count("\n") == 1
    for name, message in [("./some/dir", "not a hub repo id like 'Qwen/Qwen3.5-0.8B'"),
                          ("someone/llama", "model_type 'llama', not a model qwenrt runs"),
                          (DEFAULT_MODEL, "is built in")]:
        run = qwenrt_cli("pull", name, **env)
        assert message in run.stdout + run.stderr and "Traceback" not in run.stderr, run


def test_not_a_repo_id():
    with pytest.raises(QwenrtError, match="no such directory"):
        qwenrt.load("./relative/missing/dir")


@pytest.fixture
def image_server(tmp_path):
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(tmp_path / "a.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_image_from_url(image_server):
    image = load_image(f"{image_server}/a.png")
    assert image.size == (60, 40) and image.getpixel((0, 0)) == (200, 200, 200)
    with pytest.raises(QwenrtError, match="404|not found|cannot"):
        load_image(f"{image_server}/missing.png")

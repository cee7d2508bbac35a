import os

import pytest
import torch

from tests import checkpoints

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` run only when asked for: QWENRT_LONG=1, or a -m expression naming them."""
    if os.environ.get("QWENRT_LONG") == "1" or "long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="long test: QWENRT_LONG=1 or -m long runs it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def _build(tmp_path_factory, name, builder):
    path = tmp_path_factory.mktemp(name)
    return path, builder(path)


@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory):
    """(path, transformers reference) of a tiny dense text checkpoint (tied embeddings)."""
    return _build(tmp_path_factory, "dense", checkpoints.build_dense)


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory):
    """A tiny MoE text checkpoint with per-expert tensors, as transformers 5.23 writes them."""
    return _build(tmp_path_factory, "moe", checkpoints.build_moe)


@pytest.fixture(scope="session")
def vlm_ckpt(tmp_path_factory):
    return _build(tmp_path_factory, "vlm", checkpoints.build_vlm)


@pytest.fixture(scope="session")
def qwen3_vl_ckpt(tmp_path_factory):
    """A tiny Qwen3-VL (DeepStack) with the real vocabulary, tokenizer and preprocessor configs."""
    return _build(tmp_path_factory, "qwen3-vl", checkpoints.build_qwen3_vl)


@pytest.fixture(scope="session")
def qwen3_vl_moe_ckpt(tmp_path_factory):
    """Its MoE sibling (no shared expert; layer 1 a dense MLP), as transformers 5.23 writes it."""
    return _build(tmp_path_factory, "qwen3-vl-moe", lambda path: checkpoints.build_qwen3_vl(path, moe=True))


@pytest.fixture(scope="session")
def published_ckpt(tmp_path_factory):
    """The published layout: MoE VLM prefix, fused experts, MTP tensors, bf16, two shards."""
    return _build(tmp_path_factory, "published", checkpoints.build_published_moe)


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory):
    """A tiny dense model with the real Qwen3.5 vocabulary, tokenizer and chat template."""
    return _build(tmp_path_factory, "chat", checkpoints.build_chat_model)


@pytest.fixture(scope="session")
def chat_model(chat_ckpt):
    """(model, tokenizer, transformers reference) for the chat checkpoint, fp32."""
    import qwenrt

    model, tokenizer = qwenrt.load(chat_ckpt[0], dtype="float32")
    return model, tokenizer, chat_ckpt[1]


@pytest.fixture(scope="session", params=["dense", "moe"])
def vlm_chat(request, tmp_path_factory):
    """(model, tokenizer, transformers reference, path) of a tiny VLM with the real vocabulary, dense and MoE."""
    import qwenrt

    path = tmp_path_factory.mktemp(f"vlm-chat-{request.param}")
    ref = checkpoints.build_chat_vlm(path, moe=request.param == "moe")
    model, tokenizer = qwenrt.load(path, dtype="float32")
    return model, tokenizer, ref, path

"""Qwen3-VL and Qwen3-VL-MoE against transformers 5.23: text, images and video with DeepStack, through the model,
chunked prefill and the engine."""

import pytest
import torch

import qwenrt
from qwenrt.prompt import prepare_prompt
from tests import checkpoints
from tests.numerics import rel_err
from qwenrt.multimodal import vision_embeddings
from tests.test_multimodal import CASES, ask, ours, picture, reference, reference_inputs


@pytest.fixture(scope="module", params=["qwen3_vl_ckpt", "qwen3_vl_moe_ckpt"])
def qwen3_vl(request):
    """(model fp32, tokenizer, transformers reference, path), dense and MoE."""
    path, ref = request.getfixturevalue(request.param)
    model, tokenizer = qwenrt.load(path, dtype="float32")
    return model, tokenizer, ref, path


def test_text_logits_match_reference(qwen3_vl):
    model, _, ref, _ = qwen3_vl
    ids = torch.randint(0, 248320, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    assert rel_err(model(ids), expected) <= 1e-4


@pytest.mark.parametrize("case", CASES)
def test_vision_logits_match_reference(qwen3_vl, case):
    model, tok, ref, _ = qwen3_vl
    prepared = prepare_prompt(model, tok, CASES[case])
    assert rel_err(ours(model, prepared), reference(ref, prepared)) <= 1e-4


def test_published_moe_layout_loads(tmp_path):
    """The hub's Qwen3-VL-MoE files: experts [E, D, 2I] / [E, I, D] and `num_experts` (here D = 2I: gate_up alone
    cannot tell the layouts apart)."""
    ref = checkpoints.build_qwen3_vl(tmp_path, moe=True, published=True)
    published, _ = qwenrt.load(tmp_path, dtype="float32")
    ids = torch.randint(0, 248320, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    assert rel_err(published(ids), expected) <= 1e-4


THREE_IMAGES = ask({"type": "image", "image": picture(64, 96, 20)}, {"type": "image", "image": picture(32, 32, 21)},
                   {"type": "image", "image": picture(120, 48, 22)}, text="Which differ?")


def test_three_images_of_different_sizes(qwen3_vl):
    model, tok, ref, _ = qwen3_vl
    prepared = prepare_prompt(model, tok, THREE_IMAGES)
    grids = prepared.vision.image_grid_thw.tolist()
    assert len(grids) == len(set(map(tuple, grids))) == 3
    assert rel_err(ours(model, prepared), reference(ref, prepared)) <= 1e-4


def test_deepstack_moves_the_logits(qwen3_vl):
    """Without DeepStack the image prompt's logits differ by O(1): the parity above rests on it."""
    model, tok, ref, _ = qwen3_vl
    prepared = prepare_prompt(model, tok, CASES["one image"])
    embeds, _ = vision_embeddings(model, torch.tensor([prepared.ids]), prepared.vision)
    without = model(inputs_embeds=embeds, position_ids=prepared.vision.position_ids)
    assert rel_err(without, reference(ref, prepared)) > 1e-2


@pytest.mark.parametrize("case", ["two images", "video"])
def test_greedy_generation_matches_reference(qwen3_vl, case):
    """Through the engine's cache, whole and in prefill chunks of 5 that split every image (DeepStack features
    sliced with them), and two prompts batched."""
    model, tok, ref, _ = qwen3_vl
    messages = CASES[case]
    prepared = prepare_prompt(model, tok, messages)
    with torch.no_grad():
        expected = ref.generate(**reference_inputs(ref, prepared), max_new_tokens=10, min_new_tokens=10,
                                do_sample=False, pad_token_id=248044)[0, len(prepared.ids):].tolist()
    assert qwenrt.complete(model, tok, messages, max_tokens=10).tokens == expected
    assert qwenrt.complete(model, tok, messages, max_tokens=10, prefill_chunk=5).tokens == expected
    other = [{"role": "user", "content": "Say something."}]
    batched = qwenrt.batch_generate(model, tok, [messages, other], max_tokens=10)
    assert batched[0].tokens == expected
    assert batched[1].tokens == qwenrt.complete(model, tok, other, max_tokens=10).tokens


def test_inspect_names_the_family(qwen3_vl_moe_ckpt, capsys):
    from qwenrt.cli import main

    assert main(["inspect", str(qwen3_vl_moe_ckpt[0])]) == 0
    out = capsys.readouterr().out
    assert "qwen3_vl_moe  (Qwen3-VL MoE VLM, DeepStack into 3 layers" in out
    assert "experts 8 (top-3) in 3 of 4 layers (the others dense)" in out  # no shared expert; layer 1 dense


def test_run_answers_through_the_cli(qwen3_vl_ckpt, capsys):
    from qwenrt.cli import main

    assert main(["run", str(qwen3_vl_ckpt[0]), "Hello", "--max-tokens", "4", "--temperature", "0"]) == 0
    assert "generated 4 tokens" in capsys.readouterr().err  # a random model's 4 tokens (maybe all thinking)


def test_processor_chat_template_file(qwen3_vl_ckpt, tmp_path):
    """Qwen3-VL repos may keep the template in chat_template.json (the processor's) only: it is read from there."""
    import json
    import shutil

    from qwenrt.errors import QwenrtError
    from qwenrt.tokenizer import load_tokenizer

    path = tmp_path / "ckpt"
    shutil.copytree(qwen3_vl_ckpt[0], path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": "<<{{ messages[0]['content'] }}>>"}))
    assert load_tokenizer(path).apply_chat_template([{"role": "user", "content": "hi"}]) == "<<hi>>"
    (path / "chat_template.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(QwenrtError, match="chat_template.json: chat_template must be a string"):
        load_tokenizer(path)


def test_quantized_copy_keeps_the_checkpoints_norms(tmp_path):
    """`qwenrt quantize` writes Qwen3-VL's norms as its checkpoints mean them (w·x), under its config: the copy loads
    as the source quantized at load does (the published expert layout comes out as transformers 5.23's)."""
    from qwenrt.convert import quantize_checkpoint

    src = tmp_path / "published"
    checkpoints.build_qwen3_vl(src, moe=True, published=True)
    ids = torch.randint(0, 248320, (1, 12), generator=torch.Generator().manual_seed(2))
    stored, _ = qwenrt.load(quantize_checkpoint(src, tmp_path / "q", 8), dtype="bfloat16")
    at_load, _ = qwenrt.load(src, dtype="bfloat16", quantize="int8")
    assert torch.equal(stored(ids), at_load(ids))

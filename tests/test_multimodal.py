"""Images and video through the decoder, against transformers' Qwen3.5 VLMs (dense and MoE)."""

import numpy as np
import pytest
import torch
from PIL import Image

import qwenrt
from qwenrt import QwenrtError
from qwenrt.errors import ContextLengthError
from qwenrt.prompt import prepare_prompt
from qwenrt.multimodal import vision_embeddings
from tests.numerics import rel_err


def picture(h, w, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def ask(*parts, text="Describe this."):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def ours(model, prepared):
    ids = torch.tensor([prepared.ids])
    embeds, deepstack = vision_embeddings(model, ids, prepared.vision)
    return model(inputs_embeds=embeds, position_ids=prepared.vision.position_ids, deepstack_embeds=deepstack or None)


def reference_inputs(ref, prepared):
    """transformers' model inputs; mm_token_type_ids marks text 0, image 1, video 2 (what its processor returns)."""
    ids = torch.tensor([prepared.ids])
    v, c = prepared.vision, ref.config
    types = (ids == c.image_token_id).long() + 2 * (ids == c.video_token_id).long()
    inputs = dict(input_ids=ids, mm_token_type_ids=types, pixel_values=v.pixel_values, image_grid_thw=v.image_grid_thw,
                  pixel_values_videos=v.pixel_values_videos, video_grid_thw=v.video_grid_thw)
    return {k: x for k, x in inputs.items() if x is not None}


def reference(ref, prepared):
    with torch.no_grad():
        return ref(**reference_inputs(ref, prepared)).logits


CASES = {
    "one image": ask({"type": "image", "image": picture(64, 96, 0)}),
    "two images": ask({"type": "image", "image": picture(64, 96, 1)},
                      {"type": "image_url", "image_url": {"url": picture(120, 40, 2)}}, text="Compare them."),
    "video": ask({"type": "video", "video": [picture(64, 64, 10 + i) for i in range(4)]}),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_reference(vlm_chat, case):
    model, tok, ref, _ = vlm_chat
    prepared = prepare_prompt(model, tok, CASES[case])
    n_vision = sum(t in (model.config.image_token_id, model.config.video_token_id) for t in prepared.ids)
    assert n_vision > 0 and prepared.vision.rope_delta < 0  # vision tokens advance positions by less than one each
    assert rel_err(ours(model, prepared), reference(ref, prepared)) <= 1e-4


@pytest.mark.parametrize("case", ["two images", "video"])
def test_greedy_generation_after_vision_matches_reference(vlm_chat, case):
    """Decoding continues at cache length + rope delta: a wrong position shows up within a few tokens."""
    model, tok, ref, _ = vlm_chat
    prepared = prepare_prompt(model, tok, CASES[case])
    with torch.no_grad():
        expected = ref.generate(**reference_inputs(ref, prepared), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False, pad_token_id=248044)[0, len(prepared.ids):].tolist()
    assert qwenrt.complete(model, tok, CASES[case], max_tokens=12).tokens == expected
    chunked = qwenrt.complete(model, tok, CASES[case], max_tokens=12, prefill_chunk=5)
    assert chunked.tokens == expected


def test_text_prompt_on_vlm_loads_no_vision(vlm_chat):
    _, _, _, path = vlm_chat
    model, tok = qwenrt.load(path, dtype="float32")
    qwenrt.generate(model, tok, [{"role": "user", "content": "Hi"}], max_tokens=2)
    assert getattr(model, "vision_encoder", None) is None
    qwenrt.generate(model, tok, CASES["one image"], max_tokens=2)
    assert model.vision_encoder is not None


def test_bad_vision_inputs(vlm_chat, tmp_path, chat_model):
    model, tok, _, _ = vlm_chat
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    cases = [
        (ask({"type": "image", "image": str(tmp_path / "missing.png")}), "missing.png"),
        (ask({"type": "image", "image": str(bad)}), "bad.png"),
        (ask({"type": "image", "image": Image.new("RGB", (0, 0))}), "zero"),
        (ask({"type": "image", "image": picture(4, 1000, 3)}), "aspect ratio"),
        ([{"role": "system", "content": [{"type": "image", "image": picture(64, 64, 4)}]},
          {"role": "user", "content": "hi"}], "System message cannot contain images"),
        (ask({"type": "image"}), "no 'image' or 'image_url' value"),
    ]
    for messages, fragment in cases:
        with pytest.raises(QwenrtError, match=fragment):
            qwenrt.generate(model, tok, messages, max_tokens=1)
    with pytest.raises(ContextLengthError, match="with its images/video expanded; the context limit is 20") as e:
        qwenrt.generate(model, tok, CASES["two images"], max_tokens=1, max_context=20)
    assert (e.value.limit, e.value.counted) == (20, True) and e.value.prompt_tokens > 20  # the server's 400 says so
    text_model, text_tok, _ = chat_model
    with pytest.raises(QwenrtError, match="no vision tower"):
        qwenrt.generate(text_model, text_tok, CASES["one image"], max_tokens=1)

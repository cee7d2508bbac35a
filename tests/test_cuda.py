"""qwenrt on a CUDA GPU: against transformers 5.23 and against itself on the CPU. Skipped where torch sees no GPU
(the CPU paths beside these are tested everywhere); run on a GPU machine with `python -m pytest tests/test_cuda.py`."""

import pytest
import torch

import qwenrt
from qwenrt.gguf.export import export_gguf
from qwenrt.sampling import SamplingParams
from tests.checkpoints import VOCAB
from tests.test_multimodal import CASES
from tests.test_qwen3_next import PROMPTS as NEXT_PROMPTS, build as build_next
from tests.test_yarn import reference as yarn_reference, yarn_copy
from tests.numerics import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = "cuda"
PROMPTS = ["What is 12 + 30?", "Name a colour.", "Count from one to five, then say the word done."]


def logits_on(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids.to(model.device)).float().cpu()


@pytest.mark.parametrize("kind", ["dense_ckpt", "moe_ckpt", "vlm_ckpt", "published_ckpt", "qwen3_vl_ckpt",
                                  "qwen3_vl_moe_ckpt"])
def test_logits_match_reference_on_cuda(kind, request):
    path, ref = request.getfixturevalue(kind)
    model, _ = qwenrt.load(path, dtype="float32", device=CUDA)
    ids = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(0))  # > two DeltaNet chunks
    with torch.no_grad():
        expected = ref(input_ids=ids).logits.float()
    assert rel_err(logits_on(model, ids), expected) <= 1e-4


@pytest.mark.parametrize("speculative", [0, 2])
def test_batched_greedy_on_cuda_equals_the_cpu(chat_ckpt, speculative):
    """Three prompts decoded together (with MTP drafts or without) on the GPU: the CPU's tokens, in fp32."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def tokens(device, k):
        model, tok = qwenrt.load(chat_ckpt[0], dtype="float32", device=device)
        return [c.tokens for c in qwenrt.batch_generate(model, tok, PROMPTS, params=params, speculative_tokens=k)]

    assert tokens(CUDA, speculative) == tokens("cpu", 0)


@pytest.mark.parametrize("file_type", ["q4_0", "q4_k_m", "q8_0"])
def test_gguf_blocks_on_cuda_are_the_cpus(chat_ckpt, tmp_path, file_type):
    """A GGUF file's blocks dequantized on the GPU: the CPU's logits in fp32, within bf16 rounding of them at "auto"."""
    path = export_gguf(chat_ckpt[0], tmp_path / f"m-{file_type}.gguf", file_type)
    ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(2))
    on = {device: qwenrt.load(path, dtype="float32", device=device)[0] for device in (CUDA, "cpu")}
    assert rel_err(logits_on(on[CUDA], ids), logits_on(on["cpu"], ids)) <= 1e-5
    bf16, _ = qwenrt.load(path, device=CUDA)  # "auto": bf16 for a quantized file
    assert bf16.dtype == torch.bfloat16
    assert rel_err(logits_on(bf16, ids[:, :1]), logits_on(on["cpu"], ids[:, :1])) < 0.05  # one bf16 position


def test_qwen3_next_logits_match_reference_on_cuda(tmp_path):
    """Qwen3-Next (fused projections split at load, dense and MoE layers, raw top-k) against transformers in fp64."""
    path, ref = build_next(tmp_path, norm_topk_prob=False, seed=11)
    model, _ = qwenrt.load(path, dtype="float32", device=CUDA)
    with torch.no_grad():
        expected = ref(input_ids=NEXT_PROMPTS).logits
    assert rel_err(logits_on(model, NEXT_PROMPTS), expected) <= 1e-4


@pytest.mark.parametrize("kind", ["qwen3_vl_ckpt", "qwen3_vl_moe_ckpt"])
def test_qwen3_vl_images_on_cuda_equal_the_cpu(kind, request):
    """Two images and a video beside a text prompt, with DeepStack, batched on the GPU: the CPU's greedy tokens."""
    path = request.getfixturevalue(kind)[0]
    prompts = [CASES["two images"], CASES["video"], [{"role": "user", "content": "Say something."}]]

    def tokens(device):
        model, tok = qwenrt.load(path, dtype="float32", device=device)
        return [c.tokens for c in qwenrt.batch_generate(model, tok, prompts, max_tokens=10)]

    assert tokens(CUDA) == tokens("cpu")


def test_yarn_past_the_original_context_on_cuda(dense_ckpt, tmp_path):
    """YaRN (original context 64, factor 4) over 200 tokens on the GPU: transformers' logits, whole and chunked."""
    path = yarn_copy(dense_ckpt[0], tmp_path / "yarn")
    model, _ = qwenrt.load(path, dtype="float32", device=CUDA)
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = yarn_reference(path)(input_ids=ids).logits.float()
    assert rel_err(logits_on(model, ids), expected) <= 1e-4
    cache, pieces = model.new_cache(1), []
    with torch.inference_mode():
        for start in range(0, 200, 64):
            pieces.append(model(ids[:, start:start + 64].to(CUDA), cache=cache).float().cpu())
    assert rel_err(torch.cat(pieces, 1), expected) <= 1e-4

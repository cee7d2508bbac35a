"""A whole long context on a tiny model (one DeltaNet and one full-attention layer): prefill in chunks of one size
and of another gives the same last logits and the same decoded logits after it, within a bounded peak RSS.

At 262,144 tokens (marked `long`: about a minute on 2 cores) attention's cost is the N²/2 of its prefill; the memory
of a step is the KV cache (256 B per token here) and the native tiled attention's scratch (a few MiB, whatever the
context: no [T, S] scores or mask).
"""

import re
import time
from pathlib import Path

import pytest
import torch

import qwenrt
from qwenrt.engine.runner import decode_step
from tests.checkpoints import randomize
from tests.numerics import rel_err

TINY = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            num_attention_heads=1, num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
            linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            intermediate_size=64, max_position_embeddings=1 << 19, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))
DECODED = 8


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    path = tmp_path_factory.mktemp("long")
    randomize(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY)).eval(), seed=4).save_pretrained(path)
    return path


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM: peak resident set, VmRSS: now)."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak() -> bool:
    """Make VmHWM the current RSS (Linux: 5 > clear_refs); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def prefill_then_decode(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """ids [1, N + DECODED]: the first N prefilled in `chunk`-token pieces, then DECODED tokens one at a time on the
    engine's decode step -> logits [DECODED + 1, V]: after the prompt, then after each decoded token."""
    n = ids.shape[1] - DECODED
    cache = model.new_cache(1)
    with torch.inference_mode():
        for start in range(0, n, chunk):
            logits = model(ids[:, start:min(start + chunk, n)], cache=cache, logits_to_keep=1)[:, -1]
        rows = [logits]
        for i in range(n, n + DECODED):
            rows.append(decode_step(model, ids[:, i:i + 1], cache)[0])
    assert cache.lengths == [n + DECODED]
    return torch.cat(rows)


def check_long_context(path: Path, n: int, chunks: tuple[int, int], peak_bound: int) -> dict:
    model, _ = qwenrt.load(path, dtype="float32")
    ids = torch.randint(0, 512, (1, n + DECODED), generator=torch.Generator().manual_seed(n))
    figures = {}
    results = []
    for chunk in chunks:
        measured = _reset_peak()
        before, began = _status("VmRSS"), time.perf_counter()
        results.append(prefill_then_decode(model, ids, chunk))
        figures[chunk] = (time.perf_counter() - began, _status("VmHWM") - before)
        if measured:
            assert figures[chunk][1] < peak_bound, (chunk, figures[chunk])
    err = rel_err(results[1], results[0])
    assert err <= 1e-4, err
    return figures


def test_8k_context_in_two_chunk_sizes(tiny_long):
    """8,192 tokens, chunks of 512 (dividing it) and 1000 (not): the same logits after the prompt and after each of
    8 decoded tokens; the step's memory stays small."""
    check_long_context(tiny_long, 8192, (512, 1000), peak_bound=256 << 20)


@pytest.mark.long
def test_262k_context_in_two_chunk_sizes(tiny_long, capsys):
    """262,144 tokens, chunks of 512 and 500: the same logits; peak RSS over the loaded model under 0.5 GiB.
    Measured (2 idle cores, AMD EPYC, AVX-512 BF16): 34 s for each prefill and its 8 decoded tokens, peak +103 / +140
    MiB (the 64 MiB KV cache and the steps' activations)."""
    figures = check_long_context(tiny_long, 262144, (512, 500), peak_bound=1 << 29)
    with capsys.disabled():
        for chunk, (seconds, peak) in figures.items():
            print(f"\n262,144 tokens in chunks of {chunk}: {seconds:.0f} s, peak RSS +{peak / (1 << 20):.0f} MiB")

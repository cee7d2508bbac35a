"""`qwenrt bench --depth D --prompt-len N`: prefill D tokens (timed apart), then N prompt tokens, then decode, as
`llama-bench -d` measures; what it reports is what it ran, and bad values are refused before anything runs."""

import json

import pytest
import torch

import qwenrt
import qwenrt.engine.runner
from qwenrt import bench_worker
from qwenrt.cli import main


def count_decode_lengths(monkeypatch) -> list[int]:
    """The context length each native decode step runs at, appended as the steps run."""
    seen = []
    step = qwenrt.engine.runner.decode_step

    def counted(model, token, cache):
        seen.append(cache.lengths[0])
        return step(model, token, cache)

    monkeypatch.setattr(qwenrt.engine.runner, "decode_step", counted)
    return seen


def test_at_depth_prefills_depth_then_prompt_then_decodes(dense_ckpt, monkeypatch):
    """The decode steps run at depth + prompt tokens of context, on the native step, as many as asked."""
    model, _ = qwenrt.load(dense_ckpt[0], dtype="bfloat16")
    seen = count_decode_lengths(monkeypatch)
    ids = torch.randint(0, 512, (1, 700 + 30), generator=torch.Generator().manual_seed(0))
    depth_s, prefill_s, decode_s = bench_worker.at_depth(model, ids, 700, 5)
    warm = bench_worker.WARMUP_STEPS
    assert seen[:warm] == list(range(bench_worker.WARMUP_PROMPT, bench_worker.WARMUP_PROMPT + warm))
    assert seen[warm:] == list(range(730, 735))
    assert depth_s > 0 and prefill_s > 0 and decode_s > 0


def test_bench_reports_depth_columns(dense_ckpt, capsys, tmp_path):
    """A real run (one fresh worker process): the table has the depth prefill and the speeds at that depth."""
    out = tmp_path / "r.json"
    assert main(["bench", str(dense_ckpt[0]), "--depth", "600", "--prompt-len", "40", "--gen-len", "4",
                 "--repeats", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prompt 40 at depth 600, 4 greedy tokens at depth 600" in text
    assert "| configuration | depth prefill s | depth prefill tok/s | load s | prefill tok/s |" in text
    result = json.loads(out.read_text())["results"][0]
    assert result["depth_prefill_tps"] == pytest.approx(600 / result["depth_prefill_s"])
    assert result["prefill_tps"] == pytest.approx(40 / result["ttft_s"]) and result["peak_rss"] > 0


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_a_random_fill_holds_depth_tokens_that_decoding_reads(dense_ckpt, monkeypatch, kv_dtype):
    """--depth-fill random: the first `depth` rows of every KV store hold random rows (8-bit ones too), none past
    them; the DeltaNet states are set; the prompt and decode steps then run at depth + prompt tokens."""
    model, _ = qwenrt.load(dense_ckpt[0], dtype="bfloat16")
    cache = model.new_cache(1, capacity=800, kv_dtype=kv_dtype)
    bench_worker.fill_random(model, cache, 700)
    seq = cache.sequences[0]
    assert seq.length == 700
    for layer in model.config.text.full_attention_layers:
        k, v = seq.kv(layer, 800)
        assert all(x[:, :, :700].float().std().item() == pytest.approx(1.0, rel=0.1) for x in (k, v))
        assert not k[:, :, 700:].any() and not v[:, :, 700:].any()
    assert all(seq.recurrent[i].abs().sum() > 0 for i in model.config.text.linear_attention_layers)
    seen = count_decode_lengths(monkeypatch)
    ids = torch.randint(0, 512, (1, 730), generator=torch.Generator().manual_seed(0))
    fill_s, prefill_s, decode_s = bench_worker.at_depth(model, ids, 700, 3, kv_dtype, fill="random")
    assert seen[bench_worker.WARMUP_STEPS:] == [730, 731, 732] and min(fill_s, prefill_s, decode_s) > 0


def test_bench_with_a_random_depth_reports_no_prefill_of_it(dense_ckpt, capsys, tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", str(dense_ckpt[0]), "--depth", "600", "--depth-fill", "random", "--prompt-len", "40",
                 "--gen-len", "4", "--repeats", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 greedy tokens at depth 600, the depth a random context (--depth-fill random)" in text
    assert "| configuration | load s | prefill tok/s |" in text and "depth prefill" not in text
    result = json.loads(out.read_text())["results"][0]
    assert "depth_prefill_s" not in result and result["decode_tps"] > 0


@pytest.mark.parametrize("argv, fragment", [
    (["--depth", "-1"], "--depth must be >= 0, got -1"),
    (["--depth-fill", "random"], "--depth-fill random fills a --depth: give one"),
    (["--depth", "8", "--depth-fill", "zeros"], "--depth-fill must be prefill or random, got 'zeros'"),
    (["--depth", "8", "--compare", "transformers"], "--depth measures plain decoding on qwenrt"),
    (["--depth", "8", "--speculative"], "--depth measures plain decoding on qwenrt"),
    (["--prompt-len", "0"], "--prompt-len, --gen-len, --repeats and --threads must be >= 1"),
    (["--depth", "4000", "--prompt-len", "90"], "--depth 4000 + --prompt-len 90 + --gen-len 128 = 4218 tokens exceed "
                                                "the model's context limit of 4096 (YaRN extends it: --rope-scaling)"),
    (["--depth", "4000", "--rope-scaling", '{"rope_type":"yarn","factor":0.5}'], "'factor' must be a finite number"),
])
def test_bad_values_are_refused_before_any_run(dense_ckpt, argv, fragment, capsys, monkeypatch):
    monkeypatch.setattr("qwenrt.bench._run", lambda job: pytest.fail("ran"))
    assert main(["bench", str(dense_ckpt[0]), "--repeats", "1", *argv]) == 1
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


def test_rope_scaling_extends_the_depth_bench_takes(dense_ckpt, monkeypatch, capsys):
    jobs = []

    def measured(job):
        jobs.append(job)
        return {"load_s": 1.0, "depth_prefill_s": 2.0, "depth_prefill_tps": 3000.0, "ttft_s": 0.1, "prefill_tps": 900,
                "decode_tps": 10.0, "decode_bytes": 1, "peak_rss": 1 << 30}

    monkeypatch.setattr("qwenrt.bench._run", measured)
    scaling = '{"rope_type":"yarn","factor":2,"original_max_position_embeddings":4096}'
    assert main(["bench", str(dense_ckpt[0]), "--repeats", "1", "--depth", "6000", "--rope-scaling", scaling]) == 0
    assert jobs[0]["depth"] == 6000 and jobs[0]["rope_scaling"]["factor"] == 2
    assert "| qwenrt bf16 | 2.0 | 3000 |" in capsys.readouterr().out

"""YaRN RoPE scaling against transformers 5.23: its frequencies and attention factor, logits past the original
context on tiny checkpoints (whole prefill, chunks, token-by-token decode, the native decode plan), the context limit
it gives, and the one-line refusals of bad values."""

import json
import shutil

import pytest
import torch

import qwenrt
from qwenrt.cli import main
from qwenrt.config import parse_text_config
from qwenrt.engine import Engine
from qwenrt.ops.rope import inv_frequencies
from tests.checkpoints import DENSE, VOCAB
from tests.hostile import one_line_error
from tests.numerics import rel_err, teacher_forced_logits

# a tiny original context so that ~200 tokens run past it: positions up to factor x 64 = 256
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
T = 200


def yarn_copy(src, dst, **params):
    """A copy of checkpoint `src` whose config.json (text_config for a VLM) has YaRN's rope_parameters."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    text = config.get("text_config", config)
    text["rope_parameters"] = {**text.get("rope_parameters", {}), **YARN, **params}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_yarn(rope_parameters: dict, text: dict = DENSE):
    from transformers import Qwen3_5TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["yarn"](Qwen3_5TextConfig(**dict(text, rope_parameters=dict(rope_parameters))))


@pytest.mark.parametrize("extra", [{}, {"original_max_position_embeddings": 262144},
                                   {"factor": 2.5, "truncate": False, "beta_fast": 16, "beta_slow": 2},
                                   {"factor": 8, "mscale": 0.707, "mscale_all_dim": 1.0},
                                   {"factor": 3, "attention_factor": 1.3}, {"beta_fast": 0}],
                         ids=["tiny", "qwen-card", "untruncated", "mscale", "attention-factor", "zero-beta"])
@pytest.mark.parametrize("head_dim, partial", [(32, 0.25), (256, 0.25), (128, 1.0)])
def test_frequencies_and_attention_factor_are_transformers(extra, head_dim, partial):
    """Bit-equal inverse frequencies and the same attention factor, over the rotary dims of the tiny test model,
    Qwen3.5 (64 of 256) and Qwen3-VL (all of 128)."""
    params = {"rope_theta": 1e7, "partial_rotary_factor": partial, **YARN, **extra}
    text = dict(DENSE, head_dim=head_dim)
    inv_freq, attention = hf_yarn(params, text)
    c = parse_text_config(dict(text, model_type="qwen3_5_text", rope_parameters=params))
    assert torch.equal(inv_frequencies(c.rotary_dim, c.rope_theta, yarn=c.yarn), inv_freq)
    assert c.yarn.attention_factor == attention
    assert c.context_limit == int(c.yarn.factor * c.yarn.original_max_position_embeddings)


@pytest.fixture(scope="module")
def yarn_dense(dense_ckpt, tmp_path_factory):
    return yarn_copy(dense_ckpt[0], tmp_path_factory.mktemp("yarn") / "dense")


def test_logits_past_the_original_context_match_transformers(yarn_dense, dense_ckpt):
    """fp32, 200 tokens with an original context of 64: one prefill, and prefill in chunks then one token at a time
    (the decode path the engine takes), both within 1e-4 of transformers' logits; without YaRN they are ~100x
    that far off (the tiny model rotates 8 of its 32 head channels)."""
    model, _ = qwenrt.load(yarn_dense, dtype="float32")
    assert model.config.text.context_limit == 256
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(yarn_dense)(input_ids=ids).logits.float()
    assert rel_err(model(ids), expected) <= 1e-4
    cache, pieces, start = model.new_cache(1, capacity=16), [], 0
    for n in (50, 1, 63, 30):
        pieces.append(model(ids[:, start:start + n], cache=cache))
        start += n
    pieces.append(teacher_forced_logits(model, ids, start)[:, 1:])
    assert rel_err(torch.cat(pieces, 1), expected) <= 1e-4
    plain, _ = qwenrt.load(dense_ckpt[0], dtype="float32")
    assert rel_err(plain(ids), expected) > 2e-3


def test_rope_scaling_at_load_equals_the_config(yarn_dense, dense_ckpt):
    """`load(rope_scaling=...)` on the plain checkpoint gives the YaRN config's logits; {"rope_type": "default"}
    on the YaRN checkpoint gives the plain one's."""
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(6))
    by_config, _ = qwenrt.load(yarn_dense, dtype="float32")
    by_option, _ = qwenrt.load(dense_ckpt[0], dtype="float32", rope_scaling=dict(YARN))
    assert by_option.config.text.yarn == by_config.config.text.yarn
    assert torch.equal(by_option(ids), by_config(ids))
    off, _ = qwenrt.load(yarn_dense, dtype="float32", rope_scaling={"rope_type": "default"})
    plain, _ = qwenrt.load(dense_ckpt[0], dtype="float32")
    assert off.config.text.context_limit == 4096 and torch.equal(off(ids), plain(ids))


def test_native_decode_plan_applies_yarn(yarn_dense):
    """bf16 on the CPU: the native decode plan's rotary table (YaRN frequencies and attention factor) gives the
    modules' logits exactly, past the original context."""
    from qwenrt.decode_plan import DecodePlan

    model, _ = qwenrt.load(yarn_dense, dtype="bfloat16")
    if DecodePlan.for_model(model) is None:
        pytest.skip("no native kernels")
    ids = torch.randint(0, VOCAB, (2, 120), generator=torch.Generator().manual_seed(7))
    planned = teacher_forced_logits(model, ids, 40)
    assert torch.equal(planned, teacher_forced_logits(model, ids, 40, modules=True))


def test_moe_logits_match_transformers(moe_ckpt, tmp_path):
    path = yarn_copy(moe_ckpt[0], tmp_path / "moe")
    model, _ = qwenrt.load(path, dtype="float32")
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = reference(path)(input_ids=ids).logits.float()
    assert rel_err(model(ids), expected) <= 1e-4


def test_qwen3_next_logits_match_transformers(tmp_path):
    from tests.test_qwen3_next import build

    src, _ = build(tmp_path / "next", True, seed=3)
    path = yarn_copy(src, tmp_path / "next-yarn")
    model, _ = qwenrt.load(path, dtype="float32")
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(9))
    ref = reference(path)
    ref.set_experts_implementation("eager")  # torch's grouped_mm takes no fp64
    with torch.no_grad():  # fp64: its fp32 DeltaNet drifts ~1e-4 from fp64 (tests/test_qwen3_next.py)
        expected = ref.double()(input_ids=ids).logits.float()
    assert rel_err(model(ids), expected) <= 1e-4


def test_qwen3_vl_logits_match_transformers(qwen3_vl_ckpt, tmp_path):
    """Qwen3-VL rotates all of its 128 head channels (three-axis interleaved sections): text past the original
    context within 1e-4 of transformers."""
    from transformers import Qwen3VLForConditionalGeneration

    path = yarn_copy(qwen3_vl_ckpt[0], tmp_path / "vl")
    model, _ = qwenrt.load(path, dtype="float32")
    ids = torch.randint(0, 248320, (1, T), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        expected = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()(
            input_ids=ids).logits.float()
    assert rel_err(model(ids), expected) <= 1e-4


def test_context_limit_is_factor_times_original(yarn_dense):
    """The engine, new_cache and prompts take up to factor x original tokens, and no more."""
    model, _ = qwenrt.load(yarn_dense, dtype="float32")
    assert Engine(model, prefix_cache_size=0).max_model_len == 256
    one_line_error(lambda: Engine(model, max_model_len=257), "max_model_len 257 exceeds the model's context limit 256")
    one_line_error(lambda: model.new_cache(capacity=257), "at most the model's context of 256")
    too_long = list(range(256))
    one_line_error(lambda: qwenrt.generate(model, None, too_long, max_tokens=1), "the context limit is 256")


@pytest.mark.parametrize("scaling, fragment", [
    ({"rope_type": "yarn", "factor": 1.0}, "'factor' must be a finite number in (1.0, "),
    ({"rope_type": "yarn", "factor": 0.5}, "'factor' must be a finite number in (1.0, "),
    ({"rope_type": "yarn"}, "missing required field 'factor'"),
    ({"rope_type": "yarn", "factor": "4"}, "'factor' must be a finite number"),
    ({"rope_type": "yarn", "factor": 4, "orignal_max_position_embeddings": 8}, "unknown YaRN key(s)"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64.5}, "must be an integer"),
    ({"rope_type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 2}, "beta_fast (1) must be >= beta_slow"),
    ({"rope_type": "yarn", "factor": 4, "attention_factor": -1}, "'attention_factor' must be"),
    ({"rope_type": "yarn", "factor": 4, "truncate": "yes"}, "'truncate' must be true or false"),
    ({"rope_type": "yarn", "factor": 4, "rope_theta": 10}, "rope_theta and the sections stay"),
    ({"rope_type": "yarn", "factor": 1e5}, "exceeds 16777216 positions"),
    ({"rope_type": "linear", "factor": 2}, "rope_type 'linear' is not supported"),
    ({"rope_type": "default", "factor": 2}, "takes no other keys"),
    ([4.0], "expected a JSON object"),
])
def test_bad_rope_scaling_is_one_line(dense_ckpt, scaling, fragment):
    one_line_error(lambda: qwenrt.load(dense_ckpt[0], rope_scaling=scaling), fragment)


def test_bad_yarn_in_config_json_is_one_line(dense_ckpt, tmp_path):
    path = yarn_copy(dense_ckpt[0], tmp_path / "bad", factor=0.5)
    one_line_error(lambda: qwenrt.load(path), "config.json rope_parameters: 'factor' must be a finite number in (1.0, ")


def test_cli_inspect_shows_yarn_and_the_context_limit(yarn_dense, dense_ckpt, capsys):
    assert main(["inspect", str(yarn_dense), "--no-finite-check"]) == 0
    out = capsys.readouterr().out
    assert "context         256 tokens (YaRN x4 of 64 tokens (attention factor 1.1386" in out
    assert main(["inspect", str(dense_ckpt[0]), "--no-finite-check", "--rope-scaling",
                 '{"rope_type":"yarn","factor":2,"original_max_position_embeddings":4096}']) == 0
    assert "context         8192 tokens (YaRN x2 of 4096 tokens" in capsys.readouterr().out
    assert main(["inspect", str(dense_ckpt[0]), "--no-finite-check"]) == 0
    assert "context         4096 tokens (no RoPE scaling" in capsys.readouterr().out
    assert main(["inspect", str(dense_ckpt[0]), "--rope-scaling", '{"rope_type":"yarn","factor":0}']) == 1
    assert capsys.readouterr().err.strip() == ("qwenrt: error: rope_scaling: 'factor' must be a finite number in "
                                               "(1.0, 16777216], got 0")
    with pytest.raises(SystemExit):
        main(["inspect", str(dense_ckpt[0]), "--rope-scaling", "{factor"])
    assert "argument --rope-scaling: not JSON" in capsys.readouterr().err


def test_cli_run_takes_yarn_and_a_longer_max_model_len(capsys):
    """The built-in model (4,096 positions) with YaRN x2: --max-model-len up to 8,192, checked before loading."""
    scaling = '{"rope_type":"yarn","factor":2,"original_max_position_embeddings":4096}'
    assert main(["run", "qwenrt-tiny", "hi", "--max-model-len", "9000", "--rope-scaling", scaling]) == 1
    assert "max_context must be an integer in [2, 8192]" in capsys.readouterr().err
    assert main(["run", "qwenrt-tiny", "hi", "--max-model-len", "8192", "--rope-scaling", scaling, "-n", "2"]) == 0


def test_gguf_from_llama_cpps_converter_keeps_yarn(tmp_path):
    """llama.cpp's converter writes rope.scaling.* from rope_parameters; qwenrt reads them back as the same YaRN and
    the file gives the checkpoint's logits. qwenrt's own GGUF writer refuses a YaRN config (llama.cpp's formulas
    differ) in one line."""
    from qwenrt.default_model import default_model_path
    from qwenrt.gguf.export import export_gguf
    from tests.llama_convert import convert

    src = yarn_copy(default_model_path(), tmp_path / "tiny", factor=2.0, original_max_position_embeddings=4096,
                    beta_fast=16, attention_factor=1.25)
    gguf = convert(src, tmp_path / "tiny.gguf", "bf16", "qwen35")
    from_file, _ = qwenrt.load(gguf)
    from_dir, _ = qwenrt.load(src)
    assert from_file.config.text.yarn == from_dir.config.text.yarn and from_file.config.text.context_limit == 8192
    ids = torch.randint(0, 500, (1, 100), generator=torch.Generator().manual_seed(10))
    assert torch.equal(from_file(ids), from_dir(ids))
    one_line_error(lambda: export_gguf(src, tmp_path / "ours.gguf", "bf16"), "is not written as GGUF")

"""Adapters served side by side (qwenrt.served_adapters): each row's logits are PEFT's for its adapter; a batch mixing
two adapters and the base gives each request the tokens it gets alone, on the native decode plan (bf16 and int4
bases) and through speculative cycles; the native plan computes what the modules compute; the prefix cache keeps
adapters apart; bad names are one-line errors."""

import copy

import pytest
import torch

import qwenrt
from qwenrt.decode_plan import DecodePlan
from qwenrt.engine import Engine
from qwenrt.kernels import cpu_kernels
from qwenrt.served_adapters import served_modules
from tests.checkpoints import add_mtp_head
from tests.hostile import one_line_error
from tests.test_lora import IDS, _bound, _peft_adapter

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 300, 42, 9], [77, 128, 3, 256], [11, 500, 64, 7, 7, 19], [40, 41, 42]]
GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True, speculative_tokens=0)


@pytest.fixture(scope="module")
def two_adapters(dense_ckpt, tmp_path_factory):
    """(checkpoint path, transformers reference, {name: (directory, PeftModel)}): two different random adapters."""
    path, ref = dense_ckpt
    root = tmp_path_factory.mktemp("served")
    adapters = {"a": _peft_adapter(ref, root / "a", seed=0),
                "b": _peft_adapter(ref, root / "b", targets=["in_proj_qkv", "o_proj", "down_proj"], seed=1)}
    return path, ref, {name: (root / name, m) for name, m in adapters.items()}


def _load(two_adapters, **options):
    path, _, adapters = two_adapters
    return qwenrt.load(path, adapters={name: d for name, (d, _) in adapters.items()}, **options)[0]


def _logits(model, ids: torch.Tensor, slot: int) -> torch.Tensor:
    state = model.new_sequence()
    state.adapter = slot
    with torch.no_grad():
        return model(ids, qwenrt.cache.HybridCache([state]))


def test_each_slot_computes_its_peft_adapter_and_the_base(two_adapters):
    _, ref, adapters = two_adapters
    model = _load(two_adapters, dtype="float32")
    assert len(served_modules(model)) == 62  # adapter a: every projection; b's are among them
    with torch.no_grad():
        expected = [ref(IDS).logits] + [m(IDS).logits for _, m in adapters.values()]
    for slot, reference in enumerate(expected):
        assert _bound(_logits(model, IDS, slot), reference) <= 1e-4
    assert _bound(expected[1], expected[2]) > 1e-2 and _bound(expected[0], expected[1]) > 1e-2


def _each_alone_and_mixed(model, names, **options):
    engine = Engine(model, None, prefix_cache_size=0)
    alone = [qwenrt.batch_generate(engine, None, [p], adapter=n, **GREEDY, **options)[0].tokens
             for p, n in zip(PROMPTS, names)]
    mixed = [c.tokens for c in qwenrt.batch_generate(engine, None, PROMPTS, adapter=names, **GREEDY, **options)]
    return alone, mixed


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_a_batch_mixing_adapters_and_the_base_equals_each_alone(two_adapters, quantize):
    model = _load(two_adapters, dtype="bfloat16", quantize=quantize)
    assert cpu_kernels() is None or DecodePlan.for_model(model) is not None  # adapters keep the native plan
    names = [None, "a", "b", "a"]
    alone, mixed = _each_alone_and_mixed(model, names)
    assert mixed == alone
    base = _each_alone_and_mixed(model, [None] * 4)[1]
    assert base[0] == mixed[0] and base[1:] != mixed[1:]  # the adapters change what their rows generate


def test_native_plan_computes_what_the_modules_compute(two_adapters):
    """A decode step of three sequences (base, a, b) through the plan and through the modules: equal bit for bit."""
    model = _load(two_adapters, dtype="bfloat16")
    plan = DecodePlan.for_model(model)
    if plan is None:
        pytest.skip("no native kernels on this machine")
    caches = []
    for _ in range(2):
        states = [model.new_sequence() for _ in range(3)]
        for slot, state in enumerate(states):
            state.adapter = slot
            with torch.no_grad():
                model(IDS[:, :6], qwenrt.cache.HybridCache([state]))
        caches.append(qwenrt.cache.HybridCache(states))
    step = torch.tensor([[9], [10], [11]])
    with torch.no_grad():
        native, _ = plan(step, caches[0])
        modules = model.lm_head(model.hidden_states(step, caches[1])[:, -1]).float()
    assert torch.equal(native, modules)
    assert not torch.equal(native[0], native[1])


def test_speculative_cycles_with_adapters_equal_plain_decoding(two_adapters, tmp_path):
    path, _, adapters = two_adapters
    with_head = add_mtp_head(path, tmp_path / "mtp")
    model, _ = qwenrt.load(with_head, dtype="bfloat16", adapters={n: d for n, (d, _) in adapters.items()})
    names = [None, "a", "b", "a"]
    plain = _each_alone_and_mixed(model, names)[1]
    engine = Engine(model, None, prefix_cache_size=0)
    drafted = [c.tokens for c in qwenrt.batch_generate(engine, None, PROMPTS, adapter=names,
                                                       **dict(GREEDY, speculative_tokens=3))]
    assert drafted == plain


def test_prefix_cache_keeps_adapters_apart(two_adapters):
    """The same prompt under the base, then adapter a: a's answer is computed with a (not restored from the base's
    cached states), and a second run of a reuses a's."""
    model = _load(two_adapters, dtype="bfloat16")
    cold = Engine(model, None, prefix_cache_size=0)
    expected = [qwenrt.batch_generate(cold, None, [PROMPTS[2]], adapter=n, **GREEDY)[0].tokens for n in (None, "a")]
    engine = Engine(model, None, prefix_cache_size=1 << 26)
    runs = [qwenrt.batch_generate(engine, None, [PROMPTS[2]], adapter=n, **GREEDY)[0] for n in (None, "a", "a")]
    assert [r.tokens for r in runs] == [*expected, expected[1]]
    assert runs[1].cached_tokens == 0 and runs[2].cached_tokens == len(PROMPTS[2])


def test_one_adapter_for_every_request(two_adapters):
    path, _, adapters = two_adapters
    model, _ = qwenrt.load(path, dtype="float32", adapter=adapters["a"][0])
    with torch.no_grad():
        assert _bound(model(IDS), adapters["a"][1](IDS).logits) <= 1e-4


def test_bad_names_and_arguments_are_one_line_errors(two_adapters, dense_ckpt):
    path, _, adapters = two_adapters
    model = _load(two_adapters, dtype="bfloat16")
    one_line_error(lambda: qwenrt.generate(model, None, PROMPTS[0], adapter="c", max_tokens=2), "unknown adapter",
                   "a, b")
    plain, _ = qwenrt.load(path, dtype="bfloat16")
    one_line_error(lambda: qwenrt.generate(plain, None, PROMPTS[0], adapter="a", max_tokens=2), "serves no adapters")
    one_line_error(lambda: qwenrt.load(path, adapters={"bad name": adapters["a"][0]}), "adapter name")
    one_line_error(lambda: qwenrt.load(path, adapters=[adapters["a"][0]]), "adapters must be a dict")
    one_line_error(lambda: qwenrt.load(path, adapter=adapters["a"][0], adapters={"b": adapters["b"][0]}),
                   "not both")
    one_line_error(lambda: qwenrt.batch_generate(model, None, PROMPTS, adapter=["a"], max_tokens=2), "4 prompts")


@pytest.fixture(scope="module")
def chat_adapter(chat_ckpt, tmp_path_factory):
    """(the chat checkpoint's path, an adapter directory for it)."""
    path, ref = chat_ckpt
    directory = tmp_path_factory.mktemp("chat-adapter") / "sql"
    _peft_adapter(ref, directory, targets=["in_proj_qkv", "o_proj", "down_proj"])
    return path, directory


def test_server_routes_requests_to_adapters_by_model_name(chat_adapter):
    from tests.test_server import scripted_client

    path, directory = chat_adapter
    model, tokenizer = qwenrt.load(path, dtype="bfloat16", adapters={"sql": directory})
    engine = Engine(model, tokenizer)
    engine.start()
    http, client = scripted_client(engine, names=("base",), adapters={"sql": str(directory)})
    greedy = dict(prompt="The capital of", max_tokens=8, temperature=0)
    with http:
        cards = {m.id: m for m in client.models.list().data}
        adapted = client.completions.create(model="sql", **greedy)
        base = client.completions.create(model="base", **greedy)
        missing = http.post("/v1/completions", json=dict(greedy, model="nope"))
    engine.stop()
    assert list(cards) == ["base", "sql"] and cards["sql"].parent == "base" and cards["sql"].root.endswith("sql")
    assert adapted.model == "sql" and missing.status_code == 404 and "sql" in missing.json()["error"]["message"]
    expected = [qwenrt.generate(model, tokenizer, greedy["prompt"], adapter=a, max_tokens=8, temperature=0)
                for a in ("sql", None)]
    assert [adapted.choices[0].text, base.choices[0].text] == expected and expected[0] != expected[1]


def test_lora_requests_info_names_the_running_and_waiting_adapters(chat_adapter):
    """vllm:lora_requests_info, what llm-d's LoRA affinity reads: one request runs at a time, the base model's first
    while the adapter's waits, then the adapter's."""
    import re
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_server import scripted_client

    path, directory = chat_adapter
    model, tokenizer = qwenrt.load(path, dtype="bfloat16", adapters={"sql": directory})
    engine = Engine(model, tokenizer, max_running=1)
    engine.start()
    http, client = scripted_client(engine, names=("base",), adapters={"sql": str(directory)})
    pattern = (r'^vllm:lora_requests_info\{max_lora="(\d+)",running_lora_adapters="([^"]*)",'
               r'waiting_lora_adapters="([^"]*)"\} (\S+)$')
    long = dict(prompt="The capital of", max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
    seen = set()
    with http, ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(client.completions.create, model="base", **long)]
        while not re.search(r"^vllm:num_requests_running 1", http.get("/metrics").text, re.M):
            time.sleep(0.005)
        runs.append(pool.submit(client.completions.create, model="sql", **long))
        while not all(r.done() for r in runs):
            before = time.time()
            (max_lora, running, waiting, stamp), = re.findall(pattern, http.get("/metrics").text, re.M)
            seen.add((max_lora, running, waiting))
            assert before - 1 <= float(stamp) <= time.time() + 1
            time.sleep(0.005)
        seen.add(re.findall(pattern, http.get("/metrics").text, re.M)[0][:3])
    engine.stop()
    assert {("1", "", "sql"), ("1", "sql", "")} <= seen <= {("1", "", "sql"), ("1", "sql", ""), ("1", "", "")}


def test_serve_refuses_a_malformed_lora_option(capsys):
    from qwenrt.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--lora", "just-a-name"])
    assert "NAME=DIR" in capsys.readouterr().err


def test_run_with_an_adapter(chat_adapter, capsys):
    from qwenrt.cli import main

    path, directory = chat_adapter
    model, tokenizer = qwenrt.load(path, dtype="bfloat16", adapter=directory)
    expected = qwenrt.generate(model, tokenizer, "The capital of", max_tokens=6, temperature=0)
    assert main(["run", str(path), "The capital of", "--adapter", str(directory), "--raw", "-n", "6",
                 "--temperature", "0", "--dtype", "bfloat16", "-q"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_routed_expert_adapters_in_a_mixed_batch_equal_each_alone(moe_ckpt, tmp_path):
    """Adapters on the MoE experts' banks (PEFT's target_parameters), through the modules: a batch of two adapters
    and the base gives each request its tokens alone, and the adapters change them."""
    path, ref = moe_ckpt
    dirs = {}
    for seed, name in enumerate(("a", "b")):
        _peft_adapter(ref, tmp_path / name, ["self_attn.q_proj"], seed=seed,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        dirs[name] = tmp_path / name
    model, _ = qwenrt.load(path, dtype="bfloat16", adapters=dirs)
    alone, mixed = _each_alone_and_mixed(model, [None, "a", "b", "a"])
    assert mixed == alone
    assert _each_alone_and_mixed(model, [None] * 4)[1][1:] != mixed[1:]

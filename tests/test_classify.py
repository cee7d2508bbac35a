"""Sequence classification: the head against transformers' class (fp32, random checkpoint), labelled-data errors,
`finetune --task classify` on the built-in model with its outputs loaded by transformers and PEFT, `qwenrt
classify`, POST /classify, and the engine's refusals (generation on a classifier, /classify on a causal LM)."""

import json

import pytest
import torch

import qwenrt
from qwenrt.classifier import classify, last_token_logits
from qwenrt.cli import main
from qwenrt.default_model import default_model_path
from qwenrt.errors import QwenrtError
from qwenrt.tokenizer import Tokenizer
from qwenrt.train.labels import encode_labelled, label_map, read_labelled
from tests import checkpoints

peft = pytest.importorskip("peft")

PAD = 7
# ragged rows; the last ends in the pad token, which transformers' pooling skips as padding
ROWS = [[5, 17, 300, 42, 9, 77, 128, 3], [11, 500, 64], [99, 2, 45, 301, 8, PAD, PAD]]


def _bound(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


@pytest.fixture(scope="module")
def random_classifier(tmp_path_factory):
    """(path, transformers reference) of a random 3-class Qwen3_5TextForSequenceClassification checkpoint."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextForSequenceClassification

    path = tmp_path_factory.mktemp("classifier")
    config = Qwen3_5TextConfig(**checkpoints.DENSE, num_labels=3, pad_token_id=PAD,
                               id2label={0: "neg", 1: "neutral", 2: "pos"})
    model = checkpoints.randomize(Qwen3_5TextForSequenceClassification(config).eval())
    model.save_pretrained(path)
    return path, model


def test_head_matches_transformers_alone_batched_and_in_training(random_classifier):
    path, ref = random_classifier
    ids, mask = _padded(ROWS)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits  # [3, 3]
    model, _ = qwenrt.load(path, dtype="float32")
    assert model.lm_head is None and model.classifier.labels == ("neg", "neutral", "pos")
    batched = classify(model, None, ROWS)
    ours = torch.tensor([r.logits for r in batched])
    assert _bound(ours, expected) <= 1e-4
    assert [r.label for r in batched] == [("neg", "neutral", "pos")[i] for i in expected.argmax(-1).tolist()]
    assert batched[2].prompt_tokens == 5  # pooled at the last token that is not the pad
    alone = [classify(model, None, [row])[0].logits for row in ROWS]
    assert torch.equal(torch.tensor(alone), ours)
    lengths = torch.tensor([len(r) for r in ROWS[:2]] + [5])
    with torch.no_grad():
        assert _bound(last_token_logits(model, ids, lengths), expected) <= 1e-4  # the training path


def test_engine_refuses_generation_on_a_classifier_and_classify_on_a_causal_lm(random_classifier, dense_ckpt):
    model, _ = qwenrt.load(random_classifier[0], dtype="float32")
    with pytest.raises(QwenrtError, match="sequence classifier: it has no LM head"):
        qwenrt.generate(model, None, [5, 17, 3], max_tokens=2)
    causal, _ = qwenrt.load(dense_ckpt[0], dtype="float32")
    with pytest.raises(QwenrtError, match="causal LM, not a sequence classifier"):
        classify(causal, None, [[5, 17, 3]])


def _records(tmp_path, lines: list[str]):
    file = tmp_path / "labels.jsonl"
    file.write_text("".join(line + "\n" for line in lines))
    return file


@pytest.mark.parametrize("lines, labels, fragment", [
    ([], 2, "no labelled texts"),
    (['{"text": "a", "label": "x"}', "{oops"], 2, ":2: not valid JSON"),
    (['{"text": "", "label": "x"}'], 2, ":1: expected an object with a non-empty 'text'"),
    (['{"text": "a", "label": true}'], 2, ":1: 'label' must be a label name"),
    (['{"text": "a", "label": "x"}', '{"text": "b", "label": 1}'], 2, ":2: label 1 is an id, but the first"),
    (['{"text": "a", "label": "x"}', '{"text": "b", "label": "y"}', '{"text": "c", "label": "z"}'], 2,
     ":3: label 'z' is label number 3; --num-labels is 2"),
    (['{"text": "a", "label": "x"}', '{"text": "b", "label": "x"}'], 2, "1 distinct labels (x), but --num-labels is 2"),
    (['{"text": "a", "label": 0}', '{"text": "b", "label": 2}'], 2, ":2: label 2 is not a class id in [0, 2)"),
])
def test_bad_labelled_data_gets_one_line_errors_naming_the_line(tmp_path, lines, labels, fragment):
    file = _records(tmp_path, lines)
    with pytest.raises(QwenrtError) as e:
        label_map(read_labelled(str(file), "training data"), labels)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert str(file) in str(e.value) or fragment.startswith("1 distinct")


def test_labels_are_sorted_names_and_held_out_labels_must_be_known(tmp_path):
    tokenizer = Tokenizer(default_model_path())
    train = read_labelled([{"text": "1 + 1 = 2", "label": "yes"}, {"text": "1 + 1 = 3", "label": "no"}], "data")
    ids = label_map(train, 2)
    assert ids == {"no": 0, "yes": 1}
    examples = encode_labelled(tokenizer, train, ids, 515, 64)
    assert [e.label for e in examples] == [1, 0] and examples[0].ids == tokenizer.encode("1 + 1 = 2")
    file = _records(tmp_path, ['{"text": "2 + 2 = 4", "label": "maybe"}'])
    with pytest.raises(QwenrtError, match=r"labels.jsonl:1: label 'maybe' is not one of the training data's labels"):
        encode_labelled(tokenizer, read_labelled(str(file), "eval data"), ids, 515, 64)
    with pytest.raises(QwenrtError, match="over max_len 3"):
        encode_labelled(tokenizer, train, ids, 515, 3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-class classifier fine-tuned from the built-in model for a few steps (high learning rate: the adapters
    and the head move far from their start)."""
    from qwenrt.tiny.tasks import sum_statements

    tmp = tmp_path_factory.mktemp("finetune")
    data = tmp / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sum_statements(40, 0)))
    out = tmp / "out"
    assert main(["finetune", str(out), "--task", "classify", "--data", str(data), "--num-labels", "2",
                 "--steps", "4", "--batch-size", "8", "--lr", "2e-2", "--lora-rank", "4", "--eval-every", "2",
                 "--threads", "1", "-q"]) == 0
    return out


TEXTS = ["37 + 48 = 85", "37 + 48 = 86", "5 + 9 = 14"]


def test_finetune_writes_a_classifier_and_a_seq_cls_adapter_with_held_out_figures(trained):
    assert sorted(p.name for p in trained.iterdir()) == ["adapter", "chat_template.jinja", "config.json",
                                                        "generation_config.json", "model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json", "train_log.jsonl"]
    config = json.loads((trained / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5TextForSequenceClassification"]
    assert config["id2label"] == {"0": "correct", "1": "wrong"} and config["pad_token_id"] == 515
    adapter = json.loads((trained / "adapter" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and adapter["modules_to_save"] == ["score"] and adapter["r"] == 4
    log = [json.loads(line) for line in (trained / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["held_out"] == "4 of the 40 training examples (10%)"
    evals = [r for r in log if "eval_accuracy" in r]
    assert len(evals) == 3 and all(0 <= r["eval_macro_f1"] <= 1 for r in evals)


def test_transformers_and_peft_give_our_logits(trained):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen3_5TextForSequenceClassification

    model, tokenizer = qwenrt.load(trained, dtype="float32")
    ours = torch.tensor([r.logits for r in classify(model, tokenizer, TEXTS)])
    hf_tokenizer = AutoTokenizer.from_pretrained(trained)
    batch = hf_tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        merged = AutoModelForSequenceClassification.from_pretrained(trained, dtype=torch.float32).eval()
        assert type(merged).__name__ == "Qwen3_5TextForSequenceClassification"
        assert _bound(ours, merged(**batch).logits) <= 1e-4
        base = Qwen3_5TextForSequenceClassification.from_pretrained(default_model_path(), num_labels=2,
                                                                    dtype=torch.float32)
        base.config.pad_token_id = 515
        adapted = peft.PeftModel.from_pretrained(base, trained / "adapter").eval()
        assert _bound(ours, adapted(**batch).logits) <= 1e-4
    assert float((ours[:, 0] - ours[:, 1]).abs().max()) > 1e-3  # the head was trained: the check can fail


def test_classify_cli_prints_label_and_probability(trained, capsys):
    assert main(["classify", str(trained), *TEXTS[:2], "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[2] for line in lines] == TEXTS[:2]
    assert all(line.split("\t")[0] in ("correct", "wrong") and 0.5 <= float(line.split("\t")[1]) <= 1
               for line in lines)
    assert main(["classify", "--json", str(trained), TEXTS[0], "-q"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert set(record["probs"]) == {"correct", "wrong"} and abs(sum(record["probs"].values()) - 1) < 1e-5
    assert main(["classify", str(default_model_path()), "x", "-q"]) == 1
    assert "not a sequence classifier" in capsys.readouterr().err


def _client(path):
    from fastapi.testclient import TestClient

    from qwenrt.engine import Engine
    from qwenrt.server.app import ServerConfig, create_app

    model, tokenizer = qwenrt.load(path, dtype="float32")
    engine = Engine(model, tokenizer)
    engine.start()
    return TestClient(create_app(ServerConfig(str(path), ["m"]), lambda: engine)), engine, model, tokenizer


def test_classify_endpoint_has_vllms_shape_and_refuses_what_does_not_fit(trained):
    client, engine, model, tokenizer = _client(trained)
    try:
        with client:
            reply = client.post("/classify", json={"model": "m", "input": TEXTS})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            expected = classify(model, tokenizer, TEXTS, engine)
            assert body["object"] == "list" and body["model"] == "m" and body["id"].startswith("classify-")
            assert [d["index"] for d in body["data"]] == [0, 1, 2]
            assert [d["label"] for d in body["data"]] == [r.label for r in expected]
            assert [d["probs"] for d in body["data"]] == [r.probs for r in expected]
            assert all(d["num_classes"] == 2 for d in body["data"])
            tokens = sum(len(tokenizer.encode(t)) for t in TEXTS)
            assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                     "prompt_tokens_details": None}
            one = client.post("/v1/classify", json={"input": TEXTS[0]}).json()
            assert one["data"][0]["probs"] == expected[0].probs
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 400 and "sequence classifier" in chat.json()["error"]["message"]
            assert client.post("/classify", json={"input": []}).status_code == 400
    finally:
        engine.stop()
    client, engine, _, _ = _client(default_model_path())
    try:
        with client:
            reply = client.post("/classify", json={"input": "1 + 1 = 2"})
            assert reply.status_code == 400 and "not a sequence classifier" in reply.json()["error"]["message"]
    finally:
        engine.stop()


def test_finetune_sft_is_train_with_rank_16_and_classify_plans_its_head(tmp_path, capsys):
    assert main(["finetune", str(tmp_path / "a"), "--data", "none.jsonl", "--plan"]) == 0
    assert capsys.readouterr().out.startswith("LoRA rank 16, alpha 32")
    assert main(["finetune", str(tmp_path / "b"), "--task", "classify", "--num-labels", "3", "--data", "none.jsonl",
                 "--plan"]) == 0
    assert "score (classification head)         1 x           384 parameters" in capsys.readouterr().out


@pytest.mark.parametrize("options, fragment", [
    (["--task", "classify"], "task classify needs num_labels (--num-labels)"),
    (["--num-labels", "2"], "num_labels is for task classify"),
    (["--task", "classify", "--num-labels", "2", "--eval-split", "1"], "eval_split must be in [0, 1)"),
])
def test_bad_finetune_options_get_one_line_errors(tmp_path, capsys, options, fragment):
    assert main(["finetune", str(tmp_path / "out"), "--data", "none.jsonl", *options]) == 1
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1

"""The classification task of the trainer (`finetune --task classify`): LoRA on the body plus a whole `score` head,
the cross-entropy of the head at each text's last token (transformers' ForSequenceClassificationLoss, single
label), held-out accuracy and macro-F1, and the result written twice:

    OUT/          a classifier checkpoint, the adapters merged: what `qwenrt classify`, `qwenrt serve` and
                  transformers' AutoModelForSequenceClassification load (config with id2label, label2id, pad_token_id)
    OUT/adapter/  the PEFT adapter (task_type SEQ_CLS, the head as modules_to_save), for PEFT on the base
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from qwenrt.adapters import save_adapter
from qwenrt.classifier import TEXT_ARCHITECTURE
from qwenrt.errors import QwenrtError
from qwenrt.lora import lora_modules
from qwenrt.train.data import Example, collate

ADAPTER_DIR = "adapter"


def batch_tensors(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, T] right-padded, lengths [B], labels [B]."""
    ids, _ = collate(examples, pad_id)
    return ids, torch.tensor([len(e) for e in examples]), torch.tensor([e.label for e in examples])


def classification_loss(model, examples: list[Example], pad_id: int) -> torch.Tensor:
    """Summed cross-entropy of the head's logits at each text's last token against its label."""
    from qwenrt.classifier import last_token_logits

    ids, lengths, labels = batch_tensors(examples, pad_id)
    return F.cross_entropy(last_token_logits(model, ids, lengths), labels, reduction="sum")


def macro_f1(truth: torch.Tensor, predicted: torch.Tensor) -> float:
    """The mean F1 over the classes found in truth or predicted (scikit-learn's average='macro'; an F1 with no true
    positives is 0)."""
    scores = []
    for c in torch.cat([truth, predicted]).unique().tolist():
        tp = int(((predicted == c) & (truth == c)).sum())
        fp, fn = int(((predicted == c) & (truth != c)).sum()), int(((predicted != c) & (truth == c)).sum())
        scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


@torch.no_grad()
def evaluate_classifier(model, examples: list[Example], pad_id: int, batch: int) -> dict:
    """Held-out mean cross-entropy per text, accuracy and macro-F1."""
    from qwenrt.classifier import last_token_logits

    was_training = model.training
    model.eval()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]))
    loss, truth, predicted = 0.0, [], []
    for start in range(0, len(order), batch):
        ids, lengths, labels = batch_tensors([examples[i] for i in order[start:start + batch]], pad_id)
        logits = last_token_logits(model, ids, lengths)
        loss += float(F.cross_entropy(logits, labels, reduction="sum"))
        truth.append(labels)
        predicted.append(logits.argmax(-1))
    model.train(was_training)
    truth, predicted = torch.cat(truth), torch.cat(predicted)
    return {"eval_loss": loss / len(examples), "eval_accuracy": float((truth == predicted).float().mean()),
            "eval_macro_f1": macro_f1(truth, predicted)}


def classifier_config(config: dict, labels: tuple[str, ...], pad_id: int) -> dict:
    """A text config.json (checkpoints.config_json) made a classifier's, as transformers writes one."""
    return dict(config, architectures=[TEXT_ARCHITECTURE], id2label={str(i): n for i, n in enumerate(labels)},
                label2id={n: i for i, n in enumerate(labels)}, pad_token_id=pad_id, mtp_num_hidden_layers=0)


def save_classifier(out: Path, model, cfg, config: dict, tokenizer_dir: Path) -> None:
    """The adapter into OUT/adapter/, then the merged classifier into OUT: the base's stored weights with each
    adapter merged (W + scaling·B·A in fp32, then cfg.save_dtype; norms, A_log and dt_bias fp32), the head, the
    config and tokenizer files; no LM head and no MTP head (a classifier has neither)."""
    from qwenrt.loader import verify_checkpoint
    from qwenrt.merge import write_merged
    from qwenrt.train.checkpoints import check_files, copy_tokenizer_files, keeps_fp32

    spec = cfg.lora_spec()
    save_adapter(out / ADAPTER_DIR, model, spec, cfg.init)
    _, ckpt, plan, _, _ = verify_checkpoint(cfg.init)
    plan = {n: s for n, s in plan.items() if n != "lm_head.weight" and not n.startswith("mtp.")}
    adapters = {path: (m.lora_A.detach(), m.lora_B.detach()) for path, m in lora_modules(model).items()}
    dtype = getattr(torch, cfg.save_dtype)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
    try:
        write_merged(tmp, ckpt, plan, [], adapters, spec.scaling,
                     dtype_of=lambda name: torch.float32 if keeps_fp32(name) else dtype,
                     extra={"score.weight": model.score.weight.detach().to(dtype).contiguous()})
        config = dict(config, dtype=cfg.save_dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_tokenizer_files(tokenizer_dir, tmp)
        names = sorted(os.listdir(tmp))
        check_files(out, names)
        for name in names:
            os.replace(tmp / name, out / name)
    except OSError as e:
        raise QwenrtError(f"cannot write the classifier into {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

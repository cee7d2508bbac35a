"""Labelled texts for `finetune --task classify`: one {"text": "...", "label": NAME or ID} per JSONL line.

Label names become class ids in sorted order (the same ids whatever order the lines come in, in the training and
the held-out file alike), and the training data must hold exactly num_labels names. Integer labels are the class
ids themselves, in [0, num_labels), named LABEL_i as transformers names them. A file mixes neither kind.
"""

from __future__ import annotations

from pathlib import Path

from qwenrt.classifier import pooled_ids
from qwenrt.errors import QwenrtError
from qwenrt.train.data import Example, read_jsonl
from qwenrt.validation import check_path


def read_labelled(source: str | Path | list[dict], what: str) -> list[tuple[str, str, str | int]]:
    """(where, text, label) per line of a JSONL file ("file:line") or per record of a list ("`what`: record n")."""
    if isinstance(source, list):
        if not source:
            raise QwenrtError(f"{what}: no labelled texts")
        return [_record(r, f"{what}: record {n}") for n, r in enumerate(source)]
    path = check_path(source, f"{what} (a JSONL file, or a list of records)")
    return [record for _, record in read_jsonl(path, _record, "labelled texts")]


def _record(record, where: str) -> tuple[str, str, str | int]:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str) or not record["text"]:
        raise QwenrtError(f"{where}: expected an object with a non-empty 'text' string and a 'label'")
    label = record.get("label")
    if isinstance(label, bool) or not isinstance(label, (str, int)) or label == "":
        raise QwenrtError(f"{where}: 'label' must be a label name (a non-empty string) or a class id (an integer), "
                          f"not {label!r:.40}")
    return where, record["text"], label


def label_map(records: list[tuple[str, str, str | int]], num_labels: int) -> dict[str | int, int]:
    """Label -> class id, as the training records define it, checked against num_labels."""
    named = isinstance(records[0][2], str)
    for where, _, label in records:
        if isinstance(label, str) != named:
            raise QwenrtError(f"{where}: label {label!r:.60} is {'an id' if named else 'a name'}, but the first "
                              f"record's is {'a name' if named else 'an id'}: use one kind in a file")
    if not named:
        for where, _, label in records:
            if not 0 <= label < num_labels:
                raise QwenrtError(f"{where}: label {label} is not a class id in [0, {num_labels}) (--num-labels "
                                  f"{num_labels})")
        return {i: i for i in range(num_labels)}
    seen: set[str] = set()
    for where, _, label in records:
        if label not in seen and len(seen) == num_labels:
            raise QwenrtError(f"{where}: label {label!r:.60} is label number {num_labels + 1}; --num-labels is "
                              f"{num_labels} (labels so far: {', '.join(sorted(seen))[:200]})")
        seen.add(label)
    if len(seen) < num_labels:
        raise QwenrtError(f"{records[0][0].rpartition(':')[0]}: {len(seen)} distinct labels "
                          f"({', '.join(sorted(seen))[:200]}), but --num-labels is {num_labels}")
    return {name: i for i, name in enumerate(sorted(seen))}


def label_names(ids: dict[str | int, int]) -> tuple[str, ...]:
    """The class names by id: the label names, or LABEL_i for integer labels."""
    return tuple(label if isinstance(label, str) else f"LABEL_{label}" for label in sorted(ids, key=ids.get))


def encode_labelled(tokenizer, records, ids: dict[str | int, int], pad_id: int, max_len: int) -> list[Example]:
    """Examples whose ids end at the token the head reads (classifier.pooled_ids) and whose label is the class id;
    a label the training data does not define, or a text over max_len tokens, is an error naming its line."""
    out = []
    for where, text, label in records:
        if label not in ids:
            known = (f"one of the training data's labels ({', '.join(map(str, ids))[:200]})"
                     if isinstance(next(iter(ids)), str) else f"a class id in [0, {len(ids)})")
            raise QwenrtError(f"{where}: label {label!r:.60} is not {known}")
        tokens = pooled_ids(tokenizer.encode(text), pad_id)
        if not tokens:
            raise QwenrtError(f"{where}: the text has no tokens")
        if len(tokens) > max_len:
            raise QwenrtError(f"{where}: {len(tokens)} tokens, over max_len {max_len}")
        out.append(Example(tokens, [False] * len(tokens), ids[label]))
    return out

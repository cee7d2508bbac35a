"""Quality figures of a model trained on the built-in tasks, on held-out prompts (greedy, fixed seeds).

    python -m qwenrt.tiny.evaluate [CKPT] [--n 200] [--quant]    (a progress bar on stderr, the JSON on stdout)

arithmetic: exact answers to addition / subtraction of held-out operand pairs, thinking on and off (without
thinking the reply's last paragraph is the answer, after the working);
tools: a well-formed call with the right function and arguments (parsed by qwenrt's own parser), and the right
final answer once the tool's response is in the conversation; mtp: how often the MTP head's greedy guess of token
t+2 equals the model's own token t+2 over the answers it generated; quant: held-out accuracy and mean KL against
bf16 for int8 and int4.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import partial

import torch
import torch.nn.functional as F
from tqdm import tqdm

from qwenrt.quant import QuantSpec
from qwenrt.tiny.tasks import TOOLS, Task, quality_tasks, run_tool

GREEDY = {"temperature": 0.0}
MODES = {False: "direct", True: "thinking"}
QUANT_SPECS = (("bf16", None), ("int8", QuantSpec(8)), ("int4 g32", QuantSpec(4, 32)), ("int4 g64", QuantSpec(4, 64)),
               ("int4 g128", QuantSpec(4, 128)))


def _complete(model, tokenizer, prompts, thinking: bool, tools=None, max_tokens: int = 200):
    from qwenrt import batch_generate

    return batch_generate(model, tokenizer, prompts, enable_thinking=thinking, tools=tools, max_tokens=max_tokens,
                          **GREEDY)


def final_answer(content: str) -> str:
    """A reply's last paragraph: all of it for most tasks, the answer after the working for arithmetic without
    thinking."""
    return content.strip().rsplit("\n\n", 1)[-1]


def answer_accuracy(model, tokenizer, tasks: list[Task], thinking: bool, batch: int = 50) -> float:
    """Share of tasks whose reply ends in exactly the expected answer (`final_answer`)."""
    right = 0
    for start in range(0, len(tasks), batch):
        part = tasks[start:start + batch]
        for task, c in zip(part, _complete(model, tokenizer, [t.messages for t in part], thinking)):
            right += final_answer(c.content) == task.answer and c.finish_reason == "stop"
    return right / len(tasks)


def _mentions(content: str, value: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(value)}(?![\w]|\.\d)", content) is not None


def tool_quality(model, tokenizer, tasks: list[Task], thinking: bool, batch: int = 50) -> dict:
    """{"call": share with exactly the expected call, "answer": share whose answer after the tool's response (run on
    the model's own call) states the right result}."""
    calls = answers = 0
    for start in range(0, len(tasks), batch):
        part = tasks[start:start + batch]
        firsts = _complete(model, tokenizer, [t.messages for t in part], thinking, TOOLS)
        follow = []
        for task, c in zip(part, firsts):
            ok = len(c.tool_calls) == 1 and c.tool_calls[0].name == task.call["name"] \
                and c.tool_calls[0].arguments == task.call["arguments"]
            calls += ok
            if c.tool_calls:
                call = c.tool_calls[0]
                turn = {"role": "assistant", "content": c.content, "tool_calls": [
                    {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
                if c.reasoning:
                    turn["reasoning_content"] = c.reasoning
                follow.append((task, [*task.messages, turn, {"role": "tool", "content": run_tool(call.name,
                                                                                               call.arguments)}]))
        if follow:
            seconds = _complete(model, tokenizer, [m for _, m in follow], thinking, TOOLS)
            answers += sum(_mentions(c.content, task.result) and not c.tool_calls
                           for (task, _), c in zip(follow, seconds))
    return {"call": calls / len(tasks), "answer": answers / len(tasks)}


def _prompt_ids(tokenizer, task: Task, thinking: bool) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(task.messages, enable_thinking=thinking, tools=task.tools))


@torch.inference_mode()
def mtp_agreement(model, mtp, tokenizer, tasks: list[Task], thinking: bool, depth: int = 1) -> float:
    """Over the answers the model generates greedily: at each answer position t (t+2 inside the answer), does the
    MTP head's greedy guess from (h_t, token t+1) equal the model's token t+2? At `depth` d > 1, its guess of token
    t+d+1 chained on its own output (mtp.chained_hidden: the engine's d-th draft, the ones before it right)."""
    from qwenrt.mtp import chained_hidden

    agree = total = 0
    for task, c in zip(tasks, _complete(model, tokenizer, [t.messages for t in tasks], thinking)):
        prompt = _prompt_ids(tokenizer, task, thinking)
        ids = torch.tensor([prompt + c.tokens])  # [1, T]
        h = chained_hidden(model, mtp, ids, depth)[-1]  # [1, T-1, D]: row t predicts ids[t+depth+1]
        guess = model.lm_head(h).argmax(-1)[0, len(prompt) - 1:ids.shape[1] - depth - 1]  # answer tokens 1+depth..
        target = ids[0, len(prompt) + depth:]
        agree += int((guess == target).sum())
        total += target.numel()
    return agree / max(total, 1)


@torch.inference_mode()
def mean_kl(model, reference, tokenizer, tasks: list[Task], thinking: bool) -> float:
    """Mean KL(reference || model) per token over the reference model's greedy answers, teacher-forced."""
    total, count = 0.0, 0
    for task, c in zip(tasks, _complete(reference, tokenizer, [t.messages for t in tasks], thinking)):
        prompt = _prompt_ids(tokenizer, task, thinking)
        ids = torch.tensor([prompt + c.tokens])
        ref = reference(ids)[0, len(prompt) - 1:-1].log_softmax(-1)
        out = model(ids)[0, len(prompt) - 1:-1].log_softmax(-1)
        total += float(F.kl_div(out, ref, log_target=True, reduction="sum"))
        count += ref.shape[0]
    return total / max(count, 1)


def quality_report(path, n: int = 200, seed: int = 1234, quant: bool = False, progress: bool = False) -> dict:
    """Every figure above for the checkpoint at `path` (bf16 weights as stored; fp32 compute for the MTP head);
    `progress`: a bar on stderr, a step per figure (per configuration for the quant figures)."""
    import qwenrt

    model, tokenizer = qwenrt.load(path)
    figures = _figures(model, tokenizer, n, seed)
    report = {}
    with tqdm(total=len(figures) + (len(QUANT_SPECS) if quant else 0), desc="evaluating", unit="figure",
              disable=not progress, file=sys.stderr) as bar:
        for name, figure in figures.items():
            bar.set_postfix_str(name)
            report.update(figure())
            bar.update()
        if quant:
            report["quant"] = quant_report(path, n, seed, bar)
    return report


def _figures(model, tokenizer, n: int, seed: int) -> dict:
    """name -> a function computing that figure's entries of the report, in the report's order."""
    figures = {}
    for thinking in (False, True):
        for family in ("add", "sub", "tool", "sort", "copy"):
            figures[f"{family} {MODES[thinking]}"] = partial(_task_figure, model, tokenizer, family, thinking, n, seed)
    for depth in (1, 2, 3):
        figures[_mtp_name(depth)] = partial(_mtp_figure, model, tokenizer, depth, n, seed)
    return figures


def _task_figure(model, tokenizer, family: str, thinking: bool, n: int, seed: int) -> dict:
    mode = MODES[thinking]
    if family == "tool":
        tools = quality_tasks("calculator", n // 2, seed) + quality_tasks("capital", n // 2, seed)
        return {f"tool {key} {mode}": value for key, value in tool_quality(model, tokenizer, tools, thinking).items()}
    return {f"{family} {mode}": answer_accuracy(model, tokenizer, quality_tasks(family, n, seed), thinking)}


def _mtp_figure(model, tokenizer, depth: int, n: int, seed: int) -> dict:
    from qwenrt.mtp import load_mtp_head

    mtp = load_mtp_head(model)
    mixed = quality_tasks("add", n // 4, seed) + quality_tasks("sub", n // 4, seed)
    agreement = (mtp_agreement(model, mtp, tokenizer, mixed, False, depth)
                 + mtp_agreement(model, mtp, tokenizer, mixed, True, depth)) / 2
    return {_mtp_name(depth): agreement}


def _mtp_name(depth: int) -> str:
    return "mtp agreement" + (f" {depth}" if depth > 1 else "")


def quant_report(path, n: int, seed: int, bar: tqdm | None = None) -> dict:
    """Per quantization: held-out accuracy (add/sub, thinking on) and mean KL against the bf16 model's greedy
    answers. `bar` steps once per configuration."""
    import qwenrt

    reference, tokenizer = qwenrt.load(path, dtype="bfloat16")
    tasks = quality_tasks("add", n // 2, seed) + quality_tasks("sub", n // 2, seed)
    out = {}
    for name, spec in QUANT_SPECS:
        if bar is not None:
            bar.set_postfix_str(f"quant {name}")
        model = reference if spec is None else qwenrt.load(path, dtype="bfloat16", quantize=spec)[0]
        out[name] = {"accuracy": answer_accuracy(model, tokenizer, tasks, True),
                     "kl": mean_kl(model, reference, tokenizer, tasks[: n // 4], True)}
        if bar is not None:
            bar.update()
    return out


def main() -> None:
    from qwenrt.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", help="default: the built-in model")
    p.add_argument("--n", type=int, default=200, help="tasks per family and mode")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quant", action="store_true", help="also int8 / int4 accuracy and KL against bf16")
    args = p.parse_args()
    report = quality_report(args.checkpoint or default_model_path(), args.n, args.seed, args.quant, progress=True)
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()

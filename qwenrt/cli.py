"""The `qwenrt` command line: one verb per subcommand, argument parsing only."""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys

from qwenrt import log
from qwenrt.default_model import DEFAULT_MODEL
from qwenrt.errors import QwenrtError
from qwenrt.hub import MODEL_HELP
from qwenrt.units import add_kv_cache_dtype_option, add_mmproj_option, add_rope_scaling_option, add_speculative_option
from qwenrt.server.main import add_parser as add_serve_parser


def _inspect(args) -> None:
    from qwenrt.inspect import format_report, inspect_checkpoint

    report = inspect_checkpoint(args.path, check_finite=args.finite_check, mmproj=args.mmproj,
                                rope_scaling=args.rope_scaling)
    print(json.dumps(report, indent=2) if args.json else format_report(report))


def _list(args) -> None:
    from qwenrt.catalog import format_models, list_models

    models = list_models()
    print(json.dumps([vars(m) for m in models], indent=2) if args.json else format_models(models))


def _pull(args) -> None:
    from qwenrt.catalog import pull

    print(pull(args.repo_id, args.revision))


def _sampling(args) -> dict:
    from qwenrt.console import SAMPLING_FIELDS, constraint_files

    return {**{name: getattr(args, name) for name in SAMPLING_FIELDS},
            **constraint_files(args.json_schema, args.grammar)}


def _engine_options(args) -> dict:
    from qwenrt.units import parse_size

    options = {"prefix_cache_dir": args.prefix_cache_dir}
    if args.prefix_cache_size is not None:
        options["prefix_cache_size"] = parse_size(args.prefix_cache_size)
    if args.speculative_tokens is not None:
        options["speculative_tokens"] = args.speculative_tokens
    options["kv_cache_dtype"] = args.kv_cache_dtype
    return options


def _run(args) -> None:
    from qwenrt.console import run

    run(args.model, args.prompt, raw=args.raw, system=args.system, thinking=args.thinking, dtype=args.dtype,
        device=args.device, prefill_chunk=args.prefill_chunk, max_context=args.max_context, sampling=_sampling(args),
        images=args.image or [], videos=args.video or [], check_finite=args.finite_check,
        engine_options=_engine_options(args), show_thinking=args.show_thinking,
        threads=args.threads, mmproj=args.mmproj, adapter=args.adapter, rope_scaling=args.rope_scaling)


def _chat(args) -> None:
    from qwenrt.console import chat

    chat(args.model, system=args.system, thinking=args.thinking, dtype=args.dtype, device=args.device,
         prefill_chunk=args.prefill_chunk, max_context=args.max_context, sampling=_sampling(args),
         check_finite=args.finite_check, engine_options=_engine_options(args), show_thinking=args.show_thinking,
         threads=args.threads, adapter=args.adapter, rope_scaling=args.rope_scaling)



def _at_least(low: int):
    """An argparse type: an integer >= low (refused while parsing, before anything loads)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _quantize(args) -> None:
    from qwenrt.convert import quantize_checkpoint

    print(quantize_checkpoint(args.src, args.dst, args.bits, args.group_size, progress=log.shows_progress()))


def _convert(args) -> None:
    from qwenrt.gguf.export import export_gguf

    print(export_gguf(args.src, args.out, args.type, progress=log.shows_progress(), mmproj=args.mmproj))


def _bench(args) -> None:
    from qwenrt.bench import run

    run(args)


def _qa(args) -> int:
    from qwenrt.qa import format_report, run_qa

    report = run_qa(args.model, checks=args.checks, kl=args.kl, group_size=args.group_size, dtype=args.dtype,
                    threads=args.threads, prompt_len=args.prompt_len, gen_len=args.gen_len,
                    assert_tps=args.assert_tps)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["passed"] else 1


def _merge_lora(args) -> None:
    from qwenrt.merge import merge_lora

    print(merge_lora(args.base, args.adapter, args.out, progress=log.shows_progress()))


def _train(args) -> None:
    from qwenrt.train import train_command

    options = {k: v for k, v in vars(args).items()
               if k not in ("verb", "run", "out", "recipe", "verbosity") and v is not None}
    print(train_command(args.out, args.recipe, **options))


def _finetune(args) -> None:
    from qwenrt.train import finetune_command

    options = {k: v for k, v in vars(args).items() if k not in ("verb", "run", "out", "verbosity") and v is not None}
    print(finetune_command(args.out, **options))


def _classify(args) -> None:
    from qwenrt.classifier import classify
    from qwenrt.loader import load

    model, tokenizer = load(args.model, threads=args.threads, progress=log.shows_progress())
    results = classify(model, tokenizer, args.texts)
    labels = model.classifier.labels
    for text, r in zip(args.texts, results):
        if args.json:
            print(json.dumps({"text": text, "label": r.label, "probs": dict(zip(labels, r.probs))}))
        else:
            print(f"{r.label}\t{max(r.probs):.4f}\t{text}")


FINETUNE_DESCRIPTION = (
    "LoRA adapters (rank 16 on every projection, DeltaNet's included) on a frozen checkpoint (default: the built-in "
    "model). --task classify reads --data as JSONL, one {\"text\": \"...\", \"label\": NAME or ID} per line: "
    "label names become class ids in sorted order and the data must hold exactly --num-labels of them; integer "
    "labels are the class ids, in [0, --num-labels), named LABEL_i. It trains the adapters and a classification "
    "head (transformers' Qwen3_5ForSequenceClassification: a linear map of the last token's hidden state) and "
    "writes OUT as a classifier checkpoint with the adapters merged (qwenrt classify, qwenrt serve's /classify, "
    "transformers' AutoModelForSequenceClassification) and OUT/adapter as a PEFT adapter (task_type SEQ_CLS); "
    "held-out accuracy and macro-F1 show in the progress bar and train_log.jsonl. --task sft trains on chat "
    "conversations as `qwenrt train --lora-rank 16` does. Without --eval-data a tenth of --data is held out.")


def _training_options(p: argparse.ArgumentParser, finetune: bool) -> None:
    """The options `train` and `finetune` share (finetune: LoRA always, no MTP head, no fresh model)."""
    data = "labelled texts (classify) or conversations (sft)" if finetune else "conversations"
    p.add_argument("--data", help=f"training {data}: JSONL" + ("" if finetune else ", one {\"messages\": [...], "
                   "\"tools\": [...]} per line"))
    p.add_argument("--eval-data", dest="eval_data", help=f"held-out {data} (JSONL), evaluated periodically")
    p.add_argument("--init", help="checkpoint to start from: a directory, hub repo id or qwenrt-tiny (its config, "
                   "tokenizer and weights; default: the built-in model qwenrt-tiny" +
                   (")" if finetune else ", unless --config)"))
    if not finetune:
        p.add_argument("--config", dest="model_config", help="config.json of a freshly initialised model (needs "
                       "--tokenizer)")
        p.add_argument("--tokenizer", help="directory with the tokenizer files, for --config")
    p.add_argument("--resume", action="store_true", default=None, help="continue from the last step checkpoint in OUT")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="train even if OUT already holds a model (it is replaced)")
    if not finetune:
        p.add_argument("--mtp-only", dest="mtp_only", action="store_true", default=None,
                       help="train the MTP head alone, the model frozen (fit a head to a trained model)")
    p.add_argument("--gradient-checkpointing", dest="gradient_checkpointing", action="store_true", default=None,
                   help="recompute each layer in the backward: far less memory, about a third more time")
    lora = p.add_argument_group("LoRA" if finetune else
                                "LoRA (the model frozen, adapters trained; OUT gets the adapter in PEFT's format)")
    lora.add_argument("--lora-rank", dest="lora_rank", type=_at_least(1), help="rank of the LoRA adapters" +
                      (" (default 16)" if finetune else ": train LoRA adapters of this rank"))
    lora.add_argument("--lora-alpha", dest="lora_alpha", type=float, help="LoRA alpha (scaling alpha / rank; "
                      "default 2 x rank)")
    lora.add_argument("--lora-targets", dest="lora_targets", metavar="A,B,...", help="projections to adapt, as "
                      "PEFT names them (default: every projection of every layer, DeltaNet's included, and the routed "
                      "MoE experts' banks mlp.experts.gate_up_proj, mlp.experts.down_proj)")
    lora.add_argument("--lora-dropout", dest="lora_dropout", type=float, help="dropout on the adapters' input")
    lora.add_argument("--lora-base", dest="lora_base", choices=["float32", "bfloat16", "int8", "int4"],
                      help="the frozen base's weights (default float32; int8 / int4: QLoRA, computed in fp32)")
    lora.add_argument("--plan", action="store_true", default=None, help="print the adapters, trainable parameters "
                      "and a memory estimate, and exit")
    mtp = () if finetune else (
        ("mtp-weight", float, "weight of the MTP head's loss (0: no MTP head)"),
        ("mtp-depths", int, "the MTP head's loss also on its own chained drafts, as speculative decoding uses it "
         "for more than one (default 1)"))
    for flag, kind, what in (("steps", int, "optimizer steps"),
                             ("batch-size", int, f"{'examples' if finetune else 'conversations'} per step"),
                             ("micro-batch-tokens", int, "padded tokens per micro-batch (gradient accumulation)"),
                             ("length-groups", int, "runs of this many steps regrouped by length: less padding "
                              "(default 1: off)"),
                             ("lr", float, "peak learning rate"),
                             ("warmup", int, "warm-up steps (default: a tenth of --steps, at most 50)"),
                             ("hold", int, "steps at the peak learning rate before the cosine decay"),
                             ("min-lr-ratio", float, "final learning rate / peak (cosine)"),
                             ("weight-decay", float, "AdamW weight decay"), ("clip", float, "gradient norm clip"),
                             *mtp,
                             ("max-len", int, f"longest {'example' if finetune else 'conversation'} in tokens"),
                             ("eval-every", int, "steps between held-out evaluations"),
                             ("save-every", int, "steps between resumable checkpoints"),
                             ("save-dtype", str, "dtype of the final checkpoint: float32 or bfloat16"),
                             ("seed", int, "seed of the initialisation and the data order"),
                             ("threads", int, "torch threads (1 is faster on a machine busy with other work)")):
        p.add_argument(f"--{flag}", dest=flag.replace("-", "_"), type=kind, help=what)
    log.add_options(p, verbose=False)


RUN_DESCRIPTION = ("Answer one prompt, streamed to stdout. On a terminal a thinking model's reasoning comes first, "
                   "dimmed, between 'Thinking...' and '...done thinking.' lines; when stdout is a pipe or a file it "
                   "gets the answer alone and the reasoning goes to stderr, with the load lines and the stats line "
                   "(--show-thinking / --hide-thinking choose; -q keeps stderr to errors).")


def _generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help=f"{MODEL_HELP}; default: the built-in model {DEFAULT_MODEL}")
    p.add_argument("--system", help="system message")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--thinking", dest="thinking", action="store_true", default=None, help="think before answering")
    think.add_argument("--no-thinking", dest="thinking", action="store_false", help="answer directly")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--show-thinking", dest="show_thinking", action="store_true", default=None,
                       help="print the reasoning on stdout, between 'Thinking...' and '...done thinking.' lines, "
                            "even into a pipe or file (default: so on a terminal, to stderr otherwise, not at all "
                            "with -q)")
    shown.add_argument("--hide-thinking", dest="show_thinking", action="store_false",
                       help="never print the reasoning (the model still thinks; --no-thinking stops that)")
    log.add_options(p)
    p.add_argument("--dtype", default="auto", help="auto (as stored), bfloat16, float16 or float32")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or mps")
    p.add_argument("--threads", type=_at_least(1), help="CPU threads (default: torch's, the physical cores)")
    p.add_argument("--adapter", metavar="DIR", help="run with this LoRA adapter (PEFT's format: adapter_config.json "
                   "+ adapter_model.safetensors)")
    p.add_argument("--prefill-chunk", type=_at_least(1), help="prompt tokens per prefill step at most (bounds memory)")
    p.add_argument("--max-context", "--max-model-len", dest="max_context", type=_at_least(2),
                   help="context limit in tokens (default and most: the model's)")
    add_rope_scaling_option(p)
    add_kv_cache_dtype_option(p)
    p.add_argument("--no-finite-check", dest="finite_check", action="store_false",
                   help="skip the NaN/Inf scan of the weights at load")
    p.add_argument("--prefix-cache-size", help="memory for reusing computed prompts, e.g. 2GiB (0 = off; default: "
                   "a tenth of RAM, at most 8GiB)")
    p.add_argument("--prefix-cache-dir", help="also keep reusable prompt states in this folder, across runs")
    add_speculative_option(p)
    s = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    s.add_argument("--max-tokens", "-n", dest="max_tokens", type=int, default=512)
    s.add_argument("--temperature", "--temp", dest="temperature", type=float, help="0 = greedy")
    s.add_argument("--top-k", dest="top_k", type=int)
    s.add_argument("--top-p", dest="top_p", type=float)
    s.add_argument("--min-p", dest="min_p", type=float)
    s.add_argument("--repetition-penalty", dest="repetition_penalty", type=float)
    s.add_argument("--presence-penalty", dest="presence_penalty", type=float)
    s.add_argument("--frequency-penalty", dest="frequency_penalty", type=float)
    s.add_argument("--seed", type=int)
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    c = p.add_argument_group("output constraint (at most one; after the thinking block when thinking)")
    c.add_argument("--json-schema", metavar="FILE", help="answer with JSON that follows this JSON Schema file")
    c.add_argument("--regex", metavar="PATTERN", help="answer with text that matches this regular expression")
    c.add_argument("--grammar", metavar="FILE", help="answer in this Lark grammar (llguidance's dialect)")


UNRECOGNIZED = "unrecognized arguments: "


class _Parser(argparse.ArgumentParser):
    """argparse that names the nearest verb, choice or option to a mistyped one, on one line (what Python 3.14's
    suggest_on_error does); other usage errors as argparse prints them."""

    def error(self, message: str):
        guess = _nearest(self, message)
        if guess is not None:
            self.exit(2, f"{self.prog}: error: {message}; did you mean {guess}?\n")
        super().error(message)


def _nearest(parser: argparse.ArgumentParser, message: str) -> str | None:
    """The verb, choice or option of `parser` closest to the word an argparse error `message` refuses, if any is."""
    if chosen := re.search(r"invalid choice: '([^']*)'", message):
        word = chosen.group(1)
        known = [c for a in parser._actions if a.choices for c in a.choices if isinstance(c, str)]
    elif message.startswith(UNRECOGNIZED):
        word = next((w.split("=")[0] for w in message[len(UNRECOGNIZED):].split() if w.startswith("--")), None)
        known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    else:
        return None
    by_name = {k.lstrip("-"): k for k in known}  # compared without the dashes every option shares
    close = difflib.get_close_matches(word.lstrip("-"), list(by_name), n=1) if word else []
    return by_name[close[0]] if close else None


def _verb_parser(parser: argparse.ArgumentParser, verb: str) -> argparse.ArgumentParser:
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return verbs.choices[verb]


def build_parser() -> argparse.ArgumentParser:
    from qwenrt import __version__

    parser = _Parser(prog="qwenrt", description="Exact, fast inference for Qwen3.5 models.")
    parser.add_argument("--version", action="version", version=f"qwenrt {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True)

    p = verbs.add_parser("inspect", help="describe a checkpoint and check it against its config")
    p.add_argument("path", nargs="?", default=DEFAULT_MODEL,
                   help=f"{MODEL_HELP} (default: the built-in model {DEFAULT_MODEL})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-finite-check", dest="finite_check", action="store_false",
                   help="skip the NaN/Inf scan of the weights (a read of every weight, as load does)")
    add_mmproj_option(p)
    add_rope_scaling_option(p)
    p.set_defaults(run=_inspect)

    p = verbs.add_parser("run", help="answer one prompt, streamed to stdout", description=RUN_DESCRIPTION)
    _generation_options(p)
    p.add_argument("prompt", help="the prompt; - reads it from stdin")
    p.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    p.add_argument("--image", action="append", help="image file, URL or data: URI (repeatable)")
    p.add_argument("--video", action="append", help="video file (needs the `video` extra) (repeatable)")
    add_mmproj_option(p)
    p.set_defaults(run=_run)

    p = verbs.add_parser("chat", help="interactive multi-turn chat")
    _generation_options(p)
    p.set_defaults(run=_chat)

    p = verbs.add_parser("quantize", help="write a weight-only int8 / int4 copy of a checkpoint")
    p.add_argument("src", help=f"checkpoint directory, hub repo id or {DEFAULT_MODEL} (the built-in model)")
    p.add_argument("dst", help="new directory for the quantized checkpoint (must not exist)")
    p.add_argument("--bits", type=int, required=True, help="8 (per output channel) or 4 (group-wise)")
    p.add_argument("--group-size", type=int, help="int4 group size: 32, 64 (default) or 128")
    log.add_options(p, verbose=False)
    p.set_defaults(run=_quantize)

    p = verbs.add_parser("convert", help="write a model as a GGUF file llama.cpp runs")
    p.add_argument("src", help=f"{MODEL_HELP}, or {DEFAULT_MODEL} (the built-in model)")
    p.add_argument("out", help="the new .gguf file (must not exist)")
    p.add_argument("--type", default="bf16", choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m"],
                   help="tensor types: bf16 (default), f16, f32, q8_0, q4_0, or llama.cpp's Q4_K_M mix")
    p.add_argument("--mmproj", metavar="OUT", help="also write the vision tower as this llama.cpp vision projector "
                   "file (.gguf; the tensors at --type, F16 for the 4-bit types)")
    log.add_options(p, verbose=False)
    p.set_defaults(run=_convert)

    p = verbs.add_parser("train", help="train a model on chat conversations, or rebuild the built-in model")
    p.add_argument("out", help="output directory: the trained checkpoint, step checkpoints, train_log.jsonl")
    p.add_argument("--recipe", choices=["tiny"], help="rebuild the built-in model from scratch (data, tokenizer, "
                   "model); with --steps to shorten it")
    _training_options(p, finetune=False)
    p.set_defaults(run=_train)

    p = verbs.add_parser("finetune", help="LoRA fine-tuning of a checkpoint: a classifier on labelled texts, or "
                         "chat conversations", description=FINETUNE_DESCRIPTION)
    p.add_argument("out", help="output directory: the classifier checkpoint and OUT/adapter (classify) or the "
                   "adapter (sft), step checkpoints, train_log.jsonl")
    p.add_argument("--task", choices=["classify", "sft"], default="sft", help="classify: labelled texts, a "
                   "sequence-classification head; sft: chat conversations (default; = train --lora-rank 16)")
    p.add_argument("--num-labels", dest="num_labels", type=_at_least(1), help="classify: the number of classes "
                   "(checked against the data)")
    p.add_argument("--eval-split", dest="eval_split", type=float, help="without --eval-data: the share of --data "
                   "held out for evaluation (default 0.1)")
    _training_options(p, finetune=True)
    p.set_defaults(run=_finetune)

    p = verbs.add_parser("merge-lora", help="write a checkpoint with a LoRA adapter merged into its weights")
    p.add_argument("base", help=f"full-precision checkpoint: a directory, hub repo id or {DEFAULT_MODEL}")
    p.add_argument("adapter", help="LoRA adapter directory (PEFT's adapter_config.json + adapter_model.safetensors)")
    p.add_argument("out", help="new directory for the merged checkpoint (must not exist)")
    log.add_options(p, verbose=False)
    p.set_defaults(run=_merge_lora)

    p = verbs.add_parser("bench", help="prefill / decode speed, time to first token, peak RSS, GB/s")
    p.add_argument("model", nargs="?", help=f"{MODEL_HELP} (default, without --shape: the built-in model "
                   f"{DEFAULT_MODEL})")
    p.add_argument("--shape", help="random weights at a published shape: 0.8b, 2b, 4b, 9b, 27b, 35b-a3b (Qwen3.5), "
                   "next-80b-a3b (Qwen3-Next), next-80b-a3b-4l (its first 4 layers), qwen3-vl-2b, qwen3-vl-4b, "
                   "qwen3-vl-8b (Qwen3-VL's text decoders)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (random ids) whose prefill is timed")
    p.add_argument("--gen-len", type=int, default=128, help="greedy decode steps (no stop at EOS)")
    p.add_argument("--depth", type=int, default=0, help="tokens of context before the prompt, prefilled and timed "
                   "apart (as llama-bench -d): prefill and decode speed at that depth (default 0)")
    p.add_argument("--depth-fill", default="prefill", help="how the --depth context is made: prefill (timed), or "
                   "random (random keys, values and DeltaNet states written directly: decode speed at a depth in "
                   "seconds, without its prefill)")
    add_rope_scaling_option(p)
    p.add_argument("--threads", type=int, help="default: torch's default (the physical cores)")
    p.add_argument("--dtype", default="bf16", help="compute dtype: bf16 or fp32")
    p.add_argument("--quantize", default="none", help="comma-separated: none, int8, int4 (e.g. none,int8,int4)")
    p.add_argument("--group-size", type=int, help="int4 group size (default 64)")
    p.add_argument("--speculative-tokens", default="0", help="comma-separated draft counts per step to measure: 0 "
                   "(off), 1..8, auto (e.g. 0,auto)")
    p.add_argument("--speculative", dest="speculative_tokens", action="store_const", const="0,auto",
                   help="measure with and without speculative decoding (= --speculative-tokens 0,auto)")
    p.add_argument("--kv-cache-dtype", default="auto", help="comma-separated KV cache dtypes to measure: auto (the "
                   "compute dtype), int8 (e.g. auto,int8)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per configuration, interleaved")
    p.add_argument("--compare", help="'transformers': also run transformers bf16 in the same run")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--json", help="also write the results (medians and every sample) to this file")
    p.set_defaults(run=_bench)

    p = verbs.add_parser("qa", help="check a model and this machine: contract, determinism, parity with "
                         "transformers, quantization KL, speed", description="Run the checks before trusting a model "
                         "or a machine: each passes, fails or is skipped (with the reason). Exit code 0 when every "
                         "check that ran passed, 1 otherwise.")
    p.add_argument("model", nargs="?", help=f"{MODEL_HELP}; default: the built-in model {DEFAULT_MODEL}")
    p.add_argument("--checks", metavar="A,B,...", help="the checks to run: contract, repeat, batch, speculative "
                   "(determinism: all three), speed, parity, kl (default: all but kl; kl with --kl)")
    p.add_argument("--kl", metavar="FORMATS", help="quantize in memory to these formats (int8, int4; comma-separated) "
                   "and report KL(bf16 || quantized) per token and top-1 agreement over a fixed text")
    p.add_argument("--group-size", type=int, help="int4 group size of --kl: 32, 64 (default) or 128")
    p.add_argument("--dtype", default="auto", help="of the determinism and speed checks: auto (as stored), "
                   "bfloat16, float16 or float32 (parity runs in float32, kl's reference in bfloat16)")
    p.add_argument("--threads", type=_at_least(1), help="CPU threads (default: torch's, the physical cores)")
    p.add_argument("--prompt-len", type=_at_least(1), default=128, help="prompt tokens of the speed check")
    p.add_argument("--gen-len", type=_at_least(1), default=64, help="greedy decode steps of the speed check")
    p.add_argument("--assert-tps", type=float, metavar="N", help="fail (exit code 1) when decode is slower than N "
                   "tokens/s")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    log.add_options(p, verbose=False)
    p.set_defaults(run=_qa)

    p = verbs.add_parser("classify", help="classify texts with a classifier checkpoint (qwenrt finetune --task "
                         "classify)", description="Print each text's most probable label and its probability, "
                         "tab-separated with the text (--json: one object per line with every label's probability).")
    p.add_argument("model", help=f"{MODEL_HELP} whose config's architectures end in ForSequenceClassification")
    p.add_argument("texts", nargs="+", metavar="text", help="a text to classify (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per text: text, label, probs by label")
    p.add_argument("--threads", type=_at_least(1), help="CPU threads (default: torch's, the physical cores)")
    log.add_options(p, verbose=False)
    p.set_defaults(run=_classify)

    add_serve_parser(verbs)

    p = verbs.add_parser("list", help="the models qwenrt can see: the built-in one and the Qwen3.5-family checkpoints "
                         "in the Hugging Face cache")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(run=_list)

    p = verbs.add_parser("pull", help="download a hub checkpoint into the Hugging Face cache ahead of time")
    p.add_argument("repo_id", help="hub repo id, e.g. Qwen/Qwen3.5-0.8B, or a GGUF file of a hub repo: "
                   "OWNER/REPO:QUANT or OWNER/REPO/PATH.gguf")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.set_defaults(run=_pull)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the verb's parser: its usage, and its options to suggest from
        _verb_parser(parser, args.verb).error(UNRECOGNIZED + " ".join(unknown))
    log.set_level(args.verbosity if "verbosity" in args else log.NORMAL)
    try:
        return args.run(args) or 0  # a verb's exit code where it has one (qa: 1 when a check failed)
    except QwenrtError as e:
        print(f"qwenrt: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        return 0

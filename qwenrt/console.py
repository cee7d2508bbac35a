"""Terminal front ends: `qwenrt run` (one prompt, streamed) and `qwenrt chat` (an interactive session)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from qwenrt.constraints import MAX_SOURCE_CHARS
from qwenrt.default_model import resolve_model
from qwenrt.errors import QwenrtError
from qwenrt.files import read_json, read_text
from qwenrt.generate import GenerationResponse, stream_generate
from qwenrt.config import load_config
from qwenrt.hub import resolve_model_path
from qwenrt.kernels import kernel_path
from qwenrt.loader import load, resolve_device, resolve_dtype
from qwenrt.parsing import parse_completion
from qwenrt.quant import weight_format
from qwenrt.sampling import SamplingParams, check_generates
from qwenrt.validation import check_max_context, check_text
from qwenrt.vision.media import DEFAULT_POLICY, preflight_media

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "stop", "regex")


def constraint_files(json_schema: str | None, grammar: str | None) -> dict:
    """--json-schema FILE and --grammar FILE as the sampling options they give (read and checked here, before the
    weights load)."""
    options = {}
    if json_schema is not None:
        options["json_schema"] = read_json(Path(json_schema), MAX_SOURCE_CHARS, "JSON Schema file")
    if grammar is not None:
        options["grammar"] = read_text(Path(grammar), MAX_SOURCE_CHARS, "grammar file")
    return options


def load_for_cli(source: str | None, path, dtype: str, device: str, check_finite: bool = True,
                 engine_options: dict | None = None, threads: int | None = None):
    """Load `path` (what `check_options` resolved `source` to) with progress and timing on stderr, naming the
    built-in model when no source was given."""
    start = time.perf_counter()
    print(f"loading {resolve_model(source)[1]} …", file=sys.stderr, flush=True)
    model, tokenizer = load(path, dtype=dtype, device=device, progress=True, check_finite=check_finite,
                            threads=threads, **(engine_options or {}))
    c = model.config.text
    threads = torch.get_num_threads()
    kernels = f", CPU kernels: {kernel_path()}, {threads} thread{'s' * (threads != 1)}"
    kernels = kernels if model.device.type == "cpu" else ""
    print(f"loaded {c.num_hidden_layers}-layer {'MoE ' if c.is_moe else ''}model ({model.dtype}, weights "
          f"{weight_format(model)}) in {time.perf_counter() - start:.1f} s{kernels}", file=sys.stderr, flush=True)
    return model, tokenizer


def check_options(source: str | None, sampling: dict, device: str, dtype: str, max_context: int | None,
                  media: list[tuple[str, str]] = ()):
    """What can be refused before the weights load: sampling values, the device, the dtype, local media files, the
    context limit against the checkpoint's config. Returns the checkpoint directory (a hub id resolved; no source: the
    built-in model's)."""
    check_generates(SamplingParams(**{k: v for k, v in sampling.items() if v is not None}))
    resolve_device(device)
    resolve_dtype(dtype, None)
    for kind, item in media:  # ("image" | "video", source)
        preflight_media(item, DEFAULT_POLICY, kind)
    path = resolve_model_path(resolve_model(source)[0])
    check_max_context(max_context, load_config(path).text.max_position_embeddings)
    return path


def sampling_params(options: dict, tokenizer) -> SamplingParams:
    """The checkpoint's generation_config sampling defaults, overridden by what the user set. A default out of range
    is refused naming the file (the user did not write it)."""
    chosen = {k: v for k, v in options.items() if v is not None}
    defaults = {}
    if tokenizer is not None:
        given = tokenizer.generation_defaults
        if given.get("do_sample", True) is False:
            defaults["temperature"] = 0.0
        else:
            defaults.update({k: given[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                                    "presence_penalty", "frequency_penalty") if k in given})
    defaults = {k: v for k, v in defaults.items() if k not in chosen}
    try:
        SamplingParams(**defaults)
    except QwenrtError as e:
        raise QwenrtError(f"the checkpoint's generation_config.json: {e} (set it explicitly to override)") from None
    return SamplingParams(**defaults, **chosen)


def stats_line(last: GenerationResponse) -> str:
    cached = f" ({last.cached_tokens} cached)" if last.cached_tokens else ""
    drafts = last.drafts.summary() if last.drafts is not None else ""
    return (f"[prompt {last.prompt_tokens} tokens{cached}, {last.prompt_tps:.1f} tok/s | generated {last.generation_tokens} "
            f"tokens, {last.generation_tps:.1f} tok/s | first token after {last.time_to_first_token:.2f} s | "
            + (f"{drafts} | " if drafts else "") + f"finish: {last.finish_reason}]")


def _stream(model, tokenizer, prompt, params, thinking, prefill_chunk, max_context, out: list[str]):
    """Write the answer to stdout as it streams, collecting the deltas in `out`; returns the last response. A prompt
    that takes more than a second to read gets a progress bar on stderr."""
    last, bar = None, None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, initial=done, desc="reading the prompt", unit="tok", delay=1.0, leave=False,
                       file=sys.stderr)
        bar.update(done - bar.n)

    try:
        for last in stream_generate(model, tokenizer, prompt, params=params, enable_thinking=thinking,
                                    prefill_chunk=prefill_chunk, max_context=max_context, on_prefill=progress):
            if bar is not None:
                bar.close()
                bar = None
            out.append(last.text)
            sys.stdout.write(last.text)
            sys.stdout.flush()
    finally:
        if bar is not None:
            bar.close()
    return last


def user_message(text: str, images: list[str], videos: list[str]) -> dict:
    """A user turn; with media, OpenAI-style content parts (images, then videos, then the text)."""
    if not images and not videos:
        return {"role": "user", "content": text}
    parts = [{"type": "image", "image": i} for i in images] + [{"type": "video", "video": v} for v in videos]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def run(source: str | None, prompt: str, *, raw: bool, system: str | None, thinking: bool | None, dtype: str,
        device: str, prefill_chunk: int | None, max_context: int | None, sampling: dict, images: list[str] = (),
        videos: list[str] = (), check_finite: bool = True, engine_options: dict | None = None,
        threads: int | None = None) -> None:
    """`qwenrt run`: stream one answer to stdout; load progress and a stats line go to stderr."""
    if prompt == "-":
        try:
            prompt = sys.stdin.read()
        except UnicodeDecodeError as e:
            raise QwenrtError(f"the prompt on stdin is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    check_text(prompt, "the prompt")
    if raw and (images or videos):
        raise QwenrtError("--image/--video need the chat template; drop --raw")
    path = check_options(source, sampling, device, dtype, max_context,
                         [("image", i) for i in images] + [("video", v) for v in videos])
    model, tokenizer = load_for_cli(source, path, dtype, device, check_finite, engine_options, threads)
    if tokenizer is None:
        raise QwenrtError(f"{source}: the checkpoint has no tokenizer.json; text prompts need one")
    params = sampling_params(sampling, tokenizer)
    if not raw:
        prompt = ([{"role": "system", "content": system}] if system else []) + [user_message(prompt, images, videos)]
    last = _stream(model, tokenizer, prompt, params, thinking, prefill_chunk, max_context, [])
    sys.stdout.write("\n")
    print(stats_line(last), file=sys.stderr)


CHAT_HELP = "commands: /reset (forget the conversation), /thinking on|off, /exit (or Ctrl-D); Ctrl-C stops an answer"


def chat(source: str | None, *, system: str | None, thinking: bool | None, dtype: str, device: str,
         prefill_chunk: int | None, max_context: int | None, sampling: dict, check_finite: bool = True,
         engine_options: dict | None = None, threads: int | None = None) -> None:
    """`qwenrt chat`: a multi-turn session on the terminal; each turn reuses what the previous ones computed."""
    path = check_options(source, sampling, device, dtype, max_context)
    model, tokenizer = load_for_cli(source, path, dtype, device, check_finite, engine_options, threads)
    if tokenizer is None:
        raise QwenrtError(f"{source}: the checkpoint has no tokenizer.json; chat needs one")
    params = sampling_params(sampling, tokenizer)
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is refused as a turn, not fatal to the session
        sys.stdin.reconfigure(errors="surrogateescape")
    print(CHAT_HELP, file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            history = list(start)
            print("[conversation reset]", file=sys.stderr)
            continue
        if command.startswith("/thinking"):
            arg = command.split()[1:] or [""]
            if arg[0] not in ("on", "off"):
                print("usage: /thinking on|off", file=sys.stderr)
                continue
            thinking = arg[0] == "on"
            print(f"[thinking {arg[0]}]", file=sys.stderr)
            continue
        if command.startswith("/"):
            print(f"unknown command {command.split()[0]}; {CHAT_HELP}", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        parts, last, interrupted = [], None, False
        try:
            last = _stream(model, tokenizer, history, params, thinking, prefill_chunk, max_context, parts)
        except KeyboardInterrupt:
            interrupted = True
        except QwenrtError as e:  # e.g. the conversation outgrew the context: the session goes on
            history.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        if interrupted:
            print("[stopped]", file=sys.stderr)
        elif last is not None:
            print(stats_line(last), file=sys.stderr)
        # keep what was said, reasoning apart, so the template can drop old thinking as it should
        prompt_text = tokenizer.apply_chat_template(history, add_generation_prompt=True, enable_thinking=thinking)
        parsed = parse_completion("".join(parts), prompt_text.rstrip().endswith("<think>"))
        turn = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            turn["reasoning_content"] = parsed.reasoning
        history.append(turn)

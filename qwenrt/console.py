"""Terminal front ends: `qwenrt run` (one prompt, streamed) and `qwenrt chat` (an interactive session)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from qwenrt import log
from qwenrt.chat_session import Session, run as run_session
from qwenrt.constraints import MAX_SOURCE_CHARS
from qwenrt.default_model import resolve_model
from qwenrt.errors import QwenrtError
from qwenrt.files import CheckpointDir, read_json, read_text
from qwenrt.generate import GenerationResponse, stream_generate
from qwenrt.config import QWEN3_5, load_config, with_rope_scaling
from qwenrt.hub import resolve_model_path
from qwenrt.gguf.reader import is_gguf, open_gguf
from qwenrt.kernels import kernel_path
from qwenrt.loader import load, resolve_device, resolve_dtype
from qwenrt.parsing import THINK_START, parse_completion
from qwenrt.quant import weight_format
from qwenrt.sampling import SamplingParams, check_generates
from qwenrt.stream_parser import ReasoningSplitter
from qwenrt.validation import check_max_context, check_text
from qwenrt.vision.media import DEFAULT_POLICY, preflight_media

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "stop", "regex")
THINKING_OPEN, THINKING_CLOSE = "Thinking...", "...done thinking."  # ollama's lines around shown reasoning
DIM, RESET = "\x1b[2m", "\x1b[0m"


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
                 engine_options: dict | None = None, threads: int | None = None, mmproj: str | None = None,
                 adapter: str | None = None, rope_scaling: dict | None = None):
    """Load `path` (what `check_options` resolved `source` to) with progress and timing on stderr, naming the
    built-in model when no source was given."""
    start = time.perf_counter()
    log.info(f"loading {resolve_model(source)[1]} …")
    log.detail(f"checkpoint: {path}")
    model, tokenizer = load(path, dtype=dtype, device=device, progress=log.shows_progress(), check_finite=check_finite,
                            threads=threads, mmproj=mmproj, adapter=adapter, rope_scaling=rope_scaling,
                            **(engine_options or {}))
    c = model.config.text
    kernels = ""
    if model.device.type == "cpu":
        threads = torch.get_num_threads()
        kernels = f", CPU kernels: {kernel_path()}, {threads} thread{'s' * (threads != 1)}"
    family = "" if c.family == QWEN3_5 else f"{c.family} "  # Qwen3.5's unnamed, as in `inspect`
    log.info(f"loaded {c.num_hidden_layers}-layer {family}{'MoE ' if c.is_moe else ''}model ({model.dtype}, weights "
             f"{weight_format(model)}) in {time.perf_counter() - start:.1f} s{kernels}")
    log.detail(f"device: {model.device}")
    return model, tokenizer


def check_options(source: str | None, sampling: dict, device: str, dtype: str, max_context: int | None,
                  media: list[tuple[str, str]] = (), mmproj: str | None = None, rope_scaling: dict | None = None):
    """What can be refused before the weights load: sampling values, the device, the dtype, local media files, the
    checkpoint's tokenizer, media on a text-only model, the context limit against the checkpoint's config. Returns
    the checkpoint directory (a hub id resolved; no source: the built-in model's)."""
    check_generates(SamplingParams(**{k: v for k, v in sampling.items() if v is not None}))
    resolve_device(device)
    resolve_dtype(dtype, None)
    for kind, item in media:  # ("image" | "video", source)
        preflight_media(item, DEFAULT_POLICY, kind)
    path = resolve_model_path(resolve_model(source)[0])
    if is_gguf(path):
        gguf = open_gguf(path, mmproj, blocks=False)
        config = gguf.config
        if gguf.tokenizer is None:
            raise QwenrtError(f"{path}: the file has no tokenizer (tokenizer.ggml.* metadata); text prompts need one")
    else:
        config = load_config(path)
        if not CheckpointDir(path).exists("tokenizer.json"):
            raise QwenrtError(f"{path}: the checkpoint has no tokenizer.json; text prompts need one")
    if media and not config.is_vlm and is_gguf(path):
        raise QwenrtError(f"{path}: a GGUF model file holds no vision tower; --image/--video need its vision "
                          "projector file too (--mmproj FILE)")
    if media and not config.is_vlm:
        raise QwenrtError(f"{path}: a text-only model (no vision_config in config.json); --image/--video need a "
                          "vision-language checkpoint")
    check_max_context(max_context, with_rope_scaling(config, rope_scaling).text.context_limit)
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


def describe_sampling(params: SamplingParams) -> str:
    """The sampling settings in effect for -v: temperature and max_tokens, and the rest where they are not neutral."""
    neutral = SamplingParams()
    shown = [f"{name} {getattr(params, name)}" for name in SAMPLING_FIELDS if name != "regex"
             if name in ("temperature", "max_tokens") or getattr(params, name) != getattr(neutral, name)]
    if params.constraint is not None:
        shown.append(f"constraint {params.constraint.kind}")
    return "sampling: " + ", ".join(shown)


def stats_line(last: GenerationResponse) -> str:
    cached = f" ({last.cached_tokens} cached)" if last.cached_tokens else ""
    drafts = last.drafts.summary() if last.drafts is not None else ""
    return (f"[prompt {last.prompt_tokens} tokens{cached}, {last.prompt_tps:.1f} tok/s | generated {last.generation_tokens} "
            f"tokens, {last.generation_tps:.1f} tok/s | first token after {last.time_to_first_token:.2f} s | "
            + (f"{drafts} | " if drafts else "") + f"finish: {last.finish_reason}]")


def reasoning_destination(show: bool | None):
    """Where the reasoning goes: stdout with --show-thinking, nowhere with --hide-thinking; by default stdout on a
    terminal, stderr when stdout is a pipe or a file (which then holds the answer alone), nowhere with -q."""
    if show is None:
        if not log.shows_progress():
            return None
        return sys.stdout if sys.stdout.isatty() else sys.stderr
    return sys.stdout if show else None


def _styled(stream) -> bool:
    """Whether `stream` takes ANSI styling: a terminal, NO_COLOR unset, TERM not dumb."""
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


class AnswerWriter:
    """Writes a streamed completion: the answer to stdout; the reasoning, when it has somewhere to go (`reasoning_to`),
    between a THINKING_OPEN and a THINKING_CLOSE line, dimmed on a terminal. `thinking_started`: the prompt opened
    the think block; None: a raw completion, written as it comes."""

    def __init__(self, thinking_started: bool | None, reasoning_to=None):
        self._split = ReasoningSplitter(thinking_started) if thinking_started is not None else None
        self._to = reasoning_to
        self._dim = reasoning_to is not None and _styled(reasoning_to)
        self._opened = self._closed = False

    def write(self, delta: str, final: bool = False) -> None:
        reasoning, content = self._split.feed(delta, final) if self._split is not None else ("", delta)
        if reasoning and self._to is not None:
            if not self._opened:
                self._opened = True
                self._aside(THINKING_OPEN + "\n")
            self._aside(reasoning)
        if self._opened and not self._closed and (content or final or self._split.reasoning_done):
            self._closed = True
            self._aside("\n" + THINKING_CLOSE + "\n\n")
        if content:
            sys.stdout.write(content)
            sys.stdout.flush()

    def _aside(self, text: str) -> None:
        self._to.write(f"{DIM}{text}{RESET}" if self._dim else text)  # reset each time: Ctrl-C leaves no dim terminal
        self._to.flush()


def _opens_thinking(tokenizer, prompt, thinking: bool | None) -> bool | None:
    """Whether the chat template's generation prompt opens a <think> block; None for a raw (string) prompt."""
    if isinstance(prompt, str):
        return None
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, enable_thinking=thinking)
    return text.rstrip().endswith(THINK_START)


def _stream(model, tokenizer, prompt, params, thinking, prefill_chunk, max_context, out: list[str],
            started: bool | None, show_thinking: bool | None = None):
    """Write the answer to stdout as it streams (the reasoning where `reasoning_destination` says; `started`: what
    _opens_thinking says of the prompt), collecting the deltas in `out`; returns the last response. A prompt that takes more than a second to read gets a progress bar
    on stderr."""
    last, bar = None, None
    writer = AnswerWriter(started, reasoning_destination(show_thinking))

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, initial=done, desc="reading the prompt", unit="tok", delay=1.0, leave=False,
                       file=sys.stderr, disable=not log.shows_progress())
        bar.update(done - bar.n)

    try:
        for last in stream_generate(model, tokenizer, prompt, params=params, enable_thinking=thinking,
                                    prefill_chunk=prefill_chunk, max_context=max_context, on_prefill=progress):
            if bar is not None:
                bar.close()
                bar = None
            out.append(last.text)
            writer.write(last.text, final=last.finish_reason is not None)
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
        show_thinking: bool | None = None, threads: int | None = None, mmproj: str | None = None,
        adapter: str | None = None, rope_scaling: dict | None = None) -> None:
    """`qwenrt run`: stream one answer to stdout (the reasoning where `reasoning_destination` says); load progress
    and a stats line go to stderr."""
    began = time.perf_counter()
    if prompt == "-":
        try:
            prompt = sys.stdin.read()
        except UnicodeDecodeError as e:
            raise QwenrtError(f"the prompt on stdin is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    check_text(prompt, "the prompt")
    if raw and (images or videos):
        raise QwenrtError("--image/--video need the chat template; drop --raw")
    path = check_options(source, sampling, device, dtype, max_context,
                         [("image", i) for i in images] + [("video", v) for v in videos], mmproj, rope_scaling)
    checked = time.perf_counter()
    model, tokenizer = load_for_cli(source, path, dtype, device, check_finite, engine_options, threads, mmproj,
                                    adapter, rope_scaling)
    loaded = time.perf_counter()
    params = sampling_params(sampling, tokenizer)
    log.detail(describe_sampling(params))
    if not raw:
        prompt = ([{"role": "system", "content": system}] if system else []) + [user_message(prompt, images, videos)]
    last = _stream(model, tokenizer, prompt, params, thinking, prefill_chunk, max_context, [],
                   _opens_thinking(tokenizer, prompt, thinking), show_thinking)
    sys.stdout.write("\n")
    log.info(stats_line(last))
    done = time.perf_counter()
    log.detail(f"time: checks {checked - began:.2f} s, load {loaded - checked:.2f} s, answer {done - loaded:.2f} s, "
               f"total {done - began:.2f} s")


def chat(source: str | None, *, system: str | None, thinking: bool | None, dtype: str, device: str,
         prefill_chunk: int | None, max_context: int | None, sampling: dict, check_finite: bool = True,
         engine_options: dict | None = None, show_thinking: bool | None = None,
         threads: int | None = None, adapter: str | None = None, rope_scaling: dict | None = None) -> None:
    """`qwenrt chat`: a multi-turn session on the terminal (qwenrt/chat_session.py); each turn reuses what the
    previous ones computed."""
    path = check_options(source, sampling, device, dtype, max_context, rope_scaling=rope_scaling)
    model, tokenizer = load_for_cli(source, path, dtype, device, check_finite, engine_options, threads,
                                    adapter=adapter, rope_scaling=rope_scaling)

    def resolve(options: dict) -> SamplingParams:
        params = sampling_params(options, tokenizer)
        check_generates(params)
        return params

    def answer(messages: list[dict], options: dict, thinking: bool | None) -> dict:
        parts, started = [], _opens_thinking(tokenizer, messages, thinking)
        last = _stream(model, tokenizer, messages, resolve(options), thinking, prefill_chunk, max_context, parts,
                       started, show_thinking)
        sys.stdout.write("\n")
        if last is not None:
            log.info(stats_line(last))
        return _assistant_turn("".join(parts), started)

    log.detail(describe_sampling(resolve(sampling)))
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is refused as a turn, not fatal to the session
        sys.stdin.reconfigure(errors="surrogateescape")
    run_session(Session(dict(sampling), system, thinking), answer, resolve)


def _assistant_turn(text: str, started: bool) -> dict:
    """The answer as the conversation keeps it, reasoning apart, so the template can drop old thinking as it should
    (`started`: the prompt opened a <think> block)."""
    parsed = parse_completion(text, started)
    turn = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        turn["reasoning_content"] = parsed.reasoning
    return turn

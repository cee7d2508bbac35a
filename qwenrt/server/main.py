"""`qwenrt serve [MODEL]`: bind the port, load the model in the background, serve until Ctrl-C (or SIGTERM): then
new requests are refused, the answers under way cut (each client gets an error event and [DONE]) and the process
exits 0."""

from __future__ import annotations

import argparse
import errno
import gc
import math
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

from qwenrt import log
from qwenrt.default_model import DEFAULT_MODEL, resolve_model
from qwenrt.errors import QwenrtError
from qwenrt.hub import MODEL_HELP
from qwenrt.units import (add_kv_cache_dtype_option, add_mmproj_option, add_rope_scaling_option,
                          add_speculative_option, parse_size)


def load_engine(args):
    """Load the model and start its engine; checks that a request at the full context can ever run."""
    from qwenrt.console import sampling_params
    from qwenrt.engine import Engine
    from qwenrt.engine.core import _size
    from qwenrt.loader import load
    from qwenrt.quant import weight_format

    start = time.perf_counter()
    model, tokenizer = load(args.model, dtype=args.dtype, quantize=args.quantize, progress=log.shows_progress(),
                            threads=args.threads, mmproj=args.mmproj, adapters=dict(args.lora) or None,
                            rope_scaling=args.rope_scaling)
    if args.tokenizer is not None:
        from qwenrt.hub import resolve_model_path
        from qwenrt.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model_path(args.tokenizer), model_vocab_size=model.config.text.vocab_size)
    if tokenizer is None:
        raise QwenrtError(f"{args.tokenizer or args.model}: no tokenizer.json; the server needs one (--tokenizer)")
    sampling_params({}, tokenizer)  # a generation_config.json default out of range fails here, not every request
    limits = {"max_running": args.max_running, "max_queue": args.max_queue, "max_model_len": args.max_model_len,
              "max_batched_tokens": args.max_num_batched_tokens,
              "memory_budget": parse_size(args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes else None,
              "prefix_cache_size": parse_size(args.prefix_cache_size) if args.prefix_cache_size else None,
              "prefix_cache_dir": args.prefix_cache_dir, "speculative_tokens": args.speculative_tokens,
              "kv_cache_dtype": args.kv_cache_dtype}
    engine = Engine(model, tokenizer, **{k: v for k, v in limits.items() if v is not None})
    per_token, full = engine.kv_token_bytes, engine.state_bytes + engine.kv_token_bytes * engine.max_model_len
    if full > engine.memory_budget:
        fits = (engine.memory_budget - engine.state_bytes) // per_token
        raise QwenrtError(f"a request at the full context ({engine.max_model_len} tokens) needs {_size(full)} of "
                          f"cache, over the cache budget of {_size(engine.memory_budget)}: pass --max-model-len "
                          f"{fits} or less, or a larger --kv-cache-memory-bytes")
    engine.grammar_compiler()  # the first structured-output request does not wait for its token tables
    engine.start()
    running = engine.scheduler.config.max_running
    at_once = min(running, engine.memory_budget // full)
    note = "" if at_once == running else " (lower --max-model-len, or give max_tokens, for more)"
    log.info(f"loaded {args.model or DEFAULT_MODEL} ({model.dtype}, weights {weight_format(model)}) in "
             f"{time.perf_counter() - start:.1f} s; context {engine.max_model_len} tokens; cache budget "
             f"{_size(engine.memory_budget)}, {_size(full)} per request at the full context (one without max_tokens): "
             f"{at_once} such requests run at once{note}, up to --max-running {running} in all")
    _describe_setup(model, engine)
    return engine


def _describe_setup(model, engine) -> None:
    """-v: where the model came from and how the engine runs it."""
    import torch

    from qwenrt.engine.core import _size

    prefix = _size(engine.prefix_cache.budget) if engine.prefix_cache is not None else "off"
    log.detail(f"checkpoint: {model.checkpoint_path}")
    log.detail(f"device: {model.device}, {torch.get_num_threads()} torch threads")
    log.detail(f"engine: {engine.scheduler.config.max_batched_tokens} tokens per step, prefix cache {prefix}, "
               f"speculative tokens {engine.speculative_tokens}, KV cache "
               f"{str(engine.kv_dtype).removeprefix('torch.')} ({engine.kv_token_bytes} bytes per token)")


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before anything loads: a port in use is a one-line error at once,
    and uvicorn is handed this socket, so nothing can take the port in between."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait
        sock.bind((host, port))
        sock.listen()
    except OverflowError:
        sock.close()
        raise QwenrtError(f"--port must be in 0..65535, got {port}") from None
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise QwenrtError(f"port {port} on {host} is already in use (another server? pick a free one with "
                              "--port)") from None
        if e.errno == errno.EACCES:
            raise QwenrtError(f"no permission to listen on port {port} on {host} (ports below 1024 need "
                              "privileges; pick another with --port)") from None
        raise QwenrtError(f"cannot listen on {host} port {port}: {e.strerror or e} (--host, --port)") from None
    return sock


def make_app(args, on_load_failed=None):
    """(the FastAPI app `qwenrt serve` runs for `args`, its limits): the model loads once the app starts.
    `on_load_failed(message)` is called if the load fails."""
    try:
        from qwenrt.server.app import ServerConfig, create_app
        from qwenrt.server.limits import Limits, default_max_connections
        from qwenrt.vision.media import MediaPolicy
    except ImportError as e:
        raise QwenrtError(f"qwenrt serve needs the serve extra ({e.name} is missing): pip install 'qwenrt[serve]'"
                          ) from None
    allowed = None
    if args.allowed_local_media_path:
        allowed = Path(os.path.realpath(args.allowed_local_media_path))
        if not allowed.is_dir():
            raise QwenrtError(f"--allowed-local-media-path {args.allowed_local_media_path}: not a directory")
    model = str(args.model) if args.model is not None else DEFAULT_MODEL
    config = ServerConfig(model, args.served_model_name or [model],
                          args.api_key or os.environ.get("QWENRT_API_KEY") or None,
                          MediaPolicy.strict(file_root=allowed), args.allowed_origins, dict(args.lora))
    clash = set(config.adapters) & set(config.served_model_names)
    if clash:
        raise QwenrtError(f"--lora {min(clash)}: the name of the base model too (--served-model-name); name the "
                          "adapter otherwise")
    given = {"max_request_bytes": parse_size(args.max_request_bytes) if args.max_request_bytes else None,
             "header_timeout": args.header_timeout, "max_connections": args.max_connections or default_max_connections()}
    limits = Limits(**{k: v for k, v in given.items() if v is not None})
    if limits.max_request_bytes < 1:
        raise QwenrtError(f"--max-request-bytes must be at least 1 byte, got {args.max_request_bytes!r}")
    return create_app(config, lambda: load_engine(args), on_load_failed=on_load_failed, limits=limits), limits


def serve(args) -> None:
    given = [flag for flag, value in (("--replicas", args.replicas != (1, 1)), ("--threads-per-replica",
             args.threads_per_replica), ("--ray-address", args.ray_address), ("--routing", args.routing != "affinity"))
             if value]
    if given and not args.ray:
        raise QwenrtError(f"{', '.join(given)}: only with --ray (replicas on Ray Serve)")
    if args.ray:
        from qwenrt.scaleout.ray_app import serve_on_ray

        return serve_on_ray(args)
    listener = listen(args.host, args.port)
    try:
        import uvicorn

        from qwenrt.server.limits import guarded_protocol
    except ImportError as e:
        raise QwenrtError(f"qwenrt serve needs the serve extra ({e.name} is missing): pip install 'qwenrt[serve]'"
                          ) from None
    name = resolve_model(args.model)[1]
    server = None

    def stop(_: str) -> None:
        server.should_exit = True

    app, limits = make_app(args, on_load_failed=stop)
    state = app.state.qwenrt
    log_level = args.log_level or ("info" if log.shows_progress() else "warning")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level,
                                           access_log=not args.disable_uvicorn_access_log,
                                           timeout_graceful_shutdown=5, http=guarded_protocol(limits),
                                           timeout_keep_alive=args.timeout_keep_alive))

    def on_signal(sig: int, _frame) -> None:
        # uvicorn's own handler, but the answers under way are cut at once rather than waited for, and the signal is
        # not raised again once stopped (a stop on request exits 0); a second Ctrl-C stops waiting for anything
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True
        state.shut_down_soon()

    server.handle_exit = on_signal
    log.info(f"qwenrt serve: http://{args.host}:{listener.getsockname()[1]} (loading {name}; /health answers 200 "
             "when ready; Ctrl-C stops)")
    server.run(sockets=[listener])
    if state.stop(0) is not None:  # a thread in torch when Python tears down aborts the process (C++ terminate)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    gc.freeze()  # the exit's collections walked its ~300K objects for ~1.5 s on a busy machine; none need freeing
    if state.load_error is not None:
        raise QwenrtError(state.load_error)


def _replicas(text: str) -> tuple[int, int]:
    """An argparse type: N (that many replicas) or MIN:MAX (Ray Serve autoscales between them) -> (MIN, MAX)."""
    low, colon, high = text.partition(":")
    try:
        bounds = int(low), int(high if colon else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"N or MIN:MAX replicas, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1] <= 4096:
        raise argparse.ArgumentTypeError(f"replicas must be 1 <= MIN <= MAX <= 4096, got {text!r}")
    return bounds


def _positive(kind):
    """An argparse type: a finite number of `kind` above 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    return parse


_ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")


def _origin(text: str) -> str:
    """An argparse type: `*` or an origin as a browser sends it, scheme://host[:port] (one with a path never
    matches)."""
    if text != "*" and not _ORIGIN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not an origin: {text!r} (scheme://host[:port], no path; or *)")
    return text


def _lora(text: str) -> tuple[str, str]:
    """NAME=DIR -> (NAME, DIR)."""
    name, sep, directory = text.partition("=")
    if not (sep and name and directory):
        raise argparse.ArgumentTypeError(f"expected NAME=DIR (an adapter's name and its directory), got {text!r}")
    return name, directory


def add_parser(verbs) -> None:
    p = verbs.add_parser("serve", help="OpenAI-compatible HTTP server (needs the `serve` extra)")
    p.add_argument("model", nargs="?", help=f"{MODEL_HELP} (default: the built-in model {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $QWENRT_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", help="name(s) clients use as `model` (default: MODEL, or "
                   f"{DEFAULT_MODEL})")
    p.add_argument("--tokenizer", help="directory or repo id of the tokenizer (default: MODEL's)")
    p.add_argument("--lora", "--lora-modules", dest="lora", nargs="+", action="extend", type=_lora, default=[],
                   metavar="NAME=DIR", help="serve LoRA adapters (PEFT's format) beside the base model: a request "
                   "whose `model` is NAME runs with that adapter; requests of different adapters and of the base "
                   "share one batched step")
    add_mmproj_option(p)
    p.add_argument("--dtype", default="auto", help="auto (as stored), bfloat16, float16 or float32")
    p.add_argument("--quantize", "--quantization", dest="quantize", choices=("int8", "int4"),
                   help="weight-only quantization while loading")
    p.add_argument("--threads", type=_positive(int), help="CPU threads (default: torch's, the physical cores)")
    p.add_argument("--max-running", "--max-num-seqs", dest="max_running", type=int,
                   help="requests decoded together at most (default 8)")
    p.add_argument("--max-queue", type=int, help="requests waiting at most, more get 429 (default 256)")
    p.add_argument("--max-model-len", type=int, help="context limit of every request (default: the model's)")
    add_rope_scaling_option(p)
    add_kv_cache_dtype_option(p)
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens per engine step: decode tokens first, the rest for prompt chunks (default 256)")
    p.add_argument("--kv-cache-memory-bytes", help="cache budget for KV + DeltaNet state, e.g. 8G (default: half "
                                                   "the memory available after loading)")
    p.add_argument("--prefix-cache-size", help="memory for reusing computed prompts (shared system prompts, earlier "
                                                "turns), e.g. 2GiB; 0 = off (default: a tenth of RAM, at most 8GiB)")
    p.add_argument("--prefix-cache-dir", help="also keep reusable prompt states in this folder, across restarts")
    add_speculative_option(p)
    p.add_argument("--allowed-local-media-path", help="let requests read local image/video files under this "
                                                      "directory (file:// URLs or paths)")
    p.add_argument("--allowed-origins", nargs="+", type=_origin, metavar="ORIGIN",
                   help="answer browsers from these origins (CORS), e.g. http://localhost:3000, or * for any "
                        "(default: none, no CORS headers)")
    p.add_argument("--max-request-bytes",
                   help="largest request body, e.g. 64MiB: larger ones get 413 before they are read (default 32MiB: room "
                        "for a full context of text, or ~24 MB of images as base64)")
    p.add_argument("--header-timeout", type=_positive(float), metavar="SECONDS",
                   help="a connection whose request headers are not all in within this many seconds is closed; a "
                        "body then has as long before it must keep up 64 KiB/s (default 10)")
    p.add_argument("--max-connections", type=_positive(int),
                   help="connections held at once; more are closed as they open (default 1024, or half the "
                        "open-file limit when that is lower)")
    p.add_argument("--timeout-keep-alive", type=_positive(float), default=5.0, metavar="SECONDS",
                   help="an idle keep-alive connection is closed after this many seconds (default 5)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default: info; warning with -q)")
    ray = p.add_argument_group("replicas on Ray Serve (needs the `ray` extra)")
    ray.add_argument("--ray", action="store_true", help="serve through Ray Serve: --replicas copies of the model "
                     "behind one endpoint, on a local Ray cluster or the one at --ray-address")
    ray.add_argument("--replicas", type=_replicas, default=(1, 1), metavar="N|MIN:MAX",
                     help="model replicas (default 1); MIN:MAX: Ray Serve adds replicas while each has more than "
                          "--max-running requests under way and removes idle ones, within those bounds")
    ray.add_argument("--threads-per-replica", type=_positive(int), metavar="T",
                     help="CPU threads (and Ray CPUs) per replica (default: the cores / the most --replicas)")
    ray.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster (e.g. 10.0.0.1:6379, or auto) "
                     "rather than starting a local one")
    ray.add_argument("--routing", choices=("affinity", "pow2"), default="affinity",
                     help="affinity: a request goes to the replica that served the longest part of its prompt "
                          "lately (a chat stays where its prefix is cached) unless loads differ by more than 4 "
                          "requests; pow2: the less loaded of two random replicas (default affinity)")
    log.add_options(p)
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per request")
    p.set_defaults(run=lambda args: serve(args))

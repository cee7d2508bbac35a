"""The FastAPI application: routes, API-key check, and the model loading in the background so the port answers
(/health 503) from the start. Stopping, it refuses new requests and cuts the ones under way (their clients get an
error, not a cut connection) so the exit need not wait for them."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.middleware.cors import CORSMiddleware

from qwenrt.server import errors
from qwenrt.server.chat import chat_completions
from qwenrt.server.classify import classify_texts
from qwenrt.server.completions import completions
from qwenrt.server.errors import APIError
from qwenrt.server.limits import Limits, RequestGate
from qwenrt.server.metrics import ServerMetrics
from qwenrt.server.protocol import (ChatCompletionRequest, ClassificationRequest, CompletionRequest, DetokenizeRequest,
                                    ResponsesRequest, TokenizeRequest)
from qwenrt.server.request_id import RequestId
from qwenrt.server.responses_api import responses
from qwenrt.server.tokenize import detokenize, tokenize
from qwenrt.vision.media import MediaPolicy

STOP_WAIT_S = 10
SHUTTING_DOWN = "the server is shutting down"


@dataclass
class ServerConfig:
    model: str  # what was asked for (path or repo id): /v1/models' root
    served_model_names: list[str]  # the first is the name responses carry
    api_key: str | None = None
    # the one policy every request's images and videos are read under: strict (no private addresses), local
    # files only under its file_root (--allowed-local-media-path)
    media_policy: MediaPolicy = field(default_factory=MediaPolicy.strict)
    # browser origins answered with CORS headers ("*": any); None: no CORS, as a server without the flag
    allowed_origins: list[str] | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters served by name (--lora): their directories


@dataclass
class ServerState:
    config: ServerConfig
    engine: object | None = None  # None while the model loads
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics | None = None
    loader: threading.Thread | None = None  # the thread loading the model
    loop: asyncio.AbstractEventLoop | None = None  # the app's, once it started
    closing: bool = False  # new requests are refused, the ones under way cut
    # the requests under way (a submission is dropped with its response)
    submissions: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    stopper: threading.Thread | None = None  # the thread stopping the engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def media_policy(self) -> MediaPolicy:
        return self.config.media_policy

    def check_model(self, name: str | None) -> str:
        """The served name a request addresses, the base model's or an adapter's (none given: the first); 404 for
        any other."""
        names = [*self.config.served_model_names, *self.config.adapters]
        if name is None:
            return names[0]
        if name not in names:
            raise APIError(404, f"The model `{name}` does not exist (this server has: {', '.join(names)})", "model",
                           "model_not_found")
        return name

    def adapter(self, name: str | None) -> str | None:
        """The adapter a request's `model` names, or None (the base model)."""
        return name if name in self.config.adapters else None

    def track(self, submission) -> None:
        """Cut `submission` when the server stops (now, if it already is)."""
        self.submissions.add(submission)
        if self.closing:
            submission.cut(SHUTTING_DOWN)

    def shut_down(self) -> None:
        """On the event loop: refuse new requests (503) and end the ones under way, each client told why."""
        self.closing = True
        for submission in list(self.submissions):
            submission.cut(SHUTTING_DOWN)

    def shut_down_soon(self) -> None:
        """shut_down from a signal handler or another thread."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.shut_down)

    def stop(self, wait: float) -> str | None:
        """Stop the engine's loop, waiting at most `wait` s for the step under way; what of ours still runs after,
        if anything (a load under way cannot be stopped, and is not waited for)."""
        if self.loader is not None and self.loader.is_alive():
            return "the model load under way"
        if self.engine is not None and self.stopper is None:
            self.stopper = threading.Thread(target=self.engine.stop, daemon=True)
            self.stopper.start()
        if self.stopper is not None:
            self.stopper.join(wait)
            if self.stopper.is_alive():
                return f"the engine step under way (it did not end within {wait:g} s)"
        return None

    def model_card(self, name: str) -> dict:
        """/v1/models' entry: an adapter's root is its directory and its parent the base model (as vLLM's)."""
        adapter = self.config.adapters.get(name)
        root, parent = (self.config.model, None) if adapter is None else (adapter, self.config.served_model_names[0])
        return {"id": name, "object": "model", "created": self.created, "owned_by": "qwenrt", "root": root,
                "parent": parent, "max_model_len": self.max_model_len}


def create_app(config: ServerConfig, load: Callable[[], object],
               on_load_failed: Callable[[str], None] | None = None, limits: Limits = Limits()) -> FastAPI:
    """`load()` returns a started engine (with its tokenizer); it runs in a thread once the app starts. If it raises,
    the error is kept (and /health stays 503) and `on_load_failed(message)` is called. The API key and the request
    body's `limits` are checked before anything reads the body (RequestGate); a CORS preflight is answered before
    that (browsers send no API key on one); every response carries an x-request-id."""
    state = ServerState(config)
    state.metrics = ServerMetrics(state)

    def load_in_background() -> None:
        try:
            state.engine = load()
        except Exception as e:  # noqa: BLE001 (a load failure of any kind ends the server with its message)
            state.load_error = str(e) or type(e).__name__
            if on_load_failed is not None:
                on_load_failed(state.load_error)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.loader = threading.Thread(target=load_in_background, name="qwenrt-load", daemon=True)
        state.loader.start()
        yield
        state.shut_down()
        left = state.stop(STOP_WAIT_S)  # the step under way ends first; on a slow machine that can take long
        if left is not None:
            print(f"qwenrt serve: exiting without {left}", file=sys.stderr, flush=True)

    app = FastAPI(title="qwenrt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.qwenrt = state
    errors.install(app)
    # the last added runs first: RequestId, then CORS, then the gate
    app.add_middleware(RequestGate, limits=limits, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["x-request-id"])  # * : the SDKs' x-stainless-*
    app.add_middleware(RequestId)

    def ready() -> ServerState:
        if state.closing:
            raise APIError(503, SHUTTING_DOWN)
        if state.engine is None:
            raise APIError(503, f"the model failed to load: {state.load_error}" if state.load_error else
                           "the model is still loading; retry when /health answers 200")
        return state

    @app.get("/health")
    async def health():
        if state.engine is None:
            return errors.error_response(503, "Loading model" if state.load_error is None else state.load_error)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(s: ServerState = Depends(ready)):
        names = [*s.config.served_model_names, *s.config.adapters]
        return {"object": "list", "data": [s.model_card(name) for name in names]}

    @app.get("/v1/models/{name:path}")  # names may hold slashes: Qwen/Qwen3.5-0.8B
    async def model(name: str, s: ServerState = Depends(ready)):
        return s.model_card(s.check_model(name))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request, s: ServerState = Depends(ready)):
        return await chat_completions(body, request, s)

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: Request, s: ServerState = Depends(ready)):
        return await completions(body, request, s)

    @app.post("/tokenize")
    async def tokenize_(body: TokenizeRequest, s: ServerState = Depends(ready)):
        return await tokenize(body, s)

    @app.post("/detokenize")
    async def detokenize_(body: DetokenizeRequest, s: ServerState = Depends(ready)):
        return await detokenize(body, s)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify_(body: ClassificationRequest, s: ServerState = Depends(ready)):
        return await classify_texts(body, s)

    @app.post("/v1/responses")
    async def respond(body: ResponsesRequest, request: Request, s: ServerState = Depends(ready)):
        return await responses(body, request, s)

    return app

"""qwenrt on Ray Serve (`qwenrt serve --ray`): N replicas, each a Ray Serve deployment replica running qwenrt's own
FastAPI app (engine, routes, errors, streaming, cancellation on disconnect: all as `qwenrt serve`), behind one ingress
deployment that reads each request's body and hands it to a replica through a deployment handle, so that a request
router chooses the replica knowing the prompt: PrefixAffinityRouter (affinity, or power-of-two choices).

Not Ray's `ray.serve.llm` (LLMServer, build_openai_app): in Ray 2.60 its request and response types are vLLM's or
SGLang's, imported when the module loads, and `ray[llm]` pins vLLM with CUDA packages; its routers are written for
those types. The router here is on Ray Serve's public request-router API (ray.serve.request_router)."""

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace

from qwenrt.errors import QwenrtError

try:
    import ray
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as e:
    raise QwenrtError(f"qwenrt serve --ray needs the ray extra ({e.name} is missing): pip install 'qwenrt[ray]'"
                      ) from None

from qwenrt import log
from qwenrt.scaleout.affinity import Forwarded, Recent, by_affinity, power_of_two, prompt_prefix
from qwenrt.server.errors import error_body, error_response
from qwenrt.server.responses import SSE_DONE, sse

REPLICA_HEADER = "x-qwenrt-replica"  # which replica answered; sent by a client, which one must (debugging, metrics)
APP_NAME = "qwenrt"
MAX_ONGOING = 64  # requests a replica holds at once (its engine batches and queues them); more wait in the router


def _forwarded(pending: PendingRequest | None) -> Forwarded | None:
    args = pending.args if pending is not None else None
    return args[0] if args and isinstance(args[0], Forwarded) else None


class PrefixAffinityRouter(RequestRouter):
    """Serve's request router for the replicas: `policy` affinity (qwenrt.scaleout.affinity.by_affinity over the
    prefixes it routed to each replica, and the replicas' queue lengths as Serve caches them) or pow2; a request
    naming a replica goes there (one naming none of them is routed as any other).

    Serve pickles this class's module by value (its own classes are copies there, so what it shares with the ingress
    lives in qwenrt.scaleout.affinity)."""

    def initialize_state(self, policy: str = "affinity", imbalance: int = 4, min_share: float = 0.1):
        self.policy, self.imbalance, self.min_share = policy, imbalance, min_share
        self.recent: dict[ReplicaID, Recent] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.recent = {r.replica_id: self.recent.get(r.replica_id) or Recent() for r in replicas}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.recent.pop(replica_id, None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        request = _forwarded(pending_request)
        pinned = [r for r in candidate_replicas if request is not None and r.replica_id.unique_id == request.replica]
        if pinned:
            return [pinned]
        if request is None or self.policy != "affinity":
            return [power_of_two(candidate_replicas)]
        cache = self.replica_queue_len_cache
        load = {r: cache.get(r.replica_id) or 0 for r in candidate_replicas}
        recent = {r: self.recent[r.replica_id] for r in candidate_replicas if r.replica_id in self.recent}
        return by_affinity(candidate_replicas, request.prefix, recent, load, min_share=self.min_share,
                           imbalance=self.imbalance)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request = _forwarded(pending_request)
        if request is not None and replica_id in self.recent:
            self.recent[replica_id].add(request.prefix)


class QwenrtReplica:
    """One engine and qwenrt's app over it; ready once the model has loaded. `options`: `qwenrt serve`'s arguments."""

    async def __init__(self, options: dict):
        from qwenrt.server.main import make_app

        self.app, _ = make_app(SimpleNamespace(**options))
        self.state = self.app.state.qwenrt
        self.id = serve.get_replica_context().replica_id.unique_id
        self._tasks: set[asyncio.Task] = set()
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the load
        await asyncio.to_thread(self.state.loader.join)
        if self.state.load_error is not None:
            raise QwenrtError(f"the model failed to load: {self.state.load_error}")

    def check_health(self) -> None:
        if self.state.engine is None or self.state.closing:
            raise QwenrtError("the engine is not running")

    async def handle(self, request: Forwarded) -> AsyncIterator:
        """The app's answer: ("start", status, headers), then the body's chunks. Cancelled (the client went away, or
        the ingress stopped reading), the app sees a disconnect, which cancels the engine's requests."""
        gone = asyncio.Event()
        messages: asyncio.Queue = asyncio.Queue()
        received = False

        async def receive() -> dict:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
                 "query_string": request.query_string, "headers": request.headers, "client": request.client,
                 "server": None, "state": {}}
        task = asyncio.create_task(self.app(scope, receive, messages.put))
        self._tasks.add(task)
        task.add_done_callback(lambda t: (self._tasks.discard(t), messages.put_nowait(None)))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield ("start", message["status"],
                           [*message.get("headers", []), (REPLICA_HEADER.encode(), self.id.encode())])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
        finally:
            gone.set()

    async def __del__(self):
        self.state.shut_down()
        await asyncio.to_thread(self.state.stop, 5)


# functions the ingress uses are defined above it: the deployment pickles the class when it is declared
ingress_app = FastAPI(title="qwenrt on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


def _lost(e: BaseException) -> str:
    first = str(e).strip().splitlines()
    return (f"the replica serving this request stopped before it finished ({type(e).__name__}"
            f"{': ' + first[0][:200] if first else ''}); retry it")


def _response(content: bytes, status: int, headers: list) -> Response:
    response = Response(content, status_code=status)
    response.raw_headers = [*headers, (b"content-length", str(len(content)).encode())]
    return response


async def _rest(answer) -> AsyncIterator[bytes | str]:
    """A streamed answer's chunks; a replica lost mid-stream ends it with an error event and [DONE]."""
    try:
        async for chunk in answer:
            yield chunk
    except Exception as e:  # noqa: BLE001 (the status line is sent: an error event is all that is left)
        yield sse(error_body(503, _lost(e))) + SSE_DONE
    finally:
        answer.cancel()


def live_replicas() -> list[str]:
    """The ids of the replicas of this application's QwenrtReplica, from their actors' names."""
    prefix = f"SERVE_REPLICA::{serve.get_replica_context().app_name}#QwenrtReplica#"
    return sorted(a["name"].removeprefix(prefix) for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(prefix))


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
@serve.ingress(ingress_app)
class QwenrtIngress:
    """The endpoint: hands each request to a replica (the router chooses which) and passes its answer through."""

    def __init__(self, replicas):
        self.replicas = replicas.options(stream=True, method_name="handle")

    @ingress_app.get("/replicas")
    async def replicas_(self):
        """The replicas' ids (what REPLICA_HEADER names)."""
        return {"replicas": live_replicas()}

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "OPTIONS", "HEAD"])
    async def forward(self, path: str, request: Request):
        body = await request.body()
        pinned = request.headers.get(REPLICA_HEADER)
        if pinned is not None and pinned not in live_replicas():
            return error_response(404, f"no replica {pinned!r} (GET /replicas lists them)")
        scope = request.scope
        forwarded = Forwarded(request.method, "/" + path, scope["query_string"], list(scope["headers"]), body,
                              tuple(scope["client"]) if scope.get("client") else None,
                              prompt_prefix("/" + path, body), pinned)
        answer = self.replicas.remote(forwarded)
        try:
            _, status, headers = await answer.__anext__()
            # Serve's proxy sets its own x-request-id (the same id: qwenrt's app echoes the one it was given)
            headers = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"x-request-id")]
            if not any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers):
                return _response(b"".join([chunk async for chunk in answer]), status, headers)
        except asyncio.CancelledError:
            answer.cancel()
            raise
        except Exception as e:  # noqa: BLE001 (a replica that died, or any failure of Ray's: the client is told)
            answer.cancel()
            return error_response(503, _lost(e))
        response = StreamingResponse(_rest(answer), status_code=status)
        response.raw_headers = headers
        return response


def build_app(options: dict, replicas: int | tuple[int, int], threads: int, routing: str = "affinity",
              imbalance: int = 4):
    """The Serve application: the ingress over `replicas` QwenrtReplica (a number, or (MIN, MAX): autoscaled), each
    with `threads` CPUs (Ray's and torch's). `options`: `qwenrt serve`'s arguments (vars of its namespace)."""
    options = {k: v for k, v in options.items() if k != "run"}
    options["threads"] = threads
    replica = serve.deployment(QwenrtReplica, name="QwenrtReplica", **_scaling(replicas, options),
                               ray_actor_options={"num_cpus": threads}, max_ongoing_requests=MAX_ONGOING,
                               health_check_period_s=5, graceful_shutdown_timeout_s=10,
                               request_router_config=RequestRouterConfig(
                                   request_router_class=PrefixAffinityRouter,
                                   request_router_kwargs={"policy": routing, "imbalance": imbalance}))
    return QwenrtIngress.bind(replica.bind(options))


def _scaling(replicas: int | tuple[int, int], options: dict) -> dict:
    """Serve's replica count: fixed, or autoscaled between (MIN, MAX) to keep each replica's requests under way at
    its engine's batch (--max-running): more queue in its engine, fewer leave it idle."""
    from qwenrt.engine.core import DEFAULT_MAX_RUNNING

    low, high = (replicas, replicas) if isinstance(replicas, int) else replicas
    if low == high:
        return {"num_replicas": low}
    target = options.get("max_running") or DEFAULT_MAX_RUNNING
    return {"autoscaling_config": {"min_replicas": low, "initial_replicas": low, "max_replicas": high,
                                   "target_ongoing_requests": target, "upscale_delay_s": 10,
                                   "downscale_delay_s": 120}}


def _deploy_failure(e: RuntimeError) -> str:
    """Why the application did not start: the replicas' own error where Serve kept it (the last line of its
    traceback), else Serve's message."""
    for name, deployment in serve.status().applications[APP_NAME].deployments.items():
        lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
        if lines and deployment.status != "HEALTHY":
            return f"{name}: {lines[-1].removeprefix('qwenrt.errors.').removeprefix('QwenrtError: ')}"
    return str(e)


def serve_on_ray(args) -> None:
    """`qwenrt serve --ray`: start a local Ray cluster (or join --ray-address), run the application on --host/--port
    until Ctrl-C or SIGTERM, then shut it down."""
    low, high = args.replicas
    threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // high)
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, threads * high), include_dashboard=False,
                 log_to_driver=False)
    try:
        # one HTTP endpoint, on the cluster's head node; replicas go wherever Ray finds their CPUs
        serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="HeadOnly")
        count = str(low) if low == high else f"{low} to {high} (autoscaled)"
        log.info(f"qwenrt serve --ray: {count} replica(s) x {threads} thread(s), {args.routing} routing; "
                 f"loading the model")
        try:
            serve.run(build_app(vars(args), args.replicas, threads, args.routing), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:
            raise QwenrtError(_deploy_failure(e)) from None
        log.info(f"qwenrt serve --ray: http://{args.host}:{args.port} (Ctrl-C stops)")
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()

"""`qwenrt serve --ray`: one local Ray cluster for the module, two nodes started as separate processes on this machine
(1 CPU each, no dashboard), serving two replicas of the built-in model (1 CPU each: one per node) behind qwenrt's
ingress; answers are checked against one plain app in this process."""

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'qwenrt[ray]')")
serve = pytest.importorskip("ray.serve")

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
GREEDY = dict(model="qwenrt-tiny", temperature=0, max_tokens=24)


def serve_args(*options: str):
    from qwenrt.cli import build_parser

    return build_parser().parse_args(["serve", "--max-model-len", "1024", "-q", *options])


@pytest.fixture(scope="module")
def cluster():
    """The Ray app's URL; two replicas of one thread each, prefix-affinity routing."""
    from ray.cluster_utils import Cluster

    from qwenrt.scaleout.ray_app import APP_NAME, build_app

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1)
        ray.init(address=nodes.address, log_to_driver=False, configure_logging=False)
        with socket.socket() as s:  # after Ray took its ports
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})  # one proxy, on the head node
        serve.run(build_app(vars(serve_args()), replicas=2, threads=1), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture(scope="module")
def plain():
    """One plain qwenrt app (the same options) in this process: (http client, openai client)."""
    from fastapi.testclient import TestClient

    from qwenrt.server.main import make_app

    app, _ = make_app(serve_args())
    with TestClient(app) as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.05)
        yield http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        app.state.qwenrt.engine.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def replicas(url: str) -> list[str]:
    ids = httpx.get(url + "/replicas").json()["replicas"]
    assert len(ids) == 2
    return ids


def metric(url: str, replica: str, name: str) -> float:
    """`qwenrt:name` from one replica's /metrics; 0 when the series is absent."""
    response = httpx.get(url + "/metrics", headers={"x-qwenrt-replica": replica}, timeout=30)
    assert response.headers["x-qwenrt-replica"] == replica
    match = re.search(rf"^qwenrt:{re.escape(name)} (\S+)$", response.text, re.M)
    return float(match.group(1)) if match else 0.0


def answers(openai_client: openai.OpenAI) -> list:
    """What a client sees of a chat (whole and streamed), a tool call, a completion and a bad request."""
    chat = openai_client.chat.completions.create(messages=[{"role": "user", "content": "What is 12+7?"}], **GREEDY)
    stream = openai_client.chat.completions.create(messages=[{"role": "user", "content": "Name a colour."}],
                                                   stream=True, **GREEDY)
    chunks = [c.choices[0] for c in stream]  # how tokens group into chunks varies with timing: the text does not
    pieces = ["".join(c.delta.content or "" for c in chunks),
              "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks), chunks[-1].finish_reason]
    tools = openai_client.chat.completions.create(messages=[{"role": "user", "content": "Weather in Paris?"}],
                                                  tools=WEATHER, tool_choice="required",
                                                  **dict(GREEDY, max_tokens=160))
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in tools.choices[0].message.tool_calls]
    completion = openai_client.completions.create(prompt="The capital of France is", **GREEDY)
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], model="qwenrt-tiny",
                                              max_tokens=-1)
    return [chat.choices[0].message.content, chat.choices[0].message.reasoning_content, chat.usage.completion_tokens,
            pieces, calls, tools.choices[0].finish_reason, completion.choices[0].text,
            completion.choices[0].finish_reason, bad.value.body]


def test_the_official_client_gets_the_plain_servers_answers(cluster, plain):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # a replica needs a node's only CPU: one on each
    assert answers(client(cluster)) == answers(plain[1])


def test_a_conversation_stays_on_the_replica_holding_its_prefix(cluster):
    ids = replicas(cluster)
    before = {i: metric(cluster, i, "prefix_cache_hits_total") for i in ids}
    messages = [{"role": "system", "content": "You are a careful calculator. " * 8},
                {"role": "user", "content": "What is 2+3?"}]
    served, cached = [], []
    for turn in range(4):
        raw = client(cluster).chat.completions.with_raw_response.create(messages=messages, **GREEDY)
        answer = raw.parse()
        served.append(raw.headers["x-qwenrt-replica"])
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                     {"role": "user", "content": f"And {turn}+1?"}]
    home, = set(served)
    other, = set(ids) - {home}
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    assert metric(cluster, home, "prefix_cache_hits_total") - before[home] == sum(cached)
    assert metric(cluster, other, "prefix_cache_hits_total") == before[other]


def long_stream(url: str, replica: str, events: list, started: threading.Event) -> None:
    """A 900-token stream pinned to `replica`; its data events go to `events`."""
    body = {"model": "qwenrt-tiny", "prompt": "Count:", "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"x-qwenrt-replica": replica},
                      timeout=httpx.Timeout(30)) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_a_client_that_goes_away_cancels_its_request_on_the_replica(cluster):
    replica = replicas(cluster)[0]
    aborted = metric(cluster, replica, 'request_success_total{finished_reason="abort"}')
    body = {"model": "qwenrt-tiny", "prompt": "Count:", "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", cluster + "/v1/completions", json=body, headers={"x-qwenrt-replica": replica},
                      timeout=30) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 20
    while metric(cluster, replica, 'request_success_total{finished_reason="abort"}') == aborted:
        assert time.monotonic() < deadline, "the replica's request was not cancelled"
        time.sleep(0.05)
    assert metric(cluster, replica, "num_requests_running") == 0


def test_a_killed_replica_fails_its_requests_clearly_and_the_other_serves_on(cluster):
    """Runs last: the killed replica is replaced by Serve in the background."""
    victim, survivor = replicas(cluster)
    events = {victim: [[], []], survivor: [[], []]}
    started = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(long_stream, cluster, r, events[r][k], started[2 * n + k])
                for n, r in enumerate((victim, survivor)) for k in range(2)]
        assert all(s.wait(30) for s in started)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::qwenrt#QwenrtReplica#{victim}", namespace="serve"))
        for run in runs:
            run.result(timeout=60)  # no hang: every stream ends
        after = [client(cluster).completions.create(prompt="The capital of France is", **GREEDY)
                 for _ in range(3)]
    for lost in events[victim]:
        error = json.loads(lost[-2])["error"]
        assert lost[-1] == "[DONE]" and error["code"] == 503 and "replica serving this request stopped" in error[
            "message"]
    for kept in events[survivor]:
        assert kept[-1] == "[DONE]" and json.loads(kept[-2])["choices"][0]["finish_reason"] == "length"
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in after)

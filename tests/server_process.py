"""`qwenrt serve` in a subprocess on a free loopback port, for the server tests and bench/serve_load.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """Starts `python -m qwenrt serve CHECKPOINT --port <free> OPTIONS...` (no CHECKPOINT when it is None: the
    built-in model) and waits until /health answers 200."""

    def __init__(self, checkpoint: Path | None, log: Path, *options: str, env: dict | None = None, timeout: float = 300):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "qwenrt", "serve", *([str(checkpoint)] if checkpoint else []), "--port", str(port),
                                          "--disable-uvicorn-access-log", *options], stdout=out,
                                         stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, **(env or {})))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not come up; its log:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def metric(self, name: str, labels: str = "") -> float:
        """A value from /metrics (`name` without the qwenrt: prefix); 0 when the series is absent."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        match = re.search(rf"^qwenrt:{name}{re.escape(labels)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def wait_idle(self, timeout: float = 30) -> float:
        """Seconds until no request is running or waiting; raises TimeoutError after `timeout`."""
        start = time.monotonic()
        while self.metric("num_requests_running") or self.metric("num_requests_waiting"):
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"requests still running after {timeout} s")
            time.sleep(0.02)
        return time.monotonic() - start

    def rss(self) -> int:
        """The server's resident memory, bytes."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

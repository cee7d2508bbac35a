"""Downloading an image over http(s) under a MediaPolicy: one deadline for the whole download (redirects included),
a byte cap, and, when the policy says so, no private or loopback addresses (checked for every address the host
resolves to; the connection goes to a checked address, so a second lookup cannot swap it; every redirect is
checked again). Proxies are not used.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse

from qwenrt.errors import QwenrtError

REDIRECTS = (301, 302, 303, 307, 308)
CHUNK = 1 << 16


class _PinnedHTTP(http.client.HTTPConnection):
    """HTTP to `host` (Host header) over a connection to the already-checked `address`."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to `host` (certificate and SNI for the name) over a connection to the checked `address`."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def is_public_address(address: str) -> bool:
    """A globally routable unicast address (not loopback, private, link-local, multicast, reserved, ...)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise QwenrtError(f"could not download {what}: it took longer than the download limit")
    return left


def _resolve(host: str, port: int, deadline: float, what: str) -> list[str]:
    """The host's addresses, looked up in a worker thread so the deadline holds even for a stuck resolver."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        infos = pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM).result(
            timeout=_remaining(deadline, what))
    except concurrent.futures.TimeoutError:
        raise QwenrtError(f"could not download {what}: resolving {host} took longer than the download limit") from None
    except OSError as e:
        raise QwenrtError(f"could not download {what}: cannot resolve {host} ({e.strerror or e})") from None
    finally:
        pool.shutdown(wait=False)
    return list(dict.fromkeys(info[4][0] for info in infos))


def check_url(url: str, policy, what: str) -> urllib.parse.SplitResult:
    """The parts of a URL the policy allows (scheme, host, domain); no network."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise QwenrtError(f"{what}: only http(s) URLs with a host can be downloaded")
    if not policy.allow_urls:
        raise QwenrtError(f"{what}: downloading media is not allowed here")
    host = parts.hostname.rstrip(".").lower()
    if policy.allowed_domains is not None and not any(
            host == d or host.endswith("." + d) for d in policy.allowed_domains):
        raise QwenrtError(f"{what}: host {host} is not among the allowed domains")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise QwenrtError(f"{what}: invalid port in the URL") from None
    return parts


def _connect(parts: urllib.parse.SplitResult, policy, deadline: float, what: str) -> http.client.HTTPConnection:
    port = parts.port or (443 if parts.scheme == "https" else 80)
    addresses = _resolve(parts.hostname, port, deadline, what)
    if not policy.allow_private_addresses:
        private = [a for a in addresses if not is_public_address(a)]
        if private:
            raise QwenrtError(f"{what}: {parts.hostname} resolves to a non-public address ({private[0]}); "
                              "fetching from private, loopback or link-local addresses is not allowed here")
    kind = _PinnedHTTPS if parts.scheme == "https" else _PinnedHTTP
    error: Exception | None = None
    for address in addresses:
        conn = kind(parts.hostname, port, address, _remaining(deadline, what))
        try:
            conn.connect()
            return conn
        except OSError as e:
            error = e
            conn.close()
    raise QwenrtError(f"could not download {what}: cannot connect to {parts.hostname} ({error})")


def _read_body(sock: socket.socket, response: http.client.HTTPResponse, policy, deadline: float, what: str) -> bytes:
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > policy.max_bytes:
        raise QwenrtError(f"{what} is {int(length)} bytes; the limit is {policy.max_bytes}")
    chunks, total = [], 0
    while True:
        sock.settimeout(_remaining(deadline, what))  # each read waits at most what is left of the whole
        chunk = response.read1(CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > policy.max_bytes:
            raise QwenrtError(f"{what} is over the limit of {policy.max_bytes} bytes")
        chunks.append(chunk)


def fetch(url: str, policy, what: str) -> bytes:
    """The body of `url` under `policy` (see the module docstring); one QwenrtError for every failure."""
    deadline = time.monotonic() + policy.download_seconds
    for _ in range(policy.max_redirects + 1):
        parts = check_url(url, policy, what)
        conn = _connect(parts, policy, deadline, what)
        try:
            target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
            conn.request("GET", target, headers={"User-Agent": "qwenrt", "Accept": "image/*, */*"})
            sock = conn.sock  # the response keeps reading it after the connection lets go of it
            response = conn.getresponse()
            if response.status in REDIRECTS and response.getheader("Location"):
                url = urllib.parse.urljoin(url, response.getheader("Location"))
                continue
            if response.status != 200:
                raise QwenrtError(f"could not download {what}: HTTP {response.status} {response.reason}")
            return _read_body(sock, response, policy, deadline, what)
        except TimeoutError:  # a read waited for the rest of the deadline
            raise QwenrtError(f"could not download {what}: it took longer than the download limit "
                              f"({policy.download_seconds:g} s)") from None
        except (OSError, http.client.HTTPException) as e:
            raise QwenrtError(f"could not download {what}: {type(e).__name__} ({e})") from None
        finally:
            conn.close()
    raise QwenrtError(f"could not download {what}: more than {policy.max_redirects} redirects")

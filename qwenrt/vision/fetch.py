"""Downloading an image over http(s) under a MediaPolicy: one deadline for the whole download (redirects included),
a byte cap, and, when the policy says so, no private or loopback addresses (checked for every address the host
resolves to, the IPv4 address inside a transition IPv6 address included; the connection goes to a checked address,
so a second lookup cannot swap it; every redirect is checked again). Proxies are not used.

What a failure tells whoever sent the URL, where private addresses are refused (a server's requests): a non-public
target is refused before any connection, in the same words whatever its port, path or redirect chain and without
the address it resolved to, so the server cannot scan the network it sits in. A public host is one the sender could
reach itself, but the messages still carry nothing the far end or the kernel chose: a failed connection is "cannot
connect" whether it was refused, unreachable or timed out (no errno), a garbled answer is "no valid HTTP answer" (no
banner), a status is its number (no reason phrase); only an invalid certificate is named, as TLS already showed the
port open. What is left is timing (a closed port fails sooner than a filtered one) and whether a name resolves.
Where private addresses are allowed (the user's own machine) the underlying error is added, for diagnosis.
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


def _low_32_bits(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]


# IPv6 ranges that carry an IPv4 address a relay or translator would deliver to: judged by that address
EMBEDDED_IPV4 = (
    (ipaddress.ip_network("::ffff:0:0/96"), lambda ip: [ip.ipv4_mapped]),  # IPv4-mapped
    (ipaddress.ip_network("::/96"), _low_32_bits),  # IPv4-compatible (deprecated)
    (ipaddress.ip_network("::ffff:0:0:0/96"), _low_32_bits),  # IPv4-translated (SIIT)
    (ipaddress.ip_network("64:ff9b::/96"), _low_32_bits),  # NAT64, the well-known prefix
    (ipaddress.ip_network("2002::/16"), lambda ip: [ip.sixtofour]),  # 6to4
    (ipaddress.ip_network("2001::/32"), lambda ip: list(ip.teredo)),  # Teredo: its server and (obfuscated) client
)
# local-use NAT64: where the IPv4 address sits is the operator's choice, so no address in it is judged public
NEVER_PUBLIC = (ipaddress.ip_network("64:ff9b:1::/48"),)


def _is_global(ip) -> bool:
    return ip.is_global and not ip.is_multicast


def is_public_address(address: str) -> bool:
    """A globally routable unicast address (not loopback, private, link-local, multicast, reserved, ...); an IPv6
    address that embeds an IPv4 one (mapped, NAT64, 6to4, Teredo, ...) is public only when that one is."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 4:
        return _is_global(ip)
    if any(ip in network for network in NEVER_PUBLIC):
        return False
    for network, embedded in EMBEDDED_IPV4:
        if ip in network:
            return all(_is_global(v4) for v4 in embedded(ip))
    return _is_global(ip)


def _why(error: Exception, policy) -> str:
    """The underlying error, only where the sender may reach private addresses anyway (see the module docstring)."""
    if not policy.allow_private_addresses:
        return ""
    return f" ({type(error).__name__}: {' '.join(str(error).split())})"


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
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # e.g. an unclosed [IPv6 literal
        raise QwenrtError(f"{what}: not a valid URL") from None
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
            raise QwenrtError(f"{what}: {parts.hostname} resolves to a non-public address; fetching from private, "
                              "loopback or link-local addresses is not allowed here")
    kind = _PinnedHTTPS if parts.scheme == "https" else _PinnedHTTP
    error: Exception | None = None
    for address in addresses:
        conn = kind(parts.hostname, port, address, _remaining(deadline, what))
        try:
            conn.connect()
            return conn
        except ssl.SSLCertVerificationError as e:
            conn.close()
            raise QwenrtError(f"could not download {what}: the certificate of {parts.hostname} is not valid "
                              f"({e.verify_message})") from None
        except OSError as e:
            error = e
            conn.close()
    raise QwenrtError(f"could not download {what}: cannot connect to {parts.hostname} port {port}"
                      f"{_why(error, policy)}")


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
                raise QwenrtError(f"could not download {what}: HTTP {response.status}")
            return _read_body(sock, response, policy, deadline, what)
        except TimeoutError:  # a read waited for the rest of the deadline
            raise QwenrtError(f"could not download {what}: it took longer than the download limit "
                              f"({policy.download_seconds:g} s)") from None
        except (OSError, http.client.HTTPException) as e:
            raise QwenrtError(f"could not download {what}: no valid HTTP answer from {parts.hostname}"
                              f"{_why(e, policy)}") from None
        finally:
            conn.close()
    raise QwenrtError(f"could not download {what}: more than {policy.max_redirects} redirects")

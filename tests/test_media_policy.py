"""Hostile media: downloads that trickle, never end or redirect inside the network, private addresses (in every
spelling, through the server too), error texts that would make the server a port scanner, local files outside the
allowed place or with names the OS cannot take, FIFOs and devices, decompression bombs and the decode memory budget,
videos without a frame count. One line each."""

import contextlib
import http.server
import io
import json
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
import pytest
from PIL import Image

import qwenrt
from qwenrt.errors import QueueFullError
from qwenrt.vision import fetch as fetch_module
from qwenrt.vision.config import PreprocessConfig
from qwenrt.vision.fetch import is_public_address
from qwenrt.vision.media import DECODE_BUDGET, MediaPolicy, decode_video_file, load_image, preflight_media
from qwenrt.vision.preprocess import preprocess_images, preprocess_videos, sample_frame_indices
from tests import checkpoints
from tests.hostile import no_hang, one_line_error


def png_bytes(width=8, height=6, mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height), 0).save(out, format="PNG")
    return out.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _head(self, status=200, length=None, **headers):
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key.replace("_", "-"), value)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def do_GET(self):
        try:
            self.route()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def route(self):
        path = self.path
        if path == "/ok.png":
            body = png_bytes()
            self._head(length=len(body))
            self.wfile.write(body)
        elif path == "/trickle.png":  # a byte every 0.2 s, forever: each read succeeds, the whole never ends
            self._head(length=10 ** 6)
            while True:
                self.wfile.write(b"\x89")
                self.wfile.flush()
                time.sleep(0.2)
        elif path == "/endless.png":  # as fast as it can, no length
            self._head()
            while True:
                self.wfile.write(b"\0" * 65536)
        elif path == "/huge.png":
            self._head(length=10 ** 12)
        elif path.startswith("/redirect-to/"):
            self._head(302, length=0, Location=path[len("/redirect-to/"):])
        elif path == "/loop":
            self._head(302, length=0, Location="/loop")
        elif path == "/bomb.png":
            body = png_bytes(13000, 13000, "1")  # a few KB that decode to 169M pixels
            self._head(length=len(body))
            self.wfile.write(body)
        elif path == "/text":
            self._head(length=5)
            self.wfile.write(b"hello")
        else:
            self._head(404, length=0)


class _CountingServer(http.server.ThreadingHTTPServer):
    """Counts the connections it accepts, before any HTTP is read."""

    daemon_threads = True
    connections = 0

    def verify_request(self, request, client_address):
        self.connections += 1
        return True


@contextlib.contextmanager
def listening(host: str = "127.0.0.1"):
    httpd = _CountingServer((host, 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def listener():
    with listening() as httpd:
        yield httpd


@pytest.fixture(scope="module")
def server(listener):
    return f"http://127.0.0.1:{listener.server_address[1]}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAST = MediaPolicy(download_seconds=1.5, max_bytes=1 << 20)


def test_a_good_download(server):
    assert load_image(f"{server}/ok.png", FAST).size == (8, 6)
    assert load_image(f"{server}/redirect-to/{server}/ok.png", FAST).size == (8, 6)


@pytest.mark.parametrize("path, fragment", [
    ("/trickle.png", "longer than the download limit"),
    ("/endless.png", "over the limit of 1048576 bytes"),
    ("/huge.png", "is 1000000000000 bytes; the limit is 1048576"),
    ("/loop", "more than 5 redirects"),
    ("/missing.png", "HTTP 404"),
    ("/bomb.png", "is 13000x13000 pixels; the limit is 50000000"),
    ("/text", "not an image format Pillow recognises"),
])
def test_hostile_downloads(server, path, fragment):
    start = time.monotonic()
    message = one_line_error(lambda: load_image(server + path, FAST), fragment)
    assert time.monotonic() - start < FAST.download_seconds + 2
    assert "BytesIO" not in message and not re.search("0x[0-9a-f]{6}", message)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/x.png", "http://localhost/x.png", "http://10.1.2.3/x.png", "http://192.168.0.1/x.png",
    "http://169.254.169.254/latest/meta-data/", "http://[::1]/x.png", "http://[::ffff:127.0.0.1]/x.png",
    "http://0.0.0.0/x.png", "http://2130706433/x.png", "http://[fe80::1]/x.png", "http://100.64.0.1/x.png",
    "http://127.1/x.png", "http://0x7f000001/x.png", "http://LOCALHOST/x.png", "http://evil.com@127.0.0.1/x.png",
    "http://[64:ff9b::7f00:1]/x.png", "http://[2002:7f00:1::1]/x.png", "http://[::127.0.0.1]/x.png",
])
def test_private_addresses_are_refused_by_a_strict_policy(url):
    one_line_error(lambda: load_image(url, MediaPolicy.strict()), "non-public address")


def test_redirects_are_checked_against_the_policy(server):
    port = server.rsplit(":", 1)[1]
    lenient_but_local_only = MediaPolicy(allowed_domains=("localhost",), download_seconds=2)
    one_line_error(lambda: load_image(f"http://localhost:{port}/redirect-to/{server}/ok.png", lenient_but_local_only),
                   "host 127.0.0.1 is not among the allowed domains")
    one_line_error(lambda: load_image(f"http://localhost:{port}/redirect-to/file:///etc/passwd", FAST),
                   "only http(s) URLs")


def test_policy_switches():
    strict = MediaPolicy.strict(allowed_domains=("example.com",))
    one_line_error(lambda: load_image("https://evil.test/x.png", strict), "not among the allowed domains")
    one_line_error(lambda: load_image("/etc/hostname", strict), "local files are not allowed here")
    one_line_error(lambda: load_image("https://example.com/x.png", MediaPolicy(allow_urls=False)),
                   "downloading media is not allowed")
    one_line_error(lambda: load_image("data:image/png;base64,AAAA", MediaPolicy(allow_data_uris=False)),
                   "data URIs are not allowed")
    one_line_error(lambda: load_image("ftp://example.com/x.png"), "file not found")  # not a URL we fetch: a path
    one_line_error(lambda: load_image("http://exa mple.com:99999/x.png"), "invalid port")
    assert is_public_address("8.8.8.8") and not is_public_address("::ffff:10.0.0.1")


def test_local_files(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    os.mkfifo(root / "fifo.png")
    (root / "dir.png").mkdir()
    (root / "big.png").write_bytes(b"\0" * (2 << 20))
    policy = MediaPolicy.strict(file_root=root, max_bytes=1 << 20)
    assert load_image(str(root / "ok.png"), policy).size == (8, 6)
    one_line_error(lambda: load_image(str(tmp_path / "secret.png"), policy), "only files under")
    one_line_error(lambda: load_image(str(root / "link.png"), policy), "only files under")
    one_line_error(lambda: load_image(str(root / "../secret.png"), policy), "only files under")
    one_line_error(lambda: load_image(str(root / "fifo.png"), policy), "is a FIFO")
    one_line_error(lambda: load_image(str(root / "dir.png"), policy), "is a directory")
    one_line_error(lambda: load_image(str(root / "big.png"), policy), "the limit is 1048576")
    one_line_error(lambda: load_image("/dev/zero"), "not a regular file")
    one_line_error(lambda: preflight_media(str(root / "fifo.png"), policy), "not a regular file")
    one_line_error(lambda: preflight_media(str(root / "none.png")), "file not found")


def test_in_memory_sources():
    bomb = png_bytes(13000, 13000, "1")
    one_line_error(lambda: load_image(bomb), "is 13000x13000 pixels")
    small = png_bytes(100, 100)
    assert load_image(small).size == (100, 100)
    one_line_error(lambda: load_image(small, MediaPolicy(max_pixels=5000)), "is 100x100 pixels; the limit is 5000")
    one_line_error(lambda: load_image(b"GIF89a garbage"), "cannot decode image")
    one_line_error(lambda: load_image(b"x" * 100, MediaPolicy(max_bytes=10)), "over the limit of 10")
    one_line_error(lambda: load_image("data:image/png;base64," + "A" * 2000, MediaPolicy(max_bytes=1000)),
                   "more than the limit of 1000 bytes")


def write_video(path, frames: int, container_format: str | None = None):
    with av.open(str(path), "w", format=container_format) as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((64, 96, 3), 8 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_video_without_a_frame_count_is_not_decoded_whole(tmp_path):
    """A Matroska stream states no frame count: its packets are counted, then only the sampled frames kept."""
    cfg = PreprocessConfig(min_pixels=32 * 32, max_pixels=128 * 128)
    mkv, mp4 = tmp_path / "clip.mkv", tmp_path / "clip.mp4"
    write_video(mkv, 30)
    write_video(mp4, 30)
    with av.open(str(mkv)) as container:
        assert container.streams.video[0].frames == 0
    seen = []
    frames, indices, _ = decode_video_file(mkv, lambda total, fps: seen.append(total) or sample_frame_indices(
        total, fps, cfg))
    assert seen == [30] and indices == sample_frame_indices(30, 10.0, cfg)
    frames_mp4, indices_mp4, _ = decode_video_file(mp4, lambda total, fps: sample_frame_indices(total, fps, cfg))
    assert indices == indices_mp4
    assert all(np.abs(a.astype(int) - b.astype(int)).max() <= 2 for a, b in zip(frames, frames_mp4))
    one_line_error(lambda: preprocess_videos([mkv], cfg, policy=MediaPolicy(max_frames=20)), "more than 20 frames")
    one_line_error(lambda: preprocess_videos([mp4], cfg, policy=MediaPolicy(max_pixels=1000)), "96x64")
    one_line_error(lambda: preprocess_videos([mp4], cfg, policy=MediaPolicy(max_video_pixels=10_000)),
                   "sampled 96x64 frames exceed")
    one_line_error(lambda: preprocess_videos([mp4], cfg, policy=MediaPolicy.strict()), "local files are not allowed")
    os.mkfifo(tmp_path / "fifo.mp4")
    one_line_error(lambda: preprocess_videos([tmp_path / "fifo.mp4"], cfg), "is a FIFO")
    (tmp_path / "garbage.mp4").write_bytes(b"\0" * 1000)
    one_line_error(lambda: preprocess_videos([tmp_path / "garbage.mp4"], cfg), "cannot decode video file")


# ---- what is public -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("address", [
    "64:ff9b::7f00:1", "64:ff9b::a00:1", "64:ff9b:1::808:808", "2002:7f00:1::1", "2002:a00:1::",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2", "::127.0.0.1", "::10.0.0.1", "::ffff:0:7f00:1", "::ffff:10.0.0.1",
    "::1", "::", "fc00::1", "fe80::1%eth0", "127.0.0.1", "0.0.0.0", "224.0.0.1", "100.64.0.1",
])
def test_addresses_that_reach_inside_are_not_public(address):
    assert not is_public_address(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808",
                                     "2002:808:808::1"])
def test_public_addresses(address):
    assert is_public_address(address)


# ---- what an error tells (no port scanner) ------------------------------------------------------------------

@pytest.fixture
def loopback_is_public(monkeypatch):
    """A strict policy that takes loopback for public, so local listeners stand in for hosts on the internet."""
    judge = fetch_module.is_public_address
    monkeypatch.setattr(fetch_module, "is_public_address", lambda a: a.startswith("127.") or judge(a))
    return MediaPolicy.strict(download_seconds=2)


@contextlib.contextmanager
def raw_listener(answer: bytes):
    """A TCP port that sends `answer` (e.g. a banner) to whoever connects, then closes."""
    sock = socket.create_server(("127.0.0.1", 0))

    def serve():
        with contextlib.suppress(OSError):
            while True:
                conn, _ = sock.accept()
                with conn:
                    conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_errors_name_nothing_the_far_end_or_the_kernel_chose(loopback_is_public):
    strict = loopback_is_public
    closed = one_line_error(lambda: load_image(f"http://127.0.0.1:{closed_port()}/x.png", strict), "cannot connect")
    assert "refused" not in closed.lower() and "errno" not in closed.lower()
    with raw_listener(b"SSH-2.0-OpenSSH_9.6 secret-banner\r\n") as port:
        banner = one_line_error(lambda: load_image(f"http://127.0.0.1:{port}/x.png", strict), "no valid HTTP answer")
    assert "SSH" not in banner and "secret" not in banner
    with raw_listener(b"HTTP/1.0 404 Secret Internal Reason\r\nContent-Length: 0\r\n\r\n") as port:
        status = one_line_error(lambda: load_image(f"http://127.0.0.1:{port}/x.png", strict), "HTTP 404")
    assert "Secret" not in status
    # on the user's own machine the underlying error is worth showing
    one_line_error(lambda: load_image(f"http://127.0.0.1:{closed_port()}/x.png", FAST), "Connection refused")


# ---- local paths the OS cannot take -------------------------------------------------------------------------

@pytest.mark.parametrize("name, fragment", [("a\x00b.png", "NUL"), ("\ud800.png", "lone surrogate")])
def test_local_paths_the_os_cannot_take(tmp_path, name, fragment):
    path = str(tmp_path / name)
    for policy in (MediaPolicy(), MediaPolicy.strict(file_root=tmp_path)):
        message = one_line_error(lambda: load_image(path, policy), fragment)
        message.encode("utf-8")  # a lone surrogate in the message would break a JSON error body
        one_line_error(lambda: preflight_media(path, policy), fragment)
        one_line_error(lambda: decode_video_file(path, lambda total, fps: [0], policy), fragment)


# ---- the decode memory budget -------------------------------------------------------------------------------

def test_a_decode_over_the_budget_alone_is_refused_before_decoding():
    small = MediaPolicy(max_decode_bytes=1 << 20)
    one_line_error(lambda: load_image(png_bytes(1000, 1000), small), "needs 11.4 MiB to decode; the limit is 1.0 MiB")
    cfg = PreprocessConfig(min_pixels=32 * 32, max_pixels=512 * 512)
    one_line_error(lambda: preprocess_images([png_bytes(200, 200)], cfg, small), "preprocessing image 1 needs")
    assert DECODE_BUDGET.reserved == 0


def test_concurrent_decodes_share_the_budget():
    """Six 1000x1000 images under a budget for one at a time: each waits its turn, all decode, the reservations
    never pass the limit; a decode that finds no room in time is told to try again."""
    data, one = png_bytes(1000, 1000), 1000 * 1000 * 12
    policy = MediaPolicy(max_decode_bytes=one + one // 2, decode_wait_seconds=30)
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(DECODE_BUDGET.reserved)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with no_hang(60), ThreadPoolExecutor(6) as pool:
        sizes = list(pool.map(lambda _: load_image(data, policy).size, range(6)))
    stop.set()
    watcher.join()
    assert sizes == [(1000, 1000)] * 6 and max(seen) == one and DECODE_BUDGET.reserved == 0

    impatient = MediaPolicy(max_decode_bytes=one, decode_wait_seconds=0.3)
    with DECODE_BUDGET.hold(one, impatient, "another request"):
        start = time.monotonic()
        with pytest.raises(QueueFullError, match="held the decoding memory .* for 0.3 s; try again later"):
            load_image(data, impatient)
        assert time.monotonic() - start < 2
    assert load_image(data, impatient).size == (1000, 1000)


def test_video_frames_count_against_the_budget(tmp_path):
    cfg = PreprocessConfig(min_pixels=32 * 32, max_pixels=128 * 128)
    mp4 = tmp_path / "clip.mp4"
    write_video(mp4, 30)
    one_line_error(lambda: preprocess_videos([mp4], cfg, policy=MediaPolicy(max_decode_bytes=100_000)),
                   "video file", "clip.mp4 needs", "to decode; the limit is")  # 6 frames 32x64 + one 96x64 decoding
    one_line_error(lambda: preprocess_videos([mp4], cfg, policy=MediaPolicy(max_decode_bytes=200_000)),
                   "preprocessing video 1 needs 0.5 MiB")
    assert DECODE_BUDGET.reserved == 0


# ---- through the server -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny chat VLM (real vocabulary and template, small-image preprocessor), loaded once."""
    path = tmp_path_factory.mktemp("vlm-chat")
    checkpoints.build_chat_vlm(path)
    return qwenrt.load(path, dtype="float32")


@contextlib.contextmanager
def serving(vlm, **config):
    """The real app over a real engine, in-process: a test can stand a local listener in for a public host."""
    from fastapi.testclient import TestClient

    from qwenrt.engine import Engine
    from qwenrt.server.app import ServerConfig, create_app

    def load():
        engine = Engine(*vlm, max_model_len=1024)
        engine.start()
        return engine

    with TestClient(create_app(ServerConfig("vlm", ["tiny"], **config), load)) as http:
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, http.get("/health").text
            time.sleep(0.02)
        yield http


@pytest.fixture(scope="module")
def app(vlm):
    """A server as `qwenrt serve` starts one without --allowed-local-media-path."""
    with serving(vlm) as http:
        yield http


def ask_image(http, url: str) -> tuple[int, dict]:
    """(status, body) of a chat request with one image; the JSON is ASCII, so a lone surrogate travels escaped."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]}
    r = http.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    return r.status_code, r.json()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LOCALHOST", "2130706433", "127.1", "0x7f000001",
                                  "0.0.0.0", "[::ffff:127.0.0.1]", "evil.com@127.0.0.1"])
def test_the_server_fetches_nothing_on_loopback(app, listener, host):
    before = listener.connections
    status, body = ask_image(app, f"http://{host}:{listener.server_address[1]}/ok.png")
    assert status == 400 and "non-public address" in body["error"]["message"], body
    assert listener.connections == before


def test_the_server_checks_every_redirect(app, listener, monkeypatch):
    """A host on the internet (127.0.0.2 stands in, judged public here) that redirects to loopback."""
    judge = fetch_module.is_public_address
    monkeypatch.setattr(fetch_module, "is_public_address", lambda a: a == "127.0.0.2" or judge(a))
    target = f"http://127.0.0.1:{listener.server_address[1]}/ok.png"
    before = listener.connections
    with listening("127.0.0.2") as public:
        status, body = ask_image(app, f"http://127.0.0.2:{public.server_address[1]}/redirect-to/{target}")
        assert public.connections == 1
    assert status == 400 and "non-public address" in body["error"]["message"], body
    assert listener.connections == before


def test_the_server_is_no_port_scanner(app, listener):
    """An open port (its listener would answer 404) and a closed one get the same answer, word for word."""
    def answer(port: int) -> tuple[int, str]:
        status, body = ask_image(app, f"http://127.0.0.1:{port}/x.png")
        return status, body["error"]["message"].replace(str(port), "PORT")

    assert answer(listener.server_address[1]) == answer(closed_port())


@pytest.fixture(scope="module")
def media_app(vlm, tmp_path_factory):
    """A server started with --allowed-local-media-path MEDIA."""
    media = tmp_path_factory.mktemp("media").resolve()
    (media / "ok.png").write_bytes(png_bytes(64, 48))
    with serving(vlm, media_policy=MediaPolicy.strict(file_root=media)) as http:
        yield http, media


@pytest.mark.parametrize("spelling", ["file://{}/a%00b.png", "file://{}/a\x00b.png", "{}/a\x00b.png",
                                      "file://{}/\ud800.png", "{}/\ud800.png"])
def test_server_local_paths_the_os_cannot_take_are_a_400(media_app, spelling):
    http, media = media_app
    status, body = ask_image(http, spelling.format(media))
    assert status == 400 and body["error"]["param"] == "messages[0].content[0].image_url.url", body
    assert ask_image(http, f"file://{media}/ok.png")[0] == 200

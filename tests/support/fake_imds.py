"""A stand-in for the EC2 instance metadata service (IMDSv2) on 127.0.0.1, for tests of the
spot-notice logic in engines/cluster/preemption.py. It fakes AWS, so it tests our logic only."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator


class FakeImds(http.server.ThreadingHTTPServer):
    """IMDSv2 as EC2 documents it: PUT /latest/api/token with a TTL header returns a token;
    GETs without a current token get 401; the spot notice is 404 until one is posted.
    ``fail_next`` makes the next GETs answer 500 (a metadata hiccup)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.token_serial = 0
        self.token_puts = 0
        self.notice: bytes | None = None
        self.fail_next = 0
        self.spot_gets = 0
        self.reject_tokens = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def current_token(self) -> str:
        return f"token-{self.token_serial}"

    def rotate_token(self) -> None:
        """Invalidate the issued token, as a restarted metadata service would."""
        with self.lock:
            self.token_serial += 1


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeImds

    def log_message(self, *args: object) -> None:
        """Keep the test output free of one access-log line per request."""

    def _send(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        fake = self.server
        if self.path != "/latest/api/token":
            return self._send(404)
        if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._send(400)
        with fake.lock:
            fake.token_puts += 1
            fake.token_serial += 1
            token = fake.current_token()
        self._send(200, token.encode())

    def do_GET(self) -> None:
        fake = self.server
        with fake.lock:
            token = self.headers.get("X-aws-ec2-metadata-token")
            if fake.reject_tokens or token != fake.current_token():
                return self._send(401)
            if fake.fail_next > 0:
                fake.fail_next -= 1
                return self._send(500)
            if self.path == "/latest/meta-data/instance-id":
                return self._send(200, b"i-0123456789abcdef0")
            if self.path == "/latest/meta-data/spot/instance-action":
                fake.spot_gets += 1
                return self._send(404) if fake.notice is None else self._send(200, fake.notice)
        self._send(404)


@contextlib.contextmanager
def running_imds() -> Iterator[FakeImds]:
    """A FakeImds serving on 127.0.0.1 from a thread, shut down on exit."""
    server = FakeImds()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

"""A stand-in for the Hugging Face hub on loopback, speaking the part of its protocol that
``huggingface_hub.snapshot_download`` uses: the revision info, the file tree, and HEAD/GET on
``/<repo>/resolve/<revision>/<path>`` with ETag, X-Repo-Commit, Content-Length and Range.

It serves the files of a directory as one repository at one commit, counts what it was asked,
and can be slowed down (to kill a download midway) or told to fail.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, root: Path, repo_id: str = "2Noise/ChatTTS", host: str = "127.0.0.1"):
        self.root, self.repo_id = Path(root), repo_id
        self.files = sorted(
            str(path.relative_to(self.root)) for path in self.root.rglob("*") if path.is_file()
        )
        self.requests: Counter = Counter()  # (method, path) -> count
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of ranged GETs
        self.bytes_per_second: float | None = None  # throttle file bodies
        self.fail_with: int | None = None  # answer every request with this status
        self.on_request = None  # called with (method, file) for each file asked for
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, path: str) -> int:
        """How many times the file ``path`` was fetched (GET)."""
        return self.requests[("GET", path)]

    def etag(self, path: str) -> str:
        return hashlib.sha256((self.root / path).read_bytes()).hexdigest()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args):  # quiet
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _json(self, payload, status=200):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                data = json.dumps({"error": message}).encode()
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Error-Message", message)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _serve(self, body: bool):
                path = unquote(urlparse(self.path).path)
                if hub.fail_with is not None:
                    return self._error(hub.fail_with, "the stand-in was told to fail")
                repo = re.escape(hub.repo_id)
                if re.fullmatch(rf"/api/models/{repo}/revision/[^/]+", path):
                    return self._json(
                        {
                            "id": hub.repo_id,
                            "sha": COMMIT,
                            "siblings": [{"rfilename": name} for name in hub.files],
                        }
                    )
                if re.fullmatch(rf"/api/models/{repo}/tree/[^/]+(/.*)?", path):
                    return self._json(
                        [
                            {
                                "type": "file",
                                "path": name,
                                "oid": hub.etag(name)[:40],
                                "size": (hub.root / name).stat().st_size,
                            }
                            for name in hub.files
                        ]
                    )
                match = re.fullmatch(rf"/{repo}/resolve/[^/]+/(.+)", path)
                if match and match.group(1) in hub.files:
                    name = match.group(1)
                    with hub._lock:
                        hub.requests[(self.command, name)] += 1
                    if hub.on_request is not None:
                        hub.on_request(self.command, name)
                    return self._file(name, body)
                return self._error(404, f"no such path {path}")

            def _file(self, name: str, body: bool):
                data = (hub.root / name).read_bytes()
                start, status = 0, 200
                wanted = self.headers.get("Range")
                if wanted and body:
                    hub.ranges.append((name, wanted))
                    match = re.fullmatch(r"bytes=(\d+)-", wanted.strip())
                    if match:
                        start, status = int(match.group(1)), 206
                self.send_response(status)
                self.send_header("ETag", f'"{hub.etag(name)}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data) - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not body:
                    return
                chunk = 16 * 1024
                try:
                    for offset in range(start, len(data), chunk):
                        self.wfile.write(data[offset : offset + chunk])
                        if hub.bytes_per_second:
                            time.sleep(chunk / hub.bytes_per_second)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        return Handler


def main() -> None:
    """``python tests/fakehub.py DIR --port N``: serve DIR as the hub on 127.0.0.1 until
    stopped, one line per request on stdout (the container test reads them)."""
    import argparse
    import signal
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("root", type=Path)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    hub = FakeHub(args.root)
    if args.port:
        hub.server.server_close()
        hub.server = ThreadingHTTPServer(("127.0.0.1", args.port), hub._handler())
        hub.server.daemon_threads = True
        hub.url = f"http://127.0.0.1:{args.port}"
        hub._thread = threading.Thread(target=hub.server.serve_forever, daemon=True)
    hub.on_request = lambda method, path: print(f"{method} {path}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with hub:
        print(f"serving {args.root} at {hub.url}", flush=True)
        signal.pause()


if __name__ == "__main__":
    main()

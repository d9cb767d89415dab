"""A loopback HTTP server serving a folder as an HF-style repository (`/REPO/resolve/REV/FILE`) with the
Hub's headers (X-Repo-Commit, ETag, Content-Length; 206 with Content-Range for a range request), able to
misbehave on request: `faults` is a queue of what the next range requests get instead of their bytes."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# what a queued fault does to one range request
FAULTS = ("drop",        # headers and half the body, then the connection closes
          "500",         # an internal server error
          "200",         # the whole file with status 200, the Range header ignored
          "truncate",    # a complete response whose body is half the range
          "hang")        # waits until `release` is set, then serves normally


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass        # a client that hangs up mid-body (as a pack that refuses a 200 does) is not news


class HubServer:
    def __init__(self, folder: Path, repo: str = "org/tiny"):
        self.folder, self.repo = folder, repo
        self.commit = hashlib.sha1(b"first").hexdigest()
        self.faults: list[str] = []
        self.ranges = 0                     # range requests answered with data
        self.hanging, self.release = threading.Event(), threading.Event()
        self.lock = threading.Lock()
        self.httpd = QuietServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{self.repo}"

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def next_fault(self) -> str | None:
        with self.lock:
            return self.faults.pop(0) if self.faults else None

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _file(self) -> Path | None:
                prefix = f"/{server.repo}/resolve/"
                if not self.path.startswith(prefix):
                    return None
                rev, _, name = self.path[len(prefix):].partition("/")
                if rev not in ("main", server.commit):
                    return None
                p = server.folder / name
                return p if p.is_file() else None

            def _headers(self, p: Path, status: int, length: int, extra: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(length))
                self.send_header("ETag", f'"{hashlib.sha1(p.read_bytes()).hexdigest()}"')
                self.send_header("X-Repo-Commit", server.commit)
                self.send_header("Accept-Ranges", "bytes")
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()

            def do_HEAD(self) -> None:
                p = self._file()
                if p is None:
                    self.send_error(404)
                    return
                self._headers(p, 200, p.stat().st_size)

            def do_GET(self) -> None:
                p = self._file()
                if p is None:
                    self.send_error(404)
                    return
                data = p.read_bytes()
                rng = self.headers.get("Range")
                if rng is None:
                    self._headers(p, 200, len(data))
                    self.wfile.write(data)
                    return
                a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
                body = data[a:b + 1]
                fault = server.next_fault()
                if fault == "hang":
                    server.hanging.set()
                    server.release.wait()
                if fault == "500":
                    self.send_error(500)
                    return
                if fault == "200":
                    self._headers(p, 200, len(data))
                    self.wfile.write(data)
                    return
                if fault == "truncate":        # a well-formed response, half as long as the range
                    self._headers(p, 206, len(body) // 2, {"Content-Range": f"bytes {a}-{b}/{len(data)}"})
                    self.wfile.write(body[:len(body) // 2])
                    return
                self._headers(p, 206, len(body), {"Content-Range": f"bytes {a}-{b}/{len(data)}"})
                if fault == "drop":
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)
                with server.lock:
                    server.ranges += 1

        return Handler

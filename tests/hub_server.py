"""A small stand-in for the Hugging Face hub on 127.0.0.1, for the real huggingface_hub client.

Serves what `snapshot_download` asks for: repo info (`/api/{models,datasets}/ID[/revision/R]`),
the recursive tree (`/api/{type}s/ID/tree/R`), and files (`HEAD`/`GET` on
`[datasets/]ID/resolve/R/PATH`). A repo may be gated (a bearer token required) and files may be
served slowly (to interrupt a download mid-way). Counts the file GETs per repo.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Repo:
    files: dict[str, bytes]
    token: str | None = None  # gated: requests must carry "Authorization: Bearer <token>"
    slow: float = 0.0  # seconds per 64 KiB chunk of file bodies
    sha: str = ""
    gets: int = 0
    seen_auth: list = field(default_factory=list)

    def __post_init__(self):
        digest = hashlib.sha1(json.dumps(sorted((k, v.hex()) for k, v in self.files.items())).encode())
        self.sha = digest.hexdigest()


class Hub:
    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}  # (type, id) -> Repo
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool):
                path = self.path.split("?")[0]
                m = re.fullmatch(r"/api/(model|dataset)s/(.+?)(?:/revision/[^/]+)?", path)
                t = re.fullmatch(r"/api/(model|dataset)s/(.+?)/tree/[^/]+", path)
                f = re.fullmatch(r"/(?:(dataset)s/)?(.+?)/resolve/([^/]+)/(.+)", path)
                if t:
                    repo = self._repo(t.group(1), t.group(2))
                    if repo:
                        tree = [{"type": "file", "path": p, "size": len(b),
                                 "oid": hashlib.sha1(b).hexdigest()} for p, b in repo.files.items()]
                        self._json(tree, body)
                elif m:
                    repo = self._repo(m.group(1), m.group(2))
                    if repo:
                        self._json({"id": m.group(2), "sha": repo.sha, "private": False,
                                    "siblings": [{"rfilename": p} for p in repo.files]}, body)
                elif f:
                    repo = self._repo(f.group(1) or "model", f.group(2))
                    if repo:
                        self._file(repo, f.group(4), body)
                else:
                    self._error(404, "RepoNotFound")

            def _repo(self, kind: str, repo_id: str) -> Repo | None:
                repo = hub.repos.get((kind, repo_id))
                if repo is None:
                    self._error(404, "RepoNotFound")
                    return None
                auth = self.headers.get("Authorization")
                repo.seen_auth.append(auth)
                if repo.token and auth != f"Bearer {repo.token}":
                    self._error(401 if not auth else 403, "GatedRepo")
                    return None
                return repo

            def _json(self, obj, body: bool):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _file(self, repo: Repo, name: str, body: bool):
                data = repo.files.get(name)
                if data is None:
                    self._error(404, "EntryNotFound")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
                self.send_header("X-Repo-Commit", repo.sha)
                self.end_headers()
                if not body:
                    return
                repo.gets += 1
                for i in range(0, len(data), 65536):
                    self.wfile.write(data[i:i + 65536])
                    self.wfile.flush()
                    if repo.slow:
                        time.sleep(repo.slow)

            def _error(self, code: int, kind: str):
                data = json.dumps({"error": kind}).encode()
                self.send_response(code)
                self.send_header("X-Error-Code", kind)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        return Handler

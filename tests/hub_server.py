"""A tiny Hub-compatible HTTP server on 127.0.0.1 for push/pull tests (only what huggingface_hub calls).

Repos live in memory: {repo_id: {"sha": commit, "files": {path: bytes}}}. Every file is accepted as a
"regular" (inline, base64) upload, so no LFS or Xet endpoints are needed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

_REPO = r"(?P<repo>[^/]+/[^/]+|[^/]+)"


class HubState:
    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[str] = []
        self.lock = threading.Lock()


def _handler(state: HubState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output quiet
            pass

        def _send(self, status, body=b"", headers=None, head=False):
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
                headers = {"Content-Type": "application/json", **(headers or {})}
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _route(self, method):
            path = unquote(urlparse(self.path).path)
            state.requests.append(f"{method} {path}")
            head = method == "HEAD"
            if method == "POST" and path == "/api/repos/create":
                spec = json.loads(self._body())
                repo_id = f"{spec['organization']}/{spec['name']}" if spec.get("organization") else spec["name"]
                with state.lock:
                    if repo_id in state.repos:
                        return self._send(409, {"error": "You already created this model repo", "url": repo_id})
                    private = bool(spec.get("private")) or spec.get("visibility") == "private"  # old / new clients
                    state.repos[repo_id] = {"sha": "0" * 40, "files": {}, "private": private}
                return self._send(200, {"url": f"http://{self.headers['Host']}/{repo_id}"})
            m = re.fullmatch(rf"/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?", path)
            if m and method == "GET":
                repo = state.repos.get(m["repo"])
                if repo is None:
                    return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                siblings = [{"rfilename": name} for name in sorted(repo["files"])]
                return self._send(200, {"id": m["repo"], "sha": repo["sha"], "siblings": siblings,
                                        "private": repo.get("private", False)})
            if method == "GET" and path == "/api/whoami-v2":  # the user a token belongs to: always "me" here
                return self._send(200, {"type": "user", "name": "me", "orgs": []})
            if method == "POST" and path == "/api/validate-yaml":  # model card metadata check
                self._body()
                return self._send(200, {"errors": [], "warnings": []})
            m = re.fullmatch(rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)", path)
            if m and method == "GET":
                repo = state.repos.get(m["repo"])
                if repo is None:
                    return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                return self._send(200, [{"type": "file", "path": name, "size": len(data),
                                         "oid": hashlib.sha1(data).hexdigest()}
                                        for name, data in sorted(repo["files"].items())])
            m = re.fullmatch(rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)", path)
            if m and method == "POST":
                files = json.loads(self._body())["files"]
                return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                  for f in files]})
            m = re.fullmatch(rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)", path)
            if m and method == "POST":
                repo = state.repos.get(m["repo"])
                if repo is None:
                    return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                files = dict(repo["files"])
                for line in self._body().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    elif item["key"] == "deletedFile":
                        files.pop(item["value"]["path"], None)
                sha = hashlib.sha1(json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items()))
                                   .encode()).hexdigest()
                repo.update(files=files, sha=sha)
                host = self.headers["Host"]
                return self._send(200, {"commitUrl": f"http://{host}/{m['repo']}/commit/{sha}", "commitOid": sha,
                                        "success": True})
            m = re.fullmatch(rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
            if m and method in ("GET", "HEAD"):
                repo = state.repos.get(m["repo"])
                content = None if repo is None else repo["files"].get(m["file"])
                if content is None:
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound" if repo else "RepoNotFound"}, head)
                headers = {"ETag": f'"{hashlib.sha1(content).hexdigest()}"', "X-Repo-Commit": repo["sha"],
                           "Content-Type": "application/octet-stream"}
                self.send_response(200)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                if not head:
                    self.wfile.write(content)
                return None
            return self._send(404, {"error": f"test hub server: no route for {method} {path}"})

        def do_GET(self):
            self._route("GET")

        def do_HEAD(self):
            self._route("HEAD")

        def do_POST(self):
            self._route("POST")

    return Handler


class HubServer:
    def __init__(self):
        self.state = HubState()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.state))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

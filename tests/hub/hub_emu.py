#!/usr/bin/env python3
"""hub_emu.py - a local Hugging Face hub emulator for deltafin's hub tests.

Serves one directory as one model repository over loopback, with the routes
the hub client uses (standard library only):

  GET  /api/models/{repo}/revision/{rev}[?blobs=true]   model info, siblings
  GET  /api/models/{repo}/tree/{rev}[?cursor=K]         file list (directories
       included), --tree-page N entries a page, the next page named by
       Link: <URL>; rel="next" as the real hub does
  GET|HEAD /{repo}/resolve/{rev}/{path}                 files; *.safetensors
       are LFS: 302 to /cdn/{sha256} with X-Linked-Etag / X-Linked-Size /
       X-Repo-Commit, like the real hub's redirect to its file host
  GET|HEAD /cdn/{sha256}                                bytes, Range (206)

Errors use the hub's X-Error-Code header: RepoNotFound (401), RevisionNotFound
(404), EntryNotFound (404), GatedRepo (403). --token T makes every route want
"Authorization: Bearer T" (401 otherwise).

Fault injection on file data responses (--faults, comma-separated KIND:COUNT,
each used COUNT times, in request order): 500 (an error status), drop (close
the connection without answering), short (full Content-Length, half the body,
close), corrupt (flip one byte of the body), list500 (500 on the listing).
--slow-ms N sleeps N ms per 16 KiB of body.

--no-sizes: the model info lists files by name only (a hub that ignores
?blobs=true); the tree still has sizes and hashes. --no-tree-sizes: the tree
has none either.

--log FILE appends one JSON line per request: method, path, range, status,
bytes of body sent. The chosen port is written to --port-file.
"""
import argparse
import hashlib
import json
import os
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ARGS = None
FILES = {}        # path -> {"size", "sha256", "git", "lfs"}
FAULTS = []       # [kind, count]
LOCK = threading.Lock()
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def take_fault(kinds):
    with LOCK:
        for f in FAULTS:
            if f[0] in kinds and f[1] > 0:
                f[1] -= 1
                return f[0]
    return None


def scan(root):
    for dp, dn, fn in os.walk(root):
        dn[:] = [d for d in dn if not d.startswith(".")]
        for f in fn:
            if f.startswith("."):
                continue
            full = os.path.join(dp, f)
            rel = os.path.relpath(full, root)
            data = open(full, "rb").read()
            git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            FILES[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                          "git": git, "lfs": rel.endswith(".safetensors")}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        # headers and body go out in separate writes: without this, Nagle and
        # delayed ACKs add 40 ms to every request
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *a):
        pass

    def record(self, status, sent, rng):
        if not ARGS.log:
            return
        with LOCK:
            with open(ARGS.log, "a") as f:
                f.write(json.dumps({"method": self.command, "path": self.path, "range": rng,
                                    "status": status, "bytes": sent}) + "\n")

    def error(self, status, code, msg):
        body = json.dumps({"error": msg}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", msg)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.record(status, 0, self.headers.get("Range"))

    def json(self, obj, link=None):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if link:
            self.send_header("Link", link)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.record(200, len(body), None)  # before the body: a client done with it may read the log at once
        self.wfile.write(body)

    def authorized(self):
        if not ARGS.token:
            return True
        return self.headers.get("Authorization") == "Bearer " + ARGS.token

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        u = urllib.parse.urlparse(self.path)
        path = urllib.parse.unquote(u.path)
        repo = ARGS.repo
        if not self.authorized():
            return self.error(401, "RepoNotFound", "Repository not found or token missing")
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            if not rest.startswith(repo + "/"):
                return self.error(401, "RepoNotFound", "Repository Not Found for url: " + self.path)
            rest = rest[len(repo) + 1:]
            kind, _, rev = rest.partition("/")
            if rev not in ("main", COMMIT):
                return self.error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            if take_fault(("list500",)):
                return self.error(500, "Internal", "injected 500")
            if kind == "revision":
                sib = []
                for p, f in sorted(FILES.items()):
                    s = {"rfilename": p}
                    if not ARGS.no_sizes:
                        s.update({"blobId": f["git"], "size": f["size"]})
                        if f["lfs"]:
                            s["lfs"] = {"sha256": f["sha256"], "size": f["size"], "pointerSize": 134}
                    sib.append(s)
                return self.json({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                  "gated": "manual" if ARGS.gated else False, "siblings": sib})
            if kind == "tree":
                out = []
                dirs = sorted({os.path.dirname(p) for p in FILES} - {""})
                for d in dirs:
                    out.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": d})
                for p, f in sorted(FILES.items()):
                    e = {"type": "file", "oid": f["git"], "size": f["size"], "path": p}
                    if f["lfs"]:
                        e["lfs"] = {"oid": f["sha256"], "size": f["size"], "pointerSize": 134}
                    if ARGS.no_tree_sizes:
                        del e["size"]
                        e.pop("lfs", None)
                    out.append(e)
                q = urllib.parse.parse_qs(u.query)
                at = int(q.get("cursor", ["0"])[0])
                step = ARGS.tree_page or len(out) or 1
                link = None
                if at + step < len(out):
                    link = "<http://%s/api/models/%s/tree/%s?recursive=true&cursor=%d>; rel=\"next\"" % (
                        self.headers.get("Host"), repo, rev, at + step)
                return self.json(out[at:at + step], link)
            return self.error(404, "EntryNotFound", "unknown api route")
        if path.startswith("/" + repo + "/resolve/"):
            rest = path[len(repo) + len("/resolve/") + 1:]
            rev, _, fp = rest.partition("/")
            if rev not in ("main", COMMIT):
                return self.error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            if ARGS.gated:
                return self.error(403, "GatedRepo", "Access to model %s is restricted" % repo)
            f = FILES.get(fp)
            if not f:
                return self.error(404, "EntryNotFound", "%s does not exist on %s" % (fp, rev))
            if f["lfs"]:
                self.send_response(302)
                self.send_header("Location", "/cdn/%s?name=%s" % (f["sha256"], urllib.parse.quote(fp)))
                self.send_header("X-Linked-Etag", '"%s"' % f["sha256"])
                self.send_header("X-Linked-Size", str(f["size"]))
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"%s"' % f["git"])
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.record(302, 0, self.headers.get("Range"))
                return
            return self.send_file(fp, f, f["git"])
        if path.startswith("/cdn/"):
            sha = path[len("/cdn/"):]
            for p, f in FILES.items():
                if f["sha256"] == sha:
                    return self.send_file(p, f, sha)
            return self.error(404, "EntryNotFound", "no such blob")
        if path.startswith("/repo-file/"):
            pass
        return self.error(404, "EntryNotFound", "unknown route " + path)

    def send_file(self, rel, f, etag):
        size = f["size"]
        rng = self.headers.get("Range")
        a, b, status = 0, size - 1, 200
        if rng and rng.startswith("bytes="):
            lo, _, hi = rng[6:].partition("-")
            try:
                a = int(lo) if lo else size - int(hi)
                b = int(hi) if (hi and lo) else size - 1
            except ValueError:
                return self.error(416, "RangeNotSatisfiable", "bad range")
            if a >= size or a > b:
                self.send_response(416)
                self.send_header("Content-Range", "bytes */%d" % size)
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.record(416, 0, rng)
                return
            b = min(b, size - 1)
            status = 206
        fault = None
        if self.command == "GET":
            fault = take_fault(("500", "drop", "short", "corrupt"))
        if fault == "500":
            return self.error(500, "Internal", "injected 500")
        if fault == "drop":
            self.record(0, 0, rng)
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        with open(os.path.join(ARGS.root, rel), "rb") as fh:
            fh.seek(a)
            body = bytearray(fh.read(b - a + 1))
        if fault == "corrupt" and body:
            body[len(body) // 2] ^= 0x5A
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", '"%s"' % etag)
        self.send_header("X-Repo-Commit", COMMIT)
        if status == 206:
            self.send_header("Content-Range", "bytes %d-%d/%d" % (a, b, size))
        self.end_headers()
        if self.command == "HEAD":
            self.record(status, 0, rng)
            return
        send = body if fault != "short" else body[: len(body) // 2]
        sent = 0
        step = 16384
        try:
            for i in range(0, len(send), step):
                if ARGS.slow_ms:
                    time.sleep(ARGS.slow_ms / 1000.0)
                self.wfile.write(send[i:i + step])
                sent += len(send[i:i + step])
            self.wfile.flush()
        except OSError:
            self.close_connection = True
        if fault == "short":
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.record(status, sent, rng)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--repo", default="deltafin/tiny-k3")
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--log")
    ap.add_argument("--token")
    ap.add_argument("--gated", action="store_true")
    ap.add_argument("--faults", default="")
    ap.add_argument("--slow-ms", type=float, default=0)
    ap.add_argument("--no-sizes", action="store_true")
    ap.add_argument("--no-tree-sizes", action="store_true")
    ap.add_argument("--tree-page", type=int, default=0)
    ARGS = ap.parse_args()
    for spec in filter(None, ARGS.faults.split(",")):
        k, _, n = spec.partition(":")
        FAULTS.append([k, int(n or 1)])
    scan(ARGS.root)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    tmp = ARGS.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(srv.server_address[1]))
    os.rename(tmp, ARGS.port_file)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())

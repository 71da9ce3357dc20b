"""A stand-in for the Kubernetes API server, as much of it as DRA mode talks to: discovery,
SelfSubjectReview, the Node, ResourceClaims (read), ResourceSlices (list, watch, create,
replace, delete) and, for the tests, a kubelet's wipe of a node's slices. Plain HTTP on
127.0.0.1, JSON only.

Like the node authorizer it lets the node's credentials (the token `node-<name>`) write only
slices whose `spec.nodeName` is that node, and it keeps a resourceVersion per object and a
global one for watches, so the kubernetes client's list-then-watch works as against the real
server. `slow_s` delays every answer (an API server under load; beyond the daemon's timeouts),
and `down` refuses every connection's request with 503.
"""

import json
import re
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple

RESOURCE_GROUP = "resource.k8s.io/v1"


def _resource(name: str, kind: str, namespaced: bool, verbs) -> dict:
    return {"name": name, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind, "verbs": list(verbs)}


DISCOVERY = {
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        _resource("nodes", "Node", False, ["get", "list", "watch"])]},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
        {"name": g, "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
         "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"}}
        for g in ("resource.k8s.io", "authentication.k8s.io")]},
    "/apis/resource.k8s.io/v1": {"kind": "APIResourceList", "groupVersion": RESOURCE_GROUP, "resources": [
        _resource("resourceclaims", "ResourceClaim", True, ["get", "list", "watch"]),
        _resource("resourceslices", "ResourceSlice", False, ["create", "delete", "deletecollection", "get", "list",
                                                             "update", "watch"]),
        _resource("deviceclasses", "DeviceClass", False, ["get", "list"])]},
    "/apis/authentication.k8s.io/v1": {"kind": "APIResourceList", "groupVersion": "authentication.k8s.io/v1",
                                       "resources": [_resource("selfsubjectreviews", "SelfSubjectReview", False,
                                                               ["create"])]},
    "/version": {"major": "1", "minor": "37", "gitVersion": "v1.37.2"},
}
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
_CLAIM = re.compile(r"/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims/([^/]+)")
_NODE = re.compile(r"/api/v1/nodes/([^/]+)")


class ApiServerStandIn:
    def __init__(self, node: str = "node-a", port: int = 0) -> None:
        self.node = node
        self.lock = threading.Condition()
        self.version = 1
        self.slices: Dict[str, dict] = {}
        self.claims: Dict[Tuple[str, str], dict] = {}
        self.events: List[Tuple[int, str, dict]] = []  # (resourceVersion, type, slice)
        self.writes: List[Tuple[float, str, str]] = []  # (time, verb, slice name) of every slice write
        self.claim_gets = 0
        self.slow_s = 0.0
        self.down = False
        self.node_uid = "0b9d5c1e-node-uid"
        self.node_status: dict = {"allocatable": {}, "nodeInfo": {"kubeletVersion": "v1.37.2"}}
        self.device_classes: Dict[str, dict] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="apiserver-standin", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: str, node: Optional[str] = None) -> str:
        """A kubeconfig with the node's credentials (as kubelet's own is)."""
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "node",
               "clusters": [{"name": "c", "cluster": {"server": self.url}}],
               "users": [{"name": "u", "user": {"token": f"node-{node or self.node}"}}],
               "contexts": [{"name": "node", "context": {"cluster": "c", "user": "u"}}]}
        with open(path, "w") as f:
            json.dump(doc, f)
        return str(path)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- what a test does -------------------------------------------------------------------

    def add_claim(self, namespace: str, name: str, uid: str, results: List[dict]) -> None:
        """An allocated ResourceClaim: `results` as the scheduler writes them ({request, driver, pool, device})."""
        with self.lock:
            self.claims[(namespace, name)] = {
                "apiVersion": RESOURCE_GROUP, "kind": "ResourceClaim",
                "metadata": {"namespace": namespace, "name": name, "uid": uid, "resourceVersion": str(self._bump())},
                "spec": {"devices": {"requests": [{"name": r.get("request", "")} for r in results]}},
                "status": {"allocation": {"devices": {"results": results}}}}

    def wipe(self, node: Optional[str] = None) -> int:
        """What kubelet does when it starts: every slice of the node deleted."""
        with self.lock:
            names = [n for n, s in self.slices.items() if s["spec"].get("nodeName") == (node or self.node)]
            for n in names:
                self._event("DELETED", self.slices.pop(n))
            return len(names)

    def node_slices(self, node: Optional[str] = None) -> List[dict]:
        with self.lock:
            return [json.loads(json.dumps(s)) for s in self.slices.values()
                    if s["spec"].get("nodeName") == (node or self.node)]

    # --- the server ---------------------------------------------------------------------------

    def _bump(self) -> int:
        self.version += 1
        return self.version

    def _event(self, kind: str, obj: dict) -> None:
        version = self._bump() if kind == "DELETED" else int(obj["metadata"]["resourceVersion"])
        self.events.append((version, kind, obj))
        self.lock.notify_all()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # connections kept, as a client of the real server keeps them

            def log_message(self, *args) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                # headers and body go out as two writes: without this a kept connection waits
                # 40 ms for the client's delayed ACK (Nagle), which no real API server makes one wait
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _send(self, code: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                                  "message": message, "code": code})

            def _user(self) -> str:
                auth = self.headers.get("Authorization", "")
                token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
                return f"system:node:{token[5:]}" if token.startswith("node-") else ""

            def _body(self) -> dict:
                return json.loads(self._payload.decode() or "{}")

            def _route(self, method: str) -> None:
                # read whole before anything is answered: on a kept connection what is left unread is
                # taken for the next request
                self._payload = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if server.slow_s:
                    time.sleep(server.slow_s)
                if server.down:
                    return self._status(503, "ServiceUnavailable", "the stand-in is down")
                url = urllib.parse.urlsplit(self.path)
                path, query = url.path.rstrip("/") or "/", dict(urllib.parse.parse_qsl(url.query))
                if method == "GET" and path in DISCOVERY:
                    return self._send(200, DISCOVERY[path])
                user = self._user()
                if not user:
                    return self._status(401, "Unauthorized", "Unauthorized")
                node = user[len("system:node:"):]
                if method == "POST" and path == "/apis/authentication.k8s.io/v1/selfsubjectreviews":
                    return self._send(201, {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview",
                                            "status": {"userInfo": {"username": user, "groups": ["system:nodes"]}}})
                m = _NODE.fullmatch(path)
                if m and method == "GET":
                    if m.group(1) != server.node:
                        return self._status(404, "NotFound", f'nodes "{m.group(1)}" not found')
                    return self._send(200, {"apiVersion": "v1", "kind": "Node", "status": server.node_status,
                                            "metadata": {"name": server.node, "uid": server.node_uid}})
                if method == "GET" and path.startswith("/apis/resource.k8s.io/v1/deviceclasses/"):
                    dc = server.device_classes.get(path.rsplit("/", 1)[1])
                    if dc is None:
                        return self._status(404, "NotFound", f'deviceclasses "{path.rsplit("/", 1)[1]}" not found')
                    return self._send(200, dc)
                m = _CLAIM.fullmatch(path)
                if m and method == "GET":
                    with server.lock:
                        server.claim_gets += 1
                        claim = server.claims.get((m.group(1), m.group(2)))
                    if claim is None:
                        return self._status(404, "NotFound", f'resourceclaims "{m.group(2)}" not found')
                    return self._send(200, claim)
                if path == SLICES and method == "GET":
                    return self._list_or_watch(query, node)
                if path == SLICES and method == "POST":
                    return self._write(self._body(), node, create=True)
                if path.startswith(SLICES + "/"):
                    name = path[len(SLICES) + 1:]
                    if method == "PUT":
                        return self._write(self._body(), node, create=False, name=name)
                    if method == "DELETE":
                        with server.lock:
                            s = server.slices.get(name)
                            if s is None:
                                return self._status(404, "NotFound", f'resourceslices "{name}" not found')
                            if s["spec"].get("nodeName") != node:
                                return self._status(403, "Forbidden", "not this node's slice")
                            server._event("DELETED", server.slices.pop(name))
                            server.writes.append((time.monotonic(), "delete", name))
                        return self._send(200, {"kind": "Status", "status": "Success"})
                return self._status(404, "NotFound", f"{method} {path}: not served by the stand-in")

            def _selected(self, query: dict, s: dict) -> bool:
                for term in filter(None, query.get("fieldSelector", "").split(",")):
                    key, _, value = term.partition("=")
                    if str(s["spec"].get(key.split(".", 1)[1])) != value:
                        return False
                return True

            def _list_or_watch(self, query: dict, node: str) -> None:
                if query.get("watch") not in ("true", "True", "1"):
                    with server.lock:
                        items = [s for s in server.slices.values() if self._selected(query, s)]
                        version = server.version
                    return self._send(200, {"apiVersion": RESOURCE_GROUP, "kind": "ResourceSliceList",
                                            "metadata": {"resourceVersion": str(version)}, "items": items})
                since = int(query.get("resourceVersion") or 0)
                deadline = time.monotonic() + float(query.get("timeoutSeconds") or 30)
                self.close_connection = True  # a stream of chunks, one per event, as the real server's
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                sent = since
                while True:
                    with server.lock:
                        new = [(v, k, o) for v, k, o in server.events if v > sent and self._selected(query, o)]
                        if not new:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                try:
                                    self.wfile.write(b"0\r\n\r\n")
                                except OSError:
                                    pass
                                return
                            server.lock.wait(min(left, 0.5))
                            continue
                    for v, kind, obj in new:
                        try:
                            line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                            self.wfile.flush()
                        except OSError:
                            return
                        sent = max(sent, v)

            def _write(self, body: dict, node: str, create: bool, name: str = "") -> None:
                spec = body.get("spec") or {}
                if spec.get("nodeName") != node:
                    return self._status(403, "Forbidden", f"system:node:{node} may write only slices of its node")
                with server.lock:
                    name = name or body["metadata"]["name"]
                    old = server.slices.get(name)
                    if create and old is not None:
                        return self._status(409, "AlreadyExists", f'resourceslices "{name}" already exists')
                    if not create:
                        if old is None:
                            return self._status(404, "NotFound", f'resourceslices "{name}" not found')
                        if str(body["metadata"].get("resourceVersion")) != old["metadata"]["resourceVersion"]:
                            return self._status(409, "Conflict", "the object has been modified")
                    body["metadata"]["resourceVersion"] = str(server._bump())
                    body["metadata"].setdefault("uid", f"uid-{name}")
                    server.slices[name] = body
                    server._event("ADDED" if create else "MODIFIED", body)
                    server.writes.append((time.monotonic(), "create" if create else "update", name))
                return self._send(201 if create else 200, body)

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_PUT(self) -> None:
                self._route("PUT")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        return Handler


def main(argv=None) -> int:
    """`serve`: the stand-in as a process (under systemd in the container tests), its kubeconfig
    written with the node's credentials, and each `--claim NS/NAME/UID` allocated the node's kvm."""
    import argparse

    p = argparse.ArgumentParser(prog="apiserver_standin.py")
    p.add_argument("command", choices=["serve"])
    p.add_argument("--node", default="node-a")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--claim", action="append", default=[])
    args = p.parse_args(argv)
    api = ApiServerStandIn(args.node, args.port)
    for c in args.claim:
        namespace, name, uid = c.split("/")
        api.add_claim(namespace, name, uid, [{"request": "kvm", "driver": "ate.dev", "pool": args.node, "device": "kvm"}])
    api.kubeconfig(args.kubeconfig)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

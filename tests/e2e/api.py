"""The Kubernetes API as the tests' user speaks it: JSON over HTTPS with a client certificate.

kubectl costs a process start (a fifth of a second of CPU here) per call; a pod put into a window
tens of milliseconds wide must be one request on a kept connection instead.
"""
from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from typing import Callable, List, Optional


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


class Api:
    """One user's view of the apiserver; a kept connection per thread."""

    def __init__(self, host: str, port: int, ca: str, cert: str, key: str):
        self.host, self.port = host, port
        self._ssl = ssl.create_default_context(cafile=ca)
        self._ssl.load_cert_chain(cert, key)
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPSConnection(self.host, self.port, context=self._ssl, timeout=30)
        return conn

    def request(self, method: str, path: str, body: Optional[dict] = None,
                content_type: str = "application/json") -> dict:
        data = json.dumps(body).encode() if body is not None else None
        for attempt in (1, 2):  # a kept connection the server closed is opened again once
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers={"Content-Type": content_type, "Accept": "application/json"})
                resp = conn.getresponse()
                text = resp.read().decode()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
        if resp.status >= 400:
            raise ApiError(resp.status, text)
        return json.loads(text) if text else {}

    def get(self, path: str) -> dict:
        return self.request("GET", path)

    def create(self, path: str, obj: dict) -> dict:
        return self.request("POST", path, obj)

    def delete(self, path: str, grace: Optional[int] = None) -> dict:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            return self.request("DELETE", path, body)
        except ApiError as e:
            if e.status == 404:
                return {}
            raise

    def patch(self, path: str, patch: dict) -> dict:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def items(self, path: str, selector: str = "") -> List[dict]:
        sep = "&" if "?" in path else "?"
        return self.get(path + (f"{sep}labelSelector={selector}" if selector else ""))["items"]

    def ready(self) -> bool:
        try:
            conn = self._conn()
            conn.request("GET", "/readyz")
            resp = conn.getresponse()
            resp.read()
            return resp.status == 200
        except (http.client.HTTPException, OSError):
            self._local.conn = None
            return False


def wait_for(what: str, probe: Callable[[], Optional[object]], timeout: float, interval: float = 0.1):
    """probe() until it returns something truthy, which is returned; AssertionError naming `what`
    (and the last exception) after `timeout` seconds."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        try:
            got = probe()
            if got:
                return got
        except Exception as e:  # noqa: BLE001 - an apiserver not yet up, a transient answer
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f" (last: {last})" if last else ""))
        time.sleep(interval)


def pod_phase(pod: dict) -> str:
    return pod.get("status", {}).get("phase", "")


def rejected(pod: dict) -> bool:
    """Failed at kubelet's admission because the device manager could not allocate."""
    st = pod.get("status", {})
    return st.get("phase") == "Failed" and st.get("reason") == "UnexpectedAdmissionError"

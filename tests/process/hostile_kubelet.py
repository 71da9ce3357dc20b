"""Kubelets that misbehave, for the fault tests.

`HostileKubelet` is the stand-in with a `behaviour` that can be switched at
any time: "hang" (accept Register and never answer), "error" (answer with an
error status), "no-watch" (dial back, then never open ListAndWatch),
"ten-streams" (open ten ListAndWatch streams at once, read each one's first answer, drop them
all and fail the Register if any was refused, as kubelet's dial does), or
"normal" (the stand-in's kubelet). `RawKubelet` is not gRPC at all: a unix
socket that speaks just enough HTTP/2 to receive the Register call's headers
and then closes the connection mid-call.
"""

import os
import socket
import threading
import time
from typing import List, Tuple

import grpc

from atedevd.api import DevicePluginStub, pb
from rig.kubelet_standin import _DIAL_OPTIONS, Kubelet

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
HEADERS = 0x1


class HostileKubelet(Kubelet):
    def __init__(self, plugin_dir: str, behaviour: str = "normal", error=grpc.StatusCode.INTERNAL, **kwargs):
        super().__init__(plugin_dir, **kwargs)
        self.behaviour = behaviour
        self.error = error
        self.calls = {}  # behaviour -> Register calls handled that way
        self.cancelled = 0  # hung calls whose caller went away (cancelled, or died)
        self.cancelled_at: List[float] = []  # when each was seen gone (monotonic; looked at every 20 ms)
        self.deadlines: List[float] = []  # each Register's time remaining as it arrived: the caller's deadline
        self.release = threading.Event()  # ends every hang with an answer
        # "ten-streams": per Register, each stream's first answer: the number of devices in it, or
        # the gRPC status code that refused it.
        self.rounds: List[List[Tuple[str, object]]] = []
        self.held: List[grpc.Channel] = []  # dial-backs kept open by "no-watch"

    def Register(self, request, context):
        behaviour = self.behaviour
        with self.cond:
            self.calls[behaviour] = self.calls.get(behaviour, 0) + 1
            self.deadlines.append(context.time_remaining())
            self.cond.notify_all()
        if behaviour == "normal":
            return super().Register(request, context)
        if behaviour == "error":
            context.abort(self.error, "hostile kubelet: no")
        if behaviour == "hang":
            while not self.release.wait(0.02):
                if not context.is_active():
                    with self.cond:
                        self.cancelled += 1
                        self.cancelled_at.append(time.monotonic())
                        self.cond.notify_all()
                    return pb.Empty()
            return pb.Empty()
        channel = self._dial(request.endpoint)
        stub = DevicePluginStub(channel)
        stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
        if behaviour == "no-watch":
            self.held.append(channel)
            return pb.Empty()
        if behaviour == "ten-streams":
            streams = [stub.ListAndWatch(pb.Empty()) for _ in range(10)]
            seen: List[Tuple[str, object]] = []
            try:
                for s in streams:
                    try:
                        seen.append(("devices", len(next(s).devices)))
                    except grpc.RpcError as e:  # refused (a stream too many), or the plugin went away meanwhile
                        seen.append(("refused", e.code()))
            finally:
                for s in streams:
                    s.cancel()
                channel.close()
                with self.cond:
                    self.rounds.append(seen)
                    self.cond.notify_all()
            refused = [code for what, code in seen if what == "refused"]
            if refused:
                context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {refused[0].name}")
            return pb.Empty()
        raise ValueError(behaviour)

    def _dial(self, endpoint: str) -> grpc.Channel:
        channel = grpc.insecure_channel("unix:" + os.path.join(self.dir, endpoint), options=_DIAL_OPTIONS)
        grpc.channel_ready_future(channel).result(timeout=10)
        return channel

    def close(self) -> None:
        self.release.set()
        for ch in self.held:
            ch.close()
        super().close()


class RawKubelet:
    """Listens on kubelet.sock; on each connection, reads frames up to the
    Register call's HEADERS, then closes the connection mid-call."""

    def __init__(self, path: str):
        self.path = path
        self.connections = 0
        self.closed_mid_call = 0
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            buf = _read_exactly(conn, len(PREFACE))
            if buf != PREFACE:
                return
            conn.sendall(SETTINGS)
            while True:
                header = _read_exactly(conn, 9)
                length = int.from_bytes(header[:3], "big")
                kind, flags = header[3], header[4]
                _read_exactly(conn, length)
                if kind == 0x4 and not flags & 0x1:
                    conn.sendall(SETTINGS_ACK)
                if kind == HEADERS:
                    with self._lock:
                        self.closed_mid_call += 1
                    return  # the call has begun: drop the connection
        except (OSError, EOFError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()
        self._thread.join(1)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


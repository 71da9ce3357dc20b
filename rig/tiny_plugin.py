"""A device plugin in this process, standing in for the daemon where the kubelet stand-in
itself is tested (tests/rig/test_kubelet_standin.py) or measured (bench/lifecycle.py): each step is then
driven and waited for here, not timed against another process."""

import os
import threading
from concurrent import futures

import grpc

from atedevd.api import API_VERSION, RegistrationStub, device_plugin_handler, pb


class Plugin:
    """Serves two healthy devices on `<plugin_dir>/<name>` until stop(); `stopping.set()` ends
    its ListAndWatch streams (the plugin ends them, as a daemon going away does)."""

    def __init__(self, plugin_dir: str, name: str):
        self.name = name
        self.path = os.path.join(plugin_dir, name)
        self.stopping = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[device_plugin_handler(self)])
        assert self.server.add_insecure_port("unix:" + self.path) == 1
        self.server.start()

    def GetDevicePluginOptions(self, request, context):
        return pb.DevicePluginOptions()

    def ListAndWatch(self, request, context):
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=f"d{i}", health="Healthy") for i in range(2)])
        while context.is_active() and not self.stopping.wait(0.05):
            pass

    def GetPreferredAllocation(self, request, context):
        return pb.PreferredAllocationResponse()

    def Allocate(self, request, context):
        return pb.AllocateResponse(container_responses=[pb.ContainerAllocateResponse() for _ in request.container_requests])

    def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()

    def stop(self) -> None:
        self.stopping.set()
        self.server.stop(None).wait(5)


def register(kubelet_socket: str, plugin: Plugin, resource: str, timeout: float = 5.0) -> None:
    """Register `plugin` for `resource` with the kubelet serving `kubelet_socket`, on a fresh connection."""
    channel = grpc.insecure_channel("unix:" + kubelet_socket, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        RegistrationStub(channel).Register(
            pb.RegisterRequest(version=API_VERSION, endpoint=plugin.name, resource_name=resource), timeout=timeout)
    finally:
        channel.close()

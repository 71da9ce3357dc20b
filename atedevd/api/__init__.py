"""The kubelet device plugin API (v1beta1) and pod-resources API (v1), and for DRA mode
kubelet's plugin registration and DRAPlugin (v1, v1beta1): messages and gRPC service wiring.

Each `*_pb2.py` is generated from the `.proto` beside it by protoc 3.21 (`make proto`)
and committed; do not edit them by hand. The gRPC services are
wired here by hand, with generic handlers, so that the same code runs on
Debian 12's grpcio 1.51 and on the newest grpcio from PyPI.
"""

from atedevd.api import deviceplugin_pb2 as pb
from atedevd.api import podresources_pb2 as prpb
from atedevd.api.service import (
    API_VERSION,
    DevicePluginStub,
    PodResourcesStub,
    RegistrationStub,
    device_plugin_handler,
    pod_resources_handler,
    registration_handler,
)

__all__ = [
    "API_VERSION",
    "DevicePluginStub",
    "PodResourcesStub",
    "RegistrationStub",
    "device_plugin_handler",
    "pb",
    "pod_resources_handler",
    "prpb",
    "registration_handler",
]

"""The kubelet device plugin API (v1beta1): messages and gRPC service wiring.

`deviceplugin_pb2.py` is generated from `deviceplugin.proto` by protoc 3.21
(`make proto`) and committed; do not edit it by hand. The gRPC services are
wired here by hand, with generic handlers, so that the same code runs on
Debian 12's grpcio 1.51 and on the newest grpcio from PyPI.
"""

from atedevd.api import deviceplugin_pb2 as pb
from atedevd.api.service import (
    API_VERSION,
    DevicePluginStub,
    RegistrationStub,
    device_plugin_handler,
    registration_handler,
)

__all__ = [
    "API_VERSION",
    "DevicePluginStub",
    "RegistrationStub",
    "device_plugin_handler",
    "pb",
    "registration_handler",
]

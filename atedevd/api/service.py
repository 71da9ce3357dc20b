"""gRPC wiring for the v1beta1 services, pod-resources v1 and DRA mode's plugin registration,
DRAPlugin v1/v1beta1 and DRAResourceHealth v1/v1alpha1, from one table of methods.

Servers get a generic handler built from any object with the method names;
clients get a stub whose attributes are the channel's multi-callables.
"""

from typing import Any, Dict

import grpc

from atedevd.api import deviceplugin_pb2 as pb
from atedevd.api import dra_health_v1_pb2 as healthpb
from atedevd.api import dra_health_v1alpha1_pb2 as healthpb_alpha
from atedevd.api import dra_v1_pb2 as drapb
from atedevd.api import dra_v1beta1_pb2 as drapb_beta
from atedevd.api import pluginregistration_pb2 as regpb
from atedevd.api import podresources_pb2 as prpb
from atedevd.record import Record

API_VERSION = "v1beta1"


class Method(Record):
    request: Any  # a message class (protoc's: FromString, SerializeToString)
    response: Any
    server_streaming: bool = False


REGISTRATION = "v1beta1.Registration"
DEVICE_PLUGIN = "v1beta1.DevicePlugin"
POD_RESOURCES = "v1.PodResourcesLister"
PLUGIN_REGISTRATION = "pluginregistration.Registration"  # DRA mode: what kubelet's plugin watcher asks
DRA_PLUGIN = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"  # registered as "v1.DRAPlugin" (kubelet >= 1.34)
DRA_PLUGIN_BETA = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"  # "v1beta1.DRAPlugin" (every DRA kubelet)
DRA_HEALTH = "v1.DRAResourceHealth"  # kubelet's device health stream (package "v1", beside pod-resources v1)
DRA_HEALTH_ALPHA = "v1alpha1.DRAResourceHealth"


def _dra(m) -> Dict[str, "Method"]:
    return {
        "NodePrepareResources": Method(m.NodePrepareResourcesRequest, m.NodePrepareResourcesResponse),
        "NodeUnprepareResources": Method(m.NodeUnprepareResourcesRequest, m.NodeUnprepareResourcesResponse),
    }


def _health(m) -> Dict[str, "Method"]:
    return {
        "NodeWatchResources": Method(
            m.NodeWatchResourcesRequest, m.NodeWatchResourcesResponse, server_streaming=True
        ),
    }


METHODS: Dict[str, Dict[str, Method]] = {
    REGISTRATION: {
        "Register": Method(pb.RegisterRequest, pb.Empty),
    },
    DEVICE_PLUGIN: {
        "GetDevicePluginOptions": Method(pb.Empty, pb.DevicePluginOptions),
        "ListAndWatch": Method(pb.Empty, pb.ListAndWatchResponse, server_streaming=True),
        "GetPreferredAllocation": Method(
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ),
        "Allocate": Method(pb.AllocateRequest, pb.AllocateResponse),
        "PreStartContainer": Method(pb.PreStartContainerRequest, pb.PreStartContainerResponse),
    },
    PLUGIN_REGISTRATION: {
        "GetInfo": Method(regpb.InfoRequest, regpb.PluginInfo),
        "NotifyRegistrationStatus": Method(regpb.RegistrationStatus, regpb.RegistrationStatusResponse),
    },
    DRA_PLUGIN: _dra(drapb),
    DRA_PLUGIN_BETA: _dra(drapb_beta),
    DRA_HEALTH: _health(healthpb),
    DRA_HEALTH_ALPHA: _health(healthpb_alpha),
    POD_RESOURCES: {
        "List": Method(prpb.ListPodResourcesRequest, prpb.ListPodResourcesResponse),
        "GetAllocatableResources": Method(
            prpb.AllocatableResourcesRequest, prpb.AllocatableResourcesResponse
        ),
    },
}


def _handler(service: str, servicer: object) -> grpc.GenericRpcHandler:
    handlers = {}
    for name, m in METHODS[service].items():
        make = (
            grpc.unary_stream_rpc_method_handler
            if m.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = make(
            getattr(servicer, name),
            request_deserializer=m.request.FromString,
            response_serializer=m.response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service, handlers)


def device_plugin_handler(servicer: object) -> grpc.GenericRpcHandler:
    """Serve `servicer`'s methods as v1beta1.DevicePlugin."""
    return _handler(DEVICE_PLUGIN, servicer)


def registration_handler(servicer: object) -> grpc.GenericRpcHandler:
    """Serve `servicer.Register` as v1beta1.Registration (the kubelet side)."""
    return _handler(REGISTRATION, servicer)


def handler(service: str, servicer: object) -> grpc.GenericRpcHandler:
    """Serve `servicer`'s methods as `service`, one of METHODS (DRA mode's services)."""
    return _handler(service, servicer)


def stub(service: str, channel: grpc.Channel) -> "_Stub":
    """A client of `service` on `channel` (kubelet's side of DRA mode: the tests' stand-in)."""
    return type("Stub", (_Stub,), {"_service": service})(channel)


def pod_resources_handler(servicer: object) -> grpc.GenericRpcHandler:
    """Serve `servicer.List` and `servicer.GetAllocatableResources` as v1.PodResourcesLister
    (the kubelet side; here, the tests' kubelet stand-in)."""
    return _handler(POD_RESOURCES, servicer)


class _Stub:
    """A client of one service: each method a multi-callable (set from METHODS at run time)."""

    _service = ""

    def __getattr__(self, name: str) -> Any:  # (only for type checkers: every method is set in __init__)
        raise AttributeError(name)

    def __init__(self, channel: grpc.Channel):
        for name, m in METHODS[self._service].items():
            make = channel.unary_stream if m.server_streaming else channel.unary_unary
            setattr(
                self,
                name,
                make(
                    f"/{self._service}/{name}",
                    request_serializer=m.request.SerializeToString,
                    response_deserializer=m.response.FromString,
                ),
            )


class RegistrationStub(_Stub):
    """Client of kubelet's Registration service."""

    _service = REGISTRATION


class DevicePluginStub(_Stub):
    """Client of a device plugin (what kubelet uses; here, tests and benchmarks)."""

    _service = DEVICE_PLUGIN


class PodResourcesStub(_Stub):
    """Client of kubelet's pod-resources service (v1.PodResourcesLister):
    `GetAllocatableResources(prpb.AllocatableResourcesRequest())` and
    `List(prpb.ListPodResourcesRequest())`."""

    _service = POD_RESOURCES

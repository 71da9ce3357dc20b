"""The bindings (v1beta1, pod-resources v1, DRA v1/v1beta1, DRA health v1/v1alpha1, plugin registration):
generated code matches the protos, field numbers match kubelet's, and the service table serves and calls them."""

import os
import shutil
import subprocess
import tempfile
from concurrent import futures

import grpc
import pytest

from atedevd.api import dra_health_v1_pb2 as healthpb
from atedevd.api import dra_health_v1alpha1_pb2 as healthpb_alpha
from atedevd.api import pb, prpb
from atedevd.api.service import DRA_HEALTH, DRA_HEALTH_ALPHA, METHODS, handler, stub
from rig.harness import REPO

API_DIR = os.path.join(REPO, "atedevd", "api")


PROTOS = [
    "deviceplugin.proto",
    "podresources.proto",
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "pluginregistration.proto",
    "dra_health_v1.proto",
    "dra_health_v1alpha1.proto",
]


def test_every_proto_is_listed():
    assert sorted(f for f in os.listdir(API_DIR) if f.endswith(".proto")) == sorted(PROTOS)
    with open(os.path.join(os.path.dirname(API_DIR), os.pardir, "Makefile")) as f:
        assert f"PROTOS := {' '.join(PROTOS)}" in f.read(), "`make proto` must regenerate every proto"


@pytest.mark.parametrize("proto", PROTOS)
def test_committed_code_is_what_protoc_3_21_generates(tmp_path, proto):
    protoc = shutil.which("protoc")
    assert protoc, "protoc (Debian's protobuf-compiler, 3.21) is needed: make deps installs it"
    version = subprocess.run([protoc, "--version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith("libprotoc 3.21"), version
    subprocess.run([protoc, f"--python_out={tmp_path}", proto], cwd=API_DIR, check=True)
    generated = proto.replace(".proto", "_pb2.py")
    with open(os.path.join(API_DIR, generated)) as committed:
        assert (tmp_path / generated).read_text() == committed.read(), "run `make proto` and commit"


@pytest.mark.parametrize(
    "message, fields",
    [
        (pb.RegisterRequest, {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}),
        (pb.DevicePluginOptions, {"pre_start_required": 1, "get_preferred_allocation_available": 2}),
        (pb.Device, {"ID": 1, "health": 2, "topology": 3}),
        (pb.TopologyInfo, {"nodes": 1}),
        (pb.NUMANode, {"ID": 1}),
        (pb.ListAndWatchResponse, {"devices": 1}),
        (pb.AllocateRequest, {"container_requests": 1}),
        (pb.ContainerAllocateRequest, {"devices_ids": 1}),
        (pb.AllocateResponse, {"container_responses": 1}),
        (pb.ContainerAllocateResponse, {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}),
        (pb.Mount, {"container_path": 1, "host_path": 2, "read_only": 3}),
        (pb.DeviceSpec, {"container_path": 1, "host_path": 2, "permissions": 3}),
        (pb.CDIDevice, {"name": 1}),
        (pb.PreStartContainerRequest, {"devices_ids": 1}),
        (pb.PreferredAllocationRequest, {"container_requests": 1}),
        (pb.ContainerPreferredAllocationRequest, {"available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}),
        (pb.PreferredAllocationResponse, {"container_responses": 1}),
        (pb.ContainerPreferredAllocationResponse, {"deviceIDs": 1}),
    ],
)
def test_field_numbers_match_kubelet(message, fields):
    assert {f.name: f.number for f in message.DESCRIPTOR.fields} == fields
    assert message.DESCRIPTOR.full_name.startswith("v1beta1.")


@pytest.mark.parametrize(
    "message, fields",
    [
        (prpb.AllocatableResourcesRequest, {}),
        (prpb.AllocatableResourcesResponse, {"devices": 1, "cpu_ids": 2, "memory": 3}),
        (prpb.ListPodResourcesRequest, {}),
        (prpb.ListPodResourcesResponse, {"pod_resources": 1}),
        (prpb.PodResources, {"name": 1, "namespace": 2, "containers": 3}),
        (prpb.ContainerResources, {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4}),
        (prpb.ContainerMemory, {"memory_type": 1, "size": 2, "topology": 3}),
        (prpb.ContainerDevices, {"resource_name": 1, "device_ids": 2, "topology": 3}),
        (prpb.TopologyInfo, {"nodes": 1}),
        (prpb.NUMANode, {"ID": 1}),
    ],
)
def test_pod_resources_field_numbers_match_kubelet(message, fields):
    assert {f.name: f.number for f in message.DESCRIPTOR.fields} == fields
    assert message.DESCRIPTOR.full_name.startswith("v1.")


def test_numa_node_id_is_int64():
    assert pb.NUMANode.DESCRIPTOR.fields_by_name["ID"].type == pb.NUMANode.DESCRIPTOR.fields_by_name["ID"].TYPE_INT64


def test_pod_resources_int_types_match_kubelet():
    f = prpb.ContainerMemory.DESCRIPTOR.fields_by_name["size"]
    assert f.type == f.TYPE_UINT64
    for message, name in ((prpb.NUMANode, "ID"), (prpb.AllocatableResourcesResponse, "cpu_ids")):
        f = message.DESCRIPTOR.fields_by_name[name]
        assert f.type == f.TYPE_INT64


@pytest.mark.parametrize(
    "module", [pb, prpb, healthpb, healthpb_alpha], ids=["v1beta1", "podresources", "dra-health-v1", "dra-health-v1alpha1"]
)
def test_service_table_matches_the_proto(module):
    assert module.DESCRIPTOR.services_by_name
    for service in module.DESCRIPTOR.services_by_name.values():
        table = METHODS[service.full_name]
        assert set(table) == set(service.methods_by_name)
        for name, m in service.methods_by_name.items():
            assert table[name].request.DESCRIPTOR is m.input_type
            assert table[name].response.DESCRIPTOR is m.output_type
            assert table[name].server_streaming == m.server_streaming


HEALTH = [(DRA_HEALTH, healthpb, "v1"), (DRA_HEALTH_ALPHA, healthpb_alpha, "v1alpha1")]
HEALTH_IDS = ["v1", "v1alpha1"]


@pytest.mark.parametrize("name, module, package", HEALTH, ids=HEALTH_IDS)
def test_dra_health_field_numbers_match_kubelet(name, module, package):
    assert name == f"{package}.DRAResourceHealth" == module.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name
    for message, fields in [
        (module.NodeWatchResourcesRequest, {}),
        (module.DeviceIdentifier, {"pool_name": 1, "device_name": 2}),
        (module.DeviceHealth, {"device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4, "message": 5}),
        (module.NodeWatchResourcesResponse, {"devices": 1}),
    ]:
        assert {f.name: f.number for f in message.DESCRIPTOR.fields} == fields
        assert message.DESCRIPTOR.full_name == f"{package}.{message.DESCRIPTOR.name}"
    assert {v.name: v.number for v in module.HealthStatus.DESCRIPTOR.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    assert module.HealthStatus.DESCRIPTOR.full_name == f"{package}.HealthStatus"
    d = module.DeviceHealth.DESCRIPTOR.fields_by_name
    for f in ("last_updated_time", "health_check_timeout_seconds"):
        assert d[f].type == d[f].TYPE_INT64
    assert d["health"].type == d["health"].TYPE_ENUM and d["health"].enum_type is module.HealthStatus.DESCRIPTOR
    assert d["message"].type == d["message"].TYPE_STRING


def test_dra_health_v1_and_v1alpha1_share_the_wire_format():
    """v1alpha1 differs from v1 only in the package: either's bytes are the other's message."""
    a = healthpb.NodeWatchResourcesResponse(devices=[healthpb.DeviceHealth(
        device=healthpb.DeviceIdentifier(pool_name="node-a", device_name="kvm-0"), health=healthpb.UNHEALTHY,
        last_updated_time=1767225600, health_check_timeout_seconds=30, message="gone")])
    b = healthpb_alpha.NodeWatchResourcesResponse.FromString(a.SerializeToString())
    assert b.SerializeToString() == a.SerializeToString()
    assert b.devices[0].device.device_name == "kvm-0" and b.devices[0].health == healthpb_alpha.UNHEALTHY


@pytest.fixture
def sock_dir():
    """Short, under /tmp: a unix socket path has 107 bytes, which pytest's tmp_path may not leave."""
    root = tempfile.mkdtemp(prefix="ate", dir="/tmp")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name, module, package", HEALTH, ids=HEALTH_IDS)
def test_dra_health_stream_round_trip(sock_dir, name, module, package):
    """A real server on a unix socket, built by service.handler(); a client from service.stub():
    NodeWatchResources streams the handler's two responses, fields and types intact."""
    requests = []

    class HealthStream:
        def NodeWatchResources(self, request, context):
            requests.append(request)
            yield module.NodeWatchResourcesResponse(devices=[
                module.DeviceHealth(
                    device=module.DeviceIdentifier(pool_name="node-a", device_name="kvm-0"),
                    health=module.HEALTHY, last_updated_time=1767225600, health_check_timeout_seconds=30),
                module.DeviceHealth(
                    device=module.DeviceIdentifier(pool_name="node-a", device_name="kvm-1"),
                    health=module.UNKNOWN, last_updated_time=1767225600),
            ])
            yield module.NodeWatchResourcesResponse(devices=[
                module.DeviceHealth(
                    device=module.DeviceIdentifier(pool_name="node-a", device_name="kvm-0"),
                    health=module.UNHEALTHY, last_updated_time=2**40, health_check_timeout_seconds=2**33,
                    message="/dev/kvm gone"),
            ])

    path = os.path.join(sock_dir, "dra.sock")
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler(name, HealthStream())])
    server.add_insecure_port("unix:" + path)
    server.start()
    channel = grpc.insecure_channel("unix:" + path)
    try:
        got = list(stub(name, channel).NodeWatchResources(module.NodeWatchResourcesRequest(), timeout=10))
        # kubelet's own path for the call (what a client built from the upstream proto dials)
        raw = channel.unary_stream(
            f"/{package}.DRAResourceHealth/NodeWatchResources",
            request_serializer=module.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=module.NodeWatchResourcesResponse.FromString,
        )
        assert list(raw(module.NodeWatchResourcesRequest(), timeout=10)) == got
    finally:
        channel.close()
        server.stop(None)

    assert len(requests) == 2 and all(type(r) is module.NodeWatchResourcesRequest for r in requests)
    assert [type(r) for r in got] == [module.NodeWatchResourcesResponse] * 2
    first, second = got
    assert [(d.device.pool_name, d.device.device_name, d.health, d.last_updated_time, d.health_check_timeout_seconds, d.message)
            for d in first.devices] == [
        ("node-a", "kvm-0", module.HEALTHY, 1767225600, 30, ""),
        ("node-a", "kvm-1", module.UNKNOWN, 1767225600, 0, ""),
    ]
    (d,) = second.devices
    assert type(d) is module.DeviceHealth and type(d.device) is module.DeviceIdentifier
    assert (d.device.pool_name, d.device.device_name, d.message) == ("node-a", "kvm-0", "/dev/kvm gone")
    assert type(d.device.pool_name) is str and type(d.device.device_name) is str and type(d.message) is str
    assert d.health == module.UNHEALTHY == 2 and type(d.health) is int
    assert module.HealthStatus.Name(d.health) == "UNHEALTHY"
    assert (d.last_updated_time, d.health_check_timeout_seconds) == (2**40, 2**33)  # past 32 bits: int64 on the wire
    assert type(d.last_updated_time) is int and type(d.health_check_timeout_seconds) is int

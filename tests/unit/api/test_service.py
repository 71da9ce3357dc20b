"""The v1beta1 and pod-resources v1 bindings: generated code matches the protos, field numbers match kubelet's."""

import os
import shutil
import subprocess

import pytest

from atedevd.api import pb, prpb
from atedevd.api.service import METHODS
from rig.harness import REPO

API_DIR = os.path.join(REPO, "atedevd", "api")


PROTOS = ["deviceplugin.proto", "podresources.proto", "dra_v1.proto", "dra_v1beta1.proto", "pluginregistration.proto"]


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


@pytest.mark.parametrize("module", [pb, prpb], ids=["v1beta1", "podresources"])
def test_service_table_matches_the_proto(module):
    assert module.DESCRIPTOR.services_by_name
    for service in module.DESCRIPTOR.services_by_name.values():
        table = METHODS[service.full_name]
        assert set(table) == set(service.methods_by_name)
        for name, m in service.methods_by_name.items():
            assert table[name].request.DESCRIPTOR is m.input_type
            assert table[name].response.DESCRIPTOR is m.output_type
            assert table[name].server_streaming == m.server_streaming

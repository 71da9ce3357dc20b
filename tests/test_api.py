"""The v1beta1 bindings: generated code matches the proto, field numbers match kubelet's."""

import os
import shutil
import subprocess

import pytest

from atedevd.api import pb
from atedevd.api.service import METHODS

API_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "atedevd", "api")


def test_committed_code_is_what_protoc_3_21_generates(tmp_path):
    protoc = shutil.which("protoc")
    assert protoc, "protoc (Debian's protobuf-compiler, 3.21) is needed: make deps installs it"
    version = subprocess.run([protoc, "--version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith("libprotoc 3.21"), version
    subprocess.run([protoc, f"--python_out={tmp_path}", "deviceplugin.proto"], cwd=API_DIR, check=True)
    with open(os.path.join(API_DIR, "deviceplugin_pb2.py")) as committed:
        assert (tmp_path / "deviceplugin_pb2.py").read_text() == committed.read(), "run `make proto` and commit"


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


def test_numa_node_id_is_int64():
    assert pb.NUMANode.DESCRIPTOR.fields_by_name["ID"].type == pb.NUMANode.DESCRIPTOR.fields_by_name["ID"].TYPE_INT64


def test_service_table_matches_the_proto():
    for service in pb.DESCRIPTOR.services_by_name.values():
        table = METHODS[service.full_name]
        assert set(table) == set(service.methods_by_name)
        for name, m in service.methods_by_name.items():
            assert table[name].request.DESCRIPTOR is m.input_type
            assert table[name].response.DESCRIPTOR is m.output_type
            assert table[name].server_streaming == m.server_streaming

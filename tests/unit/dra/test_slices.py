"""What a DRA node publishes: device names, the slices and the DeviceClass."""

from atedevd.dra import slices as sl

KVM = sl.DraDevice("kvm", "ate.dev/kvm", "/dev/kvm", True, ("ate.dev/kvm=kvm",))


def unit(i: int) -> sl.DraDevice:
    return sl.DraDevice(f"vfio-vfio-{i}", "ate.dev/vfio", f"/dev/vfio/{i}", False, (f"ate.dev/vfio=vfio-{i}",), (i % 2,))


def test_device_names_are_dns_labels_and_distinct_where_the_ids_are_not_labels():
    assert sl.device_name("ate.dev/kvm", None) == "kvm"
    assert sl.device_name("ate.dev/vfio", "vfio-12") == "vfio-vfio-12"
    odd = [sl.device_name("ate.dev/tty", u) for u in ("ttyUSB_0", "ttyUSB-0", "TTYusb.0", "x" * 70)]
    assert len(set(odd)) == len(odd)
    assert all(len(n) <= 63 and sl._LABEL.fullmatch(n) for n in odd), odd


def test_a_shareable_device_allows_many_claims_and_a_unit_carries_its_numa_node():
    [doc] = sl.slices("node-a", "uid-1", [KVM, unit(1)], 4)
    assert doc["spec"]["pool"] == {"name": "node-a", "generation": 4, "resourceSliceCount": 1}
    by = {d["name"]: d for d in doc["spec"]["devices"]}
    assert by["kvm"]["allowMultipleAllocations"] is True
    assert "allowMultipleAllocations" not in by["vfio-vfio-1"]
    assert by["vfio-vfio-1"]["attributes"][sl.NUMA_ATTRIBUTE] == {"int": 1}
    assert doc["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "node-a",
                                                   "uid": "uid-1", "controller": True}]


def test_more_devices_than_a_slice_holds_make_a_pool_of_several_slices_and_none_makes_one_empty_slice():
    docs = sl.slices("n", None, [unit(i) for i in range(300)], 1)
    assert [len(d["spec"]["devices"]) for d in docs] == [128, 128, 44]
    assert {d["spec"]["pool"]["resourceSliceCount"] for d in docs} == {3}
    assert len({d["metadata"]["name"] for d in docs}) == 3
    [empty] = sl.slices("n", None, [], 1)
    assert empty["spec"]["devices"] == [] and "ownerReferences" not in empty["metadata"]


def test_same_content_ignores_the_generation_and_what_the_server_defaults_but_not_a_device():
    a = sl.slices("n", "u", [KVM], 1)[0]
    b = sl.slices("n", "u", [KVM], 7)[0]
    assert sl.same_content(a, b)
    served = dict(b, spec=dict(b["spec"], perDeviceNodeSelection=False, devices=[dict(b["spec"]["devices"][0], taints=[])]))
    assert sl.same_content(served, a)
    assert not sl.same_content(a, sl.slices("n", "u", [KVM, unit(0)], 1)[0])
    assert not sl.same_content(a, sl.slices("n", "other-uid", [KVM], 1)[0])


def test_the_device_class_maps_the_extended_resource_name_to_the_driver_s_devices_of_the_resource():
    c = sl.device_class("ate.dev/kvm")
    assert c["metadata"]["name"] == "kvm.ate.dev"
    assert c["spec"]["extendedResourceName"] == "ate.dev/kvm"
    assert c["spec"]["selectors"] == [{"cel": {"expression":
                                               'device.driver == "ate.dev" && device.attributes["ate.dev"].resource == "ate.dev/kvm"'}}]
    assert sl.class_name("example.com/tun") == "tun.example.com"


def test_a_shared_device_with_a_count_takes_one_of_it_per_claim():
    """Consumable capacity (KEP-5075): the device's `count` bounds how many claims share it."""
    d = sl.DraDevice("kvm", "ate.dev/kvm", "/dev/kvm", True, ("ate.dev/kvm=kvm",), capacity=2)
    [doc] = sl.slices("n", None, [d], 1)
    assert doc["spec"]["devices"][0]["capacity"] == {"claims": {"value": "2", "requestPolicy": {
        "default": "1", "validValues": ["1"]}}}
    unit = sl.DraDevice("u-0", "ate.dev/u", "/dev/u0", False, ("ate.dev/u=0",), capacity=2)
    assert "capacity" not in sl.slices("n", None, [unit], 1)[0]["spec"]["devices"][0]  # (one claim's at a time anyway)

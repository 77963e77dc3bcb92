"""JsonObject: a lease's BackendData as a small read-only mapping, equal to its dict."""

from __future__ import annotations

import json
import sys

import pytest

from flannelpy.subnet.json_object import JsonObject
from flannelpy.subnet.lease import LeaseAttrs


def test_it_reads_and_compares_as_the_dict_it_came_from() -> None:
    members = {"VNI": 1, "VtepMAC": "02:aa:00:00:00:01"}
    obj = JsonObject(members)
    assert obj["VNI"] == 1 and obj.get("VtepMAC") == "02:aa:00:00:00:01"
    assert obj.get("PublicKey") is None and "VNI" in obj and "Nope" not in obj
    with pytest.raises(KeyError):
        obj["Nope"]
    assert list(obj) == ["VNI", "VtepMAC"] and len(obj) == 2
    assert obj == members and members == obj and dict(obj) == members
    assert obj == JsonObject({"VtepMAC": "02:aa:00:00:00:01", "VNI": 1})  # other order
    assert obj != JsonObject({"VNI": 2, "VtepMAC": "02:aa:00:00:00:01"})
    assert obj != {"VNI": 1} and obj != ["VNI"]
    assert repr(obj) == repr(members)
    with pytest.raises(TypeError):
        hash(obj)


def test_objects_with_the_same_names_share_them_and_are_smaller_than_a_dict() -> None:
    a = JsonObject({"VNI": 1, "VtepMAC": "02:aa:00:00:00:01"})
    b = JsonObject(json.loads('{"VNI": 1, "VtepMAC": "02:aa:00:00:00:02"}'))
    assert a._names is b._names
    own = sys.getsizeof(b) + sys.getsizeof(b._values)
    assert own < sys.getsizeof(json.loads('{"VNI": 1, "VtepMAC": "02:aa:00:00:00:02"}')) * 0.7


def test_the_names_kept_are_bounded() -> None:
    for i in range(200):
        JsonObject({f"name{i}": i})
    from flannelpy.subnet import json_object

    assert len(json_object._NAMES) <= json_object._NAMES_KEPT


def test_a_lease_value_round_trips_through_it() -> None:
    raw = (
        '{"PublicIP":"192.168.1.2","PublicIPv6":null,"BackendType":"vxlan",'
        '"BackendData":{"VNI":1,"VtepMAC":"02:AA:00:00:00:01"}}'
    )
    attrs = LeaseAttrs.from_json(raw)
    assert isinstance(attrs.backend_data, JsonObject)
    assert attrs.vtep_mac == "02:aa:00:00:00:01"
    assert json.loads(attrs.to_json()) == json.loads(raw)
    assert LeaseAttrs.from_json(attrs.to_json()) == attrs


def test_the_lab_reads_a_lease_with_its_backend_data_as_json() -> None:
    """The lab's lease listing (what `flannelpy-lab leases` prints and the lab's
    readiness of a flanneld node reads) serialises BackendData."""
    from flannelpy_lab.etcd import _lease_doc

    value = (
        b'{"PublicIP":"100.64.0.2","BackendType":"vxlan",'
        b'"BackendData":{"VNI":1,"VtepMAC":"02:aa:00:00:00:01"}}'
    )
    doc = _lease_doc("10.244.5.0-24", value)
    assert doc["error"] is None and doc["public_ip"] == "100.64.0.2"
    assert json.loads(json.dumps(doc))["backend_data"] == {"VNI": 1, "VtepMAC": "02:aa:00:00:00:01"}

"""atedevd/record.py: the package's value type, which must behave as the NamedTuples it replaced."""

import copy
import os
import pickle
from typing import Optional

import pytest

from atedevd.record import Record
from rig.harness import REPO

PACKAGE = os.path.join(REPO, "atedevd")


class Pair(Record):
    """A test value."""

    sid: int
    error: Optional[str] = None


class Empty(Record):
    """No fields."""


def test_fields_by_position_name_keyword_and_default():
    assert tuple(Pair(1)) == (1, None) and tuple(Pair(1, "x")) == (1, "x")
    assert Pair(sid=2).sid == 2 and Pair(3, error="e").error == "e" and Pair(error="q", sid=4) == Pair(4, "q")
    assert Pair._fields == ("sid", "error") and Pair._defaults == {"error": None}
    assert tuple(Empty()) == () and Empty._fields == ()
    assert repr(Pair(1, "x")) == "Pair(sid=1, error='x')" and repr(Empty()) == "Empty()"


def test_replace_asdict_hash_copy_pickle():
    p = Pair(1, "x")
    assert p._replace(error="y") == Pair(1, "y") and type(p._replace(sid=2)) is Pair
    assert p._asdict() == {"sid": 1, "error": "x"}
    assert hash(p) == hash(Pair(1, "x")) and {p: 1}[Pair(1, "x")] == 1
    assert copy.deepcopy(p) == p and type(pickle.loads(pickle.dumps(p))) is Pair


def test_an_instance_is_only_its_tuple():
    with pytest.raises(AttributeError):
        Pair(1).other = 2
    assert not hasattr(Pair(1), "__dict__")
    with pytest.raises(AttributeError):
        Pair(1).sid = 2


class Other(Record):
    """Another test value, with Pair's shape."""

    sid: int
    error: Optional[str] = None


def test_values_compare_and_hash_by_type_and_fields():
    """Two actions with the same fields are two different actions: a test that compares action
    lists must fail on the wrong one, and a dict keyed by values must keep both."""
    assert Pair(1) != Other(1) and not (Pair(1) == Other(1))
    assert Pair(1) != (1, None) and (1, None) != Pair(1)
    assert Empty() != () and Empty() == Empty()
    assert len({Pair(1): "a", Other(1): "b"}) == 2
    assert Pair(1) == Pair(1, None) and not (Pair(1) != Pair(1))


class Subrecord(Pair):
    """Adds a field after Pair's."""

    extra: int = 0


def test_a_subclass_adds_its_fields_after_its_bases():
    c = Subrecord(1, "x", 2)
    assert c._fields == ("sid", "error", "extra") and (c.sid, c.error, c.extra) == (1, "x", 2)
    assert Subrecord(1) != Pair(1) and Subrecord(sid=1)._defaults == {"error": None, "extra": 0}


@pytest.mark.parametrize("make, words", [
    (lambda: Pair(), "missing 1 required positional argument: 'sid'"),
    (lambda: Pair(1, "x", 3), "takes from 2 to 3 positional arguments but 4 were given"),
    (lambda: Pair(1, other=2), "got an unexpected keyword argument 'other'"),
    (lambda: Pair(1, sid=2), "got multiple values for argument 'sid'"),
    (lambda: Empty(1), "takes 1 positional argument but 2 were given"),
])
def test_a_wrong_call_names_the_problem(make, words):
    """Python checks the call itself: `__new__` has the fields as its parameters."""
    with pytest.raises(TypeError) as e:
        make()
    assert words in str(e.value)


def test_a_default_before_a_field_without_one_is_refused_when_defined():
    with pytest.raises(TypeError, match="without a default follows one with a default"):
        class Bad(Record):
            first: int = 1
            second: int


def test_every_value_type_of_the_package_is_a_record():
    """typing.NamedTuple costs ~40 µs a class on the way to the first Register; a Record a few."""
    found = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py") and "_pb2" not in name:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    if "NamedTuple" in f.read() and name != "record.py":
                        found.append(name)
    assert found == []

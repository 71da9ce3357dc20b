"""Typed values that are cheap to define: a tuple whose fields are its class's annotations.

The registration machine's events and actions, the upgrade's messages and every table
row are some sixty small classes, all defined on the way to the first Register. A
frozen dataclass costs about 0.3 ms a class to define on Debian 12's Python 3.11 (it
execs five generated methods), `typing.NamedTuple` about 40 µs; a `Record` about 15,
for one exec'd `__new__` whose parameters are the fields, so a call is checked by
Python itself, by position or by keyword (`docs/design.md`, "Values", has the figures).

A Record compares and hashes by its type and its fields: `EndStreams(1) != CloseSocket(1)`,
and neither equals the plain tuple `(1,)`. Fields are read by name (and by position: it is
a tuple), with defaults, keywords, `_replace`, `_asdict` and a readable repr. Type checkers
see each class's constructor through `dataclass_transform` (PEP 681).
"""

import operator
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Tuple, TypeVar

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**_: Any):  # only type checkers read it
        return lambda cls: cls

_tuple_new = tuple.__new__
_tuple_eq = tuple.__eq__
_tuple_hash = tuple.__hash__
_R = TypeVar("_R", bound="Record")


def _own_fields(cls: type) -> Tuple[str, ...]:
    """The names annotated in the class body itself, in order: read through `type`'s own
    descriptor, which a metaclass's attributes cannot shadow (3.14 evaluates them lazily, on
    this read); Python 3.9 has none, and would hand a class without annotations its base's."""
    if _class_annotations is None:
        return tuple(cls.__dict__.get("__annotations__", {}))
    return tuple(_class_annotations.__get__(cls))


_class_annotations = vars(type).get("__annotations__")  # (Python 3.9 has none: the class's own dict there)


@dataclass_transform(eq_default=True, frozen_default=True)
class _RecordType(type):
    """Turns the annotated names of a class body into the tuple's fields."""

    if TYPE_CHECKING:
        _fields: Tuple[str, ...]
        _defaults: Dict[str, Any]

    def __new__(mcls, name: str, bases: Tuple[type, ...], namespace: Dict[str, Any]):
        namespace["__slots__"] = ()  # no per-instance dict: a tuple's size
        cls = super().__new__(mcls, name, bases, namespace)
        base = next((b for b in bases if isinstance(b, _RecordType)), None)
        if base is None:
            return cls  # Record itself
        fields = base._fields + _own_fields(cls)  # a base's fields first
        defaults = {**base._defaults, **{f: namespace[f] for f in fields if f in namespace}}
        required = len(fields) - len(defaults)
        if any(f not in defaults for f in fields[required:]):
            raise TypeError(f"{name}: a field without a default follows one with a default")
        for i, f in enumerate(fields):
            setattr(cls, f, property(operator.itemgetter(i), doc=f"field {i}: {f}"))
        params = "".join(f", {f}" for f in fields)
        made: Dict[str, Any] = {}
        exec(f"def __new__(_cls{params}): return _tuple_new(_cls, ({params[2:]}{',' if len(fields) == 1 else ''}))",
             {"_tuple_new": _tuple_new}, made)
        new = made["__new__"]
        new.__defaults__ = tuple(defaults[f] for f in fields[required:]) or None
        new.__qualname__ = f"{name}.__new__"
        setattr(cls, "__new__", staticmethod(new))
        cls._fields = fields
        cls._defaults = defaults
        return cls


class Record(tuple, metaclass=_RecordType):
    """Subclass it and annotate the fields (with defaults after the fields without); the
    class then has `_fields`, the names in order, and `_defaults`, a name's default. A
    subclass of a Record class adds its fields after its base's."""

    _fields: ClassVar[Tuple[str, ...]] = ()
    _defaults: ClassVar[Dict[str, Any]] = {}

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and _tuple_eq(self, other)

    def __ne__(self, other: object) -> bool:
        return not (type(self) is type(other) and _tuple_eq(self, other))

    def __hash__(self) -> int:
        return _tuple_hash(self) ^ hash(type(self))

    def _replace(self: _R, **changes: Any) -> _R:
        """A copy with some fields changed."""
        return type(self)(**dict(zip(self._fields, self), **changes))

    def _asdict(self) -> Dict[str, Any]:
        return dict(zip(self._fields, self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={v!r}' for f, v in zip(self._fields, self))})"

    def __getnewargs__(self) -> Tuple[Any, ...]:
        return tuple(self)

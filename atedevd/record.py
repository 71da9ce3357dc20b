"""Typed values that are cheap to define: a tuple whose fields are its class's annotations.

The registration machine's events and actions and the upgrade's messages are some forty
small classes, all defined on the way to the first Register. `typing.NamedTuple` builds
each by generating source and exec'ing it, about 40 µs a class on Debian 12's Python
3.11 (1.9 ms for the registration's messages alone); a `Record` class about 8.
Its `__new__` is a template for its number of fields, its parameters renamed to the
class's fields (`CodeType.replace`), so a call is checked by Python itself, by position or
by keyword, and costs what a NamedTuple's does (the simulation makes ~1,300 a round).
Instances behave as NamedTuple's do where this package uses them: fields by name and by
position, defaults, keywords, `_replace`, `_asdict`, equality and hashing of a tuple, a
readable repr. Every value type of the package is one.
"""

import operator
import types
from typing import Any, Dict, Tuple

_tuple_new = tuple.__new__


# `__new__` for n fields, written out to n = 8 (compiled with the module: a start execs none)
def _new0(_cls): return _tuple_new(_cls, ())  # noqa: E704
def _new1(_cls, _0): return _tuple_new(_cls, (_0,))  # noqa: E704
def _new2(_cls, _0, _1): return _tuple_new(_cls, (_0, _1))  # noqa: E704
def _new3(_cls, _0, _1, _2): return _tuple_new(_cls, (_0, _1, _2))  # noqa: E704
def _new4(_cls, _0, _1, _2, _3): return _tuple_new(_cls, (_0, _1, _2, _3))  # noqa: E704
def _new5(_cls, _0, _1, _2, _3, _4): return _tuple_new(_cls, (_0, _1, _2, _3, _4))  # noqa: E704
def _new6(_cls, _0, _1, _2, _3, _4, _5): return _tuple_new(_cls, (_0, _1, _2, _3, _4, _5))  # noqa: E704
def _new7(_cls, _0, _1, _2, _3, _4, _5, _6): return _tuple_new(_cls, (_0, _1, _2, _3, _4, _5, _6))  # noqa: E704
def _new8(_cls, _0, _1, _2, _3, _4, _5, _6, _7): return _tuple_new(_cls, (_0, _1, _2, _3, _4, _5, _6, _7))  # noqa: E704


_TEMPLATES: Dict[int, types.CodeType] = {n: f.__code__ for n, f in enumerate(
    (_new0, _new1, _new2, _new3, _new4, _new5, _new6, _new7, _new8))}


def _template(n: int) -> types.CodeType:
    """The code of `__new__` for n fields: written out above, or made once for a larger n."""
    code = _TEMPLATES.get(n)
    if code is None:
        names = "".join(f", _{i}" for i in range(n))
        made: Dict[str, Any] = {}
        exec(f"def __new__(_cls{names}): return _tuple_new(_cls, ({names[2:]}))", globals(), made)
        code = _TEMPLATES[n] = made["__new__"].__code__
    return code


class _RecordType(type):
    """Turns the annotated names of a class body into the tuple's fields."""

    def __new__(mcls, name: str, bases: Tuple[type, ...], namespace: Dict[str, Any]):
        namespace["__slots__"] = ()  # no per-instance dict: a tuple's size
        cls = super().__new__(mcls, name, bases, namespace)
        # read from the class, not the namespace: Python 3.14 evaluates annotations lazily
        fields = tuple(getattr(cls, "__annotations__", ()))
        defaults = {f: namespace[f] for f in fields if f in namespace}
        required = len(fields) - len(defaults)
        if any(f not in defaults for f in fields[required:]):
            raise TypeError(f"{name}: a field without a default follows one with a default")
        for i, f in enumerate(fields):
            setattr(cls, f, property(operator.itemgetter(i), doc=f"field {i}: {f}"))
        renamed = {"co_varnames": ("_cls",) + fields}
        if hasattr(types.CodeType, "co_qualname"):  # Python >= 3.11 names it in a call's errors
            renamed["co_qualname"] = f"{name}.__new__"
        new = types.FunctionType(_template(len(fields)).replace(**renamed), globals(), "__new__",
                                 tuple(defaults[f] for f in fields[required:]) or None)
        new.__qualname__ = f"{name}.__new__"
        cls.__new__ = staticmethod(new)
        cls._fields = fields
        cls._defaults = defaults
        return cls


class Record(tuple, metaclass=_RecordType):
    """Subclass it and annotate the fields (with defaults after the fields without); the
    class then has `_fields`, the names in order, and `_defaults`, a name's default."""

    def _replace(self, **changes: Any) -> "Record":
        """A copy with some fields changed."""
        return type(self)(**dict(zip(self._fields, self), **changes))

    def _asdict(self) -> Dict[str, Any]:
        return dict(zip(self._fields, self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={v!r}' for f, v in zip(self._fields, self))})"

    def __getnewargs__(self) -> Tuple[Any, ...]:
        return tuple(self)

"""Typed values that are cheap to define: a tuple whose fields are its class's annotations.

The registration machine's events and actions and the upgrade's messages are some forty
small classes, all defined on the way to the first Register. `typing.NamedTuple` builds
each by generating source and exec'ing it, about 45 µs a class on Debian 12's Python
3.11 (1.9 ms for the registration's messages alone); a `Record` class costs a few µs.
Instances behave as NamedTuple's do where this package uses them: fields by name and by
position, defaults, keywords, `_replace`, `_asdict`, equality and hashing of a tuple, a
readable repr. Every value type of the package is one.
"""

import operator
from typing import Any, Dict, Tuple


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
        cls._fields = fields
        cls._defaults = defaults
        cls._required = required
        cls._tail = tuple(defaults[f] for f in fields[required:])
        return cls


class Record(tuple, metaclass=_RecordType):
    """Subclass it and annotate the fields (with defaults after the fields without); the
    class then has `_fields`, the names in order, and `_defaults`, a name's default
    (`_required`, `_tail`: the same, arranged for the usual call)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Record":
        if not kwargs and cls._required <= len(args) <= len(cls._fields):  # the usual call
            return tuple.__new__(cls, args + cls._tail[len(args) - cls._required:])
        return tuple.__new__(cls, cls._complete(args, kwargs))

    @classmethod
    def _complete(cls, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
        """The whole tuple from some positional values, keywords and the defaults."""
        fields = cls._fields
        if len(args) > len(fields):
            raise TypeError(f"{cls.__name__}() takes {len(fields)} values, {len(args)} given")
        values = list(args)
        for f in fields[len(args):]:
            if f in kwargs:
                values.append(kwargs.pop(f))
            elif f in cls._defaults:
                values.append(cls._defaults[f])
            else:
                raise TypeError(f"{cls.__name__}() is missing {f!r}")
        if kwargs:
            raise TypeError(f"{cls.__name__}() has no field {', '.join(map(repr, kwargs))}"
                            f" (or got it twice)")
        return tuple(values)

    def _replace(self, **changes: Any) -> "Record":
        """A copy with some fields changed."""
        return type(self)(**dict(zip(self._fields, self), **changes))

    def _asdict(self) -> Dict[str, Any]:
        return dict(zip(self._fields, self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={v!r}' for f, v in zip(self._fields, self))})"

    def __getnewargs__(self) -> Tuple[Any, ...]:
        return tuple(self)

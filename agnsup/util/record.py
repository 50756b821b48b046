"""Record: plain data classes without `import dataclasses`.

`@dataclass` costs ~15 ms to import (it pulls in inspect, ast, dis and
tokenize) and ~1 ms per class to build (it compiles an __init__, __repr__
and __eq__ from source for each), on every `agnsup run`: together more than
bwrap needs for a whole sandbox. A Record subclass is declared the same way:
fields are annotations, defaults are class attributes, a mutable default is
`Factory(list)`. It gets an __init__ taking the fields by position or by
name, __repr__ and __eq__; `class X(Record, frozen=True)` refuses assignment
and adds __hash__, as @dataclass(frozen=True) does.
"""
from __future__ import annotations

_MISSING = object()


class Factory:
    """A default made fresh for each instance (dataclasses' default_factory)."""
    __slots__ = ("make",)

    def __init__(self, make):
        self.make = make


class FrozenError(AttributeError):
    """Assignment to a field of a frozen record."""


class Record:
    _fields: tuple[str, ...] = ()
    _defaults: dict = {}
    _fieldset: frozenset = frozenset()
    _plain: dict = {}
    _factories: tuple = ()
    _frozen = False

    def __init_subclass__(cls, frozen: bool = False, **kw) -> None:
        super().__init_subclass__(**kw)
        fields: list[str] = []
        defaults: dict = {}
        for klass in reversed(cls.__mro__):
            if klass is Record or not issubclass(klass, Record):
                continue
            for name in klass.__dict__.get("__annotations__", {}):
                if name not in fields:
                    fields.append(name)
                if name in klass.__dict__:
                    defaults[name] = klass.__dict__[name]
        seen_default = None
        for name in fields:
            if name in defaults:
                seen_default = name
            elif seen_default is not None:
                raise TypeError(f"{cls.__name__}: field {name!r} without a default follows {seen_default!r}")
        for name, d in defaults.items():
            if isinstance(d, Factory) and name in cls.__dict__:
                delattr(cls, name)  # no shared mutable default on the class
        cls._fields, cls._defaults = tuple(fields), defaults
        cls._fieldset = frozenset(fields)
        cls._plain = {n: d for n, d in defaults.items() if not isinstance(d, Factory)}
        cls._factories = tuple((n, d.make) for n, d in defaults.items() if isinstance(d, Factory))
        cls._frozen = frozen or cls._frozen
        # a mutable record is compared by value: unhashable, like a dataclass
        setattr(cls, "__hash__", Record._hash if cls._frozen else None)

    def __init__(self, *args, **kwargs) -> None:
        # Hot: the gate builds several records per judged line (agnsup check --batch): defaults
        # are filled in one update, then what was given overwrites them.
        fields = self._fields
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__}() takes {len(fields)} fields, {len(args)} given")
        d = self.__dict__
        d.update(self._plain)
        for name, make in self._factories:
            d[name] = make()
        for name, v in zip(fields, args):
            d[name] = v
        if kwargs:
            for k in kwargs:
                if k not in self._fieldset:
                    raise TypeError(f"{type(self).__name__}() got an unexpected field {k!r}")
                if k in fields[:len(args)]:
                    raise TypeError(f"{type(self).__name__}() got field {k!r} twice")
            d.update(kwargs)
        if len(d) < len(fields):
            missing = next(n for n in fields if n not in d)
            raise TypeError(f"{type(self).__name__}() missing field {missing!r}")

    def __setattr__(self, name: str, value) -> None:
        if self._frozen:
            raise FrozenError(f"cannot assign to field {name!r} of frozen {type(self).__name__}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise FrozenError(f"cannot delete field {name!r} of frozen {type(self).__name__}")
        object.__delattr__(self, name)

    def _values(self) -> tuple:
        d = self.__dict__
        return tuple(d[n] for n in self._fields)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def _hash(self) -> int:
        # Frozen, so the hash never changes: computed once (lru_cache keys hash a GateContext per call).
        h = self.__dict__.get("_hash_value")
        if h is None:
            h = hash(self._values())
            object.__setattr__(self, "_hash_value", h)
        return h

    def __repr__(self) -> str:
        d = self.__dict__
        return f"{type(self).__qualname__}({', '.join(f'{n}={d[n]!r}' for n in self._fields)})"


def replace(obj: Record, **changes) -> Record:
    """A copy of `obj` with some fields changed (dataclasses.replace for records)."""
    d = obj.__dict__
    unknown = set(changes) - set(obj._fields)
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {', '.join(sorted(unknown))}")
    return type(obj)(**{n: changes[n] if n in changes else d[n] for n in obj._fields})

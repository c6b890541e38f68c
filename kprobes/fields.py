"""The fields of the package's dataclasses, without the ``dataclasses`` module.

``import dataclasses`` imports ``inspect``, and with it ``ast``, ``dis`` and ``tokenize``:
11-17 ms of every start of the tool on this project's machine, for the little values.py
needs of it: a class's ``Field`` objects, ``field()``, ``fields()``, ``replace()`` and the
parameters a class was made with. They are here, and the standard library's own functions
take them as theirs: ``dataclasses.fields()``, ``replace()``, ``asdict()``, ``is_dataclass()``
and a standard dataclass derived from one of ours read what they read of a standard
``Field``. Where a ``Field`` holds one of the standard module's markers (a default that is
missing, a field's kind) it looks the marker up in that module when it is read, and only then:
whoever reads it through the standard library has imported the module already.

The standard library's own ``Field`` (``dataclasses.field()`` in a class made here) is taken
as this one; a class that goes to the standard decorator (values.py's exceptions) gets its
fields back as standard ones first (``to_standard``).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any, Final


class _Missing:
    """No default (the standard library's ``MISSING``, which this one stands for)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final[Any] = _Missing()
FIELD: Final = "_FIELD"  # a field's kind: the name of the standard module's marker
CLASSVAR: Final = "_FIELD_CLASSVAR"
_EMPTY: Final[Mapping[Any, Any]] = types.MappingProxyType({})


def standard() -> types.ModuleType:
    """The ``dataclasses`` module (imported now if nobody has yet)."""
    import dataclasses

    return dataclasses


def _standard_of(value: Any) -> Any:
    return standard().MISSING if value is MISSING else value


def is_standard_field(value: object) -> bool:
    """``value`` is a ``dataclasses.Field`` (its module is imported if there is one)."""
    module = sys.modules.get("dataclasses")
    return module is not None and isinstance(value, module.Field)


class Field:
    """A dataclass field, as ``dataclasses.Field`` (the same attributes, the same repr)."""

    __slots__ = (
        "compare",
        "hash",
        "init",
        "kind",  # FIELD or CLASSVAR once the class is made
        "kw_only",
        "metadata",
        "name",
        "own_default",  # MISSING is this module's: ``default`` says the standard one
        "own_factory",
        "repr",
        "type",
    )

    def __init__(
        self,
        default: Any,
        default_factory: Any,
        init: bool,
        repr: bool,
        hash: bool | None,
        compare: bool,
        metadata: Mapping[Any, Any] | None,
        kw_only: Any,
    ) -> None:
        self.name: str = ""
        self.type: Any = None
        self.own_default = default
        self.own_factory = default_factory
        self.init = init
        self.repr = repr
        self.hash = hash
        self.compare = compare
        self.metadata = _EMPTY if metadata is None else types.MappingProxyType(metadata)
        self.kw_only = kw_only
        self.kind = ""

    @property
    def default(self) -> Any:
        return _standard_of(self.own_default)

    @property
    def default_factory(self) -> Any:
        return _standard_of(self.own_factory)

    @property
    def _field_type(self) -> Any:
        return getattr(standard(), self.kind) if self.kind else None

    def __repr__(self) -> str:
        return (
            "Field("
            f"name={self.name!r},"
            f"type={self.type!r},"
            f"default={self.default!r},"
            f"default_factory={self.default_factory!r},"
            f"init={self.init!r},"
            f"repr={self.repr!r},"
            f"hash={self.hash!r},"
            f"compare={self.compare!r},"
            f"metadata={self.metadata!r},"
            f"kw_only={_standard_of(self.kw_only)!r},"
            f"_field_type={self._field_type}"
            ")"
        )

    def __set_name__(self, owner: type, name: str) -> None:
        """A default that is a descriptor is told its name, as the standard ``Field`` does."""
        if self.own_default is not MISSING:
            func = getattr(type(self.own_default), "__set_name__", None)
            if func:
                func(self.own_default, owner, name)

    __class_getitem__: Any = classmethod(types.GenericAlias)


def field(
    *,
    default: Any = MISSING,
    default_factory: Any = MISSING,
    init: bool = True,
    repr: bool = True,
    hash: bool | None = None,
    compare: bool = True,
    metadata: Mapping[Any, Any] | None = None,
    kw_only: Any = MISSING,
) -> Any:
    """``dataclasses.field``."""
    if default is not MISSING and default_factory is not MISSING:
        raise ValueError("cannot specify both default and default_factory")
    return Field(default, default_factory, init, repr, hash, compare, metadata, kw_only)


def from_standard(value: Any) -> Field:
    """A ``dataclasses.Field`` not yet given to a class, as this module's."""
    missing = standard().MISSING

    def own(x: Any) -> Any:
        return MISSING if x is missing else x

    return Field(
        own(value.default),
        own(value.default_factory),
        value.init,
        value.repr,
        value.hash,
        value.compare,
        dict(value.metadata) or None,
        own(value.kw_only),
    )


def to_standard(cls: type) -> None:
    """``cls``'s fields of this module, as ``dataclasses.field()`` would have made them:
    the class goes to the standard decorator."""
    for name, value in list(cls.__dict__.items()):
        if isinstance(value, Field):
            setattr(
                cls,
                name,
                standard().field(
                    default=value.default,
                    default_factory=value.default_factory,
                    init=value.init,
                    repr=value.repr,
                    hash=value.hash,
                    compare=value.compare,
                    metadata=dict(value.metadata) or None,
                    kw_only=_standard_of(value.kw_only),
                ),
            )


class Params:
    """``__dataclass_params__``: what a class was made with (``dataclasses._DataclassParams``
    of Python 3.12, whose first six are 3.11's)."""

    NAMES: Final = (
        "init",
        "repr",
        "eq",
        "order",
        "unsafe_hash",
        "frozen",
        "match_args",
        "kw_only",
        "slots",
        "weakref_slot",
    )
    __slots__ = NAMES

    def __init__(self, *, eq: bool, frozen: bool, slots: bool) -> None:
        self.init = self.repr = self.match_args = True
        self.eq, self.frozen, self.slots = eq, frozen, slots
        self.order = self.unsafe_hash = self.kw_only = self.weakref_slot = False

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.NAMES)
        return f"_DataclassParams({shown})"


def is_dataclass(obj: object) -> bool:
    cls = obj if isinstance(obj, type) else type(obj)
    return hasattr(cls, "__dataclass_fields__")


def _own_fields(obj: object) -> dict[str, Field] | None:
    """The fields of a class made here (None: the standard decorator made it)."""
    found = getattr(obj, "__dataclass_fields__", None)
    if found is None:
        raise TypeError("must be called with a dataclass type or instance")
    if all(isinstance(f, Field) for f in found.values()):
        return found  # type: ignore[no-any-return]
    return None


def fields(obj: object) -> tuple[Any, ...]:
    """``dataclasses.fields``: the fields of a dataclass or of one of its values."""
    own = _own_fields(obj)
    if own is None:
        return tuple(standard().fields(obj))
    return tuple(f for f in own.values() if f.kind == FIELD)


def replace(obj: Any, /, **changes: Any) -> Any:
    """``dataclasses.replace``: a copy of ``obj`` with ``changes``."""
    own = None if isinstance(obj, type) or not is_dataclass(obj) else _own_fields(obj)
    if own is None:
        return standard().replace(obj, **changes)
    for f in own.values():
        if f.kind == FIELD and f.name not in changes:
            changes[f.name] = getattr(obj, f.name)
    return obj.__class__(**changes)


def slots_of(cls: type) -> Iterator[str]:
    """The slots ``cls`` itself declares (``dataclasses._get_slots``)."""
    match cls.__dict__.get("__slots__"):
        case None:
            return
        case str(slot):
            yield slot
        case iterable if not hasattr(iterable, "__next__"):
            yield from iterable
        case _:
            raise TypeError(f"Slots of '{cls.__name__}' cannot be determined")

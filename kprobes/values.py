"""``dataclass``: the standard library's, its methods made without an ``exec`` each.

The package's values are frozen, slotted dataclasses (STYLE.md), about 150 of them, and the
tool imports most of them before it does anything. CPython 3.11 and 3.12's ``dataclasses``
writes each generated method as text and compiles it with its own ``exec`` (``__init__``,
``__repr__``, ``__eq__``, ``__hash__``, and a frozen class's ``__setattr__`` and
``__delattr__``): about 1 ms a class on this project's machines, ~100 ms of every start of
the tool (docs/performance.md). Here:

- the class is a dataclass as the standard decorator makes it when asked for no method
  (its fields, ``__match_args__``, the slotted class), made here by its rules
  (``dataclass_class``) with the ``Field`` objects of fields.py, which need no
  ``dataclasses`` module (its import is ~11-17 ms of a start): the package's modules take
  ``field``, ``fields`` and ``replace`` from here;
- ``__init__`` is the standard library's text, compiled once per shape of class and given
  each class's field names (``init_method``: it runs for every value made, so it stays
  straight-line code; the package's shapes are compiled ahead, in ``initcode.py``);
  ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__`` and ``__delattr__`` are
  closures over the class's field names, which compile nothing: ``operator.attrgetter``
  reads the fields compared, as the generated tuples did;
- what this does not make the same way (``init=False`` and keyword-only fields,
  ``InitVar``, ``order``, ``unsafe_hash``, a frozen class with its own ``__setattr__``, a
  dataclass base, a field named ``self``) goes to the standard decorator whole, its fields
  made standard ones first, and so does every class on Python 3.13 and later, which
  compiles a class's methods at once.

Type checkers see ``dataclasses.dataclass`` itself (the name is re-exported under
``TYPE_CHECKING``, as are ``field``, ``fields`` and ``replace``), so the classes are checked
as the standard library's. tests/test_values.py builds the same classes with both decorators
and compares what they do.
"""

from __future__ import annotations

import abc
import functools
import reprlib
import sys
import types
import typing
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from kprobes import fields as fs
from kprobes.initcode import TEMPLATES

if TYPE_CHECKING:
    from dataclasses import dataclass as dataclass
    from dataclasses import field as field
    from dataclasses import fields as fields
    from dataclasses import replace as replace
else:
    field, fields, replace = fs.field, fs.fields, fs.replace

    def dataclass(
        cls: type | None = None,
        /,
        *,
        frozen: bool = False,
        slots: bool = False,
        eq: bool = True,
        **options: Any,
    ) -> Any:
        """``dataclasses.dataclass``, its methods made as the module docstring says."""

        def wrap(cls: type) -> type:
            if options or not made_here(cls, frozen):
                fs.to_standard(cls)
                decorate = fs.standard().dataclass
                return decorate(cls, frozen=frozen, slots=slots, eq=eq, **options)  # type: ignore[no-any-return]
            return make(cls, frozen=frozen, slots=slots, eq=eq)

        return wrap if cls is None else wrap(cls)


FieldTuple = tuple[fs.Field, ...]


def made_here(cls: type, frozen: bool) -> bool:
    """Whether this module makes ``cls``'s methods (the module docstring's exceptions)."""
    if sys.version_info[:2] not in ((3, 11), (3, 12)):
        return False
    if frozen and ("__setattr__" in cls.__dict__ or "__delattr__" in cls.__dict__):
        return False
    if any(fs.is_dataclass(base) for base in cls.__mro__[1:]):
        return False
    for name, value in cls.__dict__.items():
        is_field = isinstance(value, fs.Field) or fs.is_standard_field(value)
        if is_field and (not value.init or value.kw_only is True):
            return False
        if name == "__annotations__":
            if "self" in value:
                return False
            for kind in value.values():
                text = kind if isinstance(kind, str) else repr(kind)
                if "InitVar" in text or "KW_ONLY" in text:
                    return False
    return True


def make(cls: type, *, frozen: bool, slots: bool, eq: bool) -> type:
    """The dataclass: its fields and class as the standard decorator makes them, this
    module's methods."""
    documented = bool(cls.__doc__)
    made = dataclass_class(cls, frozen=frozen, eq=eq, slots=slots)
    fields = fs.fields(made)
    hashing = hash_action(made, frozen=frozen, eq=eq)
    methods: dict[str, Callable[..., Any]] = {
        "__init__": init_method(made, fields, frozen),
        "__repr__": repr_method(fields),
    }
    if eq:
        methods["__eq__"] = eq_method(fields)
    if hashing == "add":
        methods["__hash__"] = hash_method(fields)
    if frozen:
        methods.update(frozen_methods(made, fields))
    for name, method in methods.items():
        method.__qualname__ = f"{made.__qualname__}.{name}"
        if name in ("__setattr__", "__delattr__") or name not in made.__dict__:
            setattr(made, name, method)
    if hashing == "none":
        made.__hash__ = None  # type: ignore[assignment]  # unhashable, as the standard's
    if frozen and slots:
        add_frozen_state(made, fields)
    record_params(made, frozen=frozen, eq=eq)
    if not documented:
        made.__doc__ = made.__name__ + signature_text(fields)
    return made


def dataclass_class(cls: type, *, frozen: bool, eq: bool, slots: bool) -> type[Any]:
    """The class as ``dataclasses.dataclass(cls, init=False, repr=False, eq=False,
    slots=slots)`` makes it -- its fields, parameters, ``__match_args__``, the slotted class
    -- by its rules, with fields.py's ``Field`` objects, and without the standard
    decorator's passes over each annotation (three regular expressions a field, to tell
    ``ClassVar``, ``InitVar`` and ``KW_ONLY`` apart): 12.7 ms for the 122 classes a
    ``count`` imports, 5.0 here (this project's machine). ``made_here`` has sent the
    classes with ``InitVar``, ``KW_ONLY`` or a dataclass base to the standard decorator."""
    fields = own_fields(cls)
    cls.__dataclass_params__ = fs.Params(eq=eq, frozen=frozen, slots=slots)  # type: ignore[attr-defined]
    cls.__dataclass_fields__ = fields  # type: ignore[attr-defined]
    names = tuple(f.name for f in fields.values() if f.kind == fs.FIELD)
    if "__match_args__" not in cls.__dict__:
        cls.__match_args__ = names  # type: ignore[attr-defined,misc]
    if slots:
        cls = slotted(cls, names)
    abc.update_abstractmethods(cls)
    return cls


def own_fields(cls: type) -> dict[str, fs.Field]:
    """``cls``'s fields, by the standard library's rules (``_get_field``) for what
    ``made_here`` lets through: a default or a ``field()`` in the class, a ``ClassVar``
    left out of the fields the methods see, a mutable default refused."""
    fields: dict[str, fs.Field] = {}
    annotations = cls.__dict__.get("__annotations__", {})  # noqa: RUF063  # its own, as written
    for name, kind in annotations.items():
        default = getattr(cls, name, fs.MISSING)
        if fs.is_standard_field(default):
            default = fs.from_standard(default)
            setattr(cls, name, default)
        if isinstance(default, fs.Field):
            f = default
        else:
            if isinstance(default, types.MemberDescriptorType):
                default = fs.MISSING
            f = fs.field(default=default)
        f.name, f.type = name, kind
        if is_classvar(cls, kind):
            f.kind = fs.CLASSVAR
            if f.own_factory is not fs.MISSING:
                raise TypeError(f"field {name} cannot have a default factory")
            if f.kw_only is not fs.MISSING:
                raise TypeError(f"field {name} is a ClassVar but specifies kw_only")
        else:
            f.kind = fs.FIELD
            if f.kw_only is fs.MISSING:
                f.kw_only = False
            if f.own_default.__class__.__hash__ is None:
                raise ValueError(
                    f"mutable default {type(f.own_default)} for field {name} is not allowed: "
                    "use default_factory"
                )
        fields[name] = f
        if isinstance(getattr(cls, name, None), fs.Field):
            if f.own_default is fs.MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.own_default)
    for name, value in cls.__dict__.items():
        is_field = isinstance(value, fs.Field) or fs.is_standard_field(value)
        if is_field and name not in annotations:
            raise TypeError(f"{name!r} is a field but has no type annotation")
    return fields


def is_classvar(cls: type, kind: Any) -> bool:
    """Whether annotation ``kind`` is a ``ClassVar``: the standard library's test (for a
    text, run only on one that names it)."""
    if not isinstance(kind, str):
        return kind is typing.ClassVar or (
            type(kind) is typing._GenericAlias  # type: ignore[attr-defined]
            and kind.__origin__ is typing.ClassVar
        )
    if "ClassVar" not in kind:
        return False
    dataclasses: Any = fs.standard()
    return bool(dataclasses._is_type(kind, cls, typing, typing.ClassVar, dataclasses._is_classvar))


def slotted(cls: type[Any], names: tuple[str, ...]) -> type[Any]:
    """The class made again with ``__slots__`` for the fields ``names`` (those its bases
    have slots for left out), as the standard library's ``_add_slots``."""
    if "__slots__" in cls.__dict__:
        raise TypeError(f"{cls.__name__} already specifies __slots__")
    space = dict(cls.__dict__)
    inherited = {slot for base in cls.__mro__[1:-1] for slot in fs.slots_of(base)}
    space["__slots__"] = tuple(name for name in names if name not in inherited)
    for name in names:
        space.pop(name, None)
    space.pop("__dict__", None)
    space.pop("__weakref__", None)
    qualname = getattr(cls, "__qualname__", None)
    made: type[Any] = type(cls)(cls.__name__, cls.__bases__, space)  # type: ignore[misc]
    if qualname is not None:
        made.__qualname__ = qualname
    return made


def init_method(cls: type, fields: FieldTuple, frozen: bool) -> Callable[..., Any]:
    """``__init__``, the standard library's: every field by position, defaults and
    factories as its, ``__post_init__`` called last, in the globals of the class's module.

    Classes of one shape (frozen or not, each field plain, defaulted or with a factory,
    ``__post_init__`` or not) share one compiled template whose field names are
    placeholders; each class's ``__init__`` is the template's code with its own names put
    in (``CodeType.replace``), its defaults and factories bound by the template's
    closure."""
    kinds = "".join(
        "f" if f.own_factory is not fs.MISSING else "d" if f.own_default is not fs.MISSING else "p"
        for f in fields
    )
    if "dp" in kinds or "fp" in kinds:
        at = kinds.index("p", min(i for i in (kinds.find("d"), kinds.find("f")) if i >= 0))
        raise TypeError(f"non-default argument {fields[at].name!r} follows default argument")
    bind = init_template(frozen, hasattr(cls, "__post_init__"), kinds)
    defaults = [f.own_factory if f.own_factory is not fs.MISSING else f.own_default for f in fields]
    template = bind(object, _HAS_DEFAULT_FACTORY, *defaults)
    rename = {placeholder(i): f.name for i, f in enumerate(fields)}
    code = template.__code__
    code = code.replace(
        co_varnames=tuple(rename.get(name, name) for name in code.co_varnames),
        co_names=tuple(rename.get(name, name) for name in code.co_names),
        co_consts=tuple(rename.get(c, c) if isinstance(c, str) else c for c in code.co_consts),
    )
    module = sys.modules.get(cls.__module__)
    init = types.FunctionType(
        code,
        vars(module) if module else {},
        "__init__",
        template.__defaults__,
        template.__closure__,
    )
    init.__annotations__ = {f.name: f.type for f in fields} | {"return": None}
    return init


def placeholder(index: int) -> str:
    """The name of field ``index`` in a template (none is a prefix of another)."""
    return f"_kp_field{index}_"


@functools.cache
def init_template(frozen: bool, post_init: bool, kinds: str) -> Callable[..., Any]:
    """The compiled template of one shape: called with ``object``, the factory marker and
    each field's default or factory, it gives the ``__init__`` of placeholder names.

    The shapes the package's classes have are compiled ahead, in ``initcode.py`` (generated
    by scripts/build-inits, loaded from its ``.pyc`` as any module): ~45 ``compile`` calls,
    ~5-10 ms, off every start of the tool. Another shape is compiled here."""
    found = TEMPLATES.get((frozen, post_init, kinds))
    if callable(found):
        return found
    scope: dict[str, Any] = {}
    source = template_source(frozen, post_init, kinds)
    exec(compile(source, "<dataclass>", "exec", dont_inherit=True), {}, scope)
    bind: Callable[..., Any] = scope["__create_fn__"]
    return bind


def template_source(frozen: bool, post_init: bool, kinds: str, name: str = "__create_fn__") -> str:
    """The text of one shape's template, a function ``name``: the standard library's
    ``__init__`` (its lines, its names) with placeholder field names."""
    params, body, defaults = ["self"], [], []
    for i, kind in enumerate(kinds):
        field, default = placeholder(i), f"_kp_default{i}"
        defaults.append(default)
        value = field
        if kind == "f":
            params.append(f"{field}=_HAS_DEFAULT_FACTORY")
            value = f"{default}() if {field} is _HAS_DEFAULT_FACTORY else {field}"
        elif kind == "d":
            params.append(f"{field}={default}")
        else:
            params.append(field)
        if frozen:
            body.append(f"__dataclass_builtins_object__.__setattr__(self,{field!r},{value})")
        else:
            body.append(f"self.{field}={value}")
    if post_init:
        body.append("self.__post_init__()")
    statements = "; ".join(body or ["pass"])  # one line: initcode.py holds ~50 of them
    return (
        f"def {name}(__dataclass_builtins_object__, _HAS_DEFAULT_FACTORY"
        + "".join(f", {d}" for d in defaults)
        + f"):\n def __init__({', '.join(params)}): {statements}\n return __init__\n"
    )


def generated_templates(shapes: list[tuple[bool, bool, str]]) -> str:
    """``initcode.py``'s text: one template of each of ``shapes``, and their table."""
    out = [
        '"""Generated by scripts/build-inits from values.py\'s templates: do not edit.\n\n'
        "The compiled ``__init__`` template of each shape of dataclass the package has, loaded\n"
        'from this module\'s ``.pyc`` instead of compiled at every start (values.py)."""\n',
        "# mypy: ignore-errors\n",
    ]
    table = []
    for index, shape in enumerate(sorted(shapes)):
        out.append("\n" + template_source(*shape, name=f"_t{index}"))
        table.append(f"    {shape!r}: _t{index},\n")
    out.append("\n\nTEMPLATES: dict[tuple[bool, bool, str], object] = {\n" + "".join(table) + "}\n")
    return "".join(out)


def repr_method(fields: FieldTuple) -> Callable[..., str]:
    """``Name(a=1, b='x')``: the fields shown, by ``repr``; ``...`` for a value met again
    inside itself."""
    shown = tuple(f.name for f in fields if f.repr)

    @reprlib.recursive_repr()
    def __repr__(self: Any) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in shown)
        return f"{self.__class__.__qualname__}({inner})"

    return __repr__


def compared(fields: FieldTuple, *, hashed: bool = False) -> Callable[[Any], tuple[Any, ...]]:
    """The tuple of the fields that ``__eq__`` compares (or ``__hash__`` hashes)."""
    names = tuple(
        f.name for f in fields if (f.hash if hashed and f.hash is not None else f.compare)
    )
    if not names:
        return lambda value: ()
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda value: (one(value),)
    many: Callable[[Any], tuple[Any, ...]] = attrgetter(*names)
    return many


def eq_method(fields: FieldTuple) -> Callable[[Any, Any], Any]:
    key = compared(fields)

    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is self.__class__:
            return key(self) == key(other)
        return NotImplemented

    return __eq__


def hash_method(fields: FieldTuple) -> Callable[[Any], int]:
    key = compared(fields, hashed=True)

    def __hash__(self: Any) -> int:
        return hash(key(self))

    return __hash__


def hash_action(cls: type, *, frozen: bool, eq: bool) -> str:
    """The standard library's rule without ``unsafe_hash``: a class that defines its own
    ``__hash__`` keeps it; otherwise an ``eq`` class gets one when frozen and is unhashable
    when not; a class without ``eq`` keeps what it inherits."""
    own = cls.__dict__.get("__hash__", fs.MISSING)
    explicit = not (own is fs.MISSING or (own is None and "__eq__" in cls.__dict__))
    if explicit or not eq:
        return "keep"
    return "add" if frozen else "none"


def frozen_methods(cls: type[Any], fields: FieldTuple) -> dict[str, Callable[..., None]]:
    """A frozen class's ``__setattr__`` and ``__delattr__``: its fields refuse both."""
    names = frozenset(f.name for f in fields)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is cls or name in names:
            raise fs.standard().FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in names:
            raise fs.standard().FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    return {"__setattr__": __setattr__, "__delattr__": __delattr__}


def add_frozen_state(cls: type, fields: FieldTuple) -> None:
    """A frozen, slotted class's pickling methods, as the standard library adds them (its
    ``__setattr__`` refuses the default ``__setstate__``)."""
    names = tuple(f.name for f in fields)

    def __getstate__(self: Any) -> list[Any]:
        return [getattr(self, name) for name in names]

    def __setstate__(self: Any, state: list[Any]) -> None:
        for name, value in zip(names, state, strict=False):
            object.__setattr__(self, name, value)

    for method in (__getstate__, __setstate__):
        if method.__name__ not in cls.__dict__:
            method.__qualname__ = f"{cls.__qualname__}.{method.__name__}"
            setattr(cls, method.__name__, method)


def record_params(cls: type[Any], *, frozen: bool, eq: bool) -> None:
    """``__dataclass_params__`` says what the class is (the standard decorator recorded the
    methods it was asked not to write)."""
    params = cls.__dataclass_params__
    params.init = params.repr = True
    params.eq = eq
    params.frozen = frozen


def signature_text(fields: FieldTuple) -> str:
    """An undocumented dataclass's docstring, as the standard library writes it."""

    def shown(f: fs.Field) -> str:
        kind = repr(f.type) if isinstance(f.type, str) else annotation_text(f.type)
        default = "" if f.own_default is fs.MISSING else f" = {f.own_default!r}"
        if f.own_factory is not fs.MISSING:
            default = " = <factory>"
        return f"{f.name}: {kind}{default}"

    return "(" + ", ".join(shown(f) for f in fields) + ")"


class _Factory:
    """The default of a parameter whose field has a factory (shown as the standard's)."""

    def __repr__(self) -> str:
        return "<factory>"


_HAS_DEFAULT_FACTORY = _Factory()


def annotation_text(kind: Any) -> str:
    """An annotation that is not a text, as ``inspect.signature`` shows it."""
    import inspect  # rare (the package's annotations are texts), and ~10 ms to import

    return inspect.formatannotation(kind)

"""kprobes.values.dataclass against the standard library's: the same classes, made by both,
behave the same (construction, defaults and factories, __post_init__, repr, equality,
hashing, frozen fields, replace, fields, match_args, slots, pickling, signature)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import subprocess
import sys
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import support

from kprobes import initcode, values

Decorator = Callable[..., Any]


def classes(dataclass: Decorator, field: Callable[..., Any] = field) -> dict[str, type]:
    """One family of classes, made by ``dataclass`` (the standard's or ours), their fields
    by ``field`` (the standard's, or ours: kprobes.fields)."""

    @dataclass(frozen=True, slots=True)
    class Point:
        """A point."""

        x: int
        y: int = 0
        label: str = "p"
        unit: ClassVar[str] = "px"

    @dataclass(frozen=True, slots=True)
    class Tagged:
        """Factories, a field left out of repr and comparison, a check after __init__."""

        name: str
        tags: list[str] = field(default_factory=list)
        seen: dict[str, int] = field(default_factory=dict)
        cache: int = field(default=0, compare=False, repr=False)

        def __post_init__(self) -> None:
            if not self.name:
                raise ValueError("a name")
            object.__setattr__(self, "name", self.name.strip())

    @dataclass(frozen=True, slots=True)
    class Own:
        value: int

        def __repr__(self) -> str:
            return f"<own {self.value}>"

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Own) and other.value % 10 == self.value % 10

        def __hash__(self) -> int:
            return self.value % 10

    @dataclass(frozen=True, slots=True)
    class Empty:
        pass

    @dataclass(slots=True)
    class Mutable:
        count: int = 0
        items: list[int] = field(default_factory=list)

    @dataclass(slots=True, eq=False)
    class Identity:
        n: int

    @dataclass(frozen=True, slots=True)
    class Nested:
        """Holds another value."""

        inner: Point
        more: tuple[Point, ...] = ()

    return {c.__name__: c for c in (Point, Tagged, Own, Empty, Mutable, Identity, Nested)}


STANDARD = classes(dataclasses.dataclass)
OURS = classes(values.dataclass)
# The package's own way: kprobes.values's field(), which needs no ``dataclasses`` module.
OWN = classes(values.dataclass, values.field)


def made_by_ours(cls: type) -> bool:
    """Whether ``cls``'s methods came from kprobes.values (the standard library's are
    compiled in the class's own module)."""
    return any(getattr(m, "__module__", None) == "kprobes.values" for m in vars(cls).values())


def both(name: str, family: str = "ours") -> tuple[type, type]:
    return STANDARD[name], (OURS if family == "ours" else OWN)[name]


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """What calling ``fn`` gives: its value, or its exception's type and text."""
    try:
        return ("value", fn())
    except Exception as exc:
        return ("raised", (type(exc).__name__, str(exc)))


def test_ours_are_made_here_and_are_dataclasses() -> None:
    for name, cls in OURS.items():
        assert dataclasses.is_dataclass(cls), name
        assert made_by_ours(cls), name
        assert not made_by_ours(STANDARD[name]), name
        assert cls.__init__.__qualname__.endswith(f"{name}.__init__")
    assert values.made_here(type("Plain", (), {"__annotations__": {}}), True)


@pytest.mark.parametrize("family", ["ours", "own fields"])
@pytest.mark.parametrize("name", sorted(STANDARD))
def test_the_same_shape(name: str, family: str) -> None:
    standard, ours = both(name, family)
    assert [(f.name, f.type, f.default, f.compare, f.repr) for f in dataclasses.fields(ours)] == [
        (f.name, f.type, f.default, f.compare, f.repr) for f in dataclasses.fields(standard)
    ]
    assert ours.__match_args__ == standard.__match_args__  # type: ignore[attr-defined]
    assert ours.__slots__ == standard.__slots__  # type: ignore[attr-defined]
    assert str(inspect.signature(ours)) == str(inspect.signature(standard))
    assert (ours.__hash__ is None) == (standard.__hash__ is None)
    for param in ("init", "repr", "eq", "order", "unsafe_hash", "frozen"):
        assert getattr(ours.__dataclass_params__, param) == getattr(  # type: ignore[attr-defined]
            standard.__dataclass_params__,  # type: ignore[attr-defined]
            param,
        ), param
    if not standard.__doc__ or standard.__doc__.startswith(name + "("):
        assert ours.__doc__ == standard.__doc__


CASES: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("Point", (1,), {}),
    ("Point", (1, 2), {"label": "q"}),
    ("Point", (), {"x": 3, "y": 4}),
    ("Point", (1, 2, "a", 4), {}),
    ("Point", (), {}),
    ("Point", (1,), {"z": 2}),
    ("Tagged", (" spaced ",), {}),
    ("Tagged", ("n", ["a"], {"k": 1}, 5), {}),
    ("Tagged", ("",), {}),
    ("Own", (13,), {}),
    ("Empty", (), {}),
    ("Mutable", (), {}),
    ("Mutable", (5, [1, 2]), {}),
    ("Identity", (7,), {}),
]


@pytest.mark.parametrize("family", ["ours", "own fields"])
@pytest.mark.parametrize(("name", "args", "kwargs"), CASES)
def test_the_same_values(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], family: str
) -> None:
    standard, ours = both(name, family)
    made_s = outcome(lambda: standard(*args, **kwargs))
    made_o = outcome(lambda: ours(*args, **kwargs))
    if made_s[0] == "raised":
        assert made_o == made_s
        return
    s, o = made_s[1], made_o[1]
    assert repr(o) == repr(s)
    s2, o2 = standard(*args, **kwargs), ours(*args, **kwargs)
    assert (o == o2) == (s == s2)
    assert (o != o2) == (s != s2)
    assert (o == s) is False  # another class
    assert outcome(lambda: hash(o) == hash(o2)) == outcome(lambda: hash(s) == hash(s2))
    for attr in [f.name for f in dataclasses.fields(standard)]:
        assert outcome(lambda a=attr: setattr(o, a, 1)) == outcome(lambda a=attr: setattr(s, a, 1))
        assert outcome(lambda a=attr: delattr(o2, a)) == outcome(lambda a=attr: delattr(s2, a))
    # Not a field: both refuse (3.11's frozen, slotted class by a TypeError of its
    # __setattr__'s super(), a class it made before the slots; ours as a frozen field).
    assert outcome(lambda: setattr(o, "other", 1))[0] == "raised"
    assert outcome(lambda: setattr(s, "other", 1))[0] == "raised"
    assert not hasattr(o, "__dict__")
    if dataclasses.fields(standard) and standard.__dataclass_params__.eq:  # type: ignore[attr-defined]
        first = dataclasses.fields(standard)[0].name
        changes = {first: getattr(s, first)}
        assert dataclasses.replace(o, **changes) == o
    assert dataclasses.astuple(o) == dataclasses.astuple(s)
    assert repr(copy.deepcopy(o)) == repr(o)
    assert repr(copy.copy(o)) == repr(o)


def test_a_value_inside_itself_is_shown_once() -> None:
    for made in (STANDARD, OURS):
        box = made["Mutable"]()
        box.items.append(box)
        assert repr(box) == "classes.<locals>.Mutable(count=0, items=[...])"


def test_a_nested_value_compares_by_value() -> None:
    for made in (STANDARD, OURS):
        point, nested = made["Point"], made["Nested"]
        one = nested(point(1), (point(2), point(3)))
        assert one == nested(point(1), (point(2), point(3)))
        assert hash(one) == hash(nested(point(1), (point(2), point(3))))
        assert one != nested(point(1), (point(2),))
        assert {one: 1}[nested(point(1), (point(2), point(3)))] == 1


def test_what_is_not_made_here_goes_to_the_standard_decorator() -> None:
    @values.dataclass(frozen=True, slots=True)
    class Late:
        a: int
        b: int = field(default=2, init=False)

    @values.dataclass(frozen=True, order=True)
    class Ordered:
        a: int

    @values.dataclass(frozen=True)
    class Base:
        a: int

    @values.dataclass(frozen=True)
    class Derived(Base):
        b: int = 0

    for cls in (Late, Ordered, Derived):
        assert not made_by_ours(cls), cls
    assert Late(1).b == 2
    assert Ordered(1) < Ordered(2)
    assert Derived(1, 2) == Derived(1, 2)


def test_the_standard_error_for_a_default_before_a_field_without() -> None:
    def make(dataclass: Decorator) -> tuple[str, Any]:
        def build() -> type:
            class Bad:
                __annotations__ = {"a": "int", "b": "int"}
                a = 1

            return dataclass(frozen=True, slots=True)(Bad)  # type: ignore[no-any-return]

        return outcome(build)

    assert make(values.dataclass) == make(dataclasses.dataclass)
    assert make(values.dataclass)[0] == "raised"


BAD_CLASSES: dict[str, dict[str, Any]] = {
    "a mutable default": {"__annotations__": {"a": "list[int]"}, "a": []},
    "a field with no annotation": {"__annotations__": {"a": "int"}, "b": field(default=1)},
    "a ClassVar with a factory": {
        "__annotations__": {"a": "ClassVar[list[int]]"},
        "a": field(default_factory=list),
    },
    "a slotted class with slots": {"__annotations__": {"a": "int"}, "__slots__": ("a",)},
}


@pytest.mark.parametrize("name", sorted(BAD_CLASSES))
def test_the_standard_errors_of_a_bad_class(name: str) -> None:
    """What the fields are made of here (``own_fields``, ``slotted``) refuses what the
    standard decorator refuses, with its words."""

    def make(dataclass: Decorator) -> tuple[str, Any]:
        space = {"__module__": __name__, **BAD_CLASSES[name]}
        return outcome(lambda: dataclass(frozen=True, slots=True)(type("Bad", (), space)))

    assert make(values.dataclass) == make(dataclasses.dataclass)
    assert make(values.dataclass)[0] == "raised"


def test_the_fields_made_here_are_the_standard_ones() -> None:
    """Every field attribute, the ClassVar kept out, the class attributes as the standard
    decorator leaves them (a slot, or a plain default on a class without slots)."""
    for name, family in [(name, family) for name in STANDARD for family in ("ours", "own")]:
        standard, ours = both(name, family)
        assert [repr(f) for f in ours.__dataclass_fields__.values()] == [  # type: ignore[attr-defined]
            repr(f)
            for f in standard.__dataclass_fields__.values()  # type: ignore[attr-defined]
        ]
        assert {k: type(v) for k, v in vars(ours).items() if k in ours.__dataclass_fields__} == {  # type: ignore[attr-defined]
            k: type(v)
            for k, v in vars(standard).items()
            if k in standard.__dataclass_fields__  # type: ignore[attr-defined]
        }
    for made in (OURS, OWN):
        assert [f.name for f in dataclasses.fields(made["Point"])] == ["x", "y", "label"]
        assert [f.name for f in values.fields(made["Point"])] == ["x", "y", "label"]
        assert made["Point"].unit == "px"  # type: ignore[attr-defined]


def test_our_functions_take_the_standard_classes_too() -> None:
    """kprobes.values's ``fields`` and ``replace`` on a class the standard decorator made
    (the package's exceptions go to it), and on ours, give what the standard ones give."""
    for made in (STANDARD, OURS, OWN):
        point = made["Point"](1, 2)
        assert values.fields(point) == dataclasses.fields(point)
        assert values.replace(point, y=5) == dataclasses.replace(point, y=5)
        assert repr(values.replace(point, label="q")) == repr(made["Point"](1, 2, "q"))
        tagged = made["Tagged"]("n", ["a"])
        assert outcome(lambda t=tagged: values.replace(t, name="")) == outcome(
            lambda t=tagged: dataclasses.replace(t, name="")
        )
        assert dataclasses.asdict(made["Nested"](point)) == {
            "inner": {"x": 1, "y": 2, "label": "p"},
            "more": (),
        }
    for call in (values.fields, dataclasses.fields):
        assert outcome(lambda c=call: c(1))[0] == "raised"
    assert outcome(lambda: values.replace(1)) == outcome(lambda: dataclasses.replace(1))


def test_a_standard_dataclass_derived_from_one_with_own_fields() -> None:
    base = OWN["Point"]

    @dataclasses.dataclass(frozen=True)
    class Labelled(base):  # type: ignore[misc,valid-type]
        colour: str = "red"

    value = Labelled(1, 2, "a", "blue")
    assert repr(value).endswith("Labelled(x=1, y=2, label='a', colour='blue')")
    assert [f.name for f in dataclasses.fields(Labelled)] == ["x", "y", "label", "colour"]
    assert Labelled(1) == Labelled(1, 0, "p", "red")


@pytest.mark.parametrize("command", ["count", "trace"])
def test_the_tool_runs_without_the_dataclasses_module(command: str) -> None:
    """``dataclasses`` imports ``inspect``, ``ast``, ``dis`` and ``tokenize`` (11-17 ms of a
    start): a command on our own backend must not need it (kprobes.fields). (The kernel's
    backends read ELF files with pyelftools, whose ``pprint`` imports it.) Nor does it call
    ``compile()``, whose first call builds the compiler's tables (~3 ms): a text annotation
    of a ``NamedTuple`` (kprobes.model), a dataclass shape missing from initcode.py."""
    code = (
        "import builtins, sys\n"
        "compiled = []\n"
        "def watched(source, name, *a, c=builtins.compile, **k):\n"
        "    if str(name).startswith('<'):  # not the import system's, of a module's file\n"
        "        compiled.append((source, name))\n"
        "    return c(source, name, *a, **k)\n"
        "builtins.compile = watched\n"
        "from kprobes.cli.main import main\n"
        f"code = main(['{command}', '-c', 'true', 'libc:malloc'])\n"
        "print(code, sorted(m for m in ('dataclasses', 'inspect') if m in sys.modules), compiled)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert run.stdout.splitlines()[-1] == "0 [] []", run.stdout + run.stderr


def test_every_value_of_the_package_is_a_dataclass_made_here() -> None:
    """The package's classes: made here unless the module docstring says why not."""
    import importlib
    import pkgutil

    import kprobes

    made, standard = 0, []
    for info in pkgutil.walk_packages(kprobes.__path__, "kprobes."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and obj.__module__ == module.__name__
                and dataclasses.is_dataclass(obj)
            ):
                if made_by_ours(obj):
                    made += 1
                else:
                    standard.append(obj.__qualname__)
    assert made >= 140
    assert standard == []


REPO = Path(__file__).resolve().parents[1]


# Shapes the package may have beyond initcode.py's before the test asks for scripts/build-inits:
# each costs a compile (~0.2 ms) at every start, and a branch that adds one need not
# regenerate the file its siblings regenerate too.
SHAPES_MISSING_AT_MOST = 4


def test_the_compiled_templates_are_the_package_shapes(tmp_path: Path) -> None:
    """initcode.py holds the templates of (almost) every shape the package's classes have:
    scripts/build-inits writes the table anew and the two are compared."""
    out = tmp_path / "initcode.py"
    text = support.run_build_script("build-inits", out)
    scope: dict[str, Any] = {}
    exec(compile(text, str(out), "exec"), scope)
    missing = set(scope["TEMPLATES"]) - set(initcode.TEMPLATES)
    assert len(missing) <= SHAPES_MISSING_AT_MOST, (
        f"{len(missing)} shapes of dataclass compiled at every start: run scripts/build-inits"
    )
    assert text.startswith(inspect.getsource(initcode)[:200])


def test_each_compiled_template_is_the_text_it_was_made_from() -> None:
    """The template loaded from initcode.py makes the same ``__init__`` code as the text
    values.py compiles for that shape (only the file and the line differ)."""
    assert len(initcode.TEMPLATES) > 20
    for (frozen, post_init, kinds), loaded in initcode.TEMPLATES.items():
        assert values.init_template(frozen, post_init, kinds) is loaded
        scope: dict[str, Any] = {}
        exec(values.template_source(frozen, post_init, kinds), {}, scope)
        args = [object, object(), *(object() for _ in kinds)]
        ours, theirs = loaded(*args).__code__, scope["__create_fn__"](*args).__code__
        for attribute in ("co_code", "co_varnames", "co_names", "co_consts", "co_argcount"):
            assert getattr(ours, attribute) == getattr(theirs, attribute), (kinds, attribute)


def test_a_shape_not_compiled_ahead_is_compiled_here() -> None:
    kinds = "p" * 40  # no class of the package has 40 fields
    assert (True, False, kinds) not in initcode.TEMPLATES
    made = values.dataclass(
        type("Wide", (), {"__annotations__": {f"f{i}": "int" for i in range(40)}}),
        frozen=True,
        slots=True,
    )
    wide = made(*range(40))
    assert (wide.f0, wide.f39) == (0, 39)
    with pytest.raises(dataclasses.FrozenInstanceError):
        wide.f0 = 1

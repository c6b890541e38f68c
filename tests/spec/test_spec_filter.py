"""Event filters: the kernel's grammar (events.rst examples), its error messages, evaluation,
and lib/glob.c's own self-test table for ``~``."""

from __future__ import annotations

import pytest

from kprobes.errors import SpecError
from kprobes.spec import (
    COMMON_FIELDS,
    And,
    FieldKind,
    FilterOp,
    Not,
    Or,
    Predicate,
    compile_filter,
    glob_match,
    parse,
    parse_filter,
    render_filter,
)

FIELDS = {
    "n": FieldKind.NUMBER,
    "sig": FieldKind.NUMBER,
    "prio": FieldKind.NUMBER,
    "name": FieldKind.STRING,
    "filename": FieldKind.STRING,
}


def P(field: str, op: str, value: int | str) -> Predicate:
    return Predicate(field, FilterOp(op), value)


VALID = [
    # events.rst
    (
        "((sig >= 10 && sig < 15) || sig == 17) && comm != bash".replace("bash", '"bash"'),
        And(
            (
                Or((And((P("sig", ">=", 10), P("sig", "<", 15))), P("sig", "==", 17))),
                P("comm", "!=", "bash"),
            )
        ),
    ),
    ('filename ~ "/usr/lib/*"', P("filename", "~", "/usr/lib/*")),
    ("common_pid == 0", P("common_pid", "==", 0)),
    ("prio < 100 && cpu == 1", And((P("prio", "<", 100), P("cpu", "==", 1)))),
    # the rest of the grammar
    ("n & 0x10", P("n", "&", 16)),
    ("n <= 010", P("n", "<=", 8)),
    ("n > -5", P("n", ">", -5)),
    ("n == 18446744073709551615", P("n", "==", (1 << 64) - 1)),
    ("name == 'say \"hi\"'", P("name", "==", 'say "hi"')),
    ('name != ""', P("name", "!=", "")),
    ('comm ~ "  spaced  "', P("comm", "~", "  spaced  ")),
    ("!n == 1", Not(P("n", "==", 1))),
    ("!(n == 1)", Not(P("n", "==", 1))),
    ("!!n == 1", Not(Not(P("n", "==", 1)))),
    (
        "a == 1".replace("a", "n") + " || n == 2 && n == 3",
        Or((P("n", "==", 1), And((P("n", "==", 2), P("n", "==", 3))))),
    ),
    (
        "n == 1 && (n == 2 && n == 3)",
        And((P("n", "==", 1), And((P("n", "==", 2), P("n", "==", 3))))),
    ),
    ("n==1&&n!=2||n>3", Or((And((P("n", "==", 1), P("n", "!=", 2))), P("n", ">", 3)))),
    ("\t( ( n == 1 ) )\n", P("n", "==", 1)),
]


@pytest.mark.parametrize(("text", "expected"), VALID, ids=[t for t, _ in VALID])
def test_valid_filters(text: str, expected: object) -> None:
    f = parse_filter(text, FIELDS)
    assert f == expected
    assert parse_filter(render_filter(f), FIELDS) == f


@pytest.mark.parametrize(
    ("f", "text"),
    [
        (
            Or((And((P("n", "==", 1), P("n", "==", 2))), P("n", "==", 3))),
            "n == 1 && n == 2 || n == 3",
        ),
        (
            And((Or((P("n", "==", 1), P("n", "==", 2))), P("n", "==", 3))),
            "(n == 1 || n == 2) && n == 3",
        ),
        (Not(And((P("n", "==", 1), P("n", "==", 2)))), "!(n == 1 && n == 2)"),
        (Not(P("name", "~", "*x*")), '!name ~ "*x*"'),
        (P("name", "==", 'a"b'), "name == 'a\"b'"),
    ],
)
def test_render_filter_uses_only_the_parentheses_needed(f: object, text: str) -> None:
    assert render_filter(f) == text  # type: ignore[arg-type]


ERRORS = [
    ("^", "Meaningless filter expression"),
    ("   ^", "Meaningless filter expression"),
    ("^unknown == 1", "Field not found"),
    ("^COMM == 1", "Field not found"),
    ("n ^= 1", "Invalid operator"),
    ("n ^=> 1", "Invalid operator"),
    ("n ^", "Invalid operator"),
    ('n == ^"x"', "Expecting numeric field"),
    ('n < ^"x"', "Illegal operation for field type"),
    ("n ~ ^1", "Illegal operation for field type"),
    ("name == ^1", "Expecting string field"),
    ("name < ^'x'", "Illegal operation for field type"),
    ("name & ^'x'", "Illegal operation for field type"),
    ("name == ^bash", "Invalid value (did you forget quotes)?"),
    ("n == ^", "Invalid value (did you forget quotes)?"),
    ("n == ^0x", "Illegal integer value"),
    ("n == ^12ab", "Illegal integer value"),
    ("n == ^08", "Illegal integer value"),
    ("n == ^18446744073709551616", "Illegal integer value"),
    ("n == ^-9223372036854775809", "Illegal integer value"),
    ("n == 123456789012345678901234^", "Operand too long"),
    ("name == ^'unterminated", "Missing matching quote"),
    ("name == '" + "x" * 256 + "^'", "Operand too long"),
    ("^(n == 1", "Too many '('"),
    ("^((n == 1)", "Too many '('"),
    ("n == 1^)", "Too few '('"),
    ("n == 1 ^n == 2", "Too many terms in predicate expression"),
    ("(n == 1 ^n == 2)", "Too many terms in predicate expression"),
    ("n == 1 && ^", "Meaningless filter expression"),
    ("n == 1 ^& n == 2", "Too many terms in predicate expression"),
    ("n == 1 ||^", "Meaningless filter expression"),
    ("(^)", "Meaningless filter expression"),
    ("!^", "Meaningless filter expression"),
    ("^!= 1", "Meaningless filter expression"),
    ("n == 1 && n ==^", "Invalid value (did you forget quotes)?"),
    ("n == 1 && n ^=", "Invalid operator"),
]


@pytest.mark.parametrize(("marked", "message"), ERRORS, ids=[m for m, _ in ERRORS])
def test_invalid_filters(marked: str, message: str) -> None:
    column = marked.index("^")
    text = marked[:column] + marked[column + 1 :]
    with pytest.raises(SpecError) as caught:
        parse_filter(text, FIELDS)
    assert (caught.value.message, caught.value.column) == (message, column)


def test_nesting_is_bounded() -> None:
    assert parse_filter("(" * 100 + "n == 1" + ")" * 100, FIELDS) == P("n", "==", 1)
    with pytest.raises(SpecError, match="nested too deeply") as caught:
        parse_filter("(" * 101 + "n == 1" + ")" * 101, FIELDS)
    assert caught.value.column == 100


def test_common_fields_and_the_events_own_fields_first() -> None:
    assert dict(COMMON_FIELDS) == {
        "common_pid": FieldKind.NUMBER,
        "comm": FieldKind.STRING,
        "cpu": FieldKind.NUMBER,
    }
    # an argument named like a common field shadows it
    spec = parse("p vfs_read comm=%ax")
    assert parse_filter("comm == 3", spec.filter_fields) == P("comm", "==", 3)
    with pytest.raises(SpecError, match="Expecting numeric field"):
        parse_filter('comm == "bash"', spec.filter_fields)
    assert parse_filter('comm == "bash"', {}) == P("comm", "==", "bash")


EVALUATIONS = [
    ("n == 3", {"n": 3}, True),
    ("n != 3", {"n": 3}, False),
    ("n < 3", {"n": -1}, True),
    ("n <= 3", {"n": 3}, True),
    ("n > 3", {"n": 3}, False),
    ("n >= 3", {"n": 3}, True),
    ("n & 6", {"n": 4}, True),
    ("n & 6", {"n": 9}, False),
    ('name == "ab"', {"name": "ab"}, True),
    ('name == "ab"', {"name": "abc"}, False),
    ('name != "ab"', {"name": "abc"}, True),
    ('name ~ "a*"', {"name": "abc"}, True),
    ('name ~ "*b"', {"name": "abc"}, False),
    ('name ~ "*b*"', {"name": "abc"}, True),
    ('name ~ "a?c"', {"name": "abc"}, True),
    ('name ~ "[!a]bc"', {"name": "abc"}, False),
    ("!n == 3", {"n": 3}, False),
    ("n == 1 || n == 2 && n == 3", {"n": 1}, True),
    ("(n == 1 || n == 2) && sig == 3", {"n": 1, "sig": 4}, False),
    ("!(n == 1 || n == 2)", {"n": 5}, True),
    # missing, faulted (None) and wrongly typed values make the predicate false
    ("n == 3", {}, False),
    ("n != 3", {}, False),
    ("n != 3", {"n": None}, False),
    ('name != "x"', {"name": None}, False),
    ('name == "3"', {"name": 3}, False),
    ("n == 3", {"n": "3"}, False),
    ("!n == 3", {}, True),
    ('comm ~ "ba*" && common_pid == 7', {"comm": "bash", "common_pid": 7, "cpu": 1}, True),
    ("cpu < 2 && !common_pid == 7", {"comm": "bash", "common_pid": 7, "cpu": 1}, False),
]


@pytest.mark.parametrize(("text", "values", "expected"), EVALUATIONS)
def test_compiled_filters_evaluate_like_the_kernel(
    text: str, values: dict[str, object], expected: bool
) -> None:
    assert compile_filter(parse_filter(text, FIELDS))(values) is expected


# lib/glob.c's CONFIG_GLOB_SELFTEST table, verbatim.
GLOB_SELFTEST = [
    (True, "a", "a"),
    (False, "a", "b"),
    (False, "a", "aa"),
    (False, "a", ""),
    (True, "", ""),
    (False, "", "a"),
    (True, "[a]", "a"),
    (False, "[a]", "b"),
    (False, "[!a]", "a"),
    (True, "[!a]", "b"),
    (True, "[ab]", "a"),
    (True, "[ab]", "b"),
    (False, "[ab]", "c"),
    (True, "[!ab]", "c"),
    (True, "[a-c]", "b"),
    (False, "[a-c]", "d"),
    (True, "[a-c-e-g]", "-"),
    (False, "[a-c-e-g]", "d"),
    (True, "[a-c-e-g]", "f"),
    (True, "[]a-ceg-ik[]", "a"),
    (True, "[]a-ceg-ik[]", "]"),
    (True, "[]a-ceg-ik[]", "["),
    (True, "[]a-ceg-ik[]", "h"),
    (False, "[]a-ceg-ik[]", "f"),
    (False, "[!]a-ceg-ik[]", "h"),
    (False, "[!]a-ceg-ik[]", "]"),
    (True, "[!]a-ceg-ik[]", "f"),
    (True, "?", "a"),
    (False, "?", "aa"),
    (False, "??", "a"),
    (True, "?x?", "axb"),
    (False, "?x?", "abx"),
    (False, "?x?", "xab"),
    (False, "*??", "a"),
    (True, "*??", "ab"),
    (True, "*??", "abc"),
    (True, "*??", "abcd"),
    (False, "??*", "a"),
    (True, "??*", "ab"),
    (True, "??*", "abc"),
    (True, "??*", "abcd"),
    (False, "?*?", "a"),
    (True, "?*?", "ab"),
    (True, "?*?", "abc"),
    (True, "?*?", "abcd"),
    (True, "*b", "b"),
    (True, "*b", "ab"),
    (False, "*b", "ba"),
    (True, "*b", "bb"),
    (True, "*b", "abb"),
    (True, "*b", "bab"),
    (True, "*bc", "abbc"),
    (True, "*bc", "bc"),
    (True, "*bc", "bbc"),
    (True, "*bc", "bcbc"),
    (True, "*ac*", "abacadaeafag"),
    (True, "*ac*ae*ag*", "abacadaeafag"),
    (True, "*a*b*[bc]*[ef]*g*", "abacadaeafag"),
    (False, "*a*b*[ef]*[cd]*g*", "abacadaeafag"),
    (True, "*abcd*", "abcabcabcabcdefg"),
    (True, "*ab*cd*", "abcabcabcabcdefg"),
    (True, "*abcd*abcdef*", "abcabcdabcdeabcdefg"),
    (False, "*abcd*", "abcabcabcabcefg"),
    (False, "*ab*cd*", "abcabcabcabcefg"),
    # and the cases the table leaves out: escapes, unclosed classes, reversed ranges
    (True, "a\\*", "a*"),
    (False, "a\\*", "ab"),
    (True, "[ab", "[ab"),
    (False, "[b-a]", "a"),
    (True, "[a-", "[a-"),
    (True, "ab\\", "ab"),
]


@pytest.mark.parametrize(("expected", "pattern", "string"), GLOB_SELFTEST)
def test_glob_match_is_lib_glob(expected: bool, pattern: str, string: str) -> None:
    assert glob_match(pattern, string) is expected

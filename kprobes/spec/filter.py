"""Event filters in the kernel's grammar (trace_events_filter.c): parse and evaluate.

``field op value`` predicates joined by ``&&`` (binding tighter), ``||``, ``!`` and
parentheses; ``== != < <= > >= &`` on number fields, ``== != ~`` on string fields, where ``~``
is the kernel's ``glob_match()`` (``* ? [...]``, ``\\`` escapes). String values are quoted
with ``"`` or ``'`` and have no escapes; numbers start with a digit (or ``-``; the kernel
itself wants a digit) and follow ``kstrtoull``.

The fields a filter may name are the event's own (given by the caller, e.g.
``ProbeSpec.filter_fields``) and then ``COMMON_FIELDS``: ``common_pid`` (the thread id),
``comm`` and ``cpu``, as the kernel looks them up: the event's own field wins over a common
one of the same name (``comm=$comm`` is a common probe argument).

The Process target cannot hand filters to the kernel, so ``compile_filter`` turns a parsed
filter into a plain Python predicate over a mapping of field values. A field that is missing,
``None`` (a fetch that faulted) or of the wrong kind makes its predicate false, whatever the
operator.

Rejected alternative: building the kernel's branch program (``predicate_parse()``). It is an
optimisation for C; a tree of frozen values is easier to check, render and compare.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kprobes.errors import SpecError
from kprobes.spec.lexical import WHITESPACE, parse_signed, parse_unsigned, spec_error
from kprobes.spec.types import (
    NUMBER_OPS,
    STRING_OPS,
    And,
    FieldKind,
    Filter,
    FilterOp,
    Not,
    Or,
    Predicate,
)

COMMON_FIELDS: Mapping[str, FieldKind] = {
    "common_pid": FieldKind.NUMBER,
    "comm": FieldKind.STRING,
    "cpu": FieldKind.NUMBER,
}

MAX_FILTER_STR_VAL = 256
MAX_NUMBER_LEN = 23  # the kernel's 24-byte num_buf, with its NUL
MAX_FILTER_DEPTH = 100
"""Nesting of ``(`` and ``!``; ours, to keep recursion bounded (the kernel has none)."""

_FIELD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_OPS_IN_MATCH_ORDER = ("~", "!=", "==", "<=", "<", ">=", ">", "&")  # "<=" before "<"


def parse_filter(text: str, fields: Mapping[str, FieldKind]) -> Filter:
    """Parse ``text`` for an event with ``fields`` (plus ``COMMON_FIELDS``)."""
    return _FilterParser(text, fields).parse()


class _FilterParser:
    def __init__(self, text: str, fields: Mapping[str, FieldKind]) -> None:
        self.text = text
        self.fields = {**COMMON_FIELDS, **fields}
        self.pos = 0
        self.depth = 0

    def error(self, message: str, column: int, hint: str = "") -> SpecError:
        return spec_error(message, column, self.text, hint)

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in WHITESPACE:
            self.pos += 1

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def parse(self) -> Filter:
        result = self._or()
        self.skip_space()
        if self.pos < len(self.text):
            if self.peek() == ")":
                raise self.error("Too few '('", self.pos)
            raise self.error("Too many terms in predicate expression", self.pos)
        return result

    def _or(self) -> Filter:
        operands = [self._and()]
        while True:
            self.skip_space()
            if self.peek(2) != "||":
                break
            self.pos += 2
            operands.append(self._and())
        return operands[0] if len(operands) == 1 else Or(tuple(operands))

    def _and(self) -> Filter:
        operands = [self._unary()]
        while True:
            self.skip_space()
            if self.peek(2) != "&&":
                break
            self.pos += 2
            operands.append(self._unary())
        return operands[0] if len(operands) == 1 else And(tuple(operands))

    def _nest(self, column: int) -> None:
        self.depth += 1
        if self.depth > MAX_FILTER_DEPTH:
            raise self.error("Filter expression is nested too deeply", column)

    def _unary(self) -> Filter:
        self.skip_space()
        start = self.pos
        head = self.peek()
        if head == "!" and self.peek(2) not in ("!=", "!~"):
            self._nest(start)
            self.pos += 1
            result: Filter = Not(self._unary())
            self.depth -= 1
            return result
        if head == "(":
            self._nest(start)
            self.pos += 1
            result = self._or()
            self.skip_space()
            if self.peek() != ")":
                if self.pos >= len(self.text):
                    raise self.error("Too many '('", start)
                raise self.error("Too many terms in predicate expression", self.pos)
            self.pos += 1
            self.depth -= 1
            return result
        return self._predicate()

    def _predicate(self) -> Predicate:
        """``parse_pred()``: FIELD OP VALUE."""
        text = self.text
        start = self.pos
        while self.pos < len(text) and text[self.pos] in _FIELD_CHARS:
            self.pos += 1
        field = text[start : self.pos]
        if not field:
            raise self.error("Meaningless filter expression", start)
        kind = self.fields.get(field)
        if kind is None:
            raise self.error("Field not found", start, f"fields: {', '.join(self.fields)}")
        self.skip_space()
        op_col = self.pos
        op = next((FilterOp(o) for o in _OPS_IN_MATCH_ORDER if text.startswith(o, self.pos)), None)
        if op is None:
            raise self.error("Invalid operator", op_col)
        self.pos += len(op.value)
        self.skip_space()
        value_col = self.pos
        head = self.peek()
        if head in ("'", '"'):
            if op not in STRING_OPS:
                raise self.error("Illegal operation for field type", value_col)
            if kind is not FieldKind.STRING:
                raise self.error("Expecting numeric field", value_col)
            end = text.find(head, value_col + 1)
            if end < 0:
                raise self.error("Missing matching quote", value_col)
            if end - value_col - 1 >= MAX_FILTER_STR_VAL:
                raise self.error("Operand too long", end)
            self.pos = end + 1
            return Predicate(field, op, text[value_col + 1 : end])
        if head.isdigit() or (head == "-" and self.peek(2)[1:].isdigit()):
            if kind is not FieldKind.NUMBER:
                raise self.error("Expecting string field", value_col)
            if op not in NUMBER_OPS:
                raise self.error("Illegal operation for field type", value_col)
            self.pos += 1
            while self.pos < len(text) and text[self.pos] in _FIELD_CHARS:
                self.pos += 1
            digits = text[value_col : self.pos]
            if len(digits) > MAX_NUMBER_LEN:
                raise self.error("Operand too long", self.pos)
            value = parse_signed(digits) if head == "-" else parse_unsigned(digits)
            if value is None:
                raise self.error("Illegal integer value", value_col)
            return Predicate(field, op, value)
        raise self.error("Invalid value (did you forget quotes)?", value_col)


# --- evaluation -----------------------------------------------------------------------------


def glob_match(pattern: str, string: str) -> bool:
    """lib/glob.c ``glob_match()``: ``?``, ``*``, ``[...]`` (``!`` inverts), ``\\`` escapes;
    an unclosed ``[`` is literal. Non-recursive; at worst quadratic, like the original."""
    pat = pattern.split("\0", 1)[0] + "\0"
    s = string.split("\0", 1)[0] + "\0"
    p = i = 0
    back_p, back_i = -1, 0
    while True:
        c, d = s[i], pat[p]
        i, p = i + 1, p + 1
        if d == "?":
            if c == "\0":
                return False
            continue
        if d == "*":
            if pat[p] == "\0":
                return True
            back_p, i = p, i - 1
            back_i = i
            continue
        literal = d != "["
        if d == "[":
            inverted = pat[p] == "!"
            k = p + inverted
            a, k = pat[k], k + 1
            matched = False
            while True:
                b = a
                if a == "\0":
                    literal = True
                    break
                if pat[k] == "-" and pat[k + 1] != "]":
                    b = pat[k + 1]
                    if b == "\0":
                        literal = True
                        break
                    k += 2
                matched = matched or a <= c <= b
                a, k = pat[k], k + 1
                if a == "]":
                    break
            if not literal and matched != inverted:
                p = k
                continue
        elif d == "\\":
            d, p = pat[p], p + 1
        if literal and c == d:
            if d == "\0":
                return True
            continue
        if c == "\0" or back_p < 0:
            return False
        p = back_p
        back_i += 1
        i = back_i


Evaluator = Callable[[Mapping[str, object]], bool]


def _compile_predicate(pred: Predicate) -> Evaluator:
    field, op, want = pred.field, pred.op, pred.value
    if isinstance(want, str):
        pattern: str = want
        text_tests: dict[FilterOp, Callable[[str], bool]] = {
            FilterOp.EQ: lambda v: v == pattern,
            FilterOp.NE: lambda v: v != pattern,
            FilterOp.GLOB: lambda v: glob_match(pattern, v),
        }
        text_test = text_tests[op]

        def string_predicate(values: Mapping[str, object]) -> bool:
            value = values.get(field)
            return isinstance(value, str) and text_test(value)

        return string_predicate
    number: int = want
    number_tests: dict[FilterOp, Callable[[int], bool]] = {
        FilterOp.EQ: lambda v: v == number,
        FilterOp.NE: lambda v: v != number,
        FilterOp.LT: lambda v: v < number,
        FilterOp.LE: lambda v: v <= number,
        FilterOp.GT: lambda v: v > number,
        FilterOp.GE: lambda v: v >= number,
        FilterOp.BAND: lambda v: (v & number) != 0,
    }
    number_test = number_tests[op]

    def number_predicate(values: Mapping[str, object]) -> bool:
        value = values.get(field)
        return isinstance(value, int) and number_test(value)

    return number_predicate


def compile_filter(f: Filter) -> Evaluator:
    """A predicate over ``{field name: value}`` (ints and strs) that evaluates ``f``."""
    match f:
        case Predicate():
            return _compile_predicate(f)
        case Not(operand=operand):
            inner = compile_filter(operand)
            return lambda values: not inner(values)
        case And(operands=operands):
            ands = tuple(compile_filter(o) for o in operands)
            return lambda values: all(g(values) for g in ands)
        case Or(operands=operands):
            ors = tuple(compile_filter(o) for o in operands)
            return lambda values: any(g(values) for g in ors)
    raise TypeError(f"not a filter: {f!r}")

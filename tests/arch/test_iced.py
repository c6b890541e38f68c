"""kprobes/arch/x86_64/iced.py: iced-x86's native module without its modules of names.

The package reads iced-x86's constants from a table written by scripts/build-iced-names.
These tests hold the table to iced-x86 itself, and show that a command places, relocates and
records through the native module alone, and that a name the table lacks still reads right.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import iced_x86
import support

from kprobes.arch.x86_64 import iced, iced_names

REPO = Path(__file__).resolve().parents[2]
FAMILIES = {
    "Code": iced_names.CODE,
    "DecoderError": iced_names.DECODER_ERROR,
    "FlowControl": iced_names.FLOW_CONTROL,
    "FormatterSyntax": iced_names.FORMATTER_SYNTAX,
    "Mnemonic": iced_names.MNEMONIC,
    "OpKind": iced_names.OP_KIND,
    "Register": iced_names.REGISTER,
}


def python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a new interpreter of this one, from the checkout: a start of its own."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)


def test_the_table_is_what_the_script_writes_today(tmp_path: Path) -> None:
    """Every constant the package reads is in the table, with the installed iced's value:
    the script writes the table anew from the package's source and the two are compared."""
    written = support.run_build_script("build-iced-names", tmp_path / "iced_names.py")
    committed = (REPO / "kprobes" / "arch" / "x86_64" / "iced_names.py").read_text()
    assert written == committed, "run scripts/build-iced-names"


def test_every_value_is_iced_x86s_own() -> None:
    assert version("iced-x86") == iced_names.VERSION
    for family, table in FAMILIES.items():
        module = getattr(iced_x86, family)
        assert table, family
        for name, value in table.items():
            assert getattr(iced, family).__dict__[name] == getattr(module, name) == value


def test_every_name_the_package_reads_is_in_the_table() -> None:
    """Read from the source independently of the script: ``Family.NAME`` in any module that
    takes iced from iced.py; and no other module of the package imports iced_x86."""
    use = re.compile(r"\b(" + "|".join(FAMILIES) + r")\.([A-Z][A-Z0-9_]*)\b")
    read = 0
    for path in (REPO / "kprobes").rglob("*.py"):
        text = path.read_text()
        if path.name == "iced.py":
            continue  # it imports iced_x86 for the type checker
        assert not re.search(r"^\s*(from|import) iced_x86", text, re.MULTILINE), path
        if "from kprobes.arch.x86_64.iced import" not in text:
            continue
        for family, name in use.findall(text):
            assert name in FAMILIES[family], f"{path}: {family}.{name}"
            read += 1
    assert read > 150


def test_the_classes_are_iced_x86s_whichever_is_imported_first() -> None:
    """One native module: our namespace first, then iced_x86; and the other way round."""
    check = (
        "import sys\n"
        "{first}\n{second}\n"
        "from kprobes.arch.x86_64 import iced\n"
        "import iced_x86\n"
        "assert iced.Decoder is iced_x86.Decoder and iced.Instruction is iced_x86.Instruction\n"
        "assert sys.modules['iced_x86._iced_x86_py'].Decoder is iced.Decoder\n"
        "insn = iced.Instruction.create_reg_u64(iced.Code.MOV_R64_IMM64, iced.Register.RAX, 7)\n"
        "assert iced.Encoder(64).encode(insn, 0) == 10\n"
        "print('same')\n"
    )
    ours, theirs = "from kprobes.arch.x86_64 import iced", "import iced_x86"
    for first, second in ((ours, theirs), (theirs, ours)):
        code = check.format(first=first, second=second)
        run = python(code)
        assert run.stdout == "same\n", run.stderr


def test_a_name_the_table_lacks_is_read_from_iced_x86() -> None:
    """A constant used without regenerating the table costs the full import, once; its
    value is still iced's, and a name iced does not have is still an AttributeError."""
    code = (
        "import sys\n"
        "from kprobes.arch.x86_64 import iced, iced_names\n"
        "assert 'HLT' not in iced_names.CODE and 'iced_x86.Code' not in sys.modules\n"
        "value = iced.Code.HLT\n"
        "import iced_x86\n"
        "assert value == iced_x86.Code.HLT and 'HLT' in vars(iced.Code)\n"
        "try:\n"
        "    iced.Register.NO_SUCH_REGISTER\n"
        "except AttributeError:\n"
        "    print('read')\n"
    )
    run = python(code)
    assert run.stdout == "read\n", run.stderr


def test_another_iced_x86_than_the_tables_is_used_whole() -> None:
    """The table holds one version's values: with another version installed (here, a table
    that says it was written from another), every name comes from iced-x86 itself."""
    code = (
        "import sys\n"
        "from kprobes.arch.x86_64 import iced_names\n"
        "iced_names.VERSION = '0.0.1'\n"
        "from kprobes.arch.x86_64 import iced\n"
        "import iced_x86\n"
        "assert iced.Code is iced_x86.Code and iced.Register is iced_x86.Register\n"
        "assert iced.Decoder is iced_x86.Decoder\n"
        "print('whole')\n"
    )
    run = python(code)
    assert run.stdout == "whole\n", run.stderr


def test_a_command_needs_only_the_native_module(build: Callable[[str], Path]) -> None:
    """``count`` of a jump-optimized entry and ``trace`` of a return with its value and a
    stack: decoded, relocated, encoded and recorded, with iced's 39 modules of names never
    imported, and the counts those of the program's own calls."""
    target = build("target")
    code = (
        "import sys\n"
        "from kprobes.cli.main import main\n"
        f"c = main(['count', '-c', '{target} 300', 'work', 'compute'])\n"
        f"t = main(['trace', '-c', '{target} 3', '-U', 'work%return r=$retval'])\n"
        "print(c, t, sorted(m for m in sys.modules if m.startswith('iced_x86')))\n"
    )
    run = python(code)
    lines = run.stdout.splitlines()
    assert lines[-1] == "0 0 ['iced_x86._iced_x86_py']", run.stdout + run.stderr
    rows = [line.split() for line in lines]
    counts = {row[0]: row[1] for row in rows if len(row) == 2 and row[0] in ("work", "compute")}
    assert counts == {"work": "300", "compute": "1"}, run.stdout
    returns = [line.split(" r=")[1] for line in lines if "<- work) r=" in line]
    assert returns == ["0x0", "0x3", "0x7"], run.stdout  # counter ^ (i << 1), counter += i
    assert sum(line.strip().startswith("=> main+") for line in lines) == 3, run.stdout

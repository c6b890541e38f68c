"""iced-x86 as the package uses it: its native decoder and encoder, and the names it reads.

``import iced_x86`` runs the package's ``__init__``, which imports all 39 of its modules of
named constants before it hands out a class. ``iced_x86.Code`` alone names 4,900
instruction codes, each with an annotation, and the whole costs 12 to 15 ms of every command's
start on a 2-CPU guest, where the native module that does the work loads in 3. The package
reads about 160 of those names. So this module loads the native module by itself, from the
installed package's directory, and gives each family of names (``Code``, ``Register``, ...)
as a small namespace holding the values the package reads, written out by
``scripts/build-iced-names`` into ``iced_names.py``. A name the table lacks is still found:
the namespace then imports the whole of iced-x86 once and takes it from there, so a missing
entry costs time, never a wrong value or an error. The table is used only with the iced-x86
version it was written from (pinned in pyproject.toml, and checked here against the
dist-info directory beside the package); with any other, or when iced_x86 is imported
already, the package takes iced-x86's own modules. tests/arch/test_iced.py regenerates the
table and checks every value against iced-x86's own.

The type checker sees iced-x86 itself. Every module of the package takes iced from here,
never from ``iced_x86``: one native module, loaded once, whichever is imported first.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from iced_x86 import (
        BlockEncoder,
        Code,
        Code_,
        Decoder,
        DecoderError,
        Encoder,
        FlowControl,
        Formatter,
        FormatterSyntax,
        Instruction,
        MemoryOperand,
        Mnemonic,
        Mnemonic_,
        OpKind,
        Register,
        Register_,
        RegisterExt,
    )
else:
    from kprobes.arch.x86_64 import iced_names

    _NATIVE = "iced_x86._iced_x86_py"

    def _native_alone() -> ModuleType | None:
        """The native module, loaded without the package's ``__init__``. None unless the
        iced-x86 installed is the version iced_names.py was written from (the dist-info
        directory pip puts beside it says so): another version's values may differ."""
        from importlib.machinery import PathFinder

        package = PathFinder.find_spec("iced_x86")
        places = list(package.submodule_search_locations or ()) if package is not None else []
        if len(places) != 1:
            return None
        stamp = f"iced_x86-{iced_names.VERSION}.dist-info"
        spec = PathFinder.find_spec(_NATIVE, places)
        if spec is None or spec.loader is None:
            return None
        if not os.path.isdir(os.path.join(os.path.dirname(places[0]), stamp)):
            return None
        native = spec.loader.create_module(spec)
        native.__spec__ = spec
        native.__loader__ = spec.loader
        native.__file__ = spec.origin
        sys.modules[_NATIVE] = native  # as the import system does, so iced_x86 finds it
        try:
            spec.loader.exec_module(native)
        except BaseException:
            del sys.modules[_NATIVE]
            raise
        return native

    class _Names:
        """One of iced-x86's modules of constants, with the values the package reads."""

        def __init__(self, family: str, values: dict[str, int]) -> None:
            self.__dict__.update(values)
            self._family = family

        def __getattr__(self, name: str) -> int:  # a name iced_names.py does not hold
            if name.startswith("__"):
                raise AttributeError(name)
            value: int = getattr(importlib.import_module("iced_x86." + self._family), name)
            setattr(self, name, value)
            return value

        def __repr__(self) -> str:
            return f"<iced_x86.{self._family}, {len(self.__dict__) - 1} names read>"

    _native = None if "iced_x86" in sys.modules else _native_alone()
    if _native is None:  # imported already, another version, or an unusual install
        import iced_x86 as _iced

        _native = sys.modules[_NATIVE]
        Code, DecoderError, FlowControl = _iced.Code, _iced.DecoderError, _iced.FlowControl
        FormatterSyntax, Mnemonic = _iced.FormatterSyntax, _iced.Mnemonic
        OpKind, Register = _iced.OpKind, _iced.Register
    else:
        Code = _Names("Code", iced_names.CODE)
        DecoderError = _Names("DecoderError", iced_names.DECODER_ERROR)
        FlowControl = _Names("FlowControl", iced_names.FLOW_CONTROL)
        FormatterSyntax = _Names("FormatterSyntax", iced_names.FORMATTER_SYNTAX)
        Mnemonic = _Names("Mnemonic", iced_names.MNEMONIC)
        OpKind = _Names("OpKind", iced_names.OP_KIND)
        Register = _Names("Register", iced_names.REGISTER)
    BlockEncoder = _native.BlockEncoder
    Decoder = _native.Decoder
    Encoder = _native.Encoder
    Formatter = _native.Formatter
    Instruction = _native.Instruction
    MemoryOperand = _native.MemoryOperand
    RegisterExt = _native.RegisterExt
    Code_ = Mnemonic_ = Register_ = int  # as iced_x86 defines them outside the checker

__all__ = [
    "BlockEncoder",
    "Code",
    "Code_",
    "Decoder",
    "DecoderError",
    "Encoder",
    "FlowControl",
    "Formatter",
    "FormatterSyntax",
    "Instruction",
    "MemoryOperand",
    "Mnemonic",
    "Mnemonic_",
    "OpKind",
    "Register",
    "Register_",
    "RegisterExt",
]

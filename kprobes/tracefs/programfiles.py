"""The ELF files a command will map when it runs, known before it runs.

The kernel's uprobes hang on a file, so they can be in place before the program exists, and a
command probed from its first instruction must be probed that way (``held.py``). What a name
such as ``libc:malloc`` means has then to be decided without a process to ask:

* the **first image** is the file the kernel runs: the command found in ``PATH`` as
  ``execvp`` would, or, for a ``#!`` script, its interpreter (through at most four scripts,
  the kernel's limit); a bare name (``work``) is looked up in it;
* its **libraries** are the ones its dynamic loader lists for it (``ld.so --list EXE``, what
  ``ldd`` runs: the loader maps them, prints where, and exits without running any of their
  code), in the environment the command will have (``LD_LIBRARY_PATH``, ``LD_PRELOAD``); the
  loader itself is one of them. A short name matches them as it matches a process's
  modules (``symbols.resolve``): whole basename, then up to ``.so``, then up to the first
  ``-`` (``libc``, ``ld``); two files matching equally well are refused;
* any other file is named by its absolute path (``/path/to/prog:work``): it is probed for
  whichever process of the command maps it, later or never.

Rejected: reading ``DT_NEEDED`` and searching the library paths ourselves (``ld.so.cache``,
``$ORIGIN``, hwcaps subdirectories, preloads: the loader's own answer is right by
construction); stopping the command at its entry point to read its mappings (the loader and
every library constructor would have run unprobed).
"""

from __future__ import annotations

import errno as _errno
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Final

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.segments import InterpSegment

from kprobes.errors import SymbolNotFound, TargetError
from kprobes.symbols.elf import ElfImage
from kprobes.values import dataclass

MAX_SCRIPTS: Final = 4  # BINPRM_MAX_RECURSION: #! lines the kernel follows
_LIST_TIMEOUT: Final = 10.0
# "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
_LISTED = re.compile(r"^\s*(?:\S+\s+=>\s+)?(?P<path>/\S+)\s+\(0x[0-9a-f]+\)\s*$")


@dataclass(frozen=True, slots=True)
class ProgramFile:
    """One ELF file the command maps (``path`` is its real path)."""

    path: str
    image: ElfImage

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def find_command(name: str, env: Mapping[str, str]) -> str:
    """The file ``execvp`` runs for ``name``: itself if it has a "/", else the first
    executable of that name in ``PATH``."""
    if "/" in name:
        found: str | None = name if os.access(name, os.X_OK) else None
        if found is None and not os.path.exists(name):
            raise TargetError(f"cannot run {name}: no such file", errno=_errno.ENOENT)
    else:
        found = shutil.which(name, path=env.get("PATH", os.defpath))
        if found is None:
            raise TargetError(f"cannot run {name}: not found in PATH", errno=_errno.ENOENT)
    if found is None or os.path.isdir(found):
        raise TargetError(f"cannot run {name}: not an executable file", errno=_errno.EACCES)
    return found


def _first_image(path: str) -> str:
    """The ELF file the kernel runs for ``path``, following ``#!`` lines."""
    for _ in range(MAX_SCRIPTS + 1):
        try:
            with open(path, "rb") as f:
                head = f.read(256)
        except OSError as exc:
            raise TargetError(f"cannot read {path}: {exc.strerror}", errno=exc.errno) from exc
        if not head.startswith(b"#!"):
            return os.path.realpath(path)
        words = head[2:].split(b"\n", 1)[0].split()
        if not words:
            raise TargetError(f"{path}: an empty #! line", errno=_errno.ENOEXEC)
        path = os.fsdecode(words[0])
    raise TargetError(f"{path}: more than {MAX_SCRIPTS} levels of #! scripts", errno=_errno.ELOOP)


def _interpreter(path: str) -> str | None:
    """The program interpreter (PT_INTERP) of the ELF file ``path``; None if static."""
    try:
        with open(path, "rb") as f:
            for segment in ELFFile(f).iter_segments():
                if isinstance(segment, InterpSegment):
                    return str(segment.get_interp_name())
    except (OSError, ELFError) as exc:
        raise TargetError(
            f"{path} is not a readable ELF file: {exc}", errno=_errno.ENOEXEC
        ) from exc
    return None


def _listed_libraries(interp: str, exe: str, env: Mapping[str, str]) -> list[str]:
    """What the loader ``interp`` would map for ``exe``, by its own ``--list``."""
    try:
        done = subprocess.run(
            [interp, "--list", exe],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=_LIST_TIMEOUT,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise TargetError(
            f"cannot list the libraries of {exe} with {interp}: {exc}", errno=_errno.ENOEXEC
        ) from exc
    if done.returncode != 0:
        raise TargetError(
            f"{interp} --list {exe} failed: {done.stderr.strip() or done.returncode}",
            errno=_errno.ENOEXEC,
        )
    paths = [m["path"] for m in map(_LISTED.match, done.stdout.splitlines()) if m]
    return [os.path.realpath(p) for p in paths]


def _stems(basename: str) -> tuple[str, str]:
    """("libc-2.36", "libc") for libc-2.36.so; ("libc", "libc") for libc.so.6."""
    so = basename.find(".so")
    stem = basename[:so] if so > 0 else basename
    dash = stem.find("-")
    return stem, stem[:dash] if dash > 0 else stem


class ProgramFiles:
    """The first image of a command and the libraries its loader will map."""

    def __init__(self, main: ProgramFile, libraries: Sequence[ProgramFile]) -> None:
        self.main = main
        self.libraries = list(libraries)

    @classmethod
    def of_command(cls, path: str, env: Mapping[str, str]) -> ProgramFiles:
        """The files of the command whose file (found by ``find_command``) is ``path``."""
        exe = _first_image(path)
        main = ProgramFile(exe, ElfImage.open(exe))
        interp = _interpreter(exe)
        if interp is None:
            return cls(main, [])
        listed = _listed_libraries(interp, exe, env)
        real_interp = os.path.realpath(interp)
        if real_interp not in listed:
            listed.append(real_interp)
        libraries = [ProgramFile(p, ElfImage.open(p)) for p in dict.fromkeys(listed) if p != exe]
        return cls(main, libraries)

    @property
    def files(self) -> list[ProgramFile]:
        return [self.main, *self.libraries]

    def find(self, name: str) -> ProgramFile:
        """The file called ``name``: a path, a basename, or a short name like "libc".

        A path that is none of the command's files is opened as it is: some process of the
        command may map it later (a program it runs, a library it loads).
        """
        if "/" in name:
            real = os.path.realpath(name)
            for file in self.files:
                if file.path == real:
                    return file
            return ProgramFile(real, ElfImage.open(real))
        tiers: tuple[list[ProgramFile], ...] = ([], [], [])
        for file in self.files:
            stem, short = _stems(file.name)
            if file.name == name:
                tiers[0].append(file)
            elif stem == name:
                tiers[1].append(file)
            elif short == name or file.name.startswith(name + "."):
                tiers[2].append(file)
        for tier in tiers:
            if len(tier) == 1:
                return tier[0]
            if len(tier) > 1:
                paths = ", ".join(sorted(f.path for f in tier))
                raise SymbolNotFound(f"module name {name!r} is ambiguous: {paths}")
        names = ", ".join(f.name for f in self.files)
        raise SymbolNotFound(
            f"no file {name!r} among those {self.main.name} maps when it starts ({names}); "
            "a file it maps later is named by its absolute path"
        )

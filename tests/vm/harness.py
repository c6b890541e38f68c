"""Boot the stock Debian kernel under qemu and run one command inside it, on the host's files.

The kernel tests need a kernel built with CONFIG_KPROBES, and the development machines run one
without it. Debian's ``linux-image-amd64`` has it (and CONFIG_OPTPROBES), and its 9p file
system as modules, so a guest can use the host's root directly instead of a disk image:

    initramfs (built here, cached by kernel version): static busybox, /init (init.sh), the
        virtio and 9p modules in load order, /dev/console
    qemu -accel tcg -cpu max: nested KVM hangs during boot on these machines, software
        emulation boots the kernel in seconds
    -virtfs hostroot (read-only) + -virtfs vmout (writable, a fresh host temp dir)

``/init`` chroots into the host's root and runs ``vmout/run.sh`` there, so the host's Python,
this checkout and its virtualenv work unchanged in the guest; the command's output and exit
code come back in ``vmout``, and the serial console (kernel messages, init's own failures) is
kept for the failure report. Only the standard library is used: this runs before anything
else is known to work.

    python3 tests/vm/harness.py -- sh -c 'cat /sys/kernel/debug/kprobes/list'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import hashlib
import json
import lzma
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
INIT_SCRIPT = HERE / "init.sh"
BUSYBOX = Path("/bin/busybox")

# insmod order: each module after the ones it needs (no modprobe, no modules.dep in the guest).
MODULES = (
    "drivers/virtio/virtio_ring",
    "drivers/virtio/virtio",
    "drivers/virtio/virtio_pci_legacy_dev",
    "drivers/virtio/virtio_pci_modern_dev",
    "drivers/virtio/virtio_pci",
    "fs/netfs/netfs",
    "fs/fscache/fscache",
    "net/9p/9pnet",
    "net/9p/9pnet_virtio",
    "fs/9p/9p",
)

SETUP_HINT = "run `sh scripts/ensure-system-deps` as root (make setup does)"


class VmError(Exception):
    """The VM could not be prepared or did not finish; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Kernel:
    version: str
    image: Path
    modules: Path  # /lib/modules/<version>


@dataclass(frozen=True, slots=True)
class VmResult:
    returncode: int  # of the command; -1 = no result came back (see the console)
    output: str  # the command's stdout and stderr
    console: str  # the serial console: kernel messages and /init's reports
    seconds: float


def find_kernel() -> Kernel:
    """The newest /boot/vmlinuz-* whose modules include 9p (Debian's linux-image-amd64)."""
    found = []
    for image in glob.glob("/boot/vmlinuz-*"):
        version = image.removeprefix("/boot/vmlinuz-")
        modules = Path("/lib/modules", version)
        if glob.glob(str(modules / "kernel/fs/9p/9p.ko*")):
            found.append(Kernel(version, Path(image), modules))
    if not found:
        raise VmError(f"no kernel with 9p modules in /boot and /lib/modules: {SETUP_HINT}")

    def key(k: Kernel) -> list[int]:
        return [int(n) for n in re.findall(r"\d+", k.version)]

    return max(found, key=key)


def _qemu() -> str:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise VmError(f"qemu-system-x86_64 is not installed: {SETUP_HINT}")
    return qemu


# -- the initramfs: a newc cpio archive written here (no cpio(1) on these machines) ---------


class _Cpio:
    """Writes a "newc" cpio archive, the format the kernel unpacks into its rootfs."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.ino = 1

    def _entry(
        self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)
    ) -> None:
        encoded = name.encode() + b"\0"
        # c_ino c_mode c_uid c_gid c_nlink c_mtime c_filesize c_devmajor c_devminor
        # c_rdevmajor c_rdevminor c_namesize c_check
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, *rdev, len(encoded), 0)
        self.ino += 1
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        self.parts.append(header + encoded + b"\0" * (-(110 + len(encoded)) % 4))
        self.parts.append(data + b"\0" * (-len(data) % 4))

    def directory(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, 0o100000 | mode, data)

    def char_device(self, name: str, major: int, minor: int) -> None:
        self._entry(name, 0o020600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return b"".join(self.parts)


def _module_bytes(path: str) -> bytes:
    data = Path(path).read_bytes()
    if path.endswith(".xz"):
        return lzma.decompress(data)
    if path.endswith(".zst"):
        return subprocess.run(
            ["zstd", "-dc", path], capture_output=True, check=True, timeout=60
        ).stdout
    if path.endswith(".gz"):
        import gzip

        return gzip.decompress(data)
    return data


def build_initramfs(kernel: Kernel, cache_dir: Path) -> Path:
    """The initramfs for ``kernel``, built once per kernel version, init script and busybox."""
    if not BUSYBOX.exists():
        raise VmError(f"{BUSYBOX} (busybox-static) is missing: {SETUP_HINT}")
    init = INIT_SCRIPT.read_bytes()
    busybox = BUSYBOX.read_bytes()
    digest = hashlib.sha256(init + busybox).hexdigest()[:12]
    out = cache_dir / f"initramfs-{kernel.version}-{digest}.cpio"
    if out.exists():
        return out
    archive = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "tmp", "newroot", "modules"):
        archive.directory(d)
    archive.char_device("dev/console", 5, 1)
    archive.file("bin/busybox", busybox, 0o755)
    archive.file("init", init, 0o755)
    order = []
    for module in MODULES:
        matches = glob.glob(str(kernel.modules / "kernel" / module) + ".ko*")
        if not matches:
            raise VmError(f"module {module} of {kernel.version} is missing: {SETUP_HINT}")
        name = os.path.basename(module) + ".ko"
        archive.file(f"modules/{name}", _module_bytes(matches[0]))
        order.append(name)
    archive.file("modules/order", ("\n".join(order) + "\n").encode())
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(archive.finish())
    os.replace(tmp, out)
    return out


def cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"kprobes-vm-{os.getuid()}"


# -- running a command in the guest -----------------------------------------------------------


def run(
    argv: list[str],
    *,
    cwd: Path = REPO,
    timeout: float = 300,
    cpus: int = 2,
    memory_mb: int = 1024,
) -> VmResult:
    """Boot the kernel, run ``argv`` in ``cwd`` inside the guest (as root), power off."""
    kernel = find_kernel()
    qemu = _qemu()
    keep = sorted({str(p) for p in (cwd, REPO) if Path(p).is_relative_to("/tmp")})
    if any("," in p or any(c.isspace() for c in p) for p in keep):
        raise VmError(f"cannot keep {keep} in the guest: no spaces or commas, please")
    append = "console=ttyS0 panic=-1 quiet loglevel=4 rdinit=/init"
    if keep:
        append += " kpkeep=" + ",".join(keep)
    initramfs = build_initramfs(kernel, cache_dir())
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kprobes-vmout-") as share:
        out = Path(share)
        script = f"cd {shlex.quote(str(cwd))} || exit 97\nexec {shlex.join(argv)}\n"
        (out / "run.sh").write_text(script)
        console = out.parent / f"{out.name}.console"
        cmd = [
            qemu,
            "-accel", "tcg", "-cpu", "max", "-smp", str(cpus), "-m", str(memory_mb),
            "-nographic", "-no-reboot", "-nic", "none",
            "-kernel", str(kernel.image),
            "-initrd", str(initramfs),
            "-append", append,
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={out},mount_tag=vmout,security_model=none,multidevs=remap",
        ]  # fmt: skip
        try:
            with open(console, "wb") as serial:
                vm = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=serial, stderr=subprocess.STDOUT
                )
                try:
                    vm.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    vm.kill()
                    vm.wait()
                    text = console.read_text(errors="replace")
                    raise VmError(
                        f"the VM did not power off within {timeout:.0f} s; console:\n{text}"
                    ) from None

            console_text = console.read_text(errors="replace")
        finally:
            with contextlib.suppress(OSError):
                console.unlink()
        rc_file, output_file = out / "rc", out / "output"
        output = output_file.read_text(errors="replace") if output_file.exists() else ""
        try:
            returncode = int(rc_file.read_text().strip())
        except (OSError, ValueError):
            returncode = -1
    return VmResult(returncode, output, console_text, time.monotonic() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument(
        "--result", metavar="FILE", help="write the run as JSON to FILE (tests/vm/early.py)"
    )
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    try:
        result = run(args.command, cwd=Path.cwd(), timeout=args.timeout, cpus=args.cpus)
    except VmError as exc:
        if args.result:
            _write_json(args.result, {"error": str(exc)})
        print(f"kernel-vm: {exc}", file=sys.stderr)
        return 99
    if args.result:
        _write_json(args.result, dataclasses.asdict(result))
    sys.stdout.write(result.output)
    if result.returncode < 0:
        sys.stderr.write(result.console)
    print(f"kernel-vm: exit {result.returncode} after {result.seconds:.1f} s", file=sys.stderr)
    return result.returncode if result.returncode >= 0 else 99


def _write_json(path: str, value: dict[str, object]) -> None:
    """Whole or not at all: a reader that sees the file sees all of it."""
    with open(f"{path}.part", "w") as out:
        json.dump(value, out)
    os.replace(f"{path}.part", path)


if __name__ == "__main__":
    sys.exit(main())

"""The public API is what kprobes/__init__.py exports, and nothing is missing from it."""

import kprobes

EXPECTED = {
    "TRAP_HANDLER_EXCEPTION",
    "BlacklistEntry",
    "EntryData",
    "Event",
    "Hit",
    "EventArg",
    "Jprobe",
    "Kernel",
    "Kprobe",
    "Kretprobe",
    "KretprobeInstance",
    "ProbeFlags",
    "ProbeListing",
    "ProbeNotice",
    "Process",
    "Regs",
    "Task",
    "Uprobes",
    "attach",
    "errors",
    "spawn",
}

PROBE_API = (
    "register_kprobe",
    "register_kprobes",
    "unregister_kprobe",
    "unregister_kprobes",
    "enable_kprobe",
    "disable_kprobe",
    "register_kretprobe",
    "register_kretprobes",
    "unregister_kretprobe",
    "unregister_kretprobes",
    "enable_kretprobe",
    "disable_kretprobe",
)


def test_all_is_exactly_the_public_api() -> None:
    assert set(kprobes.__all__) == EXPECTED
    for name in kprobes.__all__:
        assert hasattr(kprobes, name), name


def test_the_process_api_of_the_issue() -> None:
    for method in (
        *PROBE_API,
        "list",
        "blacklist",
        "run",
        "close",
        "detach",
        "read",
        "write",
        "read_string",
    ):
        assert callable(getattr(kprobes.Process, method)), method


def test_the_tracefs_targets_share_the_probe_api() -> None:
    for target in (kprobes.Kernel, kprobes.Uprobes):
        for method in (
            *PROBE_API,
            "add",
            "place_spec",
            "run",
            "poll",
            "read_events",
            "close",
            "register_jprobe",  # refused there, with the reason (tracefs/options.py)
            "register_jprobes",
        ):
            assert callable(getattr(target, method)), (target, method)
    for method in ("list", "blacklist"):
        assert callable(getattr(kprobes.Kernel, method)), method
    assert isinstance(kprobes.Kernel.enabled, property)
    assert isinstance(kprobes.Kernel.optimization, property)

"""Runs the bench target under Frida (``python -m bench.frida_run MODE TARGET FUNC N``).

Spawns TARGET (its stdout, with its own ``ns_per_call=`` line, is ours), hooks FUNC's first
instruction with Frida's Interceptor, counting each call in the program, and prints
``hits=<n>`` after the program has run. MODE is ``js`` (an ``onEnter`` written in JavaScript,
what most Frida users write) or ``cmodule`` (a C ``onEnter`` compiled in the program by
Frida's TinyCC, its fastest handler); ``js-leave`` and ``cmodule-leave`` count in
``onLeave`` instead (a return probe: Frida hooks the return through its own shadow
stack). The count is read in a hook on ``exit``: the host answers before the program may
go on, so the figure never races the program's end.
"""

from __future__ import annotations

import sys
import threading

import frida

_COMMON = """
const target = DebugSymbol.fromName(FUNC).address;
function report(count) {
    send({ hits: count });
    recv('ack', function () {}).wait();
}
"""

_JS = """
let hits = 0;
Interceptor.attach(target, { onEnter() { hits++; } });
Interceptor.attach(Module.getGlobalExportByName('exit'), { onEnter() { report(hits); } });
"""

_CMODULE = """
const counter = Memory.alloc(8);
const cm = new CModule(`
#include <glib.h>
#include <gum/guminterceptor.h>
extern volatile gssize counter;
void onEnter(GumInvocationContext *ic) { g_atomic_pointer_add(&counter, 1); }
`, { counter });
Interceptor.attach(target, cm);
Interceptor.attach(Module.getGlobalExportByName('exit'), {
    onEnter() { report(counter.readU64().toNumber()); }
});
"""


def main() -> int:
    mode, target, func, calls = sys.argv[1:5]
    body = _JS if mode.startswith("js") else _CMODULE
    if mode.endswith("-leave"):
        body = body.replace("onEnter() { hits++; }", "onLeave() { hits++; }")
        body = body.replace(
            "void onEnter(GumInvocationContext", "void onLeave(GumInvocationContext"
        )
    source = f"const FUNC = {func!r};" + _COMMON + body
    device = frida.get_local_device()
    pid = device.spawn([target, func, calls])
    session = device.attach(pid)
    done = threading.Event()
    hits: list[int] = []
    script = session.create_script(source)

    def on_message(message: dict[str, object], _data: object) -> None:
        if message.get("type") == "send":
            payload = message["payload"]
            assert isinstance(payload, dict)
            hits.append(int(payload["hits"]))
            script.post({"type": "ack"})
        else:
            print(f"frida: {message}", file=sys.stderr)

    script.on("message", on_message)
    session.on("detached", lambda *_args: done.set())
    script.load()
    device.resume(pid)
    done.wait(timeout=600)
    if not hits:
        print("frida: the program ended without reporting its count", file=sys.stderr)
        return 1
    print(f"hits={hits[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m router.template_process`: a worker that renders requests' own chat templates for the router
(router.template_pool), one JSON line in, one JSON line out, so that a template that loops without end costs
a process the router can kill, never a thread of its own. Nothing here is unpickled: the wire is JSON.

In:  {"template", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
      "kwargs", "max_chars", "cpu_seconds"}
Out: {"text": ...} or {"error": "too_long" | "memory" | "render", "message": ...}; {"ready": true} first.

Second line of defence, should the router's own time bound not stop a render: an address-space limit (a
template that builds a huge string gets a MemoryError, not the host's memory) and, per render, a CPU-time
limit past which the kernel ends the process (SIGXCPU). It runs at a lower priority than the gateway.
"""
from __future__ import annotations

import json
import os
import resource
import sys
from typing import IO

MEMORY_HEADROOM = 512 * 2**20  # bytes of address space a render may add to what the imports took


def main() -> int:
    out = _protocol_stdout()
    from router.template_render import render_chat

    # a first render imports transformers and jinja, before the memory limit and before any request waits
    render_chat("{{ messages[0].content }}", [{"role": "user", "content": ""}], None, None, True, False, {}, 1)
    _limit_memory()
    os.nice(10)
    _send(out, {"ready": True})
    for line in sys.stdin:
        _send(out, _handle(json.loads(line), render_chat))
    return 0  # the router closed our stdin


def _protocol_stdout() -> IO[str]:
    """The replies' own copy of stdout; fd 1 itself goes to stderr, so that nothing a library prints can be
    taken for a reply."""
    out = os.fdopen(os.dup(1), "w", encoding="ascii")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a render ended by a limit leaves no core file
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the time bound and the CPU limit remain
        print("chat template worker: no /proc/self/statm, so no address-space limit", file=sys.stderr)
        return
    _set_soft(resource.RLIMIT_AS, used + MEMORY_HEADROOM)


def _limit_cpu(seconds: float) -> None:
    """The kernel ends this process once this render has used `seconds` of CPU (the limit counts the whole
    life of the process, so each render moves it on)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _set_soft(resource.RLIMIT_CPU, int(usage.ru_utime + usage.ru_stime + seconds) + 1)


def _set_soft(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    resource.setrlimit(which, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))


def _handle(job: dict, render_chat) -> dict:
    from router.template_render import RenderTooLong

    _limit_cpu(job.pop("cpu_seconds"))
    try:
        return {"text": render_chat(**job)}
    except RenderTooLong as err:
        return {"error": "too_long", "message": str(err)}
    except MemoryError:
        return {"error": "memory", "message": f"the chat template needed more than {MEMORY_HEADROOM >> 20} MiB"}
    except Exception as err:  # the template's own error (syntax, raise_exception, a bad operation)
        return {"error": "render", "message": f"{type(err).__name__}: {err}"}


def _send(out: IO[str], reply: dict) -> None:
    out.write(json.dumps(reply) + "\n")
    out.flush()


if __name__ == "__main__":
    sys.exit(main())

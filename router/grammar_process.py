"""`python -m router.grammar_process MODEL_DIR`: a worker that compiles requests' structured-output
constraints for the router (router.grammar_pool), one JSON line in, one JSON line out, so that a constraint
that compiles for seconds costs a process the router can kill, never the event loop or a thread it shares.
Nothing here is unpickled: the wire is JSON.

In:  {"kind", "text", "choices", "any_whitespace", "max_bytes"}
Out: {"bytes": N} (compiled, N bytes) or {"error": "too_big" | "compile" | "memory", "message": ...};
{"ready": true} first, once the tokenizer's vocabulary is indexed.
"""
from __future__ import annotations

import json
import os
import sys

from router.template_process import _limit_memory, _protocol_stdout, _send


def main() -> int:
    out = _protocol_stdout()
    from transformers import AutoTokenizer

    from stagemesh.core.grammar import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else None
    compiler = GrammarCompiler(tok, len(tok), eos, cache_size=0)
    _limit_memory()
    os.nice(10)
    _send(out, {"ready": True})
    for line in sys.stdin:
        _send(out, _handle(json.loads(line), compiler))
    return 0  # the router closed our stdin


def _handle(job: dict, compiler) -> dict:
    from stagemesh.core.sampling_params import InvalidParameter, StructuredOutputs

    try:
        s = StructuredOutputs(job["kind"], job["text"], tuple(job["choices"]), job["any_whitespace"])
        size = compiler.compile(s).memory_size_bytes
    except InvalidParameter as err:
        return {"error": "compile", "message": str(err)}
    except MemoryError:
        return {"error": "memory", "message": "it ran out"}
    if size > job["max_bytes"]:
        return {"error": "too_big", "message": str(size)}
    return {"bytes": size}


if __name__ == "__main__":
    sys.exit(main())

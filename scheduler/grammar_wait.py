"""vLLM's WAITING_FOR_FSM on a replica: a structured request is queued but not scheduled while the last stage
compiles its constraint (Stage.CompileGrammar, outside the step loop), for at most --grammar-compile-timeout.
The plain requests around it are scheduled meanwhile as if it were not there, and no step waits for a compile.
Past the bound, or for a constraint that does not compile, the request fails as its own fault (INVALID_ARGUMENT:
the client's 400, as vLLM's)."""
from __future__ import annotations

import logging

from scheduler.pipeline import Pipeline
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import InvalidParameter, StructuredOutputs

log = logging.getLogger("stagemesh.scheduler")


async def compile_for(pipeline: Pipeline, request_id: str, structured: StructuredOutputs,
                      timeout_s: float) -> str | None:
    """None once the last stage holds the request's compiled constraint (or could not say: the step then
    compiles it, as a stage that re-formed under a request does); otherwise why the request fails."""
    try:
        await pipeline.compile_grammar(structured, timeout_s)
    except TimeoutError:
        return (f"the {structured.kind} constraint takes more than {timeout_s:g} s to compile on the replica's last "
                "stage (the bound, --grammar-compile-timeout): refused")
    except InvalidParameter as err:
        return str(err)
    except StagemeshError as err:  # no stage to ask (the pipeline re-forms): the step compiles it
        log.warning("request %s: its constraint was not compiled ahead (%s): the step compiles it", request_id, err)
    return None

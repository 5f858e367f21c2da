"""A built request's one way in, whichever door it came by: a healthy replica, the context length it runs
under, its priority against the replicas' scheduling policy; then its prompts as token ids and its choices,
ready for router.choices.run."""
from __future__ import annotations

from router.choices import plan
from router.errors import APIError, bad_request
from router.dispatch import Generation
from router.prompts import prepare
from router.replica_set import ReplicaSet
from router.request import GenerateRequest
from router.tokenization import Tokenizer


async def launch(req: GenerateRequest, replicas: ReplicaSet, tokenizer: Tokenizer, max_model_len: int | None,
                 answer_id: str) -> tuple[list[list[int]], list[Generation]]:
    """(each prompt's token ids, one Generation per choice), or the error that keeps the request out;
    `max_model_len` is the router's own cap (--max-model-len), if any."""
    max_len = admit(req, replicas, max_model_len)
    prompts = await prepare(req, tokenizer, max_len)
    return prompts, plan(req, prompts, answer_id, max_len)


def admit(req: GenerateRequest, replicas: ReplicaSet, max_model_len: int | None) -> int:
    """The context length the request runs under."""
    return admit_engine(replicas, req.engine.priority, max_model_len)


def admit_engine(replicas: ReplicaSet, priority: int, max_model_len: int | None) -> int:
    """The context length a request of this priority runs under (a pooling call's too), or why it cannot run."""
    if not replicas.healthy():
        raise APIError(503, "no healthy replica: " + "; ".join(f"{r.address}: {r.reason}" for r in replicas.replicas),
                       retry_after=2)
    max_len = min(filter(None, (replicas.max_model_len, max_model_len)))
    check_priority(priority, replicas)
    return max_len


def check_priority(priority: int, replicas: ReplicaSet) -> None:
    """A priority other than 0 needs replicas that schedule by it: vLLM's 400 otherwise (each scheduler checks
    it again when the request reaches it)."""
    policies = replicas.scheduling_policies
    if priority and policies != {"priority"}:
        raise bad_request(f"Got priority {priority} but Priority scheduling is not enabled (the replicas run "
                          f"--scheduling-policy {' and '.join(sorted(policies)) or 'fcfs'})", "priority")

"""A built request's one way in, whichever door it came by: a healthy replica, the context length it runs
under, its priority against the replicas' scheduling policy; then its prompts as token ids and its choices,
ready for router.choices.run."""
from __future__ import annotations

from dataclasses import replace

from router.choices import plan
from router.errors import APIError, bad_request
from router.dispatch import Generation
from router.prompts import prepare
from router.replica_set import ReplicaSet
from router.request import GenerateRequest
from router.state import tenant_owner
from router.tokenization import Tokenizer


async def launch(req: GenerateRequest, replicas: ReplicaSet, tokenizer: Tokenizer, max_model_len: int | None,
                 answer_id: str) -> tuple[list[list[int]], list[Generation]]:
    """(each prompt's token ids, one Generation per choice), or the error that keeps the request out;
    `max_model_len` is the router's own cap (--max-model-len), if any."""
    _stamp_tenant(req)
    max_len = admit(req, replicas, max_model_len)
    prompts = await prepare(req, tokenizer, max_len)
    return prompts, plan(req, prompts, answer_id, max_len)


def admit(req: GenerateRequest, replicas: ReplicaSet, max_model_len: int | None) -> int:
    """The context length the request runs under."""
    if not replicas.healthy():
        raise APIError(503, "no healthy replica: " + "; ".join(f"{r.address}: {r.reason}" for r in replicas.replicas),
                       retry_after=2)
    max_len = min(filter(None, (replicas.max_model_len, max_model_len)))
    check_priority(req, replicas)
    return max_len


def _stamp_tenant(req: GenerateRequest) -> None:
    """Its tenant travels with each of its engine requests (continuations and resumes included), and is their
    owner: a resume from any key of the tenant finds them, none from another tenant's."""
    t = req.tenant
    if t is not None:
        req.engine = replace(req.engine, tenant=t.name, tenant_weight=t.weight, owner=tenant_owner(t.name))


def check_priority(req: GenerateRequest, replicas: ReplicaSet) -> None:
    """A priority other than 0 needs replicas that schedule by it: vLLM's 400 otherwise (each scheduler checks
    it again when the request reaches it)."""
    policies = replicas.scheduling_policies
    priority = req.engine.priority
    if priority and policies != {"priority"}:
        raise bad_request(f"Got priority {priority} but Priority scheduling is not enabled (the replicas run "
                          f"--scheduling-policy {' and '.join(sorted(policies)) or 'fcfs'})", "priority")

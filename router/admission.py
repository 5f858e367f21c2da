"""A built request's one way in, whichever door it came by: a healthy replica, the context length it runs
under, its priority against the replicas' scheduling policy, its tenant's queue not past --max-queue-wait;
then its prompts as token ids and its choices, counted against its tenant's per-minute limits
(router.limits), ready for router.choices.run (which counts it against max_concurrency while it runs)."""
from __future__ import annotations

import math
from dataclasses import replace

from router.choices import plan
from router.config import RouterConfig
from router.errors import APIError, bad_request
from router.dispatch import Generation
from router.prompts import prepare
from router.replica_set import ReplicaSet
from router.observe import tenant_refused
from router.request import GenerateRequest
from router.state import tenant_owner
from router.tenants import Tenant
from router.tokenization import Tokenizer


async def launch(req: GenerateRequest, replicas: ReplicaSet, tokenizer: Tokenizer, config: RouterConfig,
                 answer_id: str) -> tuple[list[list[int]], list[Generation]]:
    """(each prompt's token ids, one Generation per choice), or the error that keeps the request out."""
    _stamp_tenant(req)
    max_len = admit(req, replicas, config.max_model_len)
    fresh = req.resume is None  # (a resume was counted when it came first)
    if fresh:
        shed(req.tenant, replicas, config)
    prompts = await prepare(req, tokenizer, max_len)
    gens = plan(req, prompts, answer_id, max_len)
    if config.limits is not None and req.tenant is not None:
        req.limits = config.limits
        if fresh:
            tokens = sum(len(g.prompt_ids) + g.sampling.max_tokens for g in gens)
            req.rate_headers = await config.limits.admit(req.tenant, tokens)
    return prompts, gens


def shed(tenant: Tenant | None, replicas: ReplicaSet, config: RouterConfig) -> None:
    """--max-queue-wait, for a generation and a pooling call alike: the 503 when the tenant's oldest waiting
    request has waited past its bound on every replica (a tenant of weight w: max_queue_wait x w / the file's
    largest weight, so the lowest weights are shed first); a tenant with nothing waiting somewhere is not."""
    if not config.max_queue_wait:
        return
    name, weight = (tenant.name, tenant.weight) if tenant is not None else ("", 1.0)  # (EngineRequest's default)
    bound = config.max_queue_wait * weight / (config.tenants.top_weight if config.tenants else 1.0)
    wait = min((r.queue_wait.get(name, 0.0) for r in replicas.healthy()), default=0.0)
    if wait > bound:
        tenant_refused(name, 503, "max_queue_wait")
        whose = f" of tenant {name!r}" if name else ""
        raise APIError(503, f"the server is saturated: the waiting requests{whose} have waited {wait:.1f} s, past "
                            f"{bound:.1f} s (--max-queue-wait {config.max_queue_wait:g}"
                            f"{' for its weight' if name else ''})",
                       retry_after=max(1, math.ceil(wait - bound)))


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


def _stamp_tenant(req: GenerateRequest) -> None:
    """Its tenant travels with each of its engine requests (continuations and resumes included), and is their
    owner: a resume from any key of the tenant finds them, none from another tenant's."""
    t = req.tenant
    if t is not None:
        req.engine = replace(req.engine, tenant=t.name, tenant_weight=t.weight, owner=tenant_owner(t.name))


def check_priority(priority: int, replicas: ReplicaSet) -> None:
    """A priority other than 0 needs replicas that schedule by it: vLLM's 400 otherwise (each scheduler checks
    it again when the request reaches it)."""
    policies = replicas.scheduling_policies
    if priority and policies != {"priority"}:
        raise bad_request(f"Got priority {priority} but Priority scheduling is not enabled (the replicas run "
                          f"--scheduling-policy {' and '.join(sorted(policies)) or 'fcfs'})", "priority")

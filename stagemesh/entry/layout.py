"""The command lines of a `stagemesh serve` mesh: each replica's scheduler and stages, and the routers over them.

Each child's command line is its service's options (RouterOptions, SchedulerOptions, StageOptions) written
out (stagemesh.core.flags.to_argv): serve's value of every flag it declares just as the service does, and
what serve decides per child (ports, layers, roles, and the flags it declares with a meaning of its own).

A replica is planned by its index alone, so that one added while the mesh serves (`stagemesh scale`) gets the
very command lines the first ones got; its scheduler gets a free port of its own. Metrics ports
(--metrics-port P): the scheduler of replica r on P + r*(PP+1), its stages on the ports after it, serve's own
on P + DP*(PP+1) for the DP replicas it started with; a replica added later (r >= DP) one port further on.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from router.config import RouterOptions
from scheduler.config import SchedulerOptions
from stage_worker.options import StageOptions
from stagemesh.core.common_flags import ModelOptions
from stagemesh.core.flags import flags, from_args, parse, to_argv
from stagemesh.core.ports import free_port
from stagemesh.entry.cpu_plan import CpuPlan, cpu_plan
from stagemesh.entry.serve_options import ServeOptions


@dataclass(frozen=True)
class ChildSpec:
    """One service of the mesh: its command line, what it adds to its environment, what it needs."""
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    kind: str = "stage"  # scheduler, stage or router
    cpus: int = 0  # CPUs it asks of a Ray cluster (a stage: its TP ranks x threads; the others run on the head)
    gpus: int = 0


@dataclass(frozen=True)
class Addresses:
    """Where the services listen: all on loopback (mp), or the router and schedulers on the head node's
    address and each stage on its own node's (NODE_IP, known once Ray placed it)."""
    head: str = "127.0.0.1"
    stage: str | None = None

    @property
    def local(self) -> bool:
        return self.stage is None


def cpu_stage_env() -> dict[str, str]:
    """What a CPU stage that shares its cores with other stages (PP > 1 on one host) adds to its environment."""
    return cpu_plan(os.cpu_count() or 1, pp=2, user_env=set(os.environ)).env


@dataclass
class MeshLayout:
    args: argparse.Namespace
    model: ModelOptions  # the schedulers' and routers' MODEL (None: each resolves the embedded default model)
    stage_model: ModelOptions  # the stages' MODEL and weight flags (a GGUF, --quantization)
    ranges: list[tuple[int, int]]  # each stage's layers
    cuda: bool
    addresses: Addresses = Addresses()
    control_ports: list[int] = field(default_factory=list)  # each router's control port (none: no control port)
    # where the routers keep their metrics, shared: every router's /metrics counts them all (router.metrics)
    metrics_dir: str = field(default_factory=lambda: os.path.join(tempfile.gettempdir(),
                                                                  f"stagemesh-router-metrics-{uuid.uuid4().hex}"))

    @classmethod
    def build(cls, args: argparse.Namespace, model: str | None, num_layers: int, cuda: bool,
              addresses: Addresses = Addresses(), stage_model: list[str] | None = None,
              control: bool = False) -> "MeshLayout":
        """`control`: each router gets a control port (router.control), for a serve that changes its replicas.
        `stage_model`: the stages' MODEL and weight flags where they differ from `model`."""
        from stagemesh.core.model_config import layer_ranges, layer_split, parse_layer_split

        pp = args.pipeline_parallel_size
        split = parse_layer_split(args.layer_split, num_layers, pp) if args.layer_split else layer_split(num_layers, pp)
        services = ModelOptions(model)
        layout = cls(args, services, services if stage_model is None else parse(ModelOptions, stage_model),
                     layer_ranges(split), cuda, addresses,
                     [free_port() for _ in range(args.api_server_count)] if control else [])
        layout._fixed()
        return layout

    def _fixed(self) -> None:
        """What every replica shares, computed once: threads per stage, the flags passed on, the EP store."""
        args, dp = self.args, self.args.data_parallel_size
        pp, tp = args.pipeline_parallel_size, stage_ranks(args)
        # (a replica added later keeps the first ones' plan)
        self.cpu: CpuPlan | None = None
        if self.addresses.local:
            self.cpu = cpu_plan(os.cpu_count() or 1, dp, pp, tp, args.threads, set(os.environ))
            self.threads = self.cpu.threads
        else:  # the cores of a node Ray has not chosen yet: what the stage asks of Ray
            self.threads = args.threads or 1
        self.initial_dp = dp
        self.spec = speculative_config(args)
        self.passed = {cls: passed_on(args, cls) for cls in (RouterOptions, SchedulerOptions, StageOptions)}
        # replica 0's stage hosts the experts' group store
        self.ep_port = free_port() if args.enable_expert_parallel and dp > 1 else None
        # the prefill replicas' schedulers keep their addresses for the mesh's life: every decode replica, one
        # added later too, is given them (--kv-peer), the only replicas whose KV its stages may read
        self.prefill_schedulers = [f"{self.addresses.head}:{free_port(self.addresses.head)}"
                                   for _ in range(args.prefill_replicas or 0)]
        # without them, every replica's scheduler address is chosen here, so that each one names the others as
        # --kv-peer: a draining replica's requests move on with their KV (--migration-policy kv); a replica added
        # later names every one known then (the older ones do not know it: its requests move by recompute)
        self.schedulers: list[str] = [] if args.prefill_replicas else [
            f"{self.addresses.head}:{free_port(self.addresses.head)}" for _ in range(dp)]

    def replica(self, r: int) -> tuple[str, list[ChildSpec]]:
        """Replica r: its scheduler's address, and its scheduler's and stages' specs (the scheduler first)."""
        args, head = self.args, self.addresses.head
        prefill = r < len(self.prefill_schedulers)
        address = self.prefill_schedulers[r] if prefill else f"{head}:{free_port(head)}"
        values: dict[str, Any] = {} if self.addresses.local else {"host": head, "advertise_host": head}
        if args.prefill_replicas:  # the decode replicas fetch KV from the prefill replicas alone
            values["kv_role"] = "prefill" if prefill else "decode"
            values["kv_peer"] = () if prefill else tuple(self.prefill_schedulers)
        else:  # every replica may read a draining one's KV (scheduler.driver.Driver.migrate)
            while len(self.schedulers) <= r:
                self.schedulers.append(f"{head}:{free_port(head)}")
            address = self.schedulers[r]
            values["kv_peer"] = tuple(a for a in self.schedulers if a != address)
        options = from_args(SchedulerOptions, self.passed[SchedulerOptions], source=self.model,
                            port=int(address.rpartition(":")[2]), stage_recovery_timeout=args.stage_recovery_timeout,
                            speculative_config=None if self.spec is None else self.spec.to_json(),
                            metrics_port=self._metrics_port(r), **values)
        scheduler = ChildSpec(f"scheduler[{r}]", ["scheduler", *to_argv(options)], kind="scheduler")
        return address, [scheduler, *(self._stage(r, i, address) for i in range(len(self.ranges)))]

    def stages(self) -> list[ChildSpec]:
        """One replica's stages as planned: what each asks of a host or of a Ray cluster."""
        return [self._stage(0, i, "") for i in range(len(self.ranges))]

    def _metrics_port(self, r: int, i: int = -1) -> int | None:
        """Replica r's scheduler's (i -1) or stage i's metrics port, with --metrics-port."""
        if self.args.metrics_port is None:
            return None
        offset = r * (self.args.pipeline_parallel_size + 1) + 1 + i + (1 if r >= self.initial_dp else 0)
        return self.args.metrics_port + offset

    def _stage(self, r: int, i: int, scheduler: str) -> ChildSpec:
        args, tp, spec = self.args, stage_ranks(self.args), self.spec  # (tp: the stage's processes)
        a, b = self.ranges[i]
        env = {} if self.cuda else dict(self.cpu.env) if self.cpu is not None else cpu_stage_env()
        if self.cuda and self.addresses.local:  # Ray gives each stage its GPUs itself
            first = (r * len(self.ranges) + i) * tp
            env = {"CUDA_VISIBLE_DEVICES": ",".join(str(first + t) for t in range(tp))}
        values: dict[str, Any] = {} if self.addresses.local else {"host": self.addresses.stage,
                                                                  "advertise_host": self.addresses.stage}
        if self.ep_port:
            values.update(data_parallel_size=args.data_parallel_size, data_parallel_rank=r,
                          data_parallel_address="127.0.0.1", data_parallel_rpc_port=self.ep_port)
        draft = spec is not None and spec.uses_draft_model and i == len(self.ranges) - 1
        options = from_args(StageOptions, self.passed[StageOptions], source=self.stage_model, scheduler=scheduler,
                            stage_index=i, layers=f"{a}:{b}", layer_split=None, handoff=args.handoff,
                            device="cuda" if self.cuda else "cpu", threads=self.threads,
                            speculative_config=spec.to_json() if draft else None,
                            kv_offloading_disk_path=_disk_tier(args, r), metrics_port=self._metrics_port(r, i),
                            disable_hybrid_kv_cache_manager=without_kv_groups(args, spec), **values)
        return ChildSpec(f"stage[{r}.{i}]", ["stage", *to_argv(options)], env, "stage", tp * self.threads,
                         tp if self.cuda else 0)

    def routers(self, replicas: list[str]) -> list[ChildSpec]:
        """The --api-server-count routers over these replicas, on one HTTP port and one gRPC port (SO_REUSEPORT
        when several), each with its own control port when the layout has them, all sharing their metrics."""
        args, n = self.args, self.args.api_server_count
        options = from_args(RouterOptions, self.passed[RouterOptions], source=self.model, host=args.host,
                            port=args.port, grpc_port=args.grpc_port, replica=tuple(replicas), reuse_port=n > 1,
                            listen_when_ready=True)
        control: list[int | None] = [*self.control_ports] or [None] * n
        env = {"PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}  # (on Ray too: the routers share the head node)
        # (the first router alone rebalances: each would move the same requests)
        each = [replace(options, control_port=control[i], rebalance_interval=options.rebalance_interval * (i == 0))
                for i in range(n)]
        return [ChildSpec("router" if n == 1 else f"router[{i}]", ["router", *to_argv(o)], env, kind="router")
                for i, o in enumerate(each)]


def stage_ranks(args: argparse.Namespace) -> int:
    """A stage's processes (and GPUs): its TP ranks times its PCP ranks (each of those with the whole weights)."""
    return args.tensor_parallel_size * getattr(args, "prefill_context_parallel_size", 1)


def plan_commands(args: argparse.Namespace, model: str | None, num_layers: int, cuda: bool,
                  addresses: Addresses = Addresses(), stage_model: list[str] | None = None) -> list[ChildSpec]:
    """Every service of the mesh, schedulers before their stages, the router last. `model` None: each service
    resolves the embedded default model on its own node. `stage_model`: the stages' MODEL and weight flags
    where they differ from `model` (a GGUF, --quantization; stagemesh.core.model_source)."""
    layout = MeshLayout.build(args, model, num_layers, cuda, addresses, stage_model)
    replicas = [layout.replica(r) for r in range(args.data_parallel_size)]
    return [s for _, specs in replicas for s in specs] + layout.routers([a for a, _ in replicas])


def passed_on(args: argparse.Namespace, cls: type) -> argparse.Namespace:
    """serve's values of the flags it declares just as a `cls` service does (the same declaration): passed on to
    every such child as they are. The rest of the child's options are serve's to decide (see MeshLayout)."""
    serve = dict(flags(ServeOptions))
    return argparse.Namespace(**{name: getattr(args, name) for name, flag in flags(cls)
                                 if serve.get(name) == flag and hasattr(args, name)})


def without_kv_groups(args: argparse.Namespace, spec) -> bool:
    """--disable-hybrid-kv-cache-manager as the stages get it: also where the mesh carries KV blocks the
    groups' tables do not reach yet (the KV tiers, disaggregated prefill, a draft model), as vLLM turns its
    hybrid manager off with a KV connector."""
    return bool(getattr(args, "disable_hybrid_kv_cache_manager", False) or getattr(args, "kv_offloading_size", None)
                or getattr(args, "kv_offloading_disk_path", None) or getattr(args, "prefill_replicas", 0)
                or (spec is not None and spec.uses_draft_model))


def speculative_config(args: argparse.Namespace):
    """--speculative-config parsed (None without one); refused with --async-scheduling."""
    from stagemesh.core.errors import StagemeshError
    from stagemesh.core.speculative import ASYNC_WITH_SPECULATION, parse_speculative_config

    spec = parse_speculative_config(args.speculative_config)
    if spec is not None and args.async_scheduling:
        raise StagemeshError(ASYNC_WITH_SPECULATION)
    return spec


def _disk_tier(args: argparse.Namespace, replica: int) -> str | None:
    """Each replica's stages get a disk tier directory of their own (two stages never share a namespace)."""
    path = getattr(args, "kv_offloading_disk_path", None)
    return os.path.join(path, f"replica-{replica}") if path else None

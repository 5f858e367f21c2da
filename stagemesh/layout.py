"""The command lines of a `stagemesh serve` mesh: each replica's scheduler and stages, and the routers over them.

A replica is planned by its index alone, so that one added while the mesh serves (`stagemesh scale`) gets the
very command lines the first ones got; its scheduler gets a free port of its own. Metrics ports
(--metrics-port P): the scheduler of replica r on P + r*(PP+1), its stages on the ports after it, serve's own
on P + DP*(PP+1) for the DP replicas it started with; a replica added later (r >= DP) one port further on.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from stagemesh.core.lora import lora_argv
from stagemesh.core.ports import free_port
from stagemesh.core.service_options import service_argv
from stagemesh.cpu_plan import CpuPlan, cpu_plan


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
    model_arg: list[str]  # [] : each service resolves the embedded default model on its own node
    stage_model: list[str]  # the stages' MODEL and weight flags (a GGUF, --quantization)
    ranges: list[tuple[int, int]]  # each stage's layers
    cuda: bool
    addresses: Addresses = Addresses()
    control_ports: list[int] = field(default_factory=list)  # each router's control port (none: no control port)

    @classmethod
    def build(cls, args: argparse.Namespace, model: str | None, num_layers: int, cuda: bool,
              addresses: Addresses = Addresses(), stage_model: list[str] | None = None,
              control: bool = False) -> "MeshLayout":
        """`control`: each router gets a control port (router.control), for a serve that changes its replicas."""
        from stagemesh.core.model_config import layer_ranges, layer_split, parse_layer_split

        pp = args.pipeline_parallel_size
        split = parse_layer_split(args.layer_split, num_layers, pp) if args.layer_split else layer_split(num_layers, pp)
        model_arg = [] if model is None else [model]
        layout = cls(args, model_arg, model_arg if stage_model is None else stage_model, layer_ranges(split), cuda,
                     addresses, [free_port() for _ in range(args.api_server_count)] if control else [])
        layout._fixed()
        return layout

    def _fixed(self) -> None:
        """What every replica shares, computed once: threads per stage, the schedulers' flags, the EP store."""
        args, dp = self.args, self.args.data_parallel_size
        pp, tp = args.pipeline_parallel_size, args.tensor_parallel_size
        # (a replica added later keeps the first ones' plan)
        self.cpu: CpuPlan | None = None
        if self.addresses.local:
            self.cpu = cpu_plan(os.cpu_count() or 1, dp, pp, tp, args.threads, set(os.environ))
            self.threads = self.cpu.threads
        else:  # the cores of a node Ray has not chosen yet: what the stage asks of Ray
            self.threads = args.threads or 1
        self.initial_dp = dp
        self.spec = speculative_config(args)
        self.scheduler_flags = _scheduler_flags(args, self.spec)
        # replica 0's stage hosts the experts' group store
        self.ep_port = free_port() if args.enable_expert_parallel and dp > 1 else None
        # the prefill replicas' schedulers keep their addresses for the mesh's life: every decode replica, one
        # added later too, is given them (--kv-peer), the only replicas whose KV its stages may read
        self.prefill_schedulers = [f"{self.addresses.head}:{free_port(self.addresses.head)}"
                                   for _ in range(args.prefill_replicas or 0)]

    def replica(self, r: int) -> tuple[str, list[ChildSpec]]:
        """Replica r: its scheduler's address, and its scheduler's and stages' specs (the scheduler first)."""
        args, head = self.args, self.addresses.head
        prefill = r < len(self.prefill_schedulers)
        address = self.prefill_schedulers[r] if prefill else f"{head}:{free_port(head)}"
        port = address.rpartition(":")[2]
        role = [] if not args.prefill_replicas else ["--kv-role", "prefill"] if prefill else \
            ["--kv-role", "decode", *(f for a in self.prefill_schedulers for f in ("--kv-peer", a)),
             "--kv-load-failure-policy", args.kv_load_failure_policy, "--kv-load-timeout", str(args.kv_load_timeout)]
        listen = [] if self.addresses.local else ["--host", head, "--advertise-host", head]
        scheduler = ChildSpec(f"scheduler[{r}]", ["scheduler", *self.model_arg, *listen, "--port", str(port),
                                                  "--pipeline-parallel-size", str(args.pipeline_parallel_size),
                                                  *self.scheduler_flags, *role, *_service(args, self._metrics(r))],
                              kind="scheduler")
        return address, [scheduler, *(self._stage(r, i, address) for i in range(len(self.ranges)))]

    def stages(self) -> list[ChildSpec]:
        """One replica's stages as planned: what each asks of a host or of a Ray cluster."""
        return [self._stage(0, i, "") for i in range(len(self.ranges))]

    def _metrics(self, r: int, i: int = -1) -> int:
        """Replica r's scheduler's (i -1) or stage i's metrics port offset."""
        return r * (self.args.pipeline_parallel_size + 1) + 1 + i + (1 if r >= self.initial_dp else 0)

    def _stage(self, r: int, i: int, scheduler: str) -> ChildSpec:
        args, tp, spec = self.args, self.args.tensor_parallel_size, self.spec
        a, b = self.ranges[i]
        env = {} if self.cuda else dict(self.cpu.env) if self.cpu is not None else cpu_stage_env()
        if self.cuda and self.addresses.local:  # Ray gives each stage its GPUs itself
            first = (r * len(self.ranges) + i) * tp
            env = {"CUDA_VISIBLE_DEVICES": ",".join(str(first + t) for t in range(tp))}
        stage_host = [] if self.addresses.local else ["--host", self.addresses.stage, "--advertise-host",
                                                      self.addresses.stage]
        ep = ["--data-parallel-size", str(args.data_parallel_size), "--data-parallel-rank", str(r),
              "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(self.ep_port)]
        argv = ["stage", *self.stage_model, "--scheduler", scheduler, "--stage-index", str(i), "--layers", f"{a}:{b}",
                "--tensor-parallel-size", str(tp), "--handoff", args.handoff, "--device",
                "cuda" if self.cuda else "cpu", "--threads", str(self.threads), *stage_host,
                *_service(args, self._metrics(r, i)),
                *(["--enforce-eager"] if args.enforce_eager else []),
                *(["--speculative-config", spec.to_json()] if spec is not None and spec.uses_draft_model
                  and i == len(self.ranges) - 1 else []),
                *(["--enable-expert-parallel"] if args.enable_expert_parallel else []),
                *(["--enable-eplb"] if args.enable_eplb else []), *_flags(args, ("eplb_config",)),
                *(ep if self.ep_port else []),
                *_flags(args, ("dtype", "block_size", "kv_cache_memory", "gpu_memory_utilization")),
                *_disk_tier(args, r), *lora_argv(args)]
        return ChildSpec(f"stage[{r}.{i}]", argv, env, "stage", tp * self.threads, tp if self.cuda else 0)

    def routers(self, replicas: list[str]) -> list[ChildSpec]:
        """The --api-server-count routers over these replicas, on one HTTP port and one gRPC port (SO_REUSEPORT
        when several), each with its own control port when the layout has them."""
        args, n = self.args, self.args.api_server_count
        argv = ["router", *self.model_arg, "--host", args.host, "--port", str(args.port), *_service(args, None)]
        for replica in replicas:
            argv += ["--replica", replica]
        if args.enable_auto_tool_choice is not None:  # None: the router chooses from the chat template
            argv += ["--enable-auto-tool-choice" if args.enable_auto_tool_choice else "--no-enable-auto-tool-choice"]
        argv += ["--reuse-port"] if n > 1 else []
        argv += ["--trust-request-chat-template"] if args.trust_request_chat_template else []
        argv += _flags(args, ("grpc_port", "served_model_name", "api_key", "max_model_len", "tool_call_parser",
                              "max_request_retries", "policy", "responses_store", "responses_store_size",
                              "responses_store_ttl", "chat_template_timeout", "structured_outputs_config",
                              "grammar_compile_timeout"))
        argv += lora_argv(args, limits=False)
        control = [["--control-port", str(p)] for p in self.control_ports] or [[]] * n
        return [ChildSpec("router" if n == 1 else f"router[{i}]", [*argv, *control[i]], kind="router")
                for i in range(n)]


def plan_commands(args: argparse.Namespace, model: str | None, num_layers: int, cuda: bool,
                  addresses: Addresses = Addresses(), stage_model: list[str] | None = None) -> list[ChildSpec]:
    """Every service of the mesh, schedulers before their stages, the router last. `model` None: each service
    resolves the embedded default model on its own node. `stage_model`: the stages' MODEL and weight flags
    where they differ from `model` (a GGUF, --quantization; stagemesh.core.model_source)."""
    layout = MeshLayout.build(args, model, num_layers, cuda, addresses, stage_model)
    replicas = [layout.replica(r) for r in range(args.data_parallel_size)]
    return [s for _, specs in replicas for s in specs] + layout.routers([a for a, _ in replicas])


def speculative_config(args: argparse.Namespace):
    """--speculative-config parsed (None without one); refused with --async-scheduling."""
    from stagemesh.core.errors import StagemeshError
    from stagemesh.core.speculative import ASYNC_WITH_SPECULATION, parse_speculative_config

    spec = parse_speculative_config(args.speculative_config)
    if spec is not None and args.async_scheduling:
        raise StagemeshError(ASYNC_WITH_SPECULATION)
    return spec


def _scheduler_flags(args: argparse.Namespace, spec) -> list[str]:
    flags = _flags(args, ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                          "served_model_name", "stage_recovery_timeout", "max_request_retries",
                          "scheduling_policy", "resume_grace_period", "kv_offloading_size",
                          "kv_offloading_backend", "kv_offloading_disk_size"))
    if not args.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if args.async_scheduling is not None:
        flags.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    if spec is not None:
        flags += ["--speculative-config", spec.to_json()]
    return flags + lora_argv(args)


def _service(args: argparse.Namespace, metrics_offset: int | None) -> list[str]:
    """Logs, traces, TLS for a child; a metrics port when --metrics-port is given (not for the router,
    whose metrics are on its HTTP port)."""
    argv = service_argv(args)
    if metrics_offset is not None and args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port + metrics_offset)]
    return argv


def _disk_tier(args: argparse.Namespace, replica: int) -> list[str]:
    """Each replica's stages get a disk tier directory of their own (two stages never share a namespace)."""
    path = getattr(args, "kv_offloading_disk_path", None)
    return ["--kv-offloading-disk-path", os.path.join(path, f"replica-{replica}")] if path else []


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out

"""serve's operations wired in: its admin and autoscale settings (the flags: stagemesh.entry.serve_options.OpsOptions),
the controller the admin API calls, and what serve starts and stops around its mesh (the admin API and its file, the
autoscaler, the end of a running operation before the drain)."""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import threading
from dataclasses import dataclass, field

from stagemesh.core.errors import StagemeshError
from stagemesh.entry.ops import admin_file
from stagemesh.entry.ops.admin_api import AdminServer
from stagemesh.entry.ops.autoscale import AutoscaleConfig, Autoscaler, Load
from stagemesh.entry.ops.mesh import ServeMesh
from stagemesh.entry.ops.operation import Operations, Refused
from stagemesh.entry.ops.rollout import rollout
from stagemesh.entry.ops.scaling import check_scale, scale, serving

log = logging.getLogger("stagemesh.serve")


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig | None:
    """The autoscaler's settings (None: it is off); StagemeshError for settings it cannot follow."""
    if args.autoscale_max_replicas is None:
        if args.autoscale_min_replicas is not None:
            raise StagemeshError("--autoscale-min-replicas needs --autoscale-max-replicas (which turns it on)")
        return None
    floor = args.prefill_replicas + 1 if args.prefill_replicas else 1
    low = floor if args.autoscale_min_replicas is None else args.autoscale_min_replicas
    high, dp = args.autoscale_max_replicas, args.data_parallel_size
    if low < floor or not low <= dp <= high:
        raise StagemeshError(f"the autoscaler needs {floor} <= --autoscale-min-replicas ({low}) <= "
                             f"--data-parallel-size ({dp}) <= --autoscale-max-replicas ({high})")
    if args.enable_expert_parallel:
        raise StagemeshError("--autoscale-max-replicas is not built for --enable-expert-parallel (the experts' "
                             "layout is fixed at start)")
    numbers = (args.autoscale_target_waiting, args.autoscale_target_kv_usage, args.autoscale_scale_up_window,
               args.autoscale_scale_down_window, args.autoscale_cooldown)
    if min(numbers) < 0 or args.autoscale_interval <= 0 or not 0 < args.autoscale_target_kv_usage <= 1:
        raise StagemeshError("the autoscaler's windows, cooldown and targets must be >= 0, its interval > 0 and "
                             "--autoscale-target-kv-usage in (0, 1]")
    return AutoscaleConfig(low, high, args.autoscale_target_waiting, args.autoscale_target_kv_usage,
                           args.autoscale_scale_up_window, args.autoscale_scale_down_window, args.autoscale_cooldown,
                           args.autoscale_interval)


@dataclass
class MeshController:
    """What the admin API (and the autoscaler) call on the mesh (mp or Ray alike)."""
    mesh: ServeMesh
    ops: Operations = field(default_factory=Operations)
    autoscaler: Autoscaler | None = None

    def status(self) -> dict:
        return {**self.mesh.describe(), **self.ops.status(),
                "autoscale": self.autoscaler.describe() if self.autoscaler is not None else None}

    def rollout(self, surge: bool) -> dict:
        return self.ops.start(rollout(self.mesh, surge)).to_dict()

    def scale(self, n: int, reason: str = "asked by the admin API") -> dict | None:
        bounds = None if self.autoscaler is None else (self.autoscaler.policy.cfg.min_replicas,
                                                       self.autoscaler.policy.cfg.max_replicas)
        check_scale(self.mesh, n, bounds)
        op = scale(self.mesh, n, reason)
        return None if op is None else self.ops.start(op).to_dict()

    def reload_api_keys(self) -> dict:
        """Every live router reads its --api-keys-file again (a router whose file does not parse keeps its
        tenants): {"routers": [{"router", "reloaded", "tenants" or "error"}]}."""
        results = []
        for router in self.mesh.live_routers():
            ok, said = self.mesh.rpc.reload_api_keys(router.control)
            results.append({"router": router.child.name, "reloaded": ok, "tenants" if ok else "error": said})
            if not ok:
                log.error("%s did not reload --api-keys-file: %s", router.child.name, said)
        return {"routers": results}

    def load(self) -> Load | None:
        groups = serving(self.mesh)
        views = [v for g in groups if (v := self.mesh.rpc.scheduler(g.address)) is not None]
        if not views or len(views) < len(groups):  # one does not answer: no decision on half the figures
            return None
        return Load(len(views), sum(v.num_waiting for v in views), sum(v.kv_cache_usage for v in views) / len(views))

    def autoscale(self, n: int, reason: str) -> None:
        try:
            self.scale(n, reason)
        except Refused as err:
            log.warning("autoscaler: scaling to %d refused: %s", n, err)


class Admin:
    """The admin API and its file, and the autoscaler's thread, for the life of serve."""

    def __init__(self, args: argparse.Namespace, controller):
        key = args.admin_api_key or os.environ.get(admin_file.ENV_KEY) or None
        generated = key is None
        key = key or secrets.token_urlsafe(32)
        self.server = AdminServer(controller, key, args.admin_host, args.admin_port)
        port = self.server.start()
        url = f"http://{args.admin_host}:{port}"
        self.file = admin_file.write(url, key if generated else None)
        log.info("admin API on %s (stagemesh rollout / stagemesh scale on this host find it in %s; the key is %s)",
                 url, self.file, "there, mode 0600" if generated else "the one serve was given")
        self.autoscaler = getattr(controller, "autoscaler", None)
        if self.autoscaler is not None:
            threading.Thread(target=self.autoscaler.run, name="autoscaler", daemon=True).start()

    def close(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.stop_event.set()
        self.server.stop()
        self.file.unlink(missing_ok=True)


def controller_for(mesh: ServeMesh, cfg: AutoscaleConfig | None) -> MeshController:
    controller = MeshController(mesh)
    if cfg is not None:
        controller.autoscaler = Autoscaler(cfg, controller.load, controller.autoscale, lambda: controller.ops.busy)
    mesh.host.before_drain.append(controller.ops.stop)
    if controller.autoscaler is not None:
        mesh.host.before_drain.insert(0, controller.autoscaler.stop_event.set)
    return controller

"""The stage's gRPC service: decode, hand off to StageWorker, encode."""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stagemesh.errors import StagemeshError
from stagemesh.service_options import add_port
from stagemesh.v1 import stage_pb2, stage_pb2_grpc
from stage_worker.observe import ForwardObserver
from stage_worker.worker import StageWorker

log = logging.getLogger("stagemesh.stage")


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, worker: StageWorker, address: str):
        self.worker = worker
        self.address = address
        c = worker.cfg
        self.observer = ForwardObserver(c.stage_index, c.layer_start, c.layer_end, c.tp_size, c.handoff)

    def describe(self) -> stage_pb2.StageDescription:
        w, c, cfg = self.worker, self.worker.cfg, self.worker.runner.config
        return stage_pb2.StageDescription(
            stage_index=c.stage_index, layer_start=c.layer_start, layer_end=c.layer_end, tensor_parallel_size=c.tp_size,
            device=c.device, free_memory_bytes=w.free_memory_bytes(), num_kv_blocks=w.num_kv_blocks,
            block_size=c.block_size, address=self.address, handoff=c.handoff, model_path=str(c.model_dir),
            weight_bytes=w.runner.model.num_parameter_bytes(),
            model=stage_pb2.ModelIdentity(model_type=cfg.model_type, num_hidden_layers=cfg.num_hidden_layers,
                                          hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                          num_attention_heads=cfg.num_attention_heads,
                                          num_key_value_heads=cfg.num_key_value_heads))

    def Describe(self, request, context):
        return self.describe()

    def JoinPipeline(self, request, context):
        return _call(context, lambda: self.worker.join(request), stage_pb2.JoinPipelineResponse())

    def Forward(self, request, context):
        span, start = self.observer.start(request, context.invocation_metadata())
        reply, error = None, "failed"
        try:
            reply = _call(context, lambda: self.worker.forward(request))
            error = None
            return reply
        finally:
            self.observer.end(span, start, request, reply, error)

    def PushActivations(self, request, context):
        return _call(context, lambda: self.worker.deliver(request), stage_pb2.PushActivationsResponse())


def _call(context, fn, empty=None):
    try:
        result = fn()
        return empty if empty is not None else result
    except StagemeshError as err:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
    except Exception as err:  # noqa: BLE001 - a failed step is reported, the service stays up
        log.exception("stage call failed")
        context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")


def start_server(servicer: StageServicer, host: str, port: int) -> tuple[grpc.Server, int, health.HealthServicer]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32),
                         options=[("grpc.max_receive_message_length", 1 << 30),
                                  ("grpc.max_send_message_length", 1 << 30)])
    stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_port(server, f"{host}:{port}")
    if bound == 0:
        raise StagemeshError(f"cannot listen on {host}:{port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("stagemesh.v1.Stage", health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer

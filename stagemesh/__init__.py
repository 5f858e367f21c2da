"""stagemesh: distributed LLM inference as a gRPC mesh.

This package is what users meet first, in two rooms and the client:
- stagemesh.core, the floor: what every service shares (errors, the request, model config and families, flags,
  the default model, wire conversions); it imports no service;
- stagemesh.entry, the roof: the `stagemesh` command line and what it runs (serve, plan, bench, ops, the
  in-process engine); it may import every service, and nothing of the floor or of a service imports it;
- stagemesh.client, the gRPC frontend's client, which stands on the floor alone.
"""
import os as _os

__version__ = "0.1.0"

# The generated protobuf code (stagemesh.v1) lives in protos/stagemesh/v1, which an install maps into this
# package (pyproject's package-dir). A checkout run without installing it (PYTHONPATH=., e.g. on a machine
# that only got a copy of the tree) finds it here instead.
_protos = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "protos", "stagemesh")
if _os.path.isdir(_os.path.join(_protos, "v1")):
    __path__.append(_protos)

"""stagemesh: distributed LLM inference as a gRPC mesh.

This package is what users meet first: the `stagemesh` command line, the
client, and the little every service shares (model config, the default model).
"""
import os as _os

__version__ = "0.1.0"

# The generated protobuf code (stagemesh.v1) lives in protos/stagemesh/v1, which an install maps into this
# package (pyproject's package-dir). A checkout run without installing it (PYTHONPATH=., e.g. on a machine
# that only got a copy of the tree) finds it here instead.
_protos = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "protos", "stagemesh")
if _os.path.isdir(_os.path.join(_protos, "v1")):
    __path__.append(_protos)

"""stagemesh: distributed LLM inference as a gRPC mesh.

This package is what users meet first: the `stagemesh` command line, the
client, and the little every service shares (model config, the default model).
"""
__version__ = "0.1.0"

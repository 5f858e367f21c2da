"""The base every service stands on: errors, sampling parameters, step types and their wire form,
model config, the default model's location, deadlines, logs, traces, and the RPC plumbing every
service shares (channels, servers, TLS, the internal token).

Rule (tests/test_layering.py): nothing here imports scheduler, stage_worker, router, kernels or
the stagemesh entry points (the command line, serve, generate, bench, plan, client), so each of
those can import any of this without a cycle.
"""

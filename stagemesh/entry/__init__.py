"""The roof: stagemesh's entry points, the modules that start or drive the services.

The `stagemesh` command line (cli), serve and its supervisor, the in-process engine and pipeline, the layout
and CPU plan, Ray's executor, and the plan / ops / bench commands. These may import the services (router,
scheduler, stage_worker); nothing of the floor (stagemesh.core, the package root, stagemesh.client) or of a
service imports them (tests/test_layering.py checks it).
"""

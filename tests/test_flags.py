"""Every flag of `stagemesh serve`, `router`, `scheduler` and `stage` is declared once, on its service's options
(stagemesh.core.flags); options written as a command line parse back to the same options; and every child
serve plans parses with its service's own parser."""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from router.config import RouterOptions
from scheduler.config import SchedulerOptions
from stage_worker.options import StageOptions
from stagemesh.entry.cli import build_parser
from stagemesh.core.flags import FLAG, GROUP, Flag, flags, from_args, to_argv
from stagemesh.entry.serve_options import SERVE_VARIANTS, ServeOptions

COMMANDS = {"router": RouterOptions, "scheduler": SchedulerOptions, "stage": StageOptions, "serve": ServeOptions}
# one name, two flags, each the service's own: never passed from serve to the other service
LOCAL = {"--port": "each service's listening port", "--max-waiting-requests": "router: 429s; scheduler: its queue"}
# the stage's --pipeline-parallel-size is optional (it goes with --layer-split, instead of --layers)
STAGE_VARIANTS = {"--pipeline-parallel-size"}


def _identity(flag: Flag) -> tuple:
    """What makes two declarations the same flag on the command line (a variant changes default or help only)."""
    return flag.names, flag.kind, flag.type, flag.choices, flag.metavar, flag.required, flag.passed_on


def test_each_flag_is_declared_once_and_each_parser_has_exactly_its_declared_flags():
    declared: dict[str, dict[Flag, set[str]]] = defaultdict(lambda: defaultdict(set))
    for command, cls in COMMANDS.items():
        names = {n for _, f in flags(cls) for n in f.names if f.kind != "positional"}
        parser = build_parser(only=command)._subparsers._group_actions[0].choices[command]
        options = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
        # no flag is added outside its declaration (serve re-declares none of the services')
        assert options == names | {"--no-" + f.name[2:] for _, f in flags(cls) if f.kind == "bool"}, command
        for _, f in flags(cls):
            declared[f.name][f].add(command)
    variants = set(SERVE_VARIANTS) | STAGE_VARIANTS
    for name, found in declared.items():
        if len(found) == 1 or name in LOCAL:
            continue
        assert name in variants, f"{name} is declared differently by {[sorted(c) for c in found.values()]}"
        assert len({_identity(f) for f in found}) == 1, f"{name}: a variant changes more than default and help"


def _non_default(name: str, flag: Flag, field: dataclasses.Field):
    """A value of this flag that is not its default (so that it must be written into the argv)."""
    if flag.choices:
        return next(c for c in flag.choices if c != flag.default)
    if flag.kind in ("switch", "bool"):
        return not flag.default
    if flag.kind in ("append", "extend"):
        return ("a=/x", "b=/y")
    if flag.type is int:
        return (flag.default or 0) + 7
    if flag.type is float:
        return (flag.default or 0) + 2.5
    return f"/value/of/{name}"


def _everything_set(cls):
    """Options of `cls` with every flag given a value other than its default, nested groups' too."""
    values = {}
    for f in dataclasses.fields(cls):
        if GROUP in f.metadata:
            values[f.name] = _everything_set(f.metadata[GROUP])
        elif FLAG in f.metadata:
            values[f.name] = _non_default(f.name, f.metadata[FLAG], f)
    return cls(**values)


def _parse(command: str, argv: list[str]):
    """The options the real `stagemesh COMMAND` parser makes of argv."""
    args = build_parser(only=command).parse_args([command, *argv])
    return from_args(COMMANDS[command], args)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_options_written_as_argv_parse_back_the_same(command):
    cls = COMMANDS[command]
    full = _everything_set(cls)
    argv = to_argv(full)
    skipped = {"internal_token", "internal_token_file"}  # (never on a child's command line: its environment)
    expected = dataclasses.replace(full, service=dataclasses.replace(full.service, **{
        n: None for n in skipped}))
    # (a group's skipped flags, the router's LoRA limits and metrics port, are not its own: they keep defaults)
    assert _parse(command, argv) == _keep_skipped(expected, cls)
    # a service started with its defaults is given nothing but what is required
    minimal = _parse(command, _required(command))
    required = {"router": {"replica": ("h:1",)}, "stage": {"scheduler": "h:1", "stage_index": 0}}.get(command, {})
    assert minimal == from_args(cls, None, **required)  # the parser's defaults are the options' own
    assert _parse(command, to_argv(minimal)) == minimal
    assert to_argv(minimal) == _required(command)


def _keep_skipped(options, cls):
    """`options` with the flags a nested group skips (which the service does not take) back at their defaults."""
    changes = {}
    for f in dataclasses.fields(cls):
        if GROUP in f.metadata and f.metadata["stagemesh.skip"]:
            changes[f.name] = dataclasses.replace(getattr(options, f.name), **{
                n: getattr(f.metadata[GROUP](), n) for n in f.metadata["stagemesh.skip"]})
    return dataclasses.replace(options, **changes)


def _required(command: str) -> list[str]:
    return {"router": ["--replica", "h:1"], "stage": ["--scheduler", "h:1", "--stage-index", "0"]}.get(command, [])


def test_every_child_serve_plans_parses_with_its_services_own_parser():
    """serve's children are given serve's values for the flags they share, and nothing a child does not take."""
    import argparse

    from stagemesh.entry.serve import add_arguments, plan_commands

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["-dp", "2", "-pp", "2", "-tp", "2", "--max-model-len", "512", "--served-model-name", "m",
                         "--block-size", "32", "--enable-lora", "--lora-modules", "a=/x", "--max-loras", "2",
                         "--policy", "kv-aware", "--max-num-seqs", "8", "--dtype", "bfloat16", "--log-level", "debug",
                         "--metrics-port", "9000", "--internal-token", "secret", "--prefill-replicas", "1",
                         "--kv-load-timeout", "3", "--layer-split", "1,3", "--enforce-eager"])
    children = plan_commands(args, "/m", 4, cuda=False)
    parsed = {c.name: _parse(c.argv[0], c.argv[1:]) for c in children}
    assert all("secret" not in c.argv for c in children)  # the token travels in the environment
    router, schedulers = parsed["router"], [parsed["scheduler[0]"], parsed["scheduler[1]"]]
    stages = [o for n, o in parsed.items() if n.startswith("stage")]
    assert (router.max_model_len, router.served_model_name, router.policy, router.lora.enable_lora,
            router.lora.max_loras, router.service.log_level) == (512, "m", "kv-aware", True, 1, "debug")
    for s in schedulers:
        assert (s.max_model_len, s.block_size, s.max_num_seqs, s.lora.max_loras, s.pipeline_parallel_size,
                s.kv_load_timeout) == (512, 32, 8, 2, 2, 3.0)
    assert [s.kv_role for s in schedulers] == ["prefill", "decode"]
    shared = (32, 2, "bfloat16", True, None, None, ("a=/x",))
    assert [(s.layers, s.settings.block_size, s.settings.tensor_parallel_size, s.settings.dtype,
             s.settings.enforce_eager, s.pipeline_parallel_size, s.layer_split, s.settings.lora.lora_modules)
            for s in stages[:2]] == [("0:1", *shared), ("1:4", *shared)]
    assert [s.service.metrics_port for s in (schedulers[0], *stages[:2], schedulers[1])] == [9000, 9001, 9002, 9003]

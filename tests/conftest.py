"""Shared fixtures: tiny models built once per session, offline hub, few threads."""
from __future__ import annotations

import os

import pytest
import torch  # noqa: E402  (imported before triton on purpose)

from stagemesh.core.default_model import cache_root

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("STAGEMESH_KERNEL_CACHE", str(cache_root() / "kernels"))  # as the command line sets it
# every service the tests start checks the internal token, and every test client sends it (tests/mesh.py)
os.environ.setdefault("STAGEMESH_INTERNAL_TOKEN", "tests-internal-token-3f9c2a7e41")
# the meshes the tests start say ready without warming up (--skip-server-warmup's default): a warm-up costs each
# start ~3.5 s of a 2-core machine, and what it warms (the first request's latency, a CPU stage's oneDNN
# builds) is what tests/test_startup.py and tests/test_onednn_rows.py check, with it on
os.environ.setdefault("STAGEMESH_SKIP_SERVER_WARMUP", "1")
torch.set_num_threads(1)
# under pytest-xdist, each worker's meshes pick their ports from a range of their own (stagemesh.core.ports)
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw") and not os.environ.get("STAGEMESH_PORT_RANGE"):
    from stagemesh.core.ports import port_range

    _low, _high = port_range()
    _step = (_high - _low) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    _start = _low + _step * int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    os.environ["STAGEMESH_PORT_RANGE"] = f"{_start}-{_start + _step}"

from tiny_models import make_tiny_model  # noqa: E402


# The files that take longest, longest first (per-test timings of whole runs on 2 cores); every other file follows in
# collection order. Under `make test`'s workers (pytest-xdist, a file whole on one worker, handed out in this order:
# the Makefile passes --no-loadscope-reorder) the long files start first, so the last file to end is a short one and
# the workers end together. The order changes no result; a file missing here only starts later.
LONGEST_FIRST = ("test_ray.py", "test_structured_outputs.py", "test_rollout.py", "test_lora.py", "test_tp_parity.py",
                 "test_kubernetes.py", "test_drain.py", "test_scaling.py", "test_router_dp.py", "test_plan.py",
                 "test_serve.py", "test_startup.py", "test_pcp.py", "test_dcp.py", "test_dp_ep.py", "test_rejoin.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)


@pytest.fixture(scope="session", autouse=True)
def shared_references(tmp_path_factory):
    """tiny_models.greedy_tokens keeps its answers in the run's folder: under pytest-xdist the parent of the
    workers' own (popen-gw0, popen-gw1), so that a reference one worker computed serves the other too."""
    import tiny_models

    base = tmp_path_factory.getbasetemp()
    tiny_models.REFERENCES = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "references"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch, **overrides) -> Path, cached per session."""
    cache = {}

    def make(arch: str = "llama", **overrides):
        key = (arch, repr(sorted(overrides.items())))  # values may be lists (mlp_only_layers)
        if key not in cache:
            name = "-".join([arch] + [f"{k}{v}" for k, v in sorted(overrides.items())])
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(name), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def default_model_dir():
    from stagemesh.core.default_model import default_model_dir as resolve

    return resolve()


@pytest.fixture(scope="session")
def wide_model_dir(tiny_model_dir, tmp_path_factory):
    """A tiny llama wider than the others, with a word tokenizer: a step takes a few milliseconds, so that a
    stream of a few hundred tokens lasts long enough for a test to act while it runs (kill, drain, resume)."""
    from tiny_models import with_word_tokenizer

    wide = tiny_model_dir("llama", hidden_size=512, intermediate_size=2048, num_attention_heads=8)
    return with_word_tokenizer(wide, tmp_path_factory.mktemp("wide") / "model")

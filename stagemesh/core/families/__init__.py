"""The model families stagemesh serves, one module each in this package (stagemesh.core.families.family says
what a module declares). A module is found by being here: adding a family is adding its module and its test.

The stage, the loaders and the planner ask the family (ModelConfig.family) instead of testing model_type.
"""
from __future__ import annotations

import importlib
import pkgutil

from stagemesh.core.errors import StagemeshError
from stagemesh.core.families.family import GGUF, Experts, Family, WeightNames

__all__ = ["GGUF", "Experts", "Family", "WeightNames", "FAMILIES", "SUPPORTED_MODEL_TYPES", "get"]


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "family":
            continue
        family = importlib.import_module(f"{__name__}.{info.name}").FAMILY
        if not isinstance(family, Family) or family.model_type in found:
            raise RuntimeError(f"{__name__}.{info.name}: FAMILY must be one new Family")
        found[family.model_type] = family
    return found


FAMILIES = _discover()
# dense families first, then mixtures of experts, each group by name (how messages list them)
SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILIES, key=lambda t: (FAMILIES[t].experts is not None, t)))


def get(model_type: str, architectures: list[str] | None = None) -> Family:
    """The family of a config's model_type, or the error that names what is served."""
    family = FAMILIES.get(model_type)
    if family is None:
        archs = ", ".join(architectures or [model_type or "unknown"])
        raise StagemeshError(f"unsupported architecture {archs} (model_type {model_type!r}); "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return family

"""Mixtral: experts w1 (gate), w3 (up), w2 (down) in block_sparse_moe, top-k weights always renormalised."""
from stagemesh.core.families.family import Experts, Family

FAMILY = Family("mixtral", ("MixtralForCausalLM",),
                experts=Experts("block_sparse_moe", ("w1", "w3", "w2"), always_renormalize=True))

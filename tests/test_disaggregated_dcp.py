"""Disaggregated prefill between replicas of different context parallelism (stage_worker.kv_transfer): a -tp 2
-dcp 2 stage keeps half of each block's tokens on each rank, a -tp 1 stage every token; what crosses the wire is
the canonical whole block, so either side reads what the other wrote and the decode replica's greedy tokens are
transformers'. The tiny llama with one KV head: -tp 2 -dcp 2 shards its heads as TP 1 would (each rank holds the
one KV head and half of the tokens); a -tp 2 -pcp 2 stage (prefill context parallelism: the same layout, its 2
PCP groups a TP shard each) feeds a -tp 2 -dcp 2 one. Real processes on loopback, one pair of replicas alive at a
time."""
from __future__ import annotations

import pytest

from mesh import Mesh
from parity import prompts
from test_disaggregated import LENGTHS, NEW_TOKENS, assert_decoded, prefill_all, run
from tiny_models import reference_model, reference_tokens

pytestmark = pytest.mark.slow
DCP = ("--decode-context-parallel-size", "2")
TP2_DCP2 = dict(tp=[2], stage_args=DCP)
TP2_PCP2 = dict(tp=[2], stage_args=("--prefill-context-parallel-size", "2"))  # 4 ranks: 2 PCP groups, a TP shard each
TP1: dict = dict(tp=[1])
# (-tp 4 -dcp 2, two DCP groups that each hold the one KV head: its reassembly is tests/test_kv_transfer_layout.py's)
PAIRS = {"prefill-tp2-dcp2": (TP2_DCP2, TP1), "prefill-tp2-pcp2-decode-tp2-dcp2": (TP2_PCP2, TP2_DCP2)}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_kv_crosses_between_a_dcp_stage_and_a_plain_one(tiny_model_dir, tmp_path, pair):
    model_dir = tiny_model_dir("llama", num_key_value_heads=1)
    prefill_layout, decode_layout = PAIRS[pair]
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    with Mesh(model_dir, [4], log_dir=tmp_path / "p", scheduler_args=("--kv-role", "prefill"),
              **prefill_layout) as p, \
            Mesh(model_dir, [4], log_dir=tmp_path / "d",
                 scheduler_args=("--kv-role", "decode", "--kv-peer", p.address), **decode_layout) as d:
        ref = reference_model(model_dir)
        batch = prompts(384, LENGTHS, seed=5)
        want = [reference_tokens(ref, x, NEW_TOKENS) for x in batch]
        assert_decoded(run(d, prefill_all(p, batch, want)), want)
        log = (tmp_path / "d" / "scheduler.log").read_text()
        # every prompt's KV was fetched (none computed again on the decode replica)
        assert log.count("its prompt's KV (") == len(batch), log[-3000:]
        assert "failed" not in log

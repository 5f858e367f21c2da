"""The request every layer takes whole (stagemesh.core.engine_request): its one wire pair carries every field,
and its hash root keeps one adapter's or one cache salt's prefix-cache blocks from another's."""
from __future__ import annotations

from dataclasses import fields

from stagemesh.core.block_hash import prefix_hashes
from stagemesh.core.engine_request import EngineRequest, KVSourceInfo
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import TokenLogprob
from stagemesh.core.wire import engine_request_from_pb, engine_request_to_pb
from stagemesh.v1 import scheduler_pb2


def test_every_field_crosses_the_wire_and_back():
    r = EngineRequest("r-1", [5, 6, 7], SamplingParams(max_tokens=5, seed=3, temperature=0.5), [8], priority=-2,
                      lora_name="sql", prefill_only=True,
                      kv_source=KVSourceInfo("h:1", "q", 2, (1, 2), 16, 20, (("s:1", 0, 4),), b"ticket"),
                      resumable=True,
                      traceparent="00-abc-def-01", tracestate="k=v", cache_salt="tenant",
                      generated_logprobs=[TokenLogprob(8, -0.5, 1, [8, 3], [-0.5, -2.0])], owner="0a1b",
                      tenant="beta", tenant_weight=2.5)
    back = engine_request_from_pb(engine_request_to_pb(r, scheduler_pb2.StreamSubmit()))
    differ = [f.name for f in fields(r) if getattr(back, f.name) != getattr(r, f.name)]
    assert not differ, differ  # (a field the wire forgets shows here: each one above is set off its default)
    assert not [f.name for f in fields(r) if getattr(r, f.name) == f.default]


def test_every_sampling_parameter_crosses_the_wire_and_back():
    """The plain fields travel by name (stagemesh.core.wire): a new SamplingParams field needs its proto field
    and nothing else; proto3's zeros read back as the defaults they stand for."""
    from stagemesh.core.pooling import PoolingParams
    from stagemesh.core.sampling_params import StructuredOutputs
    from stagemesh.core.wire import sampling_from_pb, sampling_to_pb

    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
                       frequency_penalty=-0.5, seed=0, max_tokens=30, min_tokens=2, stop_token_ids=(3, 4),
                       ignore_eos=False, logprobs=0, prompt_logprobs=0, logit_bias=((5, 1.5),),
                       allowed_token_ids=(1, 2, 5), bad_words_token_ids=((7, 8),),
                       structured=StructuredOutputs("choice", choices=("a", "b")),
                       pooling=PoolingParams("embed", dimensions=8, normalize=False, activation=False))
    default = SamplingParams()
    assert not [f.name for f in fields(p) if getattr(p, f.name) == getattr(default, f.name)
                and f.name != "ignore_eos"]  # (every field off its default; ignore_eos cannot go with a choice)
    for params in (p, default, SamplingParams(ignore_eos=True, top_k=0, seed=None),
                   SamplingParams(pooling=PoolingParams("classify"))):
        assert sampling_from_pb(sampling_to_pb(params)) == SamplingParams(**{
            **{f.name: getattr(params, f.name) for f in fields(params)}, "top_k": params.top_k if params.top_k > 0
            else -1})


def test_a_salt_changes_every_block_hash_and_the_same_salt_finds_the_same_blocks():
    prompt = list(range(100, 148))

    def hashes(**kw) -> list[int]:
        return prefix_hashes(prompt, 16, EngineRequest("r", prompt, **kw).hash_root)

    assert hashes(cache_salt="a") == hashes(cache_salt="a") and EngineRequest("r", prompt).hash_root is None
    variants = [hashes(), hashes(cache_salt="a"), hashes(cache_salt="b"), hashes(lora_name="sql"),
                hashes(lora_name="sql", cache_salt="a")]
    for i, a in enumerate(variants):  # no two share a block (the salt is in the first: every later one chains)
        for b in variants[i + 1:]:
            assert not set(a) & set(b)

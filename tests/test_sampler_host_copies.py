"""The sampler reads the device once per step, whatever the batch (on a GPU every read is a sync): its logits and
prompt logprobs stand in for device tensors (OnDevice), and every way of reading one on the host is counted."""
from __future__ import annotations

import pytest
import torch

from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence
from stage_worker import host_copy, prompt_logprobs
from stage_worker.sampler import Sampler

CPU_ON_HOST = host_copy.on_host  # (the fixture below patches it for the other tests)
VOCAB = 64
# every way a tensor's values reach Python; `.to()` counts where it names the CPU
READS = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one on an accelerator: what is computed from it stays 'on the device' (the subclass
    propagates), and each read of its values on the host is counted (its result is a plain, host tensor)."""
    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or (func is torch.Tensor.to and _names_cpu(args[1:], kwargs)):
            OnDevice.reads += 1
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return super().__torch_function__(func, types, args, kwargs)


def _names_cpu(args, kwargs) -> bool:
    return any(a == "cpu" or (isinstance(a, torch.device) and a.type == "cpu")
               for a in (*args, kwargs.get("device")))


@pytest.fixture(autouse=True)
def as_on_a_device(monkeypatch):
    """OnDevice is a CPU tensor standing for a device's: the sampler takes the path a GPU takes (one packed copy),
    not the CPU's (no copy at all)."""
    monkeypatch.setattr(host_copy, "on_host", lambda device: False)


def test_on_a_cpu_the_tensors_are_the_hosts_already_and_are_not_copied(monkeypatch):
    monkeypatch.setattr(host_copy, "on_host", CPU_ON_HOST)
    parts = [torch.arange(3), torch.ones(2, 5)]
    assert all(a is b for a, b in zip(host_copy.to_host(parts), parts))


def reads_of(fn) -> int:
    OnDevice.reads = 0
    fn()
    return OnDevice.reads


MIX = [SamplingParams(), SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.0, top_k=5),
       SamplingParams(temperature=0.7, top_p=0.9, logprobs=3), SamplingParams(logprobs=0),
       SamplingParams(temperature=1.0, min_p=0.05, logprobs=2, seed=3),
       SamplingParams(repetition_penalty=1.3, logit_bias=((5, 2.0),)),
       SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.2, logprobs=1)]


def sampler_of(params: list[SamplingParams]) -> Sampler:
    s = Sampler()
    for i, p in enumerate(params):
        s.add_sequence(NewSequence(i, [1, 2, 3], p, [4]))
    return s


@pytest.mark.parametrize("size", [1, 8])
def test_one_read_of_the_device_per_step_whatever_the_batch(size):
    params = (MIX * 2)[:size] if size > 1 else [MIX[3]]  # batch 1: a sampled row with logprobs, the most asked
    s = sampler_of(params)
    logits = torch.randn(size, VOCAB, generator=torch.Generator().manual_seed(size))
    for _ in range(3):  # steps: the outputs grow, the reads do not
        out: list = []
        assert reads_of(lambda: out.extend(s.sample(logits.as_subclass(OnDevice), list(range(size))))) == 1
        assert [t.seq_id for t in out] == list(range(size)) and all(t.error is None for t in out)


def test_a_step_with_drafts_to_verify_reads_the_device_once():
    """Speculation: a greedy sequence with two drafts, an unseeded sampled one whose draft model's distributions
    come with its two drafts (rejection sampling), and a seeded one with a draft: one read for all the rows."""
    s = sampler_of([SamplingParams(logprobs=1), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0,
                                                                                                seed=5)])
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3 + 3 + 2, VOCAB, generator=gen)  # each sequence: one row, and one per draft
    q = [torch.softmax(torch.randn(VOCAB, generator=gen), -1).as_subclass(OnDevice) for _ in range(2)]
    drafts = [[1, 2], [3, 4], [5]]
    out: list = []
    reads = reads_of(lambda: out.extend(s.sample(logits.as_subclass(OnDevice), [0, 1, 2], drafts, [None, q, None])))
    assert reads == 1
    assert {t.seq_id for t in out} == {0, 1, 2} and all(t.error is None for t in out)


def test_prompt_logprobs_read_the_device_once_and_score_every_row():
    """Pieces spread over more than one slice of rows: one read, and each entry is the row's own log-softmax."""
    hidden = torch.randn(prompt_logprobs.ROWS_PER_SLICE + 40, VOCAB, generator=torch.Generator().manual_seed(1))
    pieces = [prompt_logprobs._Piece(0, 1, list(range(0, 10)), list(range(10)), 0),
              prompt_logprobs._Piece(1, 1, list(range(10, hidden.shape[0])), [7] * (hidden.shape[0] - 10), 3)]
    got: list = []
    assert reads_of(lambda: got.extend(prompt_logprobs.compute(pieces, hidden.as_subclass(OnDevice), lambda h: h,
                                                               True))) == 1
    want = torch.log_softmax(hidden, -1)
    entries = [e for p in got for e in p.entries]
    rows = [r for p in pieces for r in p.rows]
    targets = [t for p in pieces for t in p.targets]
    assert len(entries) == len(rows)
    for e, row, target, n in zip(entries, rows, targets, [0] * 10 + [3] * (len(rows) - 10)):
        assert e.token_id == target and e.logprob == float(want[row, target])
        assert e.rank == int((want[row] > want[row, target]).sum()) + 1
        top = torch.topk(want[row], 3)
        assert (e.top_token_ids, e.top_logprobs) == ((top.indices.tolist(), top.values.tolist()) if n else ([], []))

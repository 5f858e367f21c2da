"""The pooling runner's stages against transformers on the same weights (in-process: stage slices chained by hand,
prompts in chunks), and what --runner / --convert / --pooler-config / a sentence-transformers config resolve to."""
from __future__ import annotations

import json

import pytest
import torch

from parity import prompts
from tiny_models import TINY, make_tiny_model, tiny_config
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig, layer_ranges
from stagemesh.core.pooling import PoolingParams, resolve
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, ScheduledChunks, StepBatch
from stage_worker.runner import StageRunner

CHUNK = 16


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pool-causal"), "llama")


def seq_cls_model(path, num_labels: int):
    """A tiny random LlamaForSequenceClassification (its score head: hidden -> num_labels)."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(1)
    model = LlamaForSequenceClassification(tiny_config("llama", num_labels=num_labels))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if "norm" not in name else p.uniform_(0.8, 1.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def pooled_by_stages(model_dir, split, pooler_config: str | None, seqs: list[tuple[list[int], PoolingParams]],
                     convert: str = "auto") -> list[torch.Tensor]:
    """Every sequence's pooled output from stage slices `split`, its prompt computed in chunks of CHUNK tokens,
    the sequences in one batch."""
    runners = [StageRunner.of(model_dir, a, b, runner="pooling", convert=convert, pooler_config=pooler_config)
               for a, b in layer_ranges(split)]
    for r in runners:
        r.allocate_kv_cache(64)
    new = [NewSequence(i, ids, SamplingParams(max_tokens=1, pooling=p)) for i, (ids, p) in enumerate(seqs)]
    done: dict[int, torch.Tensor] = {}
    pos, block, step = [0] * len(seqs), 0, 0
    tables: list[list[int]] = [[] for _ in seqs]
    while len(done) < len(seqs):
        chunks = ScheduledChunks()
        for i, (ids, _) in enumerate(seqs):
            if pos[i] >= len(ids):
                continue
            n = min(CHUNK, len(ids) - pos[i])
            need = -(-(pos[i] + n) // 16) - len(tables[i])
            blocks = list(range(block, block + need))
            tables[i] += blocks
            block += need
            chunks.append(i, ids[pos[i]:pos[i] + n], pos[i], blocks, pos[i] + n == len(ids))
            pos[i] += n
        batch = StepBatch(step, new if step == 0 else [], chunks)
        hidden = None
        for r in runners:
            out = r.execute(batch, hidden)
            hidden = out.hidden_states
        for t in out.sampled:
            assert t.error is None, t.error
            done[t.seq_id] = torch.tensor(t.pooled.values())
        step += 1
    return [done[i] for i in range(len(seqs))]


@torch.inference_mode()
def hidden_states(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' final normed hidden states of a prompt."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("split", [[4], [2, 2]])
def test_embeddings_equal_transformers_pooled_hidden_states(causal_dir, split):
    """LAST (the default: normalized), MEAN, CLS and the token-wise rows, each to 1e-4, one stage and PP=2, every
    prompt in chunks (two of them span several)."""
    ps = prompts(TINY["vocab_size"], lengths=(5, 40, 17))
    embed = [(p, PoolingParams("embed")) for p in ps]
    raw = [(ps[0], PoolingParams("embed", normalize=False)), (ps[1], PoolingParams("token_embed"))]
    last = pooled_by_stages(causal_dir, split, None, embed + raw)
    mean = pooled_by_stages(causal_dir, split, '{"pooling_type": "MEAN"}', embed)
    cls = pooled_by_stages(causal_dir, split, '{"pooling_type": "CLS"}',
                           [(p, PoolingParams("embed", normalize=False)) for p in ps[:2]])
    for i, p in enumerate(ps):
        h = hidden_states(causal_dir, p)
        torch.testing.assert_close(last[i], torch.nn.functional.normalize(h[-1], dim=0), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mean[i], torch.nn.functional.normalize(h.mean(0), dim=0), atol=1e-4, rtol=1e-4)
        if i < 2:
            torch.testing.assert_close(cls[i], h[0], atol=1e-4, rtol=1e-4)
    h0, h1 = hidden_states(causal_dir, ps[0]), hidden_states(causal_dir, ps[1])
    torch.testing.assert_close(last[3], h0[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last[4], torch.nn.functional.normalize(h1, dim=-1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_classification_checkpoint_equals_transformers_classifier(tmp_path, num_labels):
    """A *ForSequenceClassification checkpoint serves as classify (auto): its score head on the last token;
    softmax (classify) or, with one label, sigmoid; score with one label is sigmoid too; PP=2."""
    from transformers import AutoModelForSequenceClassification

    model_dir = seq_cls_model(tmp_path / "cls", num_labels)
    ps = prompts(TINY["vocab_size"], lengths=(7, 33))
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = [(p, PoolingParams("classify")) for p in ps] + [(ps[0], PoolingParams("classify", activation=False))]
    if num_labels == 1:
        seqs.append((ps[1], PoolingParams("score")))
    got = pooled_by_stages(model_dir, [2, 2], None, seqs)
    with torch.inference_mode():
        logits = [model(torch.tensor([p])).logits[0] for p in ps]
    act = torch.sigmoid if num_labels == 1 else (lambda x: torch.softmax(x, -1))
    for i in range(2):
        torch.testing.assert_close(got[i], act(logits[i]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], logits[0], atol=1e-4, rtol=1e-4)
    if num_labels == 1:
        torch.testing.assert_close(got[3], torch.sigmoid(logits[1]), atol=1e-4, rtol=1e-4)


def test_reward_step_pooling(causal_dir):
    """--convert reward: every token's hidden state softmaxed (ALL), or with STEP the rows of the step tag's
    tokens and the returned_token_ids columns, as vLLM's StepPooler."""
    p = prompts(TINY["vocab_size"], lengths=(20,))[0]
    tag = p[3]
    h = hidden_states(causal_dir, p)
    [all_rows] = pooled_by_stages(causal_dir, [4], None, [(p, PoolingParams("token_classify"))], convert="reward")
    torch.testing.assert_close(all_rows, torch.softmax(h, -1), atol=1e-4, rtol=1e-4)
    config = json.dumps({"pooling_type": "STEP", "step_tag_id": tag, "returned_token_ids": [5, 9]})
    [step] = pooled_by_stages(causal_dir, [2, 2], config, [(p, PoolingParams("token_classify"))], convert="reward")
    rows = h[torch.tensor(p) == tag][:, [5, 9]]
    torch.testing.assert_close(step, torch.softmax(rows, -1), atol=1e-4, rtol=1e-4)


def test_a_generate_request_on_the_pooling_runner_fails_alone(causal_dir):
    runner = StageRunner.of(causal_dir, 0, 4, runner="pooling")
    runner.allocate_kv_cache(8)
    batch = StepBatch(0, [NewSequence(0, [5, 6], SamplingParams(max_tokens=4)),
                          NewSequence(1, [5, 6], SamplingParams(max_tokens=1, pooling=PoolingParams("classify")))],
                      ScheduledChunks([0, 1], [2, 2], [5, 6, 5, 6], [0, 0], [1, 1], [0, 1], [True, True]))
    errors = [t.error for t in runner.execute(batch).sampled]
    assert "generates no tokens" in errors[0] and "does not serve the classify task" in errors[1]


def test_resolution_as_vllm(tmp_path, causal_dir):
    raw = ModelConfig.from_path(causal_dir).raw
    assert resolve(causal_dir, raw) is None  # a generative model generates by default
    embed = resolve(causal_dir, raw, "pooling")
    assert (embed.convert, embed.pooling_type, embed.normalize, embed.tasks) == ("embed", "LAST", True,
                                                                                 ("embed", "token_embed"))
    cls_raw = {**raw, "architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}}
    auto = resolve(causal_dir, cls_raw)  # --runner auto: a classification architecture pools
    assert auto.convert == "classify" and "score" in auto.tasks and auto.id2label == {0: "LABEL_0"}
    with pytest.raises(StagemeshError, match="no LM head"):
        resolve(causal_dir, cls_raw, "generate")
    st = tmp_path / "st"
    (st / "1_Pooling").mkdir(parents=True)
    (st / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer", "path": ""},
                                                 {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
                                                 {"type": "sentence_transformers.models.Normalize", "path": "2_N"}]))
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    read = resolve(st, raw, "pooling")
    assert (read.pooling_type, read.normalize) == ("MEAN", True)
    flag = resolve(st, raw, "pooling", pooler_config='{"pooling_type": "CLS", "normalize": false}')
    assert (flag.pooling_type, flag.normalize) == ("CLS", False)  # the flag over the sentence-transformers config
    for bad, match in [('{"enable_chunked_processing": true}', "not built here"), ('{"nope": 1}', "no field"),
                       ('{"pooling_type": "MAX"}', "not one of"), ('{"pooling_type": "ALL"}', "--convert reward")]:
        with pytest.raises(StagemeshError, match=match):
            resolve(causal_dir, raw, "pooling", pooler_config=bad)
    with pytest.raises(StagemeshError, match="needs --runner pooling"):
        resolve(causal_dir, raw, "generate", "embed")

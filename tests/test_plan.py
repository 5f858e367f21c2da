"""`stagemesh plan` reproduces the distributed-serving guides' figures and its commands run."""
from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest
import requests

from mesh import free_port, run_stagemesh, start_serve, wait_http_ok
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stagemesh.entry.plan.cli import load_config
from stagemesh.entry.plan.tree import GB, PlanRequest, make_plan
from tiny_models import with_word_tokenizer


def plan(model="Llama-3.1-70B", gpus=8, nodes=1, mem=80e9, dtype="fp16", max_len=8192, **kw):
    cfg, _ = load_config(model)
    return make_plan(PlanRequest(cfg, gpus, nodes, int(mem), dtype, max_len, **kw))


def stagemesh_plan(*args: str) -> subprocess.CompletedProcess:
    return run_stagemesh(["plan", *args], timeout=60)


def test_llama_70b_fp16_weights_about_140_gb():
    one = plan(gpus=8).considered[0]  # the first step of the tree: the whole model on one GPU
    assert (one.tp, one.pp) == (1, 1) and 138 * GB < one.weight_bytes_per_gpu < 143 * GB


def test_llama_70b_tp4_about_35_gb_per_gpu_and_tp2_is_tight():
    tp4 = plan(tensor_parallel_size=4)
    assert 34 * GB < tp4.layout.weight_bytes_per_gpu < 36.5 * GB and not tp4.tight(int(80e9))
    tp2 = plan(tensor_parallel_size=2)
    assert 69 * GB < tp2.layout.weight_bytes_per_gpu < 72 * GB
    assert tp2.tight(int(80e9)) and any(step.startswith("tight") for step in tp2.path)


def test_llama_8b_fits_one_gpu():
    p = plan("Llama-3.1-8B", dtype="bf16")
    assert (p.layout.tp, p.layout.pp, p.nodes_used) == (1, 1, 1) and "fits on one GPU" in p.path[0]


def test_llama_405b_needs_two_nodes_tp8_pp2():
    with pytest.raises(StagemeshError, match="does not fit 8 GPUs"):
        plan("Llama-3.1-405B")
    p = plan("Llama-3.1-405B", nodes=2)
    assert (p.layout.tp, p.layout.pp, p.nodes_used) == (8, 2, 2)
    assert 800 * GB < p.considered[0].weight_bytes_per_gpu < 820 * GB


def test_six_gpus_never_get_tp6_or_tp3_for_64_heads():
    p = plan(gpus=6)
    assert p.layout.tp not in (3, 6) and 64 % p.layout.tp == 0 and p.layout.tp * p.layout.pp == 6
    no_nvlink = plan(gpus=6, nvlink=False)
    assert (no_nvlink.layout.tp, no_nvlink.layout.pp) == (1, 6)


def test_no_nvlink_prefers_pipeline_parallel():
    p = plan(nvlink=False)
    assert (p.layout.tp, p.layout.pp) == (1, 8) and "no NVLink" in " ".join(p.path)


def test_quantization_is_suggested_when_it_would_fit_one_gpu():
    p = plan(gpus=8)
    assert p.suggestion and "q4_k" in p.suggestion and (p.layout.tp, p.layout.pp) == (8, 1)


def test_target_concurrency_adds_data_parallel_replicas():
    base = plan("Llama-3.1-8B", dtype="bf16", gpus=8, max_len=32768)
    need = int(base.layout.max_concurrency * 3) + 1
    p = plan("Llama-3.1-8B", dtype="bf16", gpus=8, max_len=32768, target_concurrency=need)
    assert p.layout.dp == 4


def test_uneven_split_gives_end_stages_fewer_layers():
    p = plan(tensor_parallel_size=2, pipeline_parallel_size=4)
    split = p.layout.layer_split
    assert sum(split) == 80 and split[0] < split[1] and split[-1] < split[-2]


def test_invalid_tp_is_refused_with_the_valid_sizes():
    result = stagemesh_plan("Llama-3.1-70B", "--gpus-per-node", "8", "--tensor-parallel-size", "6")
    assert result.returncode == 2
    assert "--tensor-parallel-size 6 does not divide the model's 64 attention heads; sizes that work: 1, 2, 4, 8" \
        in result.stderr


def test_json_has_the_fields_and_kv_math():
    result = stagemesh_plan("Llama-3.1-70B", "--gpus-per-node", "8", "--gpu-memory", "80GB", "--json",
                            "--max-model-len", "8192")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "layer_split",
                "weight_bytes_per_gpu", "kv_cache_tokens", "max_concurrency", "commands"):
        assert key in out
    # KV bytes per token per GPU at TP=8: 80 layers x 1 KV head x 128 x 2 x 2 bytes
    per_token = 80 * 1 * 128 * 2 * 2
    assert out["kv_cache_tokens"] == out["kv_cache_bytes_per_gpu"] // per_token
    assert out["max_concurrency"] == round(out["kv_cache_tokens"] / 8192, 2)


def test_text_output_prints_the_vllm_lines():
    result = stagemesh_plan("Llama-3.1-405B", "--gpus-per-node", "8", "--nodes", "2", "--gpu-memory", "80GB",
                            "--dtype", "fp16")
    assert result.returncode == 0, result.stderr
    assert re.search(r"KV cache size: [\d,]+ tokens", result.stdout)
    assert re.search(r"Maximum concurrency for 32,768 tokens per request: [\d.]+x", result.stdout)
    assert "# on node 1" in result.stdout and "--stage-index 1 --layers 63:126" in result.stdout


def test_replicas_over_several_nodes_each_get_commands_and_a_router_entry():
    result = stagemesh_plan("Llama-3.1-70B", "--gpus-per-node", "8", "--nodes", "2", "--gpu-memory", "80GB",
                            "--tensor-parallel-size", "4", "--target-concurrency", "1000", "--json")
    out = json.loads(result.stdout)
    assert out["data_parallel_size"] == 4 and out["nodes"] == 2
    head, workers = out["commands"]["head"], out["commands"]["workers"]
    assert sum(c.startswith("stagemesh scheduler") for c in head) == 4
    assert sum(c.startswith("stagemesh stage") for c in head + workers["node 1"]) == 4
    assert head[-1].count("--replica") == 4
    text = stagemesh_plan("Llama-3.1-70B", "--gpus-per-node", "8", "--nodes", "2", "--gpu-memory", "80GB",
                          "--tensor-parallel-size", "4", "--target-concurrency", "1000").stdout
    assert text.count("<- chosen") == 1


def test_moe_model_gets_tp8_with_expert_parallel_as_the_guides_deploy_deepseek_v3():
    p = plan("Qwen3-235B-A22B", dtype="bf16")
    assert (p.layout.tp, p.layout.pp, p.expert_parallel) == (8, 1, True)
    assert "16 of the 128 experts whole on each GPU" in p.path[-1]
    out = json.loads(stagemesh_plan("Qwen3-235B-A22B", "--gpus-per-node", "8", "--json").stdout)
    assert out["expert_parallel_size"] == 8 and "--enable-expert-parallel" in out["commands"]["serve"]
    two_nodes = json.loads(stagemesh_plan("Mixtral-8x7B", "--gpus-per-node", "8", "--nodes", "2", "-tp", "8",
                                          "-pp", "2", "--json").stdout)["commands"]
    stages = [c for c in two_nodes["head"] + two_nodes["workers"]["node 1"] if c.startswith("stagemesh stage")]
    assert len(stages) == 2 and all("--enable-expert-parallel" in c for c in stages)


@pytest.mark.parametrize("model,kw,why", [
    ("Mixtral-8x7B", dict(gpus=1, mem=200e9, dtype="bf16"), "each stage's one GPU holds all of its experts"),
    ("Mixtral-8x7B", dict(dtype="bf16", tensor_parallel_size=8, target_concurrency=1000, gpus=16),
     "expert parallelism spans one stage's TP ranks for now"),
])
def test_moe_experts_stay_tp_sharded_where_ep_does_not_apply(model, kw, why):
    p = plan(model, **kw)
    assert not p.expert_parallel and why in p.path[-1]


def test_dense_models_get_no_expert_parallelism():
    p = plan("Llama-3.1-70B")
    assert not p.expert_parallel and not any("expert" in step for step in p.path)


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout,flag", [
    ("llama", "--pipeline-parallel-size", "--layer-split"),
    ("mixtral", "--tensor-parallel-size", "--enable-expert-parallel"),  # TP=2 with EP=2
])
def test_printed_serve_command_starts_the_mesh(tiny_model_dir, tmp_path, arch, layout, flag):
    model = with_word_tokenizer(tiny_model_dir(arch), tmp_path / "model")
    result = stagemesh_plan(str(model), "--gpus-per-node", "2", "--gpu-memory", "1GiB", "--device", "cpu",
                            layout, "2", "--max-model-len", "256", "--json")
    assert result.returncode == 0, result.stderr
    command = json.loads(result.stdout)["commands"]["serve"].split()
    assert command[:2] == ["stagemesh", "serve"] and flag in command
    port = free_port()
    log = tmp_path / "serve.log"
    proc = start_serve([*command[2:], "--port", str(port), "--grpc-port", "0", "--threads", "1"], log)
    try:
        wait_http_ok(proc, f"http://127.0.0.1:{port}/ready", 120, "the printed serve command", log)
        body = {"model": str(model), "prompt": [5, 6, 7], "max_tokens": 4}
        assert requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_ray_backend_plan_says_which_node_gets_what_and_its_serve_command_parses():
    from stagemesh.entry.cli import build_parser

    out = json.loads(stagemesh_plan("Llama-3.1-405B", "--gpus-per-node", "8", "--nodes", "2", "--gpu-memory", "80GB",
                                    "--dtype", "fp16", "--distributed-executor-backend", "ray", "--json").stdout)
    cmds = out["commands"]
    assert cmds["head"][0] == "ray start --head --port=6379"
    assert cmds["workers"] == "ray start --address=$HEAD_NODE_IP:6379"
    serve = build_parser(only="serve").parse_args(cmds["head"][1].replace("<path to Llama-3.1-405B>", "/m").split()[1:])
    assert (serve.distributed_executor_backend, serve.tensor_parallel_size, serve.pipeline_parallel_size,
            serve.layer_split) == ("ray", 8, 2, "63,63")
    assert cmds["placement"] == {"node 0 (head)": ["router, scheduler[0] (no CPUs)", "stage[0.0] (GPU 8, CPU 8)"],
                                 "node 1": ["stage[0.1] (GPU 8, CPU 8)"]}
    text = stagemesh_plan("Llama-3.1-405B", "--gpus-per-node", "8", "--nodes", "2", "--gpu-memory", "80GB",
                          "--dtype", "fp16", "--distributed-executor-backend", "ray").stdout
    assert "Where Ray puts what" in text and "node 1: stage[0.1] (GPU 8, CPU 8)" in text


def test_quantised_formats_count_their_scales():
    """The default model's shape: q4_1 holds 4 bits + an fp32 scale and min per 32 (0.75 byte a weight), its
    tables Q8_0; int8 a byte a weight + an fp32 scale a row, its tables bf16."""
    from stagemesh.entry.plan.memory import Budget, evaluate, linear_rows_per_layer, param_counts

    cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                                 "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                 "vocab_size": 49152, "tie_word_embeddings": True})
    counts = param_counts(cfg)
    tables = 2 * counts.embedding + counts.final_norm  # the last stage of one holds a copy for the head
    q41 = evaluate(cfg, Budget(2**30, 1.0, "q4_1", 2048), 1, 1).weight_bytes_per_gpu
    assert q41 == int(counts.per_layer * 30 * 0.75 + tables * 1.125)
    int8 = evaluate(cfg, Budget(2**30, 1.0, "int8", 2048), 1, 1).weight_bytes_per_gpu
    assert int8 == int(counts.per_layer * 30 + tables * 2 + 4 * linear_rows_per_layer(cfg) * 30)
    bf16 = evaluate(cfg, Budget(2**30, 1.0, "bf16", 2048), 1, 1).weight_bytes_per_gpu
    assert q41 < int8 < bf16


# Decode context parallelism (DCP): each sequence's KV split over DCP of a stage's TP ranks, which saves memory only
# where TP replicates the KV heads (TP > KV heads).

def few_kv_heads(model="Llama-3.1-70B", **changes) -> dict:
    """A reference config with fewer KV heads (multi-query attention by default), as a config.json dict."""
    from stagemesh.entry.plan.cli import REFERENCE

    raw = json.loads((REFERENCE / f"{model}.json").read_text())
    return {**raw, "num_key_value_heads": 1, **changes}


def plan_cfg(raw: dict, gpus=8, nodes=1, mem=24e9, dtype="fp16", max_len=131072, **kw):
    return make_plan(PlanRequest(ModelConfig.from_dict(raw), gpus, nodes, int(mem), dtype, max_len, **kw))


def test_dcp_kv_tokens_match_a_hand_computation():
    from stagemesh.entry.plan.memory import Budget, evaluate, kv_bytes_per_token

    mqa = ModelConfig.from_dict(few_kv_heads())  # 80 layers, 1 KV head of 128
    plain = evaluate(mqa, Budget(int(24e9), 0.9, "fp16", 131072), 8, 1)
    dcp4 = evaluate(mqa, Budget(int(24e9), 0.9, "fp16", 131072), 8, 1, dcp=4)
    assert dcp4.dcp == 4 and dcp4.kv_bytes_per_gpu == plain.kv_bytes_per_gpu > 0
    # TP=8 holds the one KV head on every rank; with DCP=4 each rank holds a quarter of each sequence's tokens
    held = 80 * 1 * 128 * 2 * 2
    assert kv_bytes_per_token(mqa, 80, 8, "fp16", dcp=4) == held
    assert plain.kv_cache_tokens == plain.kv_bytes_per_gpu // held
    assert dcp4.kv_cache_tokens == plain.kv_bytes_per_gpu * 4 // held
    assert dcp4.max_concurrency == dcp4.kv_cache_tokens / 131072
    # Qwen3-235B: 4 KV heads, TP=8 replicates them 2x. DCP=2 shards them as TP=4 (1 head a rank) over 2 ranks;
    # DCP=4 as TP=2 (2 heads a rank) over 4 ranks: no more saving than DCP=2
    qwen, _ = load_config("Qwen3-235B-A22B")
    free = evaluate(qwen, Budget(int(80e9), 0.9, "bf16", 40960), 8, 1).kv_bytes_per_gpu
    assert kv_bytes_per_token(qwen, 94, 8, "bf16", dcp=4) == 94 * 2 * 128 * 2 * 2
    for dcp, heads in ((1, 1), (2, 1), (4, 2)):
        layout = evaluate(qwen, Budget(int(80e9), 0.9, "bf16", 40960), 8, 1, dcp=dcp)
        assert layout.kv_cache_tokens == free * dcp // (94 * heads * 128 * 2 * 2), dcp


def test_tree_proposes_dcp_where_tp_alone_cannot_hold_max_model_len():
    p = plan_cfg(few_kv_heads(), nodes=2)
    plain = next(c for c in p.considered if (c.tp, c.pp, c.dcp) == (8, 1, 1))
    assert plain.kv_cache_tokens < 131072  # TP=8 alone does not hold one request
    # DCP before a second node; DCP=2 does not fit, DCP=4 (the smallest that does) is chosen
    assert (p.layout.tp, p.layout.pp, p.layout.dcp, p.nodes_used) == (8, 1, 4, 1)
    assert p.layout.kv_cache_tokens >= 131072
    assert [c.dcp for c in p.considered if c.tp == 8] == [1, 2, 4]
    why = next(step for step in p.path if "DCP=4" in step and "replicates" in step)
    assert why.startswith("TP=8 replicates each of the 1 KV heads 8x; DCP=4 splits each sequence's KV over 4 ranks")
    assert "DCP=4" in p.path[-1] and p.path[-1].startswith("fits on one node")


def test_a_real_config_with_fewer_kv_heads_than_gpus_gets_dcp():
    qwen, _ = load_config("Qwen3-235B-A22B")  # 4 KV heads on 8 GPUs: replicated 2x
    from stagemesh.entry.plan.tree import dcp_sizes

    assert dcp_sizes(qwen, 8) == [2]  # DCP=4 would shard as TP=2, past the 4 KV heads: no further saving
    p = make_plan(PlanRequest(qwen, 8, 1, int(80e9), "bf16", 300000))
    assert (p.layout.tp, p.layout.dcp, p.expert_parallel) == (8, 2, True)
    assert any(step.startswith("TP=8 replicates each of the 4 KV heads 2x; DCP=2") for step in p.path)


def test_dcp_is_never_proposed_where_tp_does_not_replicate_the_kv_heads():
    from stagemesh.entry.plan.tree import dcp_sizes

    llama, _ = load_config("Llama-3.1-70B")  # 8 KV heads
    assert dcp_sizes(llama, 8) == [] and dcp_sizes(llama, 4) == []
    assert dcp_sizes(ModelConfig.from_dict(few_kv_heads()), 8) == [2, 4, 8]
    # the same memory that makes the one-KV-head model take DCP: 8 KV heads at TP=8 take a second node
    p = plan("Llama-3.1-70B", nodes=2, mem=24e9, max_len=131072)
    assert (p.layout.tp, p.layout.pp, p.nodes_used) == (8, 2, 2)
    assert all(c.dcp == 1 for c in p.considered) and not any("DCP" in step for step in p.path)
    with pytest.raises(StagemeshError, match="does not fit 8 GPUs"):
        plan("Llama-3.1-70B", mem=24e9, max_len=131072)


def test_dcp_1_keeps_the_tree_from_proposing_dcp():
    p = plan_cfg(few_kv_heads(), nodes=2, decode_context_parallel_size=1)
    assert (p.layout.tp, p.layout.pp, p.layout.dcp) == (8, 2, 1) and not any("DCP" in step for step in p.path)


def test_dcp_that_does_not_fit_either_moves_on_to_more_nodes():
    p = plan_cfg(few_kv_heads(), nodes=2, mem=20e9)
    assert (p.layout.tp, p.layout.pp, p.layout.dcp, p.nodes_used) == (8, 2, 1, 2)
    assert any("does not fit 131,072 tokens either (DCP=2: " in step and "DCP=8: " in step for step in p.path)


def test_forced_dcp_is_evaluated_and_counts_its_tokens():
    mqa = few_kv_heads()
    plain = plan_cfg(mqa, tensor_parallel_size=8).layout
    dcp8 = plan_cfg(mqa, tensor_parallel_size=8, decode_context_parallel_size=8)
    assert dcp8.layout.dcp == 8 and dcp8.layout.kv_cache_tokens == plain.kv_bytes_per_gpu * 8 // (80 * 128 * 2 * 2)
    assert dcp8.path[0].startswith("layout as asked: TP=8 x PP=1 x DCP=8:")
    # 8 KV heads at TP=8: DCP=2 is allowed (vLLM's rules hold) but saves nothing, and the path says so
    llama = plan("Llama-3.1-70B", tensor_parallel_size=8).layout
    dcp2 = plan("Llama-3.1-70B", tensor_parallel_size=8, decode_context_parallel_size=2)
    assert dcp2.layout.kv_cache_tokens == llama.kv_cache_tokens
    assert any(step.startswith("DCP=2 saves no KV memory") for step in dcp2.path)


@pytest.mark.parametrize("raw,gpus,tp,dcp,why", [
    (few_kv_heads(), 8, 8, 3, "--decode-context-parallel-size 3 does not divide --tensor-parallel-size 8"),
    (few_kv_heads(), 32, 32, 32, "--decode-context-parallel-size 32 does not divide --block-size 16"),
    # 48 heads, 4 KV heads: TP=24 is valid, TP=24 / DCP=4 = 6 splits the 4 KV heads unevenly
    (few_kv_heads(num_attention_heads=48, num_key_value_heads=4, hidden_size=6144), 24, 24, 4,
     "--decode-context-parallel-size 4 with --tensor-parallel-size 24 shards the KV heads over 6 groups, which "
     "the model cannot"),
    (few_kv_heads(), 8, None, 2, "--decode-context-parallel-size 2 needs --tensor-parallel-size"),
    (few_kv_heads(), 8, 8, 0, "--decode-context-parallel-size 0 must be at least 1"),
])
def test_forced_dcp_is_refused_where_it_cannot_run(raw, gpus, tp, dcp, why):
    with pytest.raises(StagemeshError, match=re.escape(why)):
        plan_cfg(raw, gpus=gpus, tensor_parallel_size=tp, decode_context_parallel_size=dcp)


def test_dcp_cli_flag_is_refused_with_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(few_kv_heads()))
    result = stagemesh_plan(str(tmp_path), "--gpus-per-node", "8", "-tp", "8", "-dcp", "3")
    assert result.returncode == 2
    assert "--decode-context-parallel-size 3 does not divide --tensor-parallel-size 8" in result.stderr


def test_json_and_commands_carry_the_dcp_flag(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(few_kv_heads()))
    common = (str(tmp_path), "--gpus-per-node", "8", "--gpu-memory", "24GB", "--dtype", "fp16",
              "--max-model-len", "131072")
    out = json.loads(stagemesh_plan(*common, "--json").stdout)
    assert out["decode_context_parallel_size"] == 4 and out["tensor_parallel_size"] == 8
    assert "--tensor-parallel-size 8 --decode-context-parallel-size 4 " in out["commands"]["serve"]
    assert out["kv_cache_tokens"] == out["kv_cache_bytes_per_gpu"] * 4 // (80 * 1 * 128 * 2 * 2)
    text = stagemesh_plan(*common).stdout
    assert re.search(r"TP=8 PP=1 DCP=4 .* <- chosen", text) and text.count("<- chosen") == 1
    assert "--decode-context-parallel-size 4" in text
    # several nodes: every stage command (mp), and the Ray backend's serve command
    forced = ("--nodes", "2", "-tp", "8", "-pp", "2", "-dcp", "8", "--json")
    cmds = json.loads(stagemesh_plan(*common, *forced).stdout)["commands"]
    stages = [c for c in cmds["head"] + cmds["workers"]["node 1"] if c.startswith("stagemesh stage")]
    assert len(stages) == 2 and all("--tensor-parallel-size 8 --decode-context-parallel-size 8 " in c
                                    for c in stages)
    ray = json.loads(stagemesh_plan(*common, *forced, "--distributed-executor-backend", "ray").stdout)["commands"]
    assert "--tensor-parallel-size 8 --decode-context-parallel-size 8 " in ray["head"][1]
    # no DCP: the key says 1 and no command has the flag
    plain = json.loads(stagemesh_plan("Llama-3.1-70B", "--gpus-per-node", "8", "--json").stdout)
    assert plain["decode_context_parallel_size"] == 1 and "decode-context" not in plain["commands"]["serve"]


def test_a_gemma3_plan_counts_the_hybrid_kv_cache_managers_tokens(tmp_path):
    """Gemma-3-27B's layout (62 layers, 10 global, a window of 1024): a block holds 10 layers, not 62, so the same
    free memory holds about 6x the tokens of an all-global count, and the plan's line per token says why."""
    from stagemesh.entry.plan.memory import Budget, evaluate, kv_bytes_per_token

    kinds = [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(62)]
    raw = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=5376,
               intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
               head_dim=128, vocab_size=262208, sliding_window=1024, layer_types=kinds, max_position_embeddings=131072,
               query_pre_attn_scalar=168, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_path(tmp_path)
    layout = evaluate(cfg, Budget(int(141e9), 0.9, "bf16", 131072), 1, 1)
    all_global = layout.kv_bytes_per_gpu // kv_bytes_per_token(cfg, 62, 1, "bf16")
    assert 5.5 * all_global < layout.kv_cache_tokens < 6.2 * all_global, (layout.kv_cache_tokens, all_global)
    assert layout.max_concurrency > 5 * all_global / 131072
    out = stagemesh_plan(str(tmp_path), "--gpus-per-node", "1", "--gpu-memory", "141GB", "--max-model-len", "131072")
    assert out.returncode == 0, out.stderr
    assert "past the sliding window of 1024 tokens a token stays in 10 of the 62 layers" in out.stdout

"""Tiny random-weight models of every supported architecture, for tests.

Built from transformers configs and saved as safetensors, so that the
reference (transformers) and stagemesh read the very same weights.
"""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
DEEPSEEK_ARCHS = ("deepseek_v3", "deepseek_v2")  # multi-head latent attention (tests/test_deepseek.py)
# the size of every tiny model (a family's test may build its own config from it: save_random_model)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=384, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_config(arch: str = "llama", **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = TINY
    if arch == "llama":
        cls, extra = LlamaConfig, {}
    elif arch == "llama3":
        cls, extra = LlamaConfig, dict(rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif arch == "mistral":
        cls, extra = MistralConfig, dict(sliding_window=None)
    elif arch == "qwen2":
        cls, extra = Qwen2Config, dict(use_sliding_window=False)
    elif arch == "qwen3":
        cls, extra = Qwen3Config, dict(head_dim=32, use_sliding_window=False)
    # mixtures of experts: 8 experts, top-2, each with the model's own routing rule
    elif arch == "mixtral":  # softmax, top-2, always renormalised
        cls, extra = MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                         sliding_window=None)
    elif arch == "qwen2_moe":  # QKV bias, no renormalisation, a shared expert behind a sigmoid gate
        cls, extra = Qwen2MoeConfig, dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, norm_topk_prob=False,
                                          use_sliding_window=False)
    elif arch == "qwen3_moe":  # q/k norm, renormalised top-k
        cls, extra = Qwen3MoeConfig, dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          norm_topk_prob=True, use_sliding_window=False)
    elif arch in DEEPSEEK_ARCHS:
        cls, extra = _deepseek(arch)
    else:
        raise ValueError(arch)
    return cls(**{**common, **extra, **overrides})


def _deepseek(arch: str):
    """DeepSeek-V3: a dense first layer, then 8 routed experts in 2 groups (a token's top-2 from its best group,
    sigmoid scores, the correction bias), a shared expert, q and kv through their LoRA ranks, YaRN (both mscales:
    cos and sin scaled, and the softmax). V2-Lite: q straight from the hidden states, a softmax gate, two shared
    experts. v_head_dim differs from qk_nope_head_dim to catch one taken for the other."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    mla = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
               moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                                "beta_slow": 1, "original_max_position_embeddings": 128, "mscale": 1.0,
                                "mscale_all_dim": 0.707})
    if arch == "deepseek_v3":
        return DeepseekV3Config, dict(mla, q_lora_rank=48, n_group=2, topk_group=1, n_shared_experts=1,
                                      routed_scaling_factor=2.5, norm_topk_prob=True)
    return DeepseekV2Config, dict(mla, q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
                                  routed_scaling_factor=1.0)


def make_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, sharded: bool = False,
                    **overrides) -> Path:
    """Save a tiny random model of `arch` in `path` and return the path."""
    return save_random_model(path, tiny_config(arch, **overrides), seed, sharded)


def save_random_model(path: str | Path, config, seed: int = 0, sharded: bool = False) -> Path:
    """Save a random model of a transformers config in `path` (safetensors) and return the path."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so layers matter
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            else:
                p.uniform_(0.8, 1.2)
        for name, b in model.named_buffers():  # DeepSeek-V3's gate bias (zeros as transformers makes it)
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB" if sharded else "10GB")
    return path


def reference_model(path: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits of each generated position (no cache: exact)."""
    ids = list(prompt)
    logits = []
    for _ in range(max_new_tokens):
        out = model(torch.tensor([ids])).logits[0, -1]
        logits.append(out)
        ids.append(int(out.argmax()))
    return ids[len(prompt):], torch.stack(logits)


@torch.inference_mode()
def reference_tokens(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens through its own generate (KV-cached: several times faster than
    reference_greedy, for tests that check tokens, not logits), never stopping at EOS."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# Where greedy_tokens keeps what it computed: one directory for the run, which its pytest-xdist workers share
# (tests/conftest.py sets it); None: computed on every call.
REFERENCES: Path | None = None


def greedy_tokens(model_dir: str | Path, batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """reference_tokens of each prompt of `batch` on the model in `model_dir`, computed once per run whichever test
    or worker asks for them: kept (in REFERENCES) under the bytes of the model's config and weights, the torch and
    transformers versions, and the prompt; a shorter ask gets the first tokens of a longer one (greedy decoding's
    first n tokens do not depend on how many follow)."""
    import hashlib
    import json
    import os

    import transformers

    if REFERENCES is None:
        ref = reference_model(model_dir)
        return [reference_tokens(ref, p, max_new_tokens) for p in batch]
    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for f in sorted(Path(model_dir).iterdir()):
        if f.name == "config.json" or f.suffix == ".safetensors":
            digest.update(f.name.encode() + f.read_bytes())
    model_key, ref, out = digest.hexdigest(), None, []
    REFERENCES.mkdir(parents=True, exist_ok=True)
    for prompt in batch:
        path = REFERENCES / (hashlib.sha256(f"{model_key} {prompt}".encode()).hexdigest() + ".json")
        known = json.loads(path.read_text()) if path.exists() else []
        if len(known) < max_new_tokens:
            if ref is None:  # (loaded once, for the first prompt not known yet)
                ref = reference_model(model_dir)
            known = reference_tokens(ref, prompt, max_new_tokens)
            path.with_name(f"{path.name}.{os.getpid()}").write_text(json.dumps(known))
            os.replace(path.with_name(f"{path.name}.{os.getpid()}"), path)  # (a reader never sees half of it)
        out.append(known[:max_new_tokens])
    return out


def with_word_tokenizer(model_dir: str | Path, target: str | Path, vocab_size: int = 384) -> Path:
    """A copy of a tiny model directory plus a word-level tokenizer ("w5 w6" -> [5, 6]) and a chat template."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = Path(target)
    shutil.copytree(model_dir, target, dirs_exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(target)
    return target


def first_layers(model_dir: str | Path, target: str | Path, num_layers: int) -> Path:
    """A model of the first `num_layers` layers of `model_dir`, with its embeddings, final norm and LM head:
    a cheap draft model that shares the tokenizer (speculative decoding)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source, target = Path(model_dir), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, target / f.name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (target / "config.json").write_text(json.dumps(config))
    tensors = {}
    for f in source.glob("*.safetensors"):
        for name, t in load_file(f).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers:
                tensors[name] = t
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def with_mtp_layer(model_dir: str | Path, target: str | Path, copy_of: int | None = None, seed: int = 0) -> Path:
    """A copy of a tiny DeepSeek-V3 with a multi-token-prediction layer, model.layers.{num_hidden_layers}, as the
    V3 checkpoint holds it (enorm, hnorm, eh_proj, a decoder layer, shared_head's norm and head, its embedding).
    copy_of: the MTP layer copies the main path: decoder layer `copy_of`'s weights, eh_proj passing the token's
    embedding through, the final norm and LM head; the embedding rows scaled to an RMS of 1 (so that enorm, whose
    weight is 1, leaves them as the main path sees them). With one layer (copy_of 0) its drafts are close to the
    model's own next tokens. Else random weights."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source, target = Path(model_dir), Path(target)
    shutil.copytree(source, target, dirs_exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    files = sorted(target.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{n}"
    if copy_of is not None:
        embed = tensors["model.embed_tokens.weight"]
        tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
        layer = f"model.layers.{copy_of}."
        tensors.update({f"{prefix}.{k[len(layer):]}": v.clone() for k, v in tensors.items() if k.startswith(layer)})
        eh_proj = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
        norms = torch.ones(h), torch.ones(h), tensors["model.norm.weight"].clone()
    else:
        layer = f"model.layers.{n - 1}."
        tensors.update({f"{prefix}.{k[len(layer):]}": torch.randn(v.shape, generator=g) * 0.08 if "norm" not in k
                        else v.clone() for k, v in tensors.items() if k.startswith(layer)})
        eh_proj = torch.randn(h, 2 * h, generator=g) * 0.08
        norms = torch.ones(h), torch.ones(h), torch.ones(h)
    tensors.update({f"{prefix}.enorm.weight": norms[0], f"{prefix}.hnorm.weight": norms[1],
                    f"{prefix}.eh_proj.weight": eh_proj, f"{prefix}.shared_head.norm.weight": norms[2],
                    f"{prefix}.shared_head.head.weight": tensors["lm_head.weight"].clone(),
                    f"{prefix}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    for f in files:
        f.unlink()
    (target / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, target / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (target / "config.json").write_text(json.dumps(config))
    return target

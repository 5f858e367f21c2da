"""No checkpoint tensor is left unread: a tensor the stage's loaders did not read is a format stagemesh does
not understand (an fp8 scale, a GPTQ qweight, an adapter), and serving without it answers garbage. Each stage
checks the tensors that are its own: those of its layers (a rank holding some experts: of those), its
embeddings (first stage) or its norm and LM head (last stage); the first stage also checks those no stage
reads (another model part, layers past num_hidden_layers but a multi-token-prediction layer's)."""
from __future__ import annotations

import re

from stagemesh.core.errors import StagemeshError
from stage_worker.moe import SparseMoeBlock

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.\w+)\.experts\.(\d+)\.")
# transformers recomputes these from the config and drops them from old checkpoints, as stagemesh does
IGNORED = (".rotary_emb.inv_freq",)


def check_all_read(names, read: set[str], model) -> None:
    """Refuse, naming them, the tensors of `names` (the checkpoint's) this stage should have read and did not."""
    held = {m.block: set(m.placement.slots) for m in model.modules() if isinstance(m, SparseMoeBlock)}
    unread = sorted(n for n in names if n not in read and not n.endswith(IGNORED) and _mine(n, model, held))
    if unread:
        more = f" and {len(unread) - 6} more" if len(unread) > 6 else ""
        raise StagemeshError(f"the checkpoint has tensors stagemesh does not read: {', '.join(unread[:6])}{more}. "
                             "A checkpoint loads only when every tensor is understood (a quantised format needs its "
                             "quantization_config, and a method stagemesh builds)")


def _mine(name: str, model, held: dict[str, set[int]]) -> bool:
    layer = _LAYER.match(name)
    cfg = model.cfg
    if layer is None:
        if name.startswith("model.embed_tokens."):
            return model.is_first
        if name.startswith(("model.norm.", "lm_head.")):
            # a tied LM head is the embedding: transformers ignores a saved lm_head.weight then, as stagemesh does
            return model.is_last and not (cfg.tie_word_embeddings and name == "lm_head.weight")
        return model.is_first
    index = int(layer.group(1))
    if index >= cfg.num_hidden_layers:
        # a multi-token-prediction layer (DeepSeek-V3's) is read by its drafter alone, when speculation asks for it
        # (stage_worker.mtp), and is no model part otherwise, as vLLM skips it
        key = cfg.family.mtp_layers
        return model.is_first and not (key and index < cfg.num_hidden_layers + int(cfg.raw.get(key) or 0))
    if not model.layer_start <= index < model.layer_end:
        return False
    expert = _EXPERT.match(name)
    return expert is None or expert.group(1) not in held or int(expert.group(2)) in held[expert.group(1)]

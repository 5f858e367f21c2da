"""`stagemesh generate`: answer one prompt in-process with the chat template, no mesh.

Handy to check a model directory before serving it, and the reference path
the mesh is compared with.
"""
from __future__ import annotations

import argparse
import os

from stagemesh.core.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", default="What is the capital of France?", help="the user message")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--layer-split", default=None, help="run as chained stages, e.g. 10,12,8")
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    parser.add_argument("--dtype", default=None, help="auto, float32, bfloat16")
    from stagemesh.core.common_flags import ModelOptions
    from stagemesh.core.flags import add_flags

    add_flags(parser, ModelOptions, ("model",))  # (--tokenizer, --quantization; its MODEL is its own)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from stagemesh.core.model_config import ModelConfig, parse_layer_split
    from stagemesh.core.model_source import resolve_source

    source = resolve_source(args.model, args.tokenizer, args.quantization, args.quantization_activations)
    model_dir = source.model_dir
    cfg = ModelConfig.from_path(model_dir)  # fails early, with one line, on a bad directory
    split = None
    if args.layer_split:
        split = parse_layer_split(args.layer_split, cfg.num_hidden_layers, len(args.layer_split.split(",")))
    from transformers import AutoTokenizer

    from stagemesh.entry.local_engine import LocalEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.no_chat_template or not tokenizer.chat_template:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "user", "content": args.prompt}]
        # (transformers types the result as str or lists; with return_dict=True it is a BatchEncoding)
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,  # type: ignore[call-overload]
                                                   return_dict=True)["input_ids"]  # type: ignore[index]
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                              max_tokens=args.max_tokens)
    gguf = str(source.gguf_file) if source.gguf_file else None
    with LocalEngine.of(model_dir, layer_split=split, dtype=args.dtype, quantization=source.quantization,
                        quantization_activations=source.activations, gguf_file=gguf) as engine:
        [tokens] = engine.generate([list(prompt_ids)], sampling)
    print(tokenizer.decode(tokens, skip_special_tokens=True))
    return 0

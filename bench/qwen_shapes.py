"""Qwen2.5-1.5B's exact architecture with random weights, for benchmarks on machines that cannot download it.

QWEN25_15B holds the architecture fields of Qwen2.5-1.5B's config.json (Qwen2ForCausalLM, QKV bias built in; the
Instruct checkpoint's config.json has the same values). The tokenizer is tests/tiny.py's ChatML byte-level BPE:
its 400 ids all lie below the 151,936-row vocabulary, so a random model can read and emit them, and it has a chat
template; completions of a random model are noise that never ends in EOS, so they run to the full length.

    python bench/qwen_shapes.py OUT_DIR [--dtype bf16] [--tiny]   # config + random weights + tokenizer, by path
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN25_15B = {  # Qwen/Qwen2.5-1.5B config.json, architecture only (weights are random)
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "max_window_layers": 21,  # unused without sliding-window attention; kept as the checkpoint states it
}
# Same fields cut down, for dry runs on a CPU (the code path, not the cost).
TINY = QWEN25_15B | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def build_random_qwen(
    config: dict = QWEN25_15B, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0
):
    """(Qwen2ForCausalLM with `config` and random weights, ChatML tokenizer), eos/pad set in config and generation
    config as a real checkpoint has them."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    cfg = Qwen2Config(**config, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise where it will run: no second full-size copy
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def write_random_qwen(out_dir: str, config: dict = QWEN25_15B, dtype: torch.dtype = torch.bfloat16) -> str:
    """Save a random model with `config` and its tokenizer to out_dir (load it with --model out_dir)."""
    model, tokenizer = build_random_qwen(config, dtype)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="stored dtype (bf16: 3.1 GB)")
    parser.add_argument("--tiny", action="store_true", help="the cut-down TINY shapes (dry runs)")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    path = write_random_qwen(args.out_dir, TINY if args.tiny else QWEN25_15B, dtype)
    print(f"random {'tiny' if args.tiny else 'Qwen2.5-1.5B'}-shaped model and tokenizer in {path}")


if __name__ == "__main__":
    main()

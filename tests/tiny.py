"""Build a tiny random Qwen2-architecture model and a ChatML byte-level BPE tokenizer in-process (no hub).

Used by the tests' fixtures and by bench/; `python -m tests.tiny OUT_DIR` writes one to disk.
"""

import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - * / = #### ?",
    "user assistant system: What is 12 plus 7? The answer is 19. Tom has 3 apples and buys 4 more.",
    "Question Answer yes no good bad red blue green hello world <think> </think> <answer> </answer>",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!'\"()[]{}\n\t",
]


def build_tokenizer(vocab_size: int = 400, pad_is_eos: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few lines; every byte is in the alphabet, so any text round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    # Qwen's instruct convention: eos = <|im_end|>, pad = <|endoftext|>; pad_is_eos exercises the pad == eos case.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>" if pad_is_eos else "<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(
    vocab_size: int, hidden: int = 64, layers: int = 2, seed: int = 0, **overrides
) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return Qwen2ForCausalLM(Qwen2Config(**cfg)).float()


def write_tiny(out_dir, pad_is_eos: bool = False, **model_kwargs) -> str:
    """Save tokenizer + model to out_dir (loadable with from_pretrained(out_dir)); returns the path as str."""
    tokenizer = build_tokenizer(pad_is_eos=pad_is_eos)
    model = build_tiny_model(len(tokenizer), **model_kwargs)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return str(out_dir)


if __name__ == "__main__":
    print(write_tiny(sys.argv[1]))


def write_learnable(out_dir, low: int = 200) -> str:
    """The tiny model with a head that scores token v by +-(h . u) (+ for ids < low): a reward on the share of low-id
    tokens is then one direction of the final hidden state, which LoRA learns in a few steps. With the random head
    the reachable logit gap between the two halves of the vocabulary is ~0.1 nats, so no reward on it could rise."""
    from transformers import AutoModelForCausalLM

    path = write_tiny(out_dir)
    model = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    vocab, hidden = model.lm_head.weight.shape
    sign = torch.where(torch.arange(vocab) < low, 1.0, -1.0)
    with torch.no_grad():
        model.lm_head.weight.copy_(
            sign[:, None] * torch.randn(hidden, generator=g) * 0.05 + 0.02 * torch.randn(vocab, hidden, generator=g)
        )
    model.save_pretrained(path)
    return path

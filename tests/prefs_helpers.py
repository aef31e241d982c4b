"""Shared by test_dpo.py, test_orpo.py and test_kto.py: tiny data files, an "SFT" adapter, weight checks, a fake
model for calling TRL's loss code without a trainer, and the CLI runner."""

import json
import os
import sys
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from tests import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def preference_rows(n=16, chosen="yes it is good", rejected="no it is bad"):
    """Separable conversational pairs: the same chosen/rejected wording under n different prompts."""
    return [
        {
            "prompt": [{"role": "user", "content": f"Question {i}: is {7 * i + 3} good?"}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }
        for i in range(n)
    ]


def binary_rows(n=16):
    """Alternating desirable / undesirable completions (so every batch of 2+ consecutive rows has both)."""
    return [
        {
            "prompt": [{"role": "user", "content": f"Question {i}: is {7 * i + 3} good?"}],
            "completion": [{"role": "assistant", "content": "yes it is good" if i % 2 == 0 else "no it is bad"}],
            "label": i % 2 == 0,
        }
        for i in range(n)
    ]


def make_sft_adapter(model_dir, out_dir) -> dict:
    """A LoRA adapter with non-zero B (so it is NOT the base model), saved as sft.py's final/; returns its tensors."""
    from transformers import AutoModelForCausalLM

    from common.model import attach_lora

    torch.manual_seed(123)
    model = attach_lora(AutoModelForCausalLM.from_pretrained(model_dir))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(str(out_dir))
    return load_file(os.path.join(out_dir, "adapter_model.safetensors"))


def slot_state(model, slot):
    """One adapter slot's tensors under the names PEFT saves them with (slot name removed)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=slot).items()}


def assert_base_untouched(model, model_dir):
    """Every non-LoRA weight bit-identical to the checkpoint on disk."""
    from transformers import AutoModelForCausalLM

    fresh = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    base = {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): p
        for n, p in model.named_parameters()
        if "lora_" not in n
    }
    assert base.keys() == fresh.keys()
    for key, p in base.items():
        assert torch.equal(p.detach().cpu(), fresh[key].detach()), f"base weight {key} changed"


def assert_adapters(model, start: dict, with_ref: bool = True):
    """'ref' is bit-identical to the starting adapter (when present), 'default' has moved away from it."""
    default = slot_state(model, "default")
    assert default.keys() == start.keys()
    assert any(not torch.equal(default[k], start[k]) for k in start), "'default' adapter did not change"
    if with_ref:
        ref = slot_state(model, "ref")
        assert all(torch.equal(ref[k], start[k]) for k in start), "'ref' adapter changed"
    else:
        assert "ref" not in model.peft_config


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_logged(out, keys):
    """Every key in the returned dict and in every line of run_dir/metrics.jsonl, with finite values."""
    lines = read_metrics(out["run_dir"])
    assert len(lines) == len(out["history"])
    for key in keys:
        assert key in out, f"{key} missing from main()'s result"
        assert torch.isfinite(torch.tensor(out[key])), f"{key} = {out[key]}"
        assert all(key in line for line in lines), f"{key} missing from metrics.jsonl"


class FakeLM:
    """Stands in for the model inside TRL's _compute_loss: row r's summed log-prob is table[input_ids[r, 0]], put on
    the first predicted position (the rest 0), so TRL's own sums recover exactly the values under test."""

    training = True

    def __init__(self, table):
        self.table = table

    def __call__(self, input_ids, labels=None, **kwargs):
        zeros = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
        log_probs = zeros.clone()
        log_probs[:, 0] = self.table[input_ids[:, 0]]
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def fake_accelerator():
    same = lambda x: x  # noqa: E731  (one process: gather is the identity)
    return SimpleNamespace(device=torch.device("cpu"), gather=same, gather_for_metrics=same, unwrap_model=same)


def rows_with_lengths(first_ids, lengths, width):
    """input_ids whose first token is the table index, and a completion mask of the given lengths, (N, width)."""
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    input_ids[:, 0] = torch.as_tensor(first_ids)
    completion_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        completion_mask[i, 1 : 1 + n] = 1
    return input_ids, torch.ones_like(input_ids), completion_mask


def hf_chosen_nll(model_dir, data, batch_size, seed, concat_pairs, micro_batch, completion_only=True) -> float:
    """transformers' own cross-entropy on the chosen rows of a script's first micro-batch (the step-1 policy of a fresh
    LoRA is the base model): labels on the response, or on every real token with completion_only=False."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.data import load_rows, setup_chat_template
    from common.completions import tokenize_dataset, validate_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    setup_chat_template(tokenizer, "auto")  # as the scripts do
    examples = tokenize_dataset(tokenizer, validate_rows(load_rows(data), "preference"), "preference", 64)
    chunk = micro_batch(examples, 0, batch_size, seed)
    batch = {k: v[:batch_size] for k, v in concat_pairs(chunk, tokenizer.pad_token_id, "cpu").items()}  # chosen
    keep = batch["completion_mask"] if completion_only else batch["attention_mask"]
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir)(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["input_ids"].masked_fill(keep == 0, -100),
        ).loss.item()


def run_cli(script, *args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli.run(
        [sys.executable, script, *map(str, args)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout
    )

"""Merge a LoRA adapter into its base model: a plain transformers folder for serving (vLLM, llama.cpp's converter, TGI)
or the hub. Writes model.safetensors, config.json, generation_config.json and the tokenizer (with the chat template
the adapter was trained with), and checks that the merged model's logits match the adapter model's before saving.

Run: `python scripts/merge_adapter.py --adapter runs/grpo__smollm2-135m__42__<time>/final`
     `python scripts/merge_adapter.py --adapter runs/<run>/final --push-to-hub <user>/<name>` (needs a token:
     `hf auth login` or HF_TOKEN)
The base is --model, else the adapter's own base_model_name_or_path (a hub id, a local folder, or an alias such as
smollm2-135m, located through harness.hub like every script's --model). Then
`AutoModelForCausalLM.from_pretrained("merged/<run>")` loads it with no PEFT installed.
"""

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # common/ is at the repo root

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, None)

import torch
import tyro

from common.data import setup_chat_template
from common.errors import ArgsError, ModelError
from common.model import attach_lora, load_model
from harness.checkpoints import stop_at_end_of_turn, whole_dir, writing
from harness.cli import check_adapter_weights, one_line_errors
from harness.hub import locate_model, note_other_base, read_adapter_config
from scripts.gguf_export import check_exportable, check_gguf, pre_tokenizer_name, rounding_tolerance, write_gguf

PROMPT = [{"role": "user", "content": "What is 12 plus 7? Answer in one line."}]
# what a served model's tokenizer must split exactly as the trained one: chat turns, digits, spaces, non-ASCII
TOKENIZER_TEXTS = [
    "<|im_start|>user\nWhat is 12 plus 7? Answer in one line.<|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n",
    "Tom has 3,456 apples   and buys 78.9 more; how many now?\n\n  Indented line\ttab",
    "Café naïve 東京 — emoji 🙂 done.",
]


@dataclass
class Args:
    adapter: str  # a PEFT adapter folder (a run's final/, or checkpoints/step-N/weights)
    # the base model: hub id, local path or alias; default: the adapter's recorded base_model_name_or_path
    model: str | None = None
    out: str | None = None  # output folder; default merged/<run name>
    # dtype to load, merge and save in (fp32: the merge adds no rounding of its own)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # largest |logit difference| allowed between the adapter model and the merged one on a test prompt; default: what
    # rounding alone stays under, 64 x eps(--dtype) x max|logit| x sqrt(layers) (the two compute the same sums in
    # another order, each rounded in --dtype)
    tolerance: float | None = None
    # also write <out>/model-<f16|q8_0>.gguf for llama.cpp and Ollama (llama and qwen2 models), checked by loading it
    # back through transformers
    gguf: Literal["f16", "q8_0"] | None = None
    push_to_hub: str | None = None  # also upload the folder to this hub repo (user/name), created if missing
    private: bool = False  # with --push-to-hub: create the repo private


def hub_token() -> str:
    """The saved or HF_TOKEN token, or a one-line error before any model is loaded (import-safe offline)."""
    from huggingface_hub import get_token

    if not (token := get_token()):
        raise PermissionError("--push-to-hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN")
    return token


def run_tokenizer(adapter: str, base_tokenizer):
    """The tokenizer (chat template, end-of-turn eos) the adapter trained with: saved beside it (a run's final/), else
    the base's with the run's --template from args.json (a checkpoints/step-N/weights folder has no tokenizer)."""
    if os.path.isfile(os.path.join(adapter, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(adapter)
    run_args = os.path.join(adapter, "..", "..", "..", "args.json")  # <run>/checkpoints/step-N/weights
    if os.path.isfile(run_args):
        with open(run_args) as f:
            setup_chat_template(base_tokenizer, json.load(f).get("template", "auto"))
    return base_tokenizer


def merge(adapter: str, model: str | None = None, dtype: str = "fp32"):
    """(merged transformers model, tokenizer, max |logit diff| against the unmerged adapter model on PROMPT, the
    difference that rounding in `dtype` alone stays under on those logits: rounding_tolerance)."""
    config_path = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(config_path) and os.path.isfile(os.path.join(adapter, "config.json")):
        raise ArgsError(f"--adapter {adapter}: a full model (config.json, no adapter_config.json), nothing to merge")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"--adapter {adapter}: no adapter_config.json there (expected a PEFT adapter dir)")
    base = model or read_adapter_config(config_path, "--adapter").get("base_model_name_or_path")
    check_adapter_weights(adapter, "--adapter")  # a NaN or a truncated file named before anything loads
    if not base:
        raise ArgsError(f"{config_path} names no base model: give --model")
    note_other_base(adapter, base)
    policy, tokenizer = load_model(base, dtype, path=locate_model(base))
    tokenizer = run_tokenizer(adapter, tokenizer)
    policy = attach_lora(policy, adapter).eval()  # PEFT loads the "default" adapter; a saved "ref" is ignored
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ].to(policy.device)
    with torch.no_grad():
        before = policy(ids).logits.float()
        merged = policy.merge_and_unload()  # W <- W + scale * B @ A in each targeted layer; the LoRA modules go
        diff = (merged(ids).logits.float() - before).abs().max().item()
    # x (W + s B A)^T and x W^T + s (x A^T) B^T are the same sums in another order, each product and sum rounded in
    # the compute dtype, in every layer: the gap scales with that dtype's eps, the logits' size and the depth.
    step = torch.finfo(merged.dtype).eps
    return merged, tokenizer, diff, rounding_tolerance(before, step, merged.config.num_hidden_layers)


def export_gguf(model, tokenizer, out: str, kind: str) -> dict:
    """Write out/model-<kind>.gguf through a temp folder beside it, load it back and compare: the file appears whole
    and checked, or not at all, and the merged folder is kept either way."""
    filename = f"model-{kind}.gguf"
    tmp = tempfile.mkdtemp(prefix=".gguf-tmp-", dir=out)
    with writing(tmp, filename, f"{out} (the merged model, kept)"):
        write_gguf(model, tokenizer, os.path.join(tmp, filename), kind, os.path.basename(os.path.abspath(out)))
        ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        diff, tolerance = check_gguf(tmp, filename, model, tokenizer, ids["input_ids"], kind, TOKENIZER_TEXTS)
        if not diff <= tolerance:
            raise ModelError(
                f"{filename}: its logits (read back through transformers) differ from the merged model's by "
                f"{diff:.3g} > {tolerance:.3g}, more than {kind} rounding explains; not written"
            )
    os.replace(os.path.join(tmp, filename), os.path.join(out, filename))
    shutil.rmtree(tmp)
    print(f"merge_adapter: wrote {os.path.join(out, filename)} (max |logit diff| vs the merged model {diff:.2g})")
    return {"gguf": os.path.join(out, filename), "gguf_max_logit_diff": diff}


def main(args: Args) -> dict:
    # ---- 1 inputs: a push without a token fails here, before minutes of loading
    token = hub_token() if args.push_to_hub else None
    out = args.out or os.path.join("merged", os.path.basename(os.path.dirname(os.path.abspath(args.adapter))))

    # ---- 2 merge and check against the adapter model (and that a --gguf export covers this model)
    model, tokenizer, diff, auto_tolerance = merge(args.adapter, args.model, args.dtype)
    tolerance = auto_tolerance if args.tolerance is None else args.tolerance
    if args.gguf:
        check_exportable(model.config)  # refused by name before anything is written
        pre_tokenizer_name(tokenizer)
    if not diff <= tolerance:
        raise ModelError(
            f"merged logits differ from the adapter model's by {diff:.3g} > --tolerance {tolerance:.3g}; nothing "
            f"written. Rounding in {args.dtype} stays under {auto_tolerance:.3g} on these logits, so the merge "
            "changed the model: check that --model is the base the adapter was trained on, or pass a larger "
            "--tolerance to save it anyway"
        )

    # ---- 3 save a plain transformers folder (and a GGUF file; and upload them)
    stop_at_end_of_turn(model, tokenizer)  # or generate() on the merged model runs on past every answer
    with whole_dir(out, out) as tmp:  # renamed into place whole: a full disk leaves no folder that looks complete
        model.save_pretrained(tmp, safe_serialization=True)  # config.json, generation_config.json, model.safetensors
        tokenizer.save_pretrained(tmp)
    print(f"merge_adapter: {args.adapter} -> {out} (max |logit diff| vs the adapter model {diff:.2g})")
    result = {"out": out, "max_logit_diff": diff, "tolerance": tolerance}
    if args.gguf:
        result |= export_gguf(model, tokenizer, out, args.gguf)
    if args.push_to_hub:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(args.push_to_hub, private=args.private, exist_ok=True)
        api.upload_folder(folder_path=out, repo_id=args.push_to_hub, commit_message=f"merged {args.adapter}")
        print(f"merge_adapter: uploaded to https://huggingface.co/{args.push_to_hub}")
    return result


if __name__ == "__main__":
    with one_line_errors():  # a missing input or a bad setting: one line, no traceback
        main(tyro.cli(Args))

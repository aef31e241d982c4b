"""A reward model on a causal LM: LoRA on the backbone (or the whole backbone trained) + a linear head (K outputs) on
the final hidden state of each sequence's last real token. The reward-model trainer writes one to its final/: the PEFT
adapter (or, trained with --no-use-lora, the full causal LM as transformers saves it), HEAD_FILE
{"weight": (K, hidden)}, the tokenizer and CONFIG_FILE {"base_model", "loss_type": "bradley_terry" | "regression",
"attributes": [K names], "quantization", "max_length"} (the last two: how it was trained; a directory written
before them scores without a cut).

`load_reward(dir, policy)` puts the adapter into a third slot "reward" of a policy on the same base (no second
backbone; scoring runs under as_reference(model, "reward")), else loads the base once more (a full model: always,
frozen and in eval mode); `score` -> (N, K).
`model_reward` reads a `--rewards model:<dir>[@attribute][:weight]` spec (pass it to common.rewards.load_reward_funcs
as loaders={"model": model_reward}); `label_rows` writes the scores into rows' `attributes` (SteerLM labelling).
"""

import hashlib
import json
import math
import os
import warnings

import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import FSDPModule
from transformers import AutoTokenizer

from common.completions import collate_sft, tokenize_sft
from common.errors import ArgsError, DataError, ModelError
from common.distributed import reshard
from common.model import REWARD, as_reference, decoder_hidden, is_peft, load_model, pick_device, resolve_dtype
from common.model import unwrap
from common.rewards import split_weight
from harness.checkpoints import adapter_hash, all_finite
from harness.cli import check_adapter_weights
from harness.hub import same_base
from harness.memory import lora_params, model_config, weight_bytes
from plugins.embedded import resolve_model
from plugins.quantization import bnb_config

HEAD_FILE = "reward_head.safetensors"
CONFIG_FILE = "reward_config.json"


def reward_logits(model, head, input_ids, attention_mask, right_padded: bool = False):
    """(B, K) = head(h), h = the backbone's final hidden state at each row's last real token: the mask's last 1, so
    right or left padding (not from pad ids: transformers' *ForSequenceClassification looks for the last token !=
    pad_token_id, which is wrong when pad == eos). The LM head (B x T x vocab) is never computed. right_padded (the
    caller's rows, collate_sft's and concat_pairs'): under the causal mask a last real token sees no pad, so the
    backbone runs without the padding mask (SDPA's causal path; transformers reads no mask values on the host)."""
    lm = unwrap(model)
    inputs = dict(input_ids=input_ids, attention_mask=None if right_padded else attention_mask, use_cache=False)
    if isinstance(lm, FSDPModule):  # sharded by FSDP2: the root's own forward gathers its weights (the head's too)
        hidden = decoder_hidden(lm, inputs)
    else:
        hidden = getattr(lm, lm.base_model_prefix)(**inputs).last_hidden_state
    last = (torch.arange(attention_mask.shape[1], device=attention_mask.device) * attention_mask).argmax(1)  # (B,)
    rewards = head(hidden[torch.arange(len(last), device=last.device), last].to(head.weight.dtype))
    if isinstance(lm, FSDPModule) and not torch.is_grad_enabled():
        reshard(lm)  # no backward will reshard the root: its gathered weights would go stale at the next update
    return rewards


def save_reward(final_dir, head, base_model, loss_type, attributes: list[str], quantization=None, max_length=None):
    """The head and reward_config.json next to the adapter save_final wrote; `quantization` is the base's as trained
    (None, "4bit", "8bit"): a model loaded apart is loaded so, and a policy base quantized otherwise is named;
    `max_length` is training's: score_rows cuts a row where training did."""
    save_file({"weight": head.weight.detach().float().cpu().contiguous()}, os.path.join(final_dir, HEAD_FILE))
    config = {"base_model": base_model, "loss_type": loss_type, "attributes": list(attributes)}
    with open(os.path.join(final_dir, CONFIG_FILE), "w") as f:
        json.dump(config | {"quantization": quantization, "max_length": max_length}, f, indent=2)


def is_full_model(path: str) -> bool:
    """A reward model trained with --no-use-lora: its folder holds the whole causal LM, no adapter."""
    return not os.path.isfile(os.path.join(path, "adapter_config.json"))


def model_files(path: str) -> list[str]:
    """A full reward model's weight files (the head's own file left out)."""
    return [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".safetensors") and n != HEAD_FILE]


def check_model_weights(path: str) -> None:
    """ModelError when a full reward model's folder has no model, or one of its tensors holds NaN/Inf (read one
    tensor at a time: the check never holds a second copy of the backbone)."""
    files = model_files(path)
    if not files or not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelError(f"reward model {path}: no adapter_config.json, nor a full model (config.json, *.safetensors)")
    for file in files:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if not all_finite(tensor):
                    raise ModelError(f"reward model {path}: tensor {key} in {os.path.basename(file)} holds NaN/Inf")


def read_config(path: str) -> dict:
    """A reward model folder's config (base model, attribute names, ...), once its weights are checked finite."""
    file = os.path.join(path, CONFIG_FILE)
    if not (os.path.isfile(file) and os.path.isfile(os.path.join(path, HEAD_FILE))):
        raise DataError(
            f"{path}: not a reward model (a trained reward model's folder has {CONFIG_FILE} and {HEAD_FILE})"
        )
    with open(file) as f:
        config = json.load(f)
    if is_full_model(path):  # a NaN/Inf weight would score every completion NaN
        check_model_weights(path)
    else:
        check_adapter_weights(path, "reward model")
    if not all_finite(load_file(os.path.join(path, HEAD_FILE))["weight"]):
        raise ModelError(f"reward model {path}: {HEAD_FILE} holds NaN/Inf; not loaded")
    return config


class RewardModel:
    """A loaded reward model: `model` scores with adapter `slot` active (None: a full model of its own), `head` maps
    to the K outputs `names`."""

    def __init__(self, model, slot: str, head, tokenizer, config: dict):
        self.model = model
        self.slot = slot
        self.head = head
        self.tokenizer = tokenizer
        self.config = config
        self.names = config["attributes"]  # the head's K outputs, in order
        self.last = (None, None)  # the last batch scored (prompts and completions as JSON, scores)


def quantization_of(model) -> str | None:
    """ "4bit", "8bit" or None: how bitsandbytes quantized the model's base."""
    config = getattr(unwrap(model).config, "quantization_config", None)
    if config is None:
        return None
    if getattr(config, "load_in_4bit", False):
        return "4bit"
    return "8bit" if getattr(config, "load_in_8bit", False) else None


def load_reward(path: str, model=None, tokenizer=None, dtype: str = "auto") -> RewardModel:
    """The reward model in `path`. With `model` (a LoRA policy) on the same base: its adapter becomes the frozen slot
    "reward" of that model, and the policy records the slot's and the head's hashes (run_identity: a resume with
    another reward model is refused; the slot is saved in checkpoints and hash-checked like "ref"). Otherwise the
    base is loaded once more (its memory is printed). A full model (trained with --no-use-lora) is always loaded
    apart, frozen in eval mode; its weight files' hash goes into the policy's identity. `tokenizer` None = the one
    saved with the reward model."""
    config = read_config(path)
    weight = load_file(os.path.join(path, HEAD_FILE))["weight"]
    full = is_full_model(path)
    slot = None if full else REWARD
    shared = not full and model is not None and is_peft(model)
    shared = shared and same_base(config["base_model"], unwrap(model).name_or_path)
    if full:
        rm_model = load_model(path, dtype)[0].eval().requires_grad_(False)
        gb = sum(p.numel() * p.element_size() for p in rm_model.parameters()) / 2**30
        if model is not None:
            print(f"reward model {path}: a full model (trained without LoRA): loaded apart, {gb:.2f} GB")
    elif shared:
        if REWARD in model.peft_config:
            raise ValueError("the policy already holds a 'reward' adapter: one reward model per run")
        was_training = model.training  # PEFT's load_adapter(is_trainable=False) puts the whole policy in eval mode
        with torch.random.fork_rng():  # PEFT may draw an init that is then overwritten: leave the RNG stream alone
            model.load_adapter(path, adapter_name=REWARD, is_trainable=False)
        rm_model = model.train(was_training)
        # Same base, other rounding (a model trained in fp32 scored on a 4-bit policy): the slot scores the backbone
        # it is on, and NF4 moves the scores (docs/reward-models.md: measured). A dir without the key: no note.
        ours = quantization_of(model)
        trained = config.get("quantization", ours)
        if trained != ours:
            print(
                f"reward model {path}: trained on a {trained or 'unquantized'} base, scored on the policy's "
                f"{ours or 'unquantized'} one: its scores move with the rounding (docs/reward-models.md)"
            )
    else:
        with warnings.catch_warnings():  # PEFT reads a deprecated transformers attribute (see attach_lora)
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            base_name = config["base_model"]  # loaded as trained: its own base, quantized the same way
            qconfig = bnb_config(config.get("quantization"), dtype)
            base = load_model(base_name, dtype, quantization_config=qconfig, path=resolve_model(base_name))[0]
            rm_model = PeftModel.from_pretrained(base, path, adapter_name=REWARD)
        gb = sum(p.numel() * p.element_size() for p in rm_model.parameters()) / 2**30
        if model is not None:  # the cost a shared backbone would have saved
            print(f"reward model {path}: base {config['base_model']!r} is not the policy's: loaded apart, {gb:.2f} GB")
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    head.weight.data.copy_(weight)
    head.requires_grad_(False).to(next(rm_model.parameters()).device)
    if model is not None:
        digest = hashlib.sha256(weight.numpy().tobytes()).hexdigest()
        if full:
            backbone = {"reward.model": files_hash(model_files(path))}
        else:
            backbone = {"reward.adapter": adapter_hash(rm_model, REWARD)}
        unwrap(model).reward_identity = backbone | {"reward.head": digest}
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    return RewardModel(rm_model, slot, head, tokenizer, config)


def files_hash(files: list[str]) -> str:
    """sha256 over the files' bytes, in the order given."""
    h = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def score_rows(scorer: RewardModel, rows: list[dict], batch_size: int = 16) -> torch.Tensor:
    """(N, K) float32 on the CPU for supervised rows ({prompt, completion}, {messages} or {text}), tokenized as
    training saw them (completions closed by their end-of-turn/EOS token, cut at its max_length), under
    as_reference(model, slot): no_grad, eval, and the policy's active adapter, trainable set and train mode restored
    afterwards, even on an error. A row whose prompt alone reaches max_length (training dropped such rows) scores
    its first max_length tokens."""
    max_length = scorer.config.get("max_length")
    ids = [tokenize_sft(scorer.tokenizer, row, None)["input_ids"][:max_length] for row in rows]
    device = scorer.head.weight.device
    out = []
    # a slot on the policy: switched in and out; a model of its own: frozen and in eval mode since load_reward
    guard = torch.no_grad() if scorer.slot is None else as_reference(scorer.model, scorer.slot)
    with guard:
        for i in range(0, len(ids), batch_size):
            chunk = [{"input_ids": x, "completion_mask": [1] * len(x)} for x in ids[i : i + batch_size]]
            batch = collate_sft(chunk, scorer.tokenizer.pad_token_id)
            mask = batch["attention_mask"].to(device, non_blocking=True)
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            out.append(reward_logits(scorer.model, scorer.head, input_ids, mask, True).float().cpu())  # right-padded
    return torch.cat(out)


def score(scorer: RewardModel, prompts: list, completions: list, batch_size: int = 16) -> torch.Tensor:
    """(N, K) rewards of N (prompt, completion) pairs: strings, or message lists (conversational; a string completion
    of a conversational prompt becomes one assistant message)."""
    chat = [
        [{"role": "assistant", "content": c}] if isinstance(p, list) and isinstance(c, str) else c
        for p, c in zip(prompts, completions, strict=True)
    ]
    return score_rows(scorer, [{"prompt": p, "completion": c} for p, c in zip(prompts, chat)], batch_size)


def model_reward(spec: str):
    """`model:<dir>[@attribute][:weight]` -> (name, fn, weight) for common.rewards. The attribute may be left out
    when the model has one (a Bradley-Terry model's is "reward"). fn scores once bind_model_rewards gave it a model;
    several specs on one directory share it, and a batch scored for one attribute is reused by the others."""
    body, weight = split_weight(spec.removeprefix("model:"))
    if not math.isfinite(weight):  # as load_reward_funcs: a NaN weight would turn every reward into 0
        raise ArgsError(f"--rewards {spec}: the weight must be a finite number, got {weight}")
    path, _, attribute = body.partition("@")
    attributes = read_config(path)["attributes"]
    if not attribute and len(attributes) > 1:
        raise ValueError(f"--rewards {spec}: name one attribute of {attributes} (model:{path}@<name>[:weight])")
    attribute = attribute or attributes[0]
    if attribute not in attributes:
        raise ValueError(f"--rewards {spec}: no attribute {attribute!r}; {path} has {attributes}")
    k = attributes.index(attribute)

    def fn(prompts, completions, **kw):
        if fn.scorer is None:
            raise RuntimeError(f"reward {spec}: no model bound (call bind_model_rewards after the policy loads)")
        key = json.dumps([prompts, completions], default=str)
        if fn.scorer.last[0] != key:
            fn.scorer.last = (key, score(fn.scorer, prompts, completions))
        return fn.scorer.last[1][:, k].tolist()

    fn.scorer = None
    fn.reward_model_dir = path
    return ("model" if len(attributes) == 1 else f"model@{attribute}"), fn, weight


def bind_model_rewards(funcs, model) -> None:
    """Load each model reward among `funcs` (load_reward_funcs' list) onto the policy `model`; call it right after
    the policy's adapters are made and before a checkpoint is restored (which then restores and checks "reward")."""
    loaded = {}
    for _, fn, _ in funcs:
        path = getattr(fn, "reward_model_dir", None)
        if path is not None:
            if loaded and path not in loaded:
                raise ValueError("--rewards: model rewards from two directories; one reward model per run")
            if path not in loaded:
                loaded[path] = load_reward(path, model)
            fn.scorer = loaded[path]


def label_rows(path: str | None, *row_lists: list[dict]) -> tuple[list[dict], ...]:
    """SteerLM labelling (--label-with): every supervised row of every list gets `attributes` = {name: level}, the
    regression reward model's score in `path` rounded to the nearest integer (SteerLM's attribute values are integer
    levels, as NeMo-Aligner's attribute_annotate.py rounds them; the row's own attributes are replaced); path None
    returns the lists as given. The model is loaded once, on its own, and freed before the policy loads."""
    if path is None:
        return row_lists
    scorer = load_reward(path)
    if scorer.config["loss_type"] != "regression":
        raise DataError(
            f"--label-with {path}: a {scorer.config['loss_type']} model; SteerLM labels need a regression one"
        )
    scores = score_rows(scorer, [row for rows in row_lists for row in rows]).tolist()
    levels = iter([dict(zip(scorer.names, map(round, s), strict=True)) for s in scores])
    return tuple([row | {"attributes": next(levels)} for row in rows] for rows in row_lists)


def reward_model_bytes(specs: list[str], policy_model: str) -> int:
    """What a `model:<dir>` reward among `specs` adds to the memory plan: its LoRA as a frozen fp32 slot on the
    policy's base, or, on another base, that base (dtype auto, quantized as trained, as load_reward loads it) + its
    LoRA, loaded apart; a full model, loaded apart. 0 without one."""
    specs = [s for s in specs if s.startswith("model:")]
    if not specs:
        return 0
    bytes_per_weight = resolve_dtype("auto", pick_device()).itemsize
    path = split_weight(specs[0].removeprefix("model:"))[0].partition("@")[0]  # one reward-model directory a run
    config = read_config(path)
    if is_full_model(path):  # loaded apart as load_reward does, unquantized (full fine-tuning refuses quantization)
        return weight_bytes(model_config(path), None, bytes_per_weight)
    with open(os.path.join(path, "adapter_config.json")) as f:
        r = json.load(f)["r"]
    if same_base(config["base_model"], policy_model):
        return lora_params(model_config(policy_model), r) * 4
    other = model_config(config["base_model"])
    return weight_bytes(other, config.get("quantization"), bytes_per_weight) + lora_params(other, r) * 4

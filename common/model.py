"""One backbone, two LoRA slots: the policy is base + adapter "default", the reference is a frozen copy in "ref".

`load_model` loads a causal LM and its tokenizer; `attach_lora` adds (or loads) the trainable "default" adapter;
`snapshot_ref` copies it into "ref"; `as_reference` runs a block with "ref" active under no_grad. No second model
copy is ever made, so DPO / KTO / GRPO cost one backbone of memory.
"""

import contextlib
import copy
import hashlib
import importlib.util
import inspect
import json
import os
import warnings

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.templates import setup_chat_template

REF = "ref"
DEFAULT = "default"
REWARD = "reward"  # a reward model's LoRA on the policy's backbone (common.reward_model), never trained


class ModelError(ValueError):
    """A --model / --adapter that is not what it must be: no such path, no config.json, an adapter of another base."""


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def require(package: str, hint: str):
    """Import an optional package or fail with a one-line install hint (GPU extras are never imported eagerly)."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{hint} needs the optional package '{package}': pip install {package}")
    return importlib.import_module(package)


def cache_kwarg(lm) -> str:
    """The name under which lm's forward (and generate) takes a KV cache: transformers 5.24 renamed past_key_values
    to cache (the old name warns until 5.40); 5.17 knows only past_key_values."""
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def is_checkpointing(lm) -> bool:
    """Activation checkpointing on? transformers 5.24's is_activation_checkpointing; 5.17 only has the older
    is_gradient_checkpointing (deprecated in 5.24, so it is read only where the new name is missing)."""
    name = "is_activation_checkpointing" if hasattr(lm, "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(lm, name, False))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' = bf16 on a CUDA card that supports it, else fp32 (CPU bf16 matmuls are slow and lossy here)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]


def resolve_attn(attn_implementation: str, device: torch.device) -> str:
    """'auto' = flash_attention_2 when flash-attn is installed and we are on CUDA, else PyTorch SDPA."""
    if attn_implementation != "auto":
        if attn_implementation == "flash_attention_2":
            require("flash_attn", "--attn-implementation flash_attention_2")
        return attn_implementation
    return "flash_attention_2" if device.type == "cuda" and importlib.util.find_spec("flash_attn") else "sdpa"


def load_model(
    name: str,
    dtype: str = "auto",
    attn_implementation: str = "auto",
    quantization: str | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
):
    """Load (model, tokenizer) from a hub id, a local path or an embedded alias such as 'smollm2-135m'.
    quantization: None, "4bit" (QLoRA NF4, double quant) or "8bit", through bitsandbytes (>= 0.48 runs on CPU too);
    the quantized base is frozen and prepared for k-bit training (norms in fp32, input grads for checkpointing)."""
    from common.embedded import resolve_model  # alias -> cached local folder; other names pass through

    from common.data import looks_local

    path, device = resolve_model(name), pick_device()
    if looks_local(path) and not os.path.exists(path):
        raise ModelError(f"--model {name}: no such file or directory")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelError(
            f"--model {name}: the folder {path} has no config.json, so it is not a model "
            f"(it holds: {', '.join(sorted(os.listdir(path))[:5]) or 'nothing'})"
        )
    torch_dtype = resolve_dtype(dtype, device)
    kwargs = dict(dtype=torch_dtype, attn_implementation=resolve_attn(attn_implementation, device))
    if quantization is not None:
        require("bitsandbytes", f"--quantization {quantization}")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=quantization == "4bit",
            load_in_8bit=quantization == "8bit",
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch_dtype,
        )
        kwargs["device_map"] = {"": (device.index or 0) if device.type == "cuda" else "cpu"}  # quantized on load
    if not os.path.isdir(path):  # a hub id: fail in seconds when it can be neither fetched nor found in the cache
        from common.hub import check_hub

        if check_hub(path, "model"):  # cached, hub unreachable: load the cached folder, no requests (no retries)
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    # An alias (smollm2-135m) stays the model's name: saved adapters record it, not this disk's cache path.
    model.name_or_path = model.config._name_or_path = name
    # Taken now, before any update: full fine-tuning changes every weight, yet a checkpoint must name its base.
    model.base_identity = base_identity(model, str(torch_dtype).removeprefix("torch."), quantization)
    if tokenizer.pad_token is None:
        # Padding is always masked out, so any id works; EOS is the usual choice (our masks never rely on pad ids).
        tokenizer.pad_token = tokenizer.eos_token
    if quantization is None:
        model.to(device)  # a quantized model was placed by device_map
    else:
        from peft import prepare_model_for_kbit_training

        # Checkpointing is switched on below, as without quantization (PEFT's would use the deprecated alias).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        # bitsandbytes 0.50 on an AVX512-BF16 CPU repacks a 4-bit weight in place the first time it runs in eval mode
        # without grad (bf16 absmax, a kernel without autograd) and keeps that layout in training: our reference and
        # rollout passes run in eval mode, so the base would change under the trainer. Keep the layout that trains.
        for module in (m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")):
            module.support_avx512bf16_for_cpu = False
    if gradient_checkpointing:  # non-reentrant works with frozen inputs (LoRA): no enable_input_require_grads hack
        if hasattr(model, "activation_checkpointing_enable"):  # the name transformers 5.24 gives it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # older transformers (the GPU image's 5.17)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = not gradient_checkpointing
    return model, tokenizer


def attach_lora(
    model,
    adapter: str | None = None,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.05,
    target_modules: str | list[str] = "all-linear",
):
    """Wrap the model in PEFT with a trainable "default" adapter, loaded from `adapter` (sft.py's output) or new."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter is not None and not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        raise FileNotFoundError(f"--adapter {adapter}: no adapter_config.json there (expected a PEFT adapter dir)")
    with warnings.catch_warnings():
        # PEFT 0.21's PeftModel.__init__ reads transformers' deprecated model.is_gradient_checkpointing on every
        # wrap (checkpointing on or off); nothing we call can avoid it, so only that one warning is hidden, here.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        if adapter is None:
            return get_peft_model(
                model,
                LoraConfig(
                    r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM"
                ),
            )
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            trained_on, name = json.load(f).get("base_model_name_or_path"), model.config._name_or_path
        try:
            peft_model = PeftModel.from_pretrained(model, adapter, adapter_name=DEFAULT, is_trainable=True)
        except RuntimeError as e:  # PEFT lists every mismatched tensor (52 lines for a 135M model): name the models
            if "size mismatch" not in str(e):
                raise
            first = next(line.strip() for line in str(e).splitlines() if "size mismatch" in line)
            raise ModelError(
                f"--adapter {adapter} was trained on {trained_on!r}, whose shapes differ from the base "
                f"--model {name!r} ({str(e).count('size mismatch')} tensors, e.g. {first[:200]})"
            ) from None
    if trained_on and name and not same_base(trained_on, name):  # same shapes, so PEFT loads it without a word
        print(f"note: --adapter {adapter} was trained on {trained_on!r}, not on --model {name!r} (same shapes)")
    return peft_model


def same_base(a: str, b: str) -> bool:
    """Do two --model names (alias, hub id, local path) name the same model? An alias stands for its cached folder."""
    from common.embedded import resolve_model

    if a == b:
        return True
    a, b = resolve_model(a), resolve_model(b)
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


def load_policy(args, *, reference: bool = False, no_dropout: bool = False, adapter: str | None = None):
    """(model, tokenizer) as a script's Args say: the base (--model, --dtype, --attn-implementation, --quantization,
    --gradient-checkpointing, --trust-remote-code), its chat template (--template), the trainable "default" LoRA
    (`adapter` or --adapter, else new; none with --no-use-lora), dropout off (TRL's disable_dropout) and, with
    `reference`, the frozen "ref" copy taken before any update: the reference is the starting policy."""
    trust = getattr(args, "trust_remote_code", False)
    model, tokenizer = load_model(
        args.model, args.dtype, args.attn_implementation, args.quantization, args.gradient_checkpointing, trust
    )
    setup_chat_template(tokenizer, args.template)
    if getattr(args, "use_lora", True):  # sft.py and orpo.py can train every weight instead
        model = attach_lora(model, adapter or args.adapter, args.lora_r, args.lora_alpha, args.lora_dropout)
    if no_dropout:
        disable_dropout(model)
    if reference:
        snapshot_ref(model)
    return model, tokenizer


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def unwrap(model):
    """The transformers PreTrainedModel inside a PeftModel (LoRA layers live in it in place), else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _slot_params(model, slot: str) -> dict[str, torch.nn.Parameter]:
    """LoRA tensors of one slot keyed by their name with the slot name removed, so the two slots line up."""
    tag = f".{slot}."
    return {n.replace(tag, ".#."): p for n, p in model.named_parameters() if tag in n}


def snapshot_ref(model) -> None:
    """Copy "default" into a frozen "ref" slot: the reference policy is the starting policy (e.g. the SFT adapter)."""
    if not is_peft(model):
        raise ValueError("snapshot_ref needs a LoRA policy (attach_lora); full fine-tuning has no 'ref' slot")
    if REF not in model.peft_config:
        cfg = copy.deepcopy(model.peft_config[DEFAULT])
        cfg.inference_mode = True
        with torch.random.fork_rng():  # PEFT draws a random init we overwrite: leave the RNG stream alone
            model.add_adapter(REF, cfg)  # PEFT keeps "default" active and creates the new slot frozen
    src, dst = _slot_params(model, DEFAULT), _slot_params(model, REF)
    if src.keys() != dst.keys():
        raise RuntimeError("the 'ref' slot does not mirror 'default' (different target modules)")
    with torch.no_grad():
        for key, p in dst.items():
            p.copy_(src[key])
            p.requires_grad_(False)


@contextlib.contextmanager
def as_reference(model, slot: str = REF):
    """Run the block as the reference policy (or another frozen slot, e.g. REWARD): `slot` active, eval mode,
    no_grad; the active adapter, every requires_grad flag and train mode restored on exit, even if the block raises.
    PEFT's set_adapter() also flips requires_grad (the active slot becomes trainable, the other frozen; seen on
    peft 0.21), so the exact requires_grad of every parameter is saved first and put back."""
    if not is_peft(model) or slot not in model.peft_config:
        raise RuntimeError(f"no '{slot}' adapter: call snapshot_ref(model) (or load_reward) before using it")
    flags, was_training = {n: p.requires_grad for n, p in model.named_parameters()}, model.training
    active = model.active_adapter
    try:
        model.set_adapter(slot)
        model.eval()  # LoRA dropout off: the reference must be deterministic
        with torch.no_grad():
            yield model
    finally:
        model.set_adapter(active)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.train(was_training)


def disable_dropout(model) -> None:
    """p = 0 on every nn.Dropout, a loaded adapter's LoRA dropout included (TRL's disable_dropout=True), and on the
    float rates modules pass to functional dropout (Llama/Qwen2's attention_dropout from config.json, which no
    nn.Dropout holds): otherwise the policy (train mode) and the reference (eval mode) differ at step 0 and DPO's
    first loss is not ln 2."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):  # e.g. attention_dropout, dropout, dropout_p, attn_drop
            if isinstance(value, float) and ("dropout" in name or name.endswith("_drop")):
                setattr(module, name, 0.0)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """What the optimizer holds: never a "ref" / "reward" tensor (checked: PEFT's adapter switching flips flags)."""
    if getattr(model, "is_quantized", False) and not is_peft(model):
        # Only LoRA can train on a bitsandbytes base: its int8/NF4 weights take no gradient and no optimizer step.
        raise ValueError("a --quantization base trains only through LoRA: drop --no-use-lora or --quantization")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if leaked := [n for n, _ in params if f".{REF}." in n or f".{REWARD}." in n]:
        raise RuntimeError(f"frozen ('ref' / 'reward') adapter tensors are trainable: {leaked[:3]}")
    if not params:
        raise RuntimeError("the model has no trainable parameters")
    return [p for _, p in params]


def base_identity(model, dtype: str | None = None, quantization: str | None = None) -> dict:
    """What a checkpoint records about its base model: a hash of the config (minus load options), a fingerprint of
    its weights (sha256 over 1,024 values at each end of the first, middle and last base tensor, rounded to bf16 so
    the load dtype shows only as `dtype`), the dtype and the quantization. load_model stores it as
    model.base_identity (before any update); otherwise it is computed from the model as it is now."""
    if (saved := getattr(model, "base_identity", None)) is not None:
        return saved
    base = model.get_base_model() if is_peft(model) else model
    config = {
        k: v
        for k, v in base.config.to_dict().items()
        if not k.startswith("_")
        and k
        not in (
            "use_cache",
            "dtype",
            "torch_dtype",
            "transformers_version",
            "quantization_config",
            "attn_implementation",
        )
    }
    params = [(n.replace(".base_layer.", "."), p) for n, p in base.named_parameters() if "lora_" not in n]
    h = hashlib.sha256()
    for name, p in (params[0], params[len(params) // 2], params[-1]):
        flat = p.detach().reshape(-1)
        values = torch.cat([flat[:1024], flat[-1024:]]).to("cpu", torch.bfloat16).view(torch.int16)
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(values.numpy().tobytes())
    return {
        "base.config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "base.weights_sha256": h.hexdigest(),
        "dtype": dtype or str(base.dtype).removeprefix("torch."),
        "quantization": quantization,
    }


def adapter_hash(model, slot: str = REF) -> str:
    """sha256 over a slot's tensors in name order: recorded in checkpoints, verified on resume."""
    h = hashlib.sha256()
    for key, p in sorted(_slot_params(model, slot).items()):
        h.update(key.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def save_weights(model, out_dir: str, adapters: list[str] | None = None) -> None:
    """Adapters via PEFT's save_pretrained (safetensors; "default" at the top, "ref" in ref/), else the full model.
    save_embedding_layers=False: our LoRA never resizes the vocabulary, and PEFT's "auto" looks a base name that is
    no local folder (an alias such as smollm2-135m) up on the hub at every save, with warnings when offline."""
    kwargs = {"selected_adapters": adapters, "save_embedding_layers": False} if is_peft(model) else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)


def load_weights(model, src_dir: str) -> None:
    """Inverse of save_weights into an already-built model (both LoRA slots, or the full state dict)."""
    if not is_peft(model):
        state = {}
        for name in sorted(os.listdir(src_dir)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(src_dir, name), device=str(model.device)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        # save_pretrained drops tied copies (lm_head = embed_tokens); anything else missing is a broken checkpoint.
        own = model.state_dict()
        loaded = {own[n].data_ptr() for n in state if n in own}
        if broken := [n for n in missing if own[n].data_ptr() not in loaded] + list(unexpected):
            raise RuntimeError(f"checkpoint {src_dir} does not match the model: {broken[:3]}")
        return
    from peft import set_peft_model_state_dict

    for slot in model.peft_config:
        path = os.path.join(src_dir, "" if slot == DEFAULT else slot, "adapter_model.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {src_dir} has no weights for adapter '{slot}' ({path})")
        result = set_peft_model_state_dict(model, load_file(path, device=str(model.device)), adapter_name=slot)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"{path}: unexpected keys {result.unexpected_keys[:3]}")

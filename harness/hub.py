"""Where a model or dataset comes from, checked before anything is fetched: `locate_model` turns an embedded alias
into its converted folder and a hub id into its cached folder when the hub is out of reach; `check_dataset` fails
a hub dataset that is neither cached nor reachable; `check_inputs` looks at every input of a run at once (model,
dataset, eval set) before anything loads. Either way the run stops at once with one line naming what is missing (all
of it) and the local alternative, instead of the hub client's retries ending in a long traceback (docs/
reliability.md has the measured delays). `note_other_base` names an adapter's own base when it is not --model's."""

import functools
import json
import os
import pathlib
import urllib.error
import urllib.request

from huggingface_hub import constants, snapshot_download, try_to_load_from_cache

from common.data import looks_local
from common.errors import DataError, ModelError
from harness.errors import HubUnavailable
from plugins.embedded import ALIAS_CONFIGS, SHIPPED, resolve_model

PROBE_TIMEOUT_S = 3.0  # one HEAD request; a firewall that drops packets costs this long, a DNS failure nothing
# each local dataset file check_inputs saw, by real path: (size, mtime_ns) before the run read it; the run's data hash
# (harness.checkpoints.data_sha256) refuses a file that has changed since, so the rows read are the rows hashed
BEFORE_READ: dict[str, tuple[int, int]] = {}


@functools.cache
def hub_unreachable() -> str | None:
    """None when the hub answers a HEAD request within PROBE_TIMEOUT_S, else the reason. Any HTTP status counts as
    reachable (the hub client reports gated or missing repos itself); proxies from the environment apply."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=PROBE_TIMEOUT_S)
    except urllib.error.HTTPError:
        return None
    except OSError as e:  # URLError (DNS, refused, TLS) and timeouts are all OSErrors
        return f"the hub ({constants.ENDPOINT}) is unreachable ({getattr(e, 'reason', e)})"
    return None


def _is_cached(repo_id: str, kind: str) -> bool:
    if kind == "model":
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    import datasets.config  # a hub dataset leaves its files in the hub cache and its Arrow tables in datasets' own

    folders = (
        os.path.join(constants.HF_HUB_CACHE, "datasets--" + repo_id.replace("/", "--")),
        os.path.join(datasets.config.HF_DATASETS_CACHE, repo_id.replace("/", "___")),
    )
    return any(os.path.isdir(f) for f in folders)


def check_hub(repo_id: str, kind: str, offline: str | None = None) -> bool:
    """Call before fetching `repo_id` (kind "model" or "dataset") from the hub. Returns True when it must come from
    the cache alone (hub unreachable, but cached: load snapshot_download(..., local_files_only=True)), False to load
    it normally; raises
    HubUnavailable (one line) when it is neither cached nor reachable, and FileNotFoundError for a path that is not
    there (it would otherwise be looked up on the hub as a repo id). `offline`: what else works without the hub
    (e.g. a built-in set), named in that line after the local copy."""
    flag = {"model": "--model /path/to/folder", "dataset": "--dataset file.jsonl"}[kind]
    if looks_local(repo_id):
        raise FileNotFoundError(f"{kind} '{repo_id}': no such local {'folder' if kind == 'model' else 'file'}")
    why = hub_unreachable()
    if why is None:
        return False
    if _is_cached(repo_id, kind):
        return True
    raise HubUnavailable(
        f"cannot fetch {kind} '{repo_id}': it is not in the local cache and {why}; download it "
        f"where the hub is reachable, or pass a local copy: {flag}" + (f", or offline: {offline}" if offline else "")
    )


def locate_model(name: str) -> str:
    """The folder or hub id to load --model `name` from: an embedded alias's converted folder (built on first use),
    a local path as it is, a hub id as it is when the hub answers, or its cached snapshot when the hub is out of
    reach (loaded without a request); HubUnavailable when it is neither cached nor reachable, ModelError (one line)
    for a local path that is not there or a folder without config.json."""
    path = resolve_model(name)
    if looks_local(path) and not os.path.exists(path):
        raise ModelError(f"--model {name}: no such file or directory")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        shown = ", ".join(sorted(os.listdir(path))[:5]) or "nothing"
        raise ModelError(
            f"--model {name}: the folder {path} has no config.json, so it is not a model (it holds: {shown})"
        )
    if path != name or looks_local(name) or os.path.isdir(name):
        return path
    if check_hub(name, "model"):  # cached, hub unreachable: the cached folder, no requests (no retries)
        return snapshot_download(name, local_files_only=True)
    return name


def _missing_model(name: str, config_only: bool) -> str | None:
    """Why --model `name` is not here (None: it is). config_only: --plan, which needs its config.json alone (a
    config.json file, or plugins.embedded.SHIPPED's architecture of a hub id when the hub is out of reach)."""
    if name in ALIAS_CONFIGS:
        return None
    if config_only and name.endswith(".json") and os.path.isfile(name):
        return None
    if os.path.isdir(name):
        return None if os.path.isfile(os.path.join(name, "config.json")) else f"the folder {name} has no config.json"
    if os.path.isfile(name):
        return "a file, not a model folder (--plan alone takes a config.json file)"
    if looks_local(name):
        return "no such local folder"
    if hub_unreachable() is None or _is_cached(name, "model") or (config_only and name in SHIPPED):
        return None
    return "not in the local cache"


def _missing_dataset(spec: str) -> str | None:
    if spec.startswith("builtin:") or os.path.exists(spec):
        return None
    if looks_local(spec) or spec.endswith((".json", ".jsonl", ".parquet")):
        return "no such local file"
    if hub_unreachable() is None or _is_cached(spec.partition(":")[0], "dataset"):
        return None
    return "not in the local cache"


def check_inputs(model: str, data: dict[str, str | None], plan: bool = False) -> bool:
    """Before anything heavy loads: is every input of a run here (or fetchable)? --model (an embedded alias, a folder
    with config.json, a hub id cached or reachable) and each dataset the script declares in `data` (its flag -> the
    spec; None: not used). When a dataset is missing, all that are missing are named in one error, each with its
    flag, so an offline user learns everything in one round trip; a missing model alone is left to the memory plan,
    which reads its config.json after the rows are checked (bad rows are reported first, as without a model). With
    `plan` (--plan) the model's config.json is enough (or the architecture plugins.embedded.SHIPPED holds) and a
    missing dataset is no error: False (plan at the length limits), after one line saying so. True when every
    dataset is here."""
    problems = {}
    why = _missing_model(model, plan)
    if why:
        problems["--model"] = (model, why, "--model /path/to/folder")
    absent = {}
    for flag, spec in data.items():
        if spec and os.path.isfile(spec):
            found = os.stat(spec)
            BEFORE_READ[os.path.realpath(spec)] = (found.st_size, found.st_mtime_ns)
        reason = _missing_dataset(spec) if spec else None
        if reason:
            absent[flag] = (spec, reason, f"{flag} file.jsonl")
    if not plan:
        problems |= absent
    if problems and (absent or plan):
        items = [
            f"{flag} {spec}: {reason} (pass a local copy: {hint})" for flag, (spec, reason, hint) in problems.items()
        ]
        offline = hub_unreachable()
        cause = f" ({offline})" if offline and any("cache" in reason for _, reason, _ in problems.values()) else ""
        raise HubUnavailable(f"{len(problems)} input(s) missing{cause}, nothing loaded: " + "; ".join(items))
    if absent and plan:
        named = "; ".join(f"{flag} {spec}: {reason}" for flag, (spec, reason, _) in absent.items())
        print(f"--plan without its data ({named}): planned at the length limits", flush=True)
    return not absent


def _load_saved_dataset(path: pathlib.Path, split: str) -> list[dict]:
    """A folder written by Dataset(Dict).save_to_disk; any other folder is refused (datasets would train on whatever
    files it finds inside, e.g. a run dir's metrics.jsonl)."""
    if not any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        shown = ", ".join(sorted(os.listdir(path))[:5]) or "nothing"
        raise DataError(
            f"{path}: a directory, not a saved HF dataset (save_to_disk's dataset_info.json/state.json "
            f"or dataset_dict.json missing; it holds: {shown}); pass a .json/.jsonl/.parquet file"
        )
    import datasets

    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataError(f"{path}: no split {split!r} in the saved dataset (it has: {', '.join(data)})")
        data = data[split]
    return [dict(r, _loc=f"{path}:[{i}]") for i, r in enumerate(data.to_list())]


def hub_rows(spec: str, split: str) -> list[dict]:
    """common.data.load_rows' source (hub=) of a saved HF dataset folder or a hub id ("org/name" or
    "org/name:config"), as a list of rows."""
    path = pathlib.Path(spec)
    if path.is_dir():
        return _load_saved_dataset(path, split)
    import datasets  # imported here: a run on local files never pays for it

    name, _, config = spec.partition(":")  # hub sets with several configs, e.g. "openai/gsm8k:main"
    return datasets.load_dataset(name, config or None, split=split).to_list()


def check_dataset(spec: str | None, offline: str | None = None) -> None:
    """Fail now, in one line, when `spec` is a hub dataset that is neither cached nor reachable (naming `offline`, what
    works without the hub, when given); files, saved datasets and builtin:<name> pass."""
    if spec is None or spec.startswith("builtin:") or os.path.exists(spec) or looks_local(spec):
        return
    if spec.endswith((".json", ".jsonl", ".parquet")):
        return
    check_hub(spec.partition(":")[0], "dataset", offline)


def read_adapter_config(path: str, what: str) -> dict:
    """An adapter_config.json as a dict, or ModelError naming the file when it is no JSON object (damaged)."""
    try:
        config = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{what}: {path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{what}: {path} holds no JSON object")
    return config


def same_base(a: str, b: str) -> bool:
    """Do two model names (hub ids or local paths) name the same model?"""
    if a == b:
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def note_other_base(adapter: str, model: str) -> None:
    """One note when `adapter` was trained on a base other than `model` (the --model name): PEFT loads an adapter onto
    any base of the same shapes without a word (other shapes: common.model.attach_lora's one-line error)."""
    config = read_adapter_config(os.path.join(adapter, "adapter_config.json"), "--adapter")
    trained_on = config.get("base_model_name_or_path")
    if trained_on and model and not same_base(trained_on, model):
        print(f"note: --adapter {adapter} was trained on {trained_on!r}, not on --model {model!r}")

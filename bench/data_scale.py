"""Load and tokenize a large JSONL as sft.py does (--convert alpaca), and measure rows/s and resident memory against
the memory plan's host line (rows_bytes + examples_bytes). docs/data.md has the figures and the command.

The file is written once to --file (outside the repo): LLaMA-Factory's alpaca demo rows, each numbered and its output
cut so that the file has about --mb MB in --rows rows. `--old-data` points at another copy of common/data.py (e.g.
`git show <commit>:common/data.py > /tmp/old_data.py`) to tokenize with its tokenize_dataset instead, in chunks, and
stop at --stop-gb of resident memory or --stop-s seconds with the figures reached so far.

    OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false python bench/data_scale.py
"""

import argparse
import importlib.util
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common.data import load_rows, setup_chat_template
from common.completions import tokenize_dataset, validate_rows
from harness.memory import examples_bytes, local_tokenizer, rows_bytes
from sft import alpaca_row

GiB = 1024**3
DEMO = pathlib.Path(__file__).resolve().parents[2] / "shared/data/llamafactory-demo/alpaca_en_demo.json"


def status(field: str) -> int:
    """A /proc/self/status memory figure (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":"))) * 1024


def write_file(path: pathlib.Path, rows: int, mb: float):
    demo = json.loads(DEMO.read_text())
    per_line = mb * 1e6 / rows
    with open(path, "w") as f:
        for i in range(rows):
            row = dict(demo[i % len(demo)])
            row["instruction"] = f"({i}) {row['instruction']}"
            room = int(per_line - len(json.dumps(row | {"output": ""}, ensure_ascii=False)) - 1)
            row["output"] = row["output"][: max(room, 16)]
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def old_tokenize(module_path: str, tokenizer, rows, stop_gb: float, stop_s: float, start: float):
    """The other copy's tokenize_dataset over chunks of rows; (examples, stopped early)."""
    spec = importlib.util.spec_from_file_location("old_data", module_path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    examples = []
    for first in range(0, len(rows), 10_000):
        examples += old.tokenize_dataset(tokenizer, rows[first : first + 10_000], "supervised", None)
        if status("VmRSS") > stop_gb * GiB or time.perf_counter() - start > stop_s:
            return examples, True
    return examples, False


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", default="/tmp/data_scale.jsonl")
    p.add_argument("--rows", type=int, default=729_047)
    p.add_argument("--mb", type=float, default=211.0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--old-data", default=None, help="another copy of common/data.py to tokenize with")
    p.add_argument("--stop-gb", type=float, default=8.0)
    p.add_argument("--stop-s", type=float, default=900.0)
    args = p.parse_args()
    path = pathlib.Path(args.file)
    if not path.is_file():
        write_file(path, args.rows, args.mb)
    tokenizer = local_tokenizer(args.model)
    if tokenizer is None:
        sys.exit(f"--model {args.model}: its tokenizer is not on this machine (run any script on it once)")
    setup_chat_template(tokenizer, "auto")
    base = status("VmRSS")
    t0 = time.perf_counter()
    rows = validate_rows(load_rows(str(path), convert=alpaca_row), "supervised")
    t1 = time.perf_counter()
    loaded = status("VmRSS") - base
    planned_rows = rows_bytes(rows)
    planned_tokens = examples_bytes(rows, tokenizer)
    t2 = time.perf_counter()
    if args.old_data:
        examples, stopped = old_tokenize(args.old_data, tokenizer, rows, args.stop_gb, args.stop_s, t2)
    else:
        examples, stopped = tokenize_dataset(tokenizer, rows, "supervised", None), False
    t3 = time.perf_counter()
    tokens = sum(len(e["input_ids"]) for e in examples)
    done = len(examples)
    both = planned_rows + planned_tokens * done / len(rows)
    result = {
        "path": args.old_data or "common/data.py",
        "file_mb": round(path.stat().st_size / 1e6, 1),
        "rows": len(rows),
        "load_s": round(t1 - t0, 1),
        "load_rows_per_s": round(len(rows) / (t1 - t0)),
        "rss_after_load_gib": round(loaded / GiB, 3),
        "plan_rows_gib": round(planned_rows / GiB, 3),
        "plan_tokens_gib": round(planned_tokens / GiB, 3),
        "plan_seconds": round(t2 - t1, 1),
        "tokenized_rows": done,
        "stopped_early": stopped,
        "tokenize_s": round(t3 - t2, 1),
        "tokenize_rows_per_s": round(done / (t3 - t2)),
        "tokens": tokens,
        "rss_growth_gib": round((status("VmRSS") - base) / GiB, 3),
        "peak_rss_gib": round(status("VmHWM") / GiB, 3),
        "plan_for_the_rows_done_gib": round(both / GiB, 3),
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

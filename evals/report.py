"""Side-by-side report: eval scores of several policies (base, SFT, DPO, GRPO, RAFT rounds, ...) with deltas against
a baseline (--baseline, default the first --evals entry's policy; its row is marked), and the training curves of their
runs, as Markdown + PNGs and one self-contained HTML page.

Inputs are what the other tools already write: the summary JSONs of evals.gsm8k / evals.ifeval (one per policy and
task; rows are grouped by their "label", in order of first appearance) and run dirs with metrics.jsonl (one JSON
object per logged step: "step" plus metric keys). Nothing is recomputed.
Run: `python -m evals.report --runs runs/sft__a runs/grpo__b --evals out/base__gsm8k.json out/grpo__gsm8k.json`
     `python -m evals.report` (neither given: every run dir in ./runs and every summary in ./eval_results, the folders
     the scripts and evals write by default, named in one line)
Writes report/report.md, report/<metric>.png for each curve, report/report.html (PNGs inlined as base64 data URIs).
Each curve's PNG has one panel per run kind (the exp_name before the first "__": sft, dpo, grpo, ...), since their
losses mean different things; a faint raw line and a bold EMA line per run (TensorBoard's debiased smoothing), or
the raw line alone for a run of fewer than MIN_EMA_POINTS logged points, where an EMA lags far behind the values.
"""

import base64
import dataclasses
import html
import json
import math
import os
import re
import time
import warnings

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, None)

import tyro

from common.errors import ArgsError
from harness.cli import one_line_errors

# The scores shown per task, in column order; a task not listed here shows its *accuracy / *_acc keys.
HEADLINE = {
    "gsm8k": ("accuracy",),
    "ifeval": ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc"),
}


@dataclasses.dataclass
class Args:
    # run dirs (each holding metrics.jsonl) whose training curves to draw; with neither --runs nor --evals, every run
    # dir in ./runs
    runs: tuple[str, ...] = ()
    # summary JSON files from evals.gsm8k / evals.ifeval; with neither --runs nor --evals, every summary
    # in ./eval_results, oldest first (so the baseline is the first policy evaluated)
    evals: tuple[str, ...] = ()
    # the policy (a summary's label) the deltas are against, its row marked; None = the first --evals entry's
    baseline: str | None = None
    out: str = "report"  # output folder for report.md, report.html and the PNGs
    # training metrics to plot, when a run logged them (every eval/* key a run logged is added)
    metrics: tuple[str, ...] = ("loss", "reward", "kl", "completions/mean_length", "memory/peak_gb")
    title: str = "OnlyOne report"  # page title
    # EMA weight of the bold smoothed line beside each raw curve (TensorBoard's slider); 0 draws the raw line only, as
    # does a run of fewer than 10 logged points
    smoothing: float = 0.6


DEFAULT_RUNS = "runs"  # the training scripts' --output-dir default
DEFAULT_EVALS = "eval_results"  # evals.gsm8k's and evals.ifeval's --output-dir default


def default_inputs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(runs, evals) when neither flag is given: the run dirs in ./runs that hold a metrics.jsonl (by name) and the
    eval summaries in ./eval_results (each <label>__<task>.json beside its per-example .jsonl), oldest first: the
    baseline is the policy evaluated first, usually the base model. One line says what was found and read."""
    runs = ()
    if os.path.isdir(DEFAULT_RUNS):
        names = sorted(os.listdir(DEFAULT_RUNS))
        runs = tuple(f"{DEFAULT_RUNS}/{n}" for n in names if os.path.isfile(f"{DEFAULT_RUNS}/{n}/metrics.jsonl"))
    evals = ()
    if os.path.isdir(DEFAULT_EVALS):
        found = [os.path.join(DEFAULT_EVALS, n) for n in os.listdir(DEFAULT_EVALS) if n.endswith(".json")]
        evals = tuple(sorted(found, key=lambda path: (os.path.getmtime(path), path)))
    if not runs and not evals:
        raise ArgsError(
            f"nothing to report: no --runs or --evals given, and no run dir with metrics.jsonl in ./{DEFAULT_RUNS} "
            f"nor summary JSON in ./{DEFAULT_EVALS} (give --runs RUN_DIR ... and/or --evals SUMMARY.json ...)"
        )
    print(
        f"report: no --runs or --evals given: read {len(runs)} run dir(s) from ./{DEFAULT_RUNS} and {len(evals)} eval "
        f"summar{'y' if len(evals) == 1 else 'ies'} from ./{DEFAULT_EVALS} (oldest first: the baseline is the first)",
        flush=True,
    )
    return runs, evals


def read_metrics(run_dir: str) -> list[dict]:
    """The steps logged in run_dir/metrics.jsonl; an unreadable line (a crash mid-write) is skipped with a warning."""
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                warnings.warn(f"{run_dir}/metrics.jsonl:{n}: not JSON, skipped")
    return rows


# What a score was measured on: a delta between two policies needs the same examples, scored the same way.
BASIS = "dataset split limit n temperature num_samples n_prompts_evaluated n_instructions_evaluated".split()


def eval_table(summaries: list[dict]) -> tuple[list[str], list[tuple[str, dict]], dict]:
    """(columns "task/metric", rows (label, {column: value}), bases {(label, task): BASIS values}) from eval summaries,
    rows in first-seen label order. Two summaries of one policy on one task are refused: one would hide the other."""
    columns = []
    rows = {}
    bases = {}
    for s in summaries:
        task, label = s.get("task", "eval"), s.get("label") or s.get("model", "?")
        if (label, task) in bases:
            raise ArgsError(f"two summaries for {label!r} on {task}: give each policy's result once (or --label them)")
        bases[label, task] = tuple(s.get(k) for k in BASIS)
        keys = HEADLINE.get(task) or [k for k in s if re.search(r"(accuracy|_acc)$", k)]
        for k in keys:
            col = f"{task}/{k}"
            columns += [col] if col not in columns else []
            rows.setdefault(label, {})[col] = s.get(k)
    return columns, list(rows.items()), bases


def _cell(value, base, comparable: bool = True) -> str:
    """'0.420 (+0.050)': the score and, unless this is the baseline row or a side is missing, its delta; no delta
    when the two were measured on different examples or settings (comparable=False)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if base is None or (isinstance(base, float) and math.isnan(base)):
        return f"{value:.3f}"
    return f"{value:.3f} ({value - base:+.3f})" if comparable else f"{value:.3f} (not comparable)"


def table_cells(
    columns: list[str], rows: list[tuple[str, dict]], bases: dict | None = None, baseline: str | None = None
) -> list[list[str]]:
    """Header + one row of strings per policy; deltas are against the baseline policy's scores (its label; None: the
    first row's), where both were measured on the same BASIS (bases from eval_table; None: assume they were). The
    baseline's row is marked "(baseline)" and has no deltas."""
    labels = [label for label, _ in rows]
    if baseline is not None and baseline not in labels:
        raise ArgsError(f"--baseline {baseline}: no such policy in --evals (their labels: {', '.join(labels)})")
    baseline = baseline if baseline is not None else (labels[0] if labels else None)
    base = dict(rows).get(baseline, {})
    out = [["policy", *columns]]
    for label, scores in rows:
        cells = []
        for c in columns:
            task = c.rsplit("/", 1)[0]
            same = bases is None or bases.get((label, task)) == bases.get((baseline, task))
            cells.append(_cell(scores.get(c), None if label == baseline else base.get(c), same))
        out.append([f"{label} (baseline)" if label == baseline else label, *cells])
    return out


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: s_t = w s_(t-1) + (1 - w) x_t from s_0 = 0, divided by 1 - w^t so that the start
    is not pulled toward 0 (an unbiased running mean of the first points)."""
    out = []
    s = 0.0
    for t, x in enumerate(values, 1):
        s = weight * s + (1 - weight) * x
        out.append(s / (1 - weight**t))
    return out


MIN_EMA_POINTS = 10  # below this an EMA trails the values by much of their range and is read as the value


def run_kind(name: str) -> str:
    """The algorithm a run dir belongs to: its exp_name, the part of runs/<exp_name>__<model>__<seed>__<time> before
    the first "__" (a dir named otherwise is its own kind)."""
    return name.split("__")[0]


def curve_figure(histories: dict[str, list[dict]], metric: str, smoothing: float = 0.6):
    """A matplotlib figure of `metric` against step: one panel per run kind, one raw line (faint) and its EMA
    (bold) per run, or the raw line alone (solid) for a run of fewer than MIN_EMA_POINTS points; None when no run
    logged the metric."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series = {name: [(r["step"], r[metric]) for r in rows if metric in r] for name, rows in histories.items()}
    kinds: dict[str, dict] = {}
    for name, pts in series.items():
        if pts:
            kinds.setdefault(run_kind(name), {})[name] = pts
    if not kinds:
        return None
    cols = min(len(kinds), 3)
    rows = math.ceil(len(kinds) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.4 * rows), dpi=100, squeeze=False)
    for ax, (kind, runs) in zip(axes.flat, kinds.items()):
        for i, (name, pts) in enumerate(runs.items()):
            steps, values = zip(*pts)
            color = f"C{i}"
            smooth = smoothing > 0 and len(pts) >= MIN_EMA_POINTS  # on a few points the EMA is read as the value
            ax.plot(
                steps,
                values,
                color=color,
                alpha=0.35 if smooth else 1.0,
                marker="." if len(pts) < 30 else None,
                label=None if smooth else name,
            )
            if smooth:
                ax.plot(
                    steps, ema(list(values), smoothing), color=color, linewidth=2, label=f"{name} (EMA {smoothing})"
                )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers: no 2.5 ticks
        ax.set(xlabel="step", ylabel=metric, title=f"{kind}: {metric}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    for ax in list(axes.flat)[len(kinds) :]:
        ax.set_visible(False)  # the empty cells of the last row
    fig.tight_layout()
    return fig


def plot_curves(histories: dict[str, list[dict]], metric: str, path: str, smoothing: float = 0.6) -> bool:
    """Write curve_figure() as a PNG; False (nothing written) when no run logged `metric`."""
    if (fig := curve_figure(histories, metric, smoothing)) is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)
    return True


DELTAS_NOTE = (
    "Deltas in parentheses are against the row marked (baseline) (--baseline; default the first --evals entry); "
    "none (not comparable) where the two were measured on a different dataset, split, limit, number of scored "
    "examples or sampling."
)
RUNS_NOTE = "Each metric column is the run's value at its last logged step (the curves below show every step)."


def to_markdown(title: str, cells: list[list[str]], finals: list[list[str]], plots: dict[str, str]) -> str:
    def table(rows):
        if len(rows) < 2:
            return "(none)\n"
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]]) + "\n"

    parts = [
        f"# {title}\n",
        f"Generated {time.strftime('%Y-%m-%d %H:%M')}.\n",
        "## Eval scores\n",
        DELTAS_NOTE + "\n",
        table(cells),
        "## Training runs\n",
        RUNS_NOTE + "\n",
        table(finals),
    ]
    parts += [f"### {metric}\n\n![{metric}]({os.path.basename(png)})\n" for metric, png in plots.items()]
    return "\n".join(parts)


def to_html(title: str, cells: list[list[str]], finals: list[list[str]], plots: dict[str, str]) -> str:
    """One page with no external assets: styles inline, every PNG as a base64 data URI."""

    def table(rows):
        if len(rows) < 2:
            return "<p>(none)</p>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
        return f"<div class='wide'><table><tr>{head}</tr>{body}</table></div>"

    images = []
    for metric, png in plots.items():
        with open(png, "rb") as f:
            data = base64.b64encode(f.read()).decode()
        images.append(
            f'<h3>{html.escape(metric)}</h3><img alt="{html.escape(metric)}" src="data:image/png;base64,{data}">'
        )
    # A three-panel curve is wider than the page: images scale down to the page's width (never cropped), and a
    # table wider than the window scrolls inside its box instead of pushing the whole page sideways.
    style = (
        "body{font-family:sans-serif;max-width:960px;margin:2em auto;padding:0 1em}img{max-width:100%;height:auto}"
        ".wide{overflow-x:auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child{text-align:left}"
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1><h2>Eval scores</h2>"
        f"<p>{html.escape(DELTAS_NOTE)}</p>{table(cells)}<h2>Training runs</h2>"
        f"<p>{html.escape(RUNS_NOTE)}</p>{table(finals)}{''.join(images)}</body></html>"
    )


def main(args: Args) -> dict:
    # ---- 1 inputs: eval summaries and run logs, all checked before anything is read or written
    if not 0 <= args.smoothing < 1:
        raise ArgsError(f"--smoothing {args.smoothing}: the EMA weight must be in [0, 1)")
    if not args.runs and not args.evals:  # the folders the scripts and evals write by default
        runs, evals = default_inputs()
        args = dataclasses.replace(args, runs=runs, evals=evals)
    missing = [p for p in args.evals if not os.path.isfile(p)]
    missing += [log for log in (os.path.join(r, "metrics.jsonl") for r in args.runs) if not os.path.isfile(log)]
    if missing:
        raise FileNotFoundError(
            f"not found: {', '.join(missing)} (--evals takes the summary JSONs evals.gsm8k / "
            "evals.ifeval write, --runs run dirs holding metrics.jsonl)"
        )
    summaries = []
    for path in args.evals:
        with open(path) as f:
            summaries.append(json.load(f))
    histories = {os.path.basename(os.path.normpath(r)): read_metrics(r) for r in args.runs}

    # ---- 2 tables: eval scores with deltas; each run's length and last logged value of each plotted metric
    cells = table_cells(*eval_table(summaries), args.baseline)
    logged = {k for rows in histories.values() for r in rows for k in r}
    wanted = [*args.metrics, *sorted(k for k in logged if k.startswith("eval/"))]
    metrics = [m for m in dict.fromkeys(wanted) if m in logged]
    finals = [["run", "last step", *metrics]]
    for name, rows in histories.items():
        last = {m: next((r[m] for r in reversed(rows) if m in r), None) for m in metrics}
        values = ["–" if last[m] is None else f"{last[m]:.4g}" for m in metrics]
        finals.append([name, str(rows[-1]["step"] if rows else 0), *values])

    # ---- 3 curves, then the two documents
    os.makedirs(args.out, exist_ok=True)
    plots = {}
    for metric in metrics:
        png = os.path.join(args.out, re.sub(r"[^A-Za-z0-9._-]+", "_", metric) + ".png")
        if plot_curves(histories, metric, png, args.smoothing):
            plots[metric] = png
    paths = {"markdown": os.path.join(args.out, "report.md"), "html": os.path.join(args.out, "report.html")}
    with open(paths["markdown"], "w") as f:
        f.write(to_markdown(args.title, cells, finals, plots))
    with open(paths["html"], "w") as f:
        f.write(to_html(args.title, cells, finals, plots))
    print(f"report: {len(cells) - 1} policies, {len(histories)} runs, {len(plots)} plots -> {paths['html']}")
    return {**paths, "plots": plots, "table": cells, "runs": finals}


if __name__ == "__main__":
    with one_line_errors():  # a missing input or a bad setting: one line, no traceback
        main(tyro.cli(Args))

"""evals/ under torchrun: `torchrun --nproc-per-node 2 -m evals.gsm8k / evals.ifeval` equals one process.

Rank r of N generates rows r, r + N, ...; the completions are gathered back into the row order on every rank, every
rank scores all of them and returns rank 0's summary, and rank 0 alone writes and prints. Greedy decoding is the same
split or not only up to the float32 rounding of the batch's shape: a rank's batches hold other rows, so the left
padding and the matmul shapes change (the size is in docs/usage.md, "Evaluation under torchrun"). A greedy token
flips only where its two best logits are that close, and no step of the tiny model on the rows below is, so the per-row
completions must be equal exactly, and so must the scores (functions of the completions; no tolerance)."""

import json
import os
import subprocess
import sys

import pytest

import evals.common_eval as common_eval
import evals.gsm8k as gsm8k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("time_s", "load_s", "created", "outputs")  # what differs between two runs of the same eval


def torchrun(args: list[str]) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 <args>` from the repo root on the CPU (gloo), one thread a rank;
    --standalone: a free rendezvous port, so runs side by side do not collide on torchrun's default 29500."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def read_results(folder, stem: str) -> tuple[list[dict], dict]:
    """(per-row records, summary) an eval wrote to folder; the folder must hold exactly that one set of files."""
    assert sorted(os.listdir(folder)) == [f"{stem}.json", f"{stem}.jsonl"]
    with open(folder / f"{stem}.jsonl") as f:
        records = [json.loads(line) for line in f]
    with open(folder / f"{stem}.json") as f:
        summary = json.load(f)
    return records, summary


def test_gather_rows_restores_the_row_order(monkeypatch):
    rows = list(range(10))
    # all_gather of [mine] on 3 ranks: each rank's list, in rank order (rank r held rows r, r + 3, ...)
    monkeypatch.setattr(common_eval, "all_gather", lambda items: [rows[r::3] for r in range(3)])
    assert common_eval.gather_rows(rows[1::3], 3) == rows
    assert common_eval.gather_rows(rows, 1) == rows  # alone: no collective, the rows as they are


@pytest.mark.slow
def test_gsm8k_on_two_ranks_equals_one_process(tiny_model_dir, shared_data, tmp_path):
    flags = dict(
        model=tiny_model_dir,
        dataset=str(shared_data / "gsm8k" / "test.jsonl"),
        limit=5,  # odd: rank 0 takes 3 rows, rank 1 two
        max_new_tokens=8,
        batch_size=2,
        label="tiny",
    )
    alone = gsm8k.main(gsm8k.Args(**flags, output_dir=str(tmp_path / "alone")))
    cli = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    done = torchrun(["-m", "evals.gsm8k", *cli, f"--output-dir={tmp_path / 'split'}"])
    records, summary = read_results(tmp_path / "split", "tiny__gsm8k")
    assert records == alone["records"]  # every row's completion, extracted answer and verdict, in the row order
    # accuracy, n, correct, unscored (and every setting) exactly
    assert {k: v for k, v in summary.items() if k not in TIMING} == {k: alone[k] for k in summary if k not in TIMING}
    assert done.stdout.count("gsm8k: accuracy") == 1  # rank 0 alone prints
    # each rank generated for its share only: rows 0, 2, 4 and rows 1, 3
    assert "generate: 3 prompts in 2 batches" in done.stderr and "generate: 2 prompts in 1 batches" in done.stderr


@pytest.mark.slow
def test_ifeval_on_two_ranks_equals_one_process(tiny_model_dir, shared_data, tmp_path):
    pytest.importorskip("if_verifiable", reason="evals.ifeval needs `pip install if-verifiable`")
    import evals.ifeval as ifeval

    flags = dict(
        model=tiny_model_dir,
        dataset=str(shared_data / "ifeval" / "input_data.jsonl"),
        limit=3,  # rank 0 takes prompts 0 and 2, rank 1 prompt 1
        max_new_tokens=8,
        batch_size=2,
        label="tiny",
    )
    alone = ifeval.main(ifeval.Args(**flags, output_dir=str(tmp_path / "alone")))
    cli = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    done = torchrun(["-m", "evals.ifeval", *cli, f"--output-dir={tmp_path / 'split'}"])
    records, summary = read_results(tmp_path / "split", "tiny__ifeval")
    assert records == alone["records"]  # each prompt's response and every instruction's strict / loose verdict
    assert {k: v for k, v in summary.items() if k not in TIMING} == {k: alone[k] for k in summary if k not in TIMING}
    assert done.stdout.count("ifeval: prompt_level_strict_acc") == 1  # rank 0 alone prints


WORKER = """
import json, os, sys
import tyro
import evals.gsm8k as gsm8k

rank, out = os.environ["RANK"], sys.argv[1]
write_results = gsm8k.write_results

def writing(*args, **kwargs):  # who writes the result files
    open(os.path.join(out, f"writer-{rank}"), "w").close()
    return write_results(*args, **kwargs)

gsm8k.write_results = writing
result = gsm8k.main(tyro.cli(gsm8k.Args, args=sys.argv[2:]))
with open(os.path.join(out, f"return-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


@pytest.mark.slow
def test_every_rank_returns_the_same_and_rank_0_alone_writes(tiny_model_dir, tmp_path):
    """Sampled (2 per question): each rank draws from its own stream (seed + rank), so the completions are not one
    process's, but a question's samples stay together in the row order and every rank returns the same dict."""
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "out").mkdir()
    flags = ["--dataset=builtin:math", "--limit=3", "--max-new-tokens=5", "--temperature=1.0", "--num-samples=2"]
    results = tmp_path / "results"
    torchrun(
        [str(tmp_path / "worker.py"), str(tmp_path / "out"), f"--model={tiny_model_dir}", *flags, "--label=tiny"]
        + [f"--output-dir={results}"]
    )
    assert sorted(os.listdir(tmp_path / "out")) == ["return-0.json", "return-1.json", "writer-0"]
    assert (tmp_path / "out" / "return-0.json").read_text() == (tmp_path / "out" / "return-1.json").read_text()
    records, summary = read_results(results, "tiny__builtin-math")
    with open(tmp_path / "out" / "return-0.json") as f:
        returned = json.load(f)
    assert returned["records"] == records and returned["accuracy"] == summary["accuracy"] and summary["n"] == 6
    questions = [row["question"] for row in common_eval.gsm8k_rows("builtin:math", limit=3)]
    assert [r["question"] for r in records] == [q for q in questions for _ in range(2)]

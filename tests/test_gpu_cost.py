"""What the GPU path costs, counted on a CPU (issue #49's guards; tests/gpu_cost.py counts). The `gpu_shapes` fixture
gives this CPU a GPU's shapes (common.model.BUCKETS["cpu"], as "cuda" has it): the rollout's static decode (no row
dropped, a fixed-capacity cache, prompts padded to the bucket, the stop read every 8 tokens) and bucketed one-pass
training passes. What a GPU adds on top, the decode step captured as a CUDA graph, is bench/gpu_check.sh's to
measure. No timings: counts of aten ops and host reads per decode token and per micro-batch, and of attention calls
with a shape never seen before, against model.generate at the same sizes."""

import json

import pytest
import torch

import common.model
import grpo
import harness.run
from common.model import attach_lora, load_model
from common.rollout import hf_generate
from tests.gpu_cost import counting
from tests.test_grpo import run as run_grpo
from tests.tiny import write_tiny

SHORT, LONG = 16, 32  # rollout lengths: a per-token figure is the difference of the two over LONG - SHORT
PROMPTS = ["hello world the quick", "What is 12 plus"]
OTHER_PROMPTS = ["Tom has 3 apples and buys 4 more. How many", "Say hi"]  # other widths, the same 64-token bucket


@pytest.fixture
def gpu_shapes(monkeypatch):
    """This CPU runs a GPU's shapes (common.model.BUCKETS)."""
    monkeypatch.setitem(getattr(common.model, "BUCKETS", {}), "cpu", 64)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """A 4-layer tiny Qwen2 in bf16 (a GPU's dtype: the CPU rollout's float32 packing does not apply) and prompts."""
    model, tokenizer = load_model(write_tiny(tmp_path_factory.mktemp("gpu_cost"), layers=4), dtype="bf16")
    model.eval()
    return model, tokenizer, [tokenizer(p)["input_ids"] for p in PROMPTS]


def per_token(model, rollout) -> tuple[float, float]:
    """(aten ops, host reads) a decode token: rollout(T)'s counts at LONG tokens less those at SHORT, over LONG -
    SHORT (the prefill and the rollout's setup cancel). rollout(T) returns the completions' longest length."""
    counts = {}
    for tokens in (SHORT, LONG):
        torch.manual_seed(0)
        with counting(device=[model]) as c:
            longest = rollout(tokens)
        assert longest == tokens, "the test needs a row that runs to the end"
        counts[tokens] = (c.ops, c.syncs)
    return tuple((counts[LONG][i] - counts[SHORT][i]) / (LONG - SHORT) for i in range(2))


def generate_without_lora(model, tokenizer, prompts, tokens: int, group_size: int = 4) -> int:
    """model.generate's sampled rollout of prompts x group_size rows, left-padded, exactly `tokens` new tokens."""
    rows = [p for p in prompts for _ in range(group_size)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows]).to(model.device)
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]).to(model.device)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=True,
            top_k=0,
            pad_token_id=pad,
        )
    return out.shape[1] - width


def test_a_decode_token_costs_no_more_ops_with_lora_than_generate_without_and_reads_the_host_every_8(bf16, gpu_shapes):
    """Per decode token, our rollout of a LoRA policy (the adapters merged for the rollout) issues at most the aten
    ops model.generate issues for the bare model (a GPU launches one kernel per non-view op: an unmerged LoRA doubles
    them), and reads the host at most once every 8 tokens (model.generate: once a token; main's loop: twice)."""
    model, tokenizer, prompts = bf16
    generate_ops, generate_syncs = per_token(model, lambda t: generate_without_lora(model, tokenizer, prompts, t))
    policy = attach_lora(model, dropout=0.0)
    try:
        with torch.no_grad():  # a trained adapter, not PEFT's zero init (merging must not hinge on B = 0)
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))

        def ours(tokens):
            out = hf_generate(policy, tokenizer, prompts, 4, temperature=1.0, max_new_tokens=tokens)
            return max(map(len, out["completion_ids"]))

        ops, syncs = per_token(policy, ours)
    finally:
        policy.unload()  # the module's model is the bare one again
    print(f"per decode token: ours with LoRA {ops:.1f} ops, {syncs:.3f} host reads; generate without LoRA "
          f"{generate_ops:.1f} ops, {generate_syncs:.3f} host reads")  # fmt: skip
    assert ops <= generate_ops
    assert syncs <= 1 / 8


def test_a_rollout_after_the_first_meets_no_attention_shape_it_has_not_seen(bf16, gpu_shapes):
    """cuDNN's attention builds a plan on the host for each new (shape, stride); a GPU's rollout keeps its shapes
    (a fixed-capacity cache attended whole, prompts padded to the bucket), so a second rollout with other prompt
    widths in the same bucket meets none it has not seen, where model.generate meets one per token."""
    model, tokenizer, prompts = bf16
    other = [tokenizer(p)["input_ids"] for p in OTHER_PROMPTS]
    assert {len(p) for p in other}.isdisjoint({len(p) for p in prompts})
    seen = {"generate": set(), "ours": set()}
    new = {}
    for engine in ("generate", "ours"):
        for batch in (prompts, other):
            torch.manual_seed(0)
            with counting(seen[engine], device=[model]) as c:
                if engine == "generate":
                    generate_without_lora(model, tokenizer, batch, SHORT)
                else:
                    hf_generate(model, tokenizer, batch, 4, temperature=1.0, max_new_tokens=SHORT)
            new[engine] = c.new_attention  # the second rollout's
    print(f"new attention shapes in a second rollout: ours {new['ours']}, model.generate {new['generate']}")
    assert new["generate"] >= SHORT - 1  # the bound is real: generate meets a new key length every token
    assert new["ours"] == 0


# --------------------------------------------------------------------------------------------- a GRPO step
@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """Prompts of different lengths, so that each step's prompt widths differ."""
    path = tmp_path_factory.mktemp("gpu_cost_data") / "prompts.jsonl"
    questions = ["What is 12 plus 7?", "Say hello to everyone in the room", "Tom has 3 apples.", "Name a colour"]
    with open(path, "w") as f:
        for q in questions + ["Count to 3 and then stop", "Hi"]:
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n")
    return str(path)


def phase_counts(tiny_model_dir, dataset, tmp_path, monkeypatch, **kw) -> list[dict]:
    """A 3-step GRPO run's counts, one dict per step: per phase (rollout, reward, reference, train) the host reads
    and the attention calls with a shape never seen before in the run."""
    steps = []
    last = {"timer": None, "reads": 0, "new": 0}  # at the previous mark
    mark = harness.run.PhaseTimer.mark

    def counted_mark(timer, phase):
        if timer is not last["timer"]:  # a step's first mark
            steps.append({})
            last["timer"] = timer
        step = steps[-1]
        reads, new = step.get(phase, (0, 0))
        step[phase] = (reads + counts.syncs - last["reads"], new + counts.new_attention - last["new"])
        last["reads"] = counts.syncs
        last["new"] = counts.new_attention
        return mark(timer, phase)

    monkeypatch.setattr(harness.run.PhaseTimer, "mark", counted_mark)
    settings = dict(rewards=["length"], group_size=4, max_completion_length=24, temperature=1.0, max_steps=3)
    with counting() as counts:
        run_grpo(tiny_model_dir, dataset, tmp_path, save_steps=0, **settings | kw)
    return steps


def test_grpo_steps_after_the_first_meet_no_attention_shape_they_have_not_seen(
    tiny_model_dir, prompts_file, tmp_path, monkeypatch, gpu_shapes
):
    """Each step's prompts and completions have other lengths; a GPU's passes round them up to the bucket (the
    rollout, the reference pass and the training pass alike), so after the first step no attention call has a
    shape the run has not met: a bucketed pass's count."""
    steps = phase_counts(tiny_model_dir, prompts_file, tmp_path, monkeypatch, groups_per_micro_batch=1)
    new = [{phase: n for phase, (_, n) in step.items()} for step in steps]
    print(f"new attention shapes per step and phase: {new}")
    assert sum(new[0].values()) > 0
    assert all(sum(step.values()) == 0 for step in new[1:]), new


def test_a_grpo_micro_batch_reads_the_host_at_most_once(
    tiny_model_dir, prompts_file, tmp_path, monkeypatch, gpu_shapes
):
    """The same steps in 2 micro-batches of one group or 1 of two: a micro-batch more may read the host at most once
    more, in the training pass (forward, loss, backward, the logged sums) and in the reference pass (the loss and
    the token sums stay on the device until the update reads them)."""
    runs = {}
    for groups in (1, 2):
        steps = phase_counts(
            tiny_model_dir, prompts_file, tmp_path / str(groups), monkeypatch, groups_per_micro_batch=groups
        )
        runs[groups] = {phase: sum(s[phase][0] for s in steps[1:]) for phase in ("reference", "train")}
    extra = (3 - 1) * (2 - 1)  # steps 2 and 3, one micro-batch more in each
    print(f"host reads in steps 2-3: 2 micro-batches a step {runs[1]}, 1 a step {runs[2]}")
    for phase in ("reference", "train"):
        assert runs[1][phase] - runs[2][phase] <= extra, phase


# ------------------------------------------------------------------------------------- timers and micro-batches
def test_phase_timers_on_a_gpu_charge_the_devices_time_and_wait_once_a_step(monkeypatch):
    """On CUDA a PhaseTimer mark records an event in the device's queue and waits for nothing; metrics() waits once,
    for the step's last event, and charges each phase the device's time from the mark before it (work a phase
    launched is its own, even when the device runs it while the host is in the next phase)."""

    class Event:  # a CUDA event on a clock the test moves
        clock = 0.0
        waits = []

        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.t = Event.clock

        def synchronize(self):
            Event.waits.append(self.t)

        def elapsed_time(self, end):  # milliseconds, as CUDA's
            return (end.t - self.t) * 1000

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = harness.run.PhaseTimer()
    for phase, seconds in (("rollout", 2.0), ("train", 0.5), ("rollout", 1.0)):
        Event.clock += seconds
        timer.mark(phase)
    assert Event.waits == []
    metrics = timer.metrics(10)
    assert Event.waits == [3.5]
    assert metrics["time/rollout"] == 3.0 and metrics["time/train"] == 0.5


def test_a_gpu_run_takes_the_most_groups_per_micro_batch_its_plan_fits(prompts_file, capsys):
    """--groups-per-micro-batch None: on a GPU (here: planned for one, --gpu-memory) the most of a step's groups whose
    memory plan fits the card, halving from all of them (one forward and backward for all rows when they fit); on a
    CPU 1; a value given is kept. The headline command at 80 and 24 GiB."""
    from harness.memory import fit_knob

    tried = []

    def plan(args):
        tried.append(args.groups_per_micro_batch)
        return {}, args.groups_per_micro_batch <= 3

    on_card = grpo.Args(gpu_memory=24.0)
    assert fit_knob(on_card, "groups_per_micro_batch", 8, plan).groups_per_micro_batch == 2 and tried[:3] == [8, 4, 2]
    tried.clear()
    assert fit_knob(grpo.Args(), "groups_per_micro_batch", 8, plan).groups_per_micro_batch == 1  # a CPU
    kept = grpo.Args(gpu_memory=24.0, groups_per_micro_batch=8)
    assert fit_knob(kept, "groups_per_micro_batch", 8, plan).groups_per_micro_batch == 8 and tried == []

    def with_checkpointing_only(args):  # nothing fits without checkpointing, 4 groups with it
        return {}, args.gradient_checkpointing and args.groups_per_micro_batch <= 4

    assert fit_knob(on_card, "groups_per_micro_batch", 8, with_checkpointing_only).groups_per_micro_batch == 4
    chosen = {}
    for card in (80.0, 24.0):
        args = grpo.Args(
            model="Qwen/Qwen2.5-1.5B",
            dataset=prompts_file,
            rewards=["length"],
            group_size=4,
            plan=True,
            gpu_memory=card,
        )
        grpo.main(args)
        printed = capsys.readouterr().out
        chosen[card] = int(printed.split("micro-batch ")[1].split()[0])
    assert chosen[80.0] > chosen[24.0] >= 1, chosen


# Host reads a micro-batch may make: one per pass through the model (common.model.sequence_logps reads how many tokens
# it scores and whether the rows are right-padded, in one go); rm's reward head reads none. dpo: the reference pass and
# the policy's; kto: the policy's no-grad pass of the mismatched rows, the reference's two and the policy's.
PASSES = {"sft": 1, "dpo": 2, "orpo": 1, "kto": 4, "rm": 0}


@pytest.mark.parametrize("script", sorted(PASSES))
def test_a_micro_batch_reads_the_host_once_a_pass(script, tiny_model_dir, tmp_path, gpu_shapes):
    """The same 2 steps with --gradient-accumulation-steps 1 and 2: each micro-batch more may read the host at most
    once per pass through the model (the loss, token counts and metrics stay on the device, or come from the host's
    own rows, until the step reads them)."""
    import importlib

    from tests.test_nonfinite import data_for

    module = importlib.import_module(script)
    reads = {}
    for ga in (1, 2):
        args = module.Args(
            model=tiny_model_dir,
            dataset=data_for(script, tmp_path),
            output_dir=str(tmp_path / f"runs{ga}"),
            max_steps=2,
            save_steps=0,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=ga,
        )
        with counting() as counts:
            module.main(args)
        reads[ga] = counts.syncs
    print(f"{script}: host reads in 2 steps, 1 micro-batch a step {reads[1]}, 2 a step {reads[2]}")
    assert reads[2] - reads[1] <= 2 * PASSES[script]


@pytest.mark.lane2
def test_the_gpu_check_dry_run_returns_every_stages_table(tmp_path):
    """bench/gpu_check.sh --dry-run: every stage of the device check (setup, quick, headline, ours against TRL,
    generation, memory, the reference swap) runs cut down on this CPU and appends its table to gpu_check.md, in at
    most 8 files (what the device tool returns)."""
    import os
    import subprocess

    out = tmp_path / "gpu_check"
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], capture_output=True, text=True, env=env,
                          timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = (out / "gpu_check.md").read_text()
    for stage in ("quick", "headline", "trl", "generation", "memory", "reference"):
        assert f"## {stage}: exit 0" in summary, summary
    assert "| tiny, 2 x 2 x 32 tokens, 2 steps |" in summary and "| ours / TRL |" in summary
    assert "| decode |" in summary and "| grpo | qwen-tiny-shapes |" in summary
    assert len(os.listdir(out)) <= 8, os.listdir(out)

"""Dropout masks keyed to the global micro-batch (common.distributed.keyed_stream): a key gives its own masks, the
outer stream is left as it was, and gradient checkpointing's recompute draws the masks its forward drew. That N ranks
then equal one process with dropout on is tests/test_distributed.py's."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

from common.distributed import keyed_stream
from sft import Args, main


def masks(*key) -> torch.Tensor:
    with keyed_stream(*key):
        return F.dropout(torch.ones(32, 32), 0.5)


def test_a_key_gives_its_own_masks_and_leaves_the_outer_stream_as_it_was():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = masks(1, 7)
    assert torch.equal(torch.get_rng_state(), before), "the block moved the outer stream"
    torch.rand(1000)  # the outer stream moves on (sampling, another rank's draws): the key's masks stay
    assert torch.equal(masks(1, 7), first)
    for other in [(1, 8), (2, 7), (1, 7, "kl"), (1, 0, 7)]:  # another micro-batch, seed or pass
        assert not torch.equal(masks(*other), first), other
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    masks(1, 7)
    assert torch.equal(torch.rand(3), expected), "the outer stream's next draws changed"


@pytest.mark.numerics
def test_gradient_checkpointing_recomputes_the_keyed_masks(tiny_model_dir, tmp_path):
    """With LoRA dropout on, the step's gradients with gradient checkpointing equal those without (fp32 rounding): the
    recompute in backward restores the random state its forward drew from, which was the keyed stream's. Dropout 0
    gives other gradients, so the masks were compared."""
    data = tmp_path / "rows.jsonl"
    with open(data, "w") as f:
        for i, w in enumerate(["red", "blue", "green", "yes"]):
            prompt = [{"role": "user", "content": f"Say {i}"}]
            f.write(json.dumps({"prompt": prompt, "completion": [{"role": "assistant", "content": w}]}) + "\n")
    grads = []

    def record(optimizer, args, kwargs):
        grads.append([p.grad.clone() for group in optimizer.param_groups for p in group["params"]])

    hook = register_optimizer_step_pre_hook(record)
    try:
        for name, checkpointing, dropout in (("plain", False, 0.1), ("ckpt", True, 0.1), ("none", False, 0.0)):
            kw = dict(model=tiny_model_dir, dataset=str(data), output_dir=str(tmp_path / name), max_steps=2, seed=1)
            main(Args(**kw, per_device_train_batch_size=2, gradient_checkpointing=checkpointing, lora_dropout=dropout))
    finally:
        hook.remove()
    plain, ckpt, none = grads[0:2], grads[2:4], grads[4:6]
    for a_step, b_step in zip(plain, ckpt, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(plain[1], none[1], strict=True))

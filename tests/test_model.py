"""The dual-adapter backbone: snapshot_ref / as_reference / trainable set / save-load / checkpoints."""

import importlib.util
import inspect
import os
import shutil
import subprocess
import sys

import pytest
import torch

from harness.errors import CorruptCheckpointError
from harness.fast_help import require
from common.model import (
    DEFAULT,
    REF,
    as_reference,
    attach_lora,
    cache_kwarg,
    is_checkpointing,
    load_model,
    snapshot_ref,
    trainable_parameters,
    unwrap,
)
from common.completions import disable_dropout
from tests.conftest import ROOT
from harness.checkpoints import (
    Checkpoints,
    adapter_hash,
    list_checkpoints,
    load_weights,
    resolve_checkpoint,
    run_identity,
    save_weights,
)


def lora_model(path, init_nonzero=True):
    model, tok = load_model(path)
    model = attach_lora(model, r=4, alpha=8, dropout=0.1)
    if init_nonzero:  # PEFT zero-inits lora_B; make "default" differ from the base so the tests can see it
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    return model, tok


def base_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def slot_state(model, slot):
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{slot}." in n}


def trainable_names(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def logits(model, ids):
    return model(input_ids=ids).logits


def test_snapshot_then_train_keeps_ref_and_base_bit_identical(tiny_model_dir):
    torch.manual_seed(0)
    model, _ = lora_model(tiny_model_dir)
    ids = torch.randint(3, 300, (2, 12))
    snapshot_ref(model)
    model.eval()
    with torch.no_grad():
        policy = logits(model, ids)
    with as_reference(model):
        ref = logits(model, ids)
    assert torch.equal(policy, ref), "right after snapshot_ref the reference must equal the policy exactly"

    base0, ref0, default0 = base_state(model), slot_state(model, REF), slot_state(model, DEFAULT)
    names0 = trainable_names(model)
    assert names0 and all(f".{DEFAULT}." in n for n in names0)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    model.train()
    for _ in range(3):
        with as_reference(model):
            ref_out = logits(model, ids)
        assert not ref_out.requires_grad
        loss = logits(model, ids).logsumexp(-1).mean() - ref_out.mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert trainable_names(model) == names0
    assert all(torch.equal(base0[n], p) for n, p in base_state(model).items()), "base weights changed"
    assert all(torch.equal(ref0[n], p) for n, p in slot_state(model, REF).items()), "'ref' adapter changed"
    assert any(not torch.equal(default0[n], p) for n, p in slot_state(model, DEFAULT).items()), "'default' unchanged"
    model.eval()
    with torch.no_grad():
        moved = logits(model, ids)
    with as_reference(model):
        assert torch.equal(logits(model, ids), ref), "reference logits moved with training"
    assert not torch.allclose(moved, ref)


def test_as_reference_restores_everything_when_the_body_raises(tiny_model_dir):
    model, _ = lora_model(tiny_model_dir)
    snapshot_ref(model)
    model.train()
    names0 = trainable_names(model)
    with pytest.raises(ZeroDivisionError):
        with as_reference(model):
            assert model.active_adapter == REF and not model.training and not torch.is_grad_enabled()
            raise ZeroDivisionError  # an exception inside: the state must still be restored
    assert trainable_names(model) == names0
    assert model.active_adapter == DEFAULT and model.training and torch.is_grad_enabled()


def test_a_full_fine_tunes_reference_is_the_starting_weights_bit_for_bit(tiny_model_dir):
    """Full fine-tuning: snapshot_ref keeps the starting weights in CPU memory and as_reference swaps them in, one
    tensor at a time (on a GPU the card never holds two backbones; here, on the CPU, the swap is of tensors alone).
    After updates the reference is the starting policy exactly, and the trained weights, their gradients and the
    optimizer's states come back untouched, also when the block raises."""
    torch.manual_seed(0)
    model, _ = load_model(tiny_model_dir)
    ids = torch.randint(3, 300, (2, 12))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        start_logits = logits(model, ids)
    snapshot_ref(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(3):
        with as_reference(model):
            assert not model.training and not torch.is_grad_enabled()
            ref_out = logits(model, ids)
        assert model.training and torch.is_grad_enabled() and torch.equal(ref_out, start_logits)
        loss = logits(model, ids).logsumexp(-1).mean() - ref_out.mean()
        loss.backward()
        opt.step()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(not torch.equal(trained[n], start[n]) for n in start), "every weight should have moved"
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    with pytest.raises(ZeroDivisionError), as_reference(model):
        assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
        assert torch.equal(logits(model, ids), start_logits)
        raise ZeroDivisionError  # an exception inside: the trained weights must still come back
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), moments, strict=True))
    assert all(torch.equal(unwrap(model).reference_weights[n], start[n]) for n in start)
    snapshot_ref(model)  # called again: the reference becomes the current policy (raft's round start)
    with as_reference(model):
        assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())


def test_reference_before_snapshot_fails_loudly(tiny_model_dir):
    model, _ = lora_model(tiny_model_dir)
    with pytest.raises(RuntimeError, match="snapshot_ref"):
        with as_reference(model):
            pass


def test_peft_set_adapter_flips_requires_grad_which_we_guard(tiny_model_dir):
    """Documents the PEFT behaviour as_reference guards against: if this stops being true, the guard is moot."""
    model, _ = lora_model(tiny_model_dir)
    snapshot_ref(model)
    model.set_adapter(REF)
    flipped = trainable_names(model)
    model.set_adapter(DEFAULT)
    assert any(f".{REF}." in n for n in flipped)
    for n, p in model.named_parameters():  # undo PEFT's flip the way as_reference does
        p.requires_grad_(f".{DEFAULT}." in n)
    with as_reference(model):
        pass
    with pytest.raises(RuntimeError, match="ref"):
        for n, p in model.named_parameters():
            if f".{REF}." in n:
                p.requires_grad_(True)
        trainable_parameters(model)


def test_adapter_save_load_roundtrip_and_plain_peft_loads_it(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, _ = lora_model(tiny_model_dir)
    snapshot_ref(model)
    save_weights(model, str(tmp_path / "w"))
    assert (tmp_path / "w" / "adapter_model.safetensors").exists()
    assert (tmp_path / "w" / "ref" / "adapter_model.safetensors").exists()
    fresh, _ = lora_model(tiny_model_dir)
    snapshot_ref(fresh)
    with torch.no_grad():  # scramble both slots so the load has to restore them
        for p in slot_state(fresh, DEFAULT).values():
            p.zero_()
    load_weights(fresh, str(tmp_path / "w"))
    assert adapter_hash(fresh, DEFAULT) == adapter_hash(model, DEFAULT)
    assert adapter_hash(fresh, REF) == adapter_hash(model, REF)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path / "w"))
    ids = torch.randint(3, 300, (1, 9))
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


def test_existing_adapter_becomes_default_and_ref(tiny_model_dir, tmp_path):
    model, _ = lora_model(tiny_model_dir)
    model.save_pretrained(str(tmp_path / "sft"))
    again, _ = load_model(tiny_model_dir)
    again = attach_lora(again, adapter=str(tmp_path / "sft"))
    assert adapter_hash(again, DEFAULT) == adapter_hash(model, DEFAULT)
    assert trainable_names(again)
    snapshot_ref(again)
    assert adapter_hash(again, REF) == adapter_hash(model, DEFAULT)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        attach_lora(load_model(tiny_model_dir)[0], adapter=str(tmp_path))


def test_disable_dropout_also_zeroes_the_attention_dropout_of_config_json():
    """Qwen2/Llama pass config.attention_dropout to functional dropout (no nn.Dropout holds it): after
    disable_dropout two forwards in train mode must agree, as they do in eval mode."""
    from tests.tiny import build_tiny_model

    model = attach_lora(build_tiny_model(300, attention_dropout=0.5, attn_implementation="eager"), dropout=0.3)
    disable_dropout(model)
    model.train()
    ids = torch.randint(3, 300, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(logits(model, ids), logits(model, ids), rtol=0, atol=0)
        model.eval()
        torch.testing.assert_close(logits(model, ids), model.train()(input_ids=ids).logits, rtol=0, atol=0)


def test_an_adapter_of_another_base_with_the_same_shapes_is_named(tiny_model_dir, tmp_path, capsys):
    """PEFT loads an adapter onto any base of the same shapes without a word: the flag check (harness.cli's
    check_adapter, before the base loads) names the two models."""
    from harness.cli import check_adapter
    from tests.tiny import write_tiny

    lora_model(tiny_model_dir)[0].save_pretrained(str(tmp_path / "sft"))
    check_adapter(str(tmp_path / "sft"), 4, 8, 0.1, tiny_model_dir)
    attach_lora(load_model(tiny_model_dir)[0], adapter=str(tmp_path / "sft"))
    assert "note:" not in capsys.readouterr().out  # its own base: nothing to say
    other = write_tiny(tmp_path / "other", seed=1)
    check_adapter(str(tmp_path / "sft"), 4, 8, 0.1, other)
    attach_lora(load_model(other)[0], adapter=str(tmp_path / "sft"))  # loads: the same shapes
    assert f"was trained on {tiny_model_dir!r}, not on --model {other!r}" in capsys.readouterr().out


def test_missing_optional_package_gives_install_hint():
    with pytest.raises(ImportError, match="pip install surely_not_installed_pkg"):
        require("surely_not_installed_pkg", "--engine vllm")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_attention_without_flash_attn_is_named_before_the_model_loads():
    """The flag checks (harness.cli.check_model_flags) name the missing package: no model is loaded first."""
    import sft

    with pytest.raises(ImportError, match="flash_attention_2 needs the optional package 'flash_attn': pip install"):
        sft.check_args(sft.Args(model="unused", attn_implementation="flash_attention_2"))


@pytest.mark.parametrize("entry", ["sft", "orpo", "kto", "dpo", "rm", "grpo", "raft", "evals.gsm8k", "evals.ifeval"])
def test_no_entry_point_imports_bitsandbytes_unless_asked(entry):
    """PEFT imports bitsandbytes when it is installed, and bitsandbytes on an AVX-512 BF16 CPU then asks the hub for a
    kernel and logs a line in every run. Each entry point imports PEFT without it; 4-bit, 8-bit and 8-bit AdamW load it
    (tests/test_quantization.py)."""
    pytest.importorskip("bitsandbytes")  # installed by --dev; without it there is nothing to hide
    loaded = "[m for m, v in sys.modules.items() if 'bitsand' in m and v]"
    code = f"import sys, {entry}; print('peft' in sys.modules, {loaded})"
    code += "; import logging; logging.getLogger('bitsandbytes.backends.cpu.ops').warning('no kernel: %s', 'offline')"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, check=True)
    assert done.stdout.split() == ["True", "[]"], done.stdout + done.stderr[-2000:]
    # what it would log once loaded (on a CPU with AVX-512 BF16, a kernel it cannot fetch) says why it was loaded
    said = "bitsandbytes (loaded for 4-bit, 8-bit or 8-bit AdamW) says: no kernel: offline"
    assert done.stderr.splitlines() == [said], done.stderr[-2000:]


def test_a_plain_run_never_loads_bitsandbytes_and_4bit_still_does(tiny_model_dir, tmp_path):
    """PEFT imports bitsandbytes again for every LoRA it creates: a whole sft run (model, LoRA, a step, final/) loads
    none of it, and the same process then loads a 4-bit base with PEFT's 4-bit LoRA layers: bitsandbytes comes back
    when asked for, whatever PEFT and transformers cached while it was hidden."""
    pytest.importorskip("bitsandbytes")
    code = (
        "import sys, collections, sft\n"
        f"sft.main(sft.Args(model={tiny_model_dir!r}, preset='demo', max_steps=1, output_dir={str(tmp_path)!r}))\n"
        "print('LOADED', [m for m, v in sys.modules.items() if 'bitsand' in m and v])\n"
        "from common.model import attach_lora, load_model\n"
        "from plugins.quantization import bnb_config\n"
        f"model = attach_lora(load_model({tiny_model_dir!r}, quantization_config=bnb_config('4bit', 'auto'))[0])\n"
        "print('LORA', sorted({type(m).__module__ for m in model.modules() if hasattr(m, 'lora_A')}))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith(("LOADED", "LORA"))]
    assert said == ["LOADED []", "LORA ['peft.tuners.lora.bnb']"], done.stdout[-2000:]
    before_4bit = done.stderr.split("bitsandbytes (loaded for")[0]
    assert "bitsandbytes" not in before_4bit and "kernels" not in before_4bit, before_4bit[-2000:]


def test_version_shims_follow_the_installed_transformers(tiny_model_dir):
    """transformers 5.17 (the GPU image) takes past_key_values and has only is_gradient_checkpointing; 5.24 renamed
    both. The shims read what the model offers, so the shared-prefix paths pass the cache under the right name."""

    class Old(torch.nn.Module):  # 5.17's signature and attribute
        is_gradient_checkpointing = True

        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    assert cache_kwarg(Old()) == "past_key_values" and is_checkpointing(Old())
    model, _ = load_model(tiny_model_dir)
    assert cache_kwarg(model) in inspect.signature(model.forward).parameters
    assert not is_checkpointing(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert is_checkpointing(model)


def test_checkpoints_are_atomic_pruned_and_verified(tiny_model_dir, tmp_path):
    model, _ = lora_model(tiny_model_dir)
    snapshot_ref(model)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-3)
    run = str(tmp_path)
    checkpoints = Checkpoints(run, run_identity(model), keep=2)
    for step in (1, 2, 3):
        checkpoints.save(step, model, opt, state={"step": step})
    assert [os.path.basename(p) for p in list_checkpoints(run)] == ["step-2", "step-3"]
    # A crash mid-save leaves a temp dir or a dir without the completion marker: both are ignored on resume.
    shutil.copytree(os.path.join(run, "checkpoints", "step-3"), os.path.join(run, "checkpoints", "step-4"))
    os.remove(os.path.join(run, "checkpoints", "step-4", "checkpoint_complete.json"))
    os.makedirs(os.path.join(run, "checkpoints", ".tmp-step-5"))
    assert resolve_checkpoint(run).endswith("step-3")
    # A tampered 'ref' is caught by the recorded hash.
    fresh, _ = lora_model(tiny_model_dir)
    resumed = Checkpoints(run, run_identity(fresh))
    step, state = resumed.resume(run, fresh, torch.optim.AdamW(trainable_parameters(fresh), lr=1e-3))
    assert step == 3 and state == {"step": 3}
    assert adapter_hash(fresh, REF) == adapter_hash(model, REF)
    from safetensors.torch import load_file, save_file

    ref_file = os.path.join(run, "checkpoints", "step-3", "weights", "ref", "adapter_model.safetensors")
    tensors = load_file(ref_file)
    key = next(iter(tensors))
    tensors[key] = tensors[key] + 1
    save_file(tensors, ref_file)
    # Named directly, the damaged newest checkpoint is refused; from a run dir it is skipped for the previous one (and,
    # newer than the step resumed, moved aside: harness.checkpoints, a resume continues its run dir).
    with pytest.raises(CorruptCheckpointError, match="hash"):
        resumed.resume(os.path.join(run, "checkpoints", "step-3"), lora_model(tiny_model_dir)[0])
    with pytest.warns(UserWarning, match="falling back"):
        assert resumed.resume(run, lora_model(tiny_model_dir)[0])[0] == 2

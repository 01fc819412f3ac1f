"""A fine-tune's controls, by torchtitan's names: microbatches accumulated to training.global_batch_size,
[lr_scheduler]'s decay to a floor, [validation] every freq steps, TensorBoard ([metrics]). Every launch
trains the tests' small model 4 steps, cosine to 0.1 x lr, validating every 2 steps, TensorBoard every
step; launches differ only in their mesh and in how the global batch is split into microbatches."""

import functools
import re
from pathlib import Path

import pytest
import torch

from conftest import _torchrun, free_port, small_config
from test_checkpoint import _step_values

CONTROLS = ("--model.num_hidden_layers", "2", "--training.seq_len", "64", "--data.max_bytes", "1000000",
            "--metrics.measure_cpu_peak", "false", "--training.steps", "4", "--validation.enable", "true",
            "--validation.freq", "2", "--validation.steps", "2", "--lr_scheduler.decay_type", "cosine",
            "--lr_scheduler.min_lr_factor", "0.1", "--metrics.enable_tensorboard", "true", "--metrics.log_freq", "1")


@functools.cache
def launch(tmp_root: str, nproc: int, local_batch: int, global_batch: int, dp_shard: int = 1) -> tuple[str, Path]:
    """(rank 0's output, the TensorBoard folder) of `nproc` ranks, each running local_batch windows at once."""
    tb = Path(tmp_root) / f"tb-{nproc}-{dp_shard}-{local_batch}-{global_batch}"
    proc = _torchrun(*CONTROLS, "--training.local_batch_size", str(local_batch), "--training.global_batch_size",
                     str(global_batch), "--parallelism.dp_shard", str(dp_shard), "--metrics.save_tb_folder", str(tb),
                     launcher=(f"--nproc_per_node={nproc}", f"--master_port={free_port()}"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, tb


def validation(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^validation: step (\d+) \| loss (\S+)", out, re.M)}


@pytest.mark.parametrize("run, reference", [
    ((1, 2, 8), (1, 8, -1)),       # one process: 4 microbatches of 2 against one batch of 8
    ((2, 2, 8), (1, 8, -1)),       # TP 2: the same
    ((4, 2, 16, 2), (1, 16, -1)),  # dp_shard 2 x tp 2: 2 ranks x 4 microbatches of 2 against one process's 16
], ids=["1proc-2x4", "tp2-2x4", "dp_shard2xtp2-2x2x4"])
def test_microbatches_give_one_step_on_the_global_batch_and_its_validation_loss(tmp_root, run, reference):
    """Accumulated microbatches: one process's losses (1e-5) and gradient norms (1e-4, as every mesh's) on
    the whole global batch (each microbatch's loss over the global count of targets), its held-out losses
    at steps 2 and 4 (held-out batches are global batches too), 1 graph and 0 recompiles."""
    out, _ = launch(tmp_root, *run)
    ref, _ = launch(tmp_root, *reference)
    assert _step_values(out, "loss") == pytest.approx(_step_values(ref, "loss"), abs=1e-5)
    assert len(_step_values(out, "loss")) == 4
    # TP's float32 sums: 2e-5 to 7e-5 off one process, with or without microbatches (RESULTS.md)
    assert _step_values(out, "grad norm") == pytest.approx(_step_values(ref, "grad norm"), rel=1e-4)
    assert sorted(validation(out)) == [2, 4], out[-3000:]
    assert validation(out) == pytest.approx(validation(ref), abs=1e-5)
    assert "compiled graphs      1 for 2 blocks" in out and "recompiles           0" in out, out[-3000:]


def test_cosine_decay_logs_each_steps_rate_and_ends_at_min_lr_factor(tmp_root):
    """The step line's lr is the rate its update used: warm-up (s + 1) / 3, then cosine from 1 to 0.1
    over steps 3-4; after step 4 the schedule is at 0.1 x lr (the summary's line)."""
    out, _ = launch(tmp_root, 1, 8, -1)
    lr = small_config()["optimizer"]["lr"]
    assert _step_values(out, "lr") == pytest.approx({1: lr / 3, 2: lr * 2 / 3, 3: lr, 4: lr * 0.55}, rel=1e-5)
    assert re.search(rf"learning rate .*, {lr * 0.1:.4g} after it \(the schedule's end\)", out), out[-2000:]


def test_the_default_schedule_is_the_linear_one_the_losses_were_measured_with():
    """[lr_scheduler]'s defaults (decay_ratio -1, linear, min_lr_factor 0) give, at every step of the
    default 40, the factor train.py had before the keys: the default run's losses stay 7.7209 -> 3.3937."""
    import train

    cfg = small_config(**{"training.steps": 40})
    _, scheduler = train.build_optimizer(torch.nn.Linear(2, 2), cfg)
    warmup, steps, lr = cfg["lr_scheduler"]["warmup_steps"], 40, cfg["optimizer"]["lr"]
    before = [(s + 1) / (warmup + 1) if s < warmup else max(0.0, 1 - (s - warmup) / max(1, steps - warmup))
              for s in range(steps + 1)]
    for s in range(steps + 1):
        assert scheduler.get_last_lr()[0] == pytest.approx(lr * before[s], rel=1e-12, abs=1e-15), s
        scheduler.optimizer.step()
        scheduler.step()


def test_tensorboard_holds_the_logged_numbers_from_rank_0_alone(tmp_root):
    """The event files, read by tensorboard's own reader: loss, lr and grad norm at every step (log_freq 1),
    the validation loss at steps 2 and 4, each as the log printed it; on TP 2, one writer (rank 0)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for run in ((1, 8, -1), (2, 2, 8)):
        out, tb = launch(tmp_root, *run)
        [folder] = tb.iterdir()  # save_tb_folder/<date-time>/
        assert len(list(folder.iterdir())) == 1, "one event file: rank 0's"
        events = EventAccumulator(str(folder))
        events.Reload()
        scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_mib", "validation_loss"} <= set(scalars)
        for tag, name in (("loss", "loss"), ("lr", "lr"), ("grad_norm", "grad norm")):  # printed to 6 digits
            assert scalars[tag] == pytest.approx(_step_values(out, name), rel=2e-6), tag
        assert scalars["validation_loss"] == pytest.approx(validation(out), rel=1e-6)


@pytest.mark.parametrize("decay_type, decay_ratio", [("linear", -1.0), ("sqrt", 0.5), ("cosine", 0.8)])
def test_after_the_warm_up_the_schedule_is_torchtitans(decay_type, decay_ratio):
    """From the warm-up's end, every step's rate is torchtitan 0.2.2's build_lr_schedulers' (its stable
    part, decay and floor); only the warm-up is train.py's own, (s + 1) / (warmup + 1)."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.config.job_config import LRScheduler

    import train

    keys = {"warmup_steps": 3, "decay_type": decay_type, "decay_ratio": decay_ratio, "min_lr_factor": 0.2}
    cfg = small_config(**{"training.steps": 20, **{f"lr_scheduler.{k}": v for k, v in keys.items()}})
    model = torch.nn.Linear(2, 2)
    optimizer, ours = train.build_optimizer(model, cfg)
    theirs = build_lr_schedulers([torch.optim.AdamW(model.parameters(), lr=cfg["optimizer"]["lr"])], LRScheduler(
        **{**keys, "decay_ratio": None if decay_ratio == -1 else decay_ratio}), 20).schedulers[0]
    for step in range(21):
        if step >= 3:
            assert ours.get_last_lr()[0] == pytest.approx(theirs.get_last_lr()[0], rel=1e-12), step
        for scheduler in (ours, theirs):
            scheduler.optimizer.step()
            scheduler.step()

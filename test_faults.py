"""Faults during a run: a changed [model] at resume, a full disk, too little room, SIGTERM."""

import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from checkpoint import checkpoint_state
from conftest import HERE, _torchrun_cmd, again_if_a_rank_died_of_a_signal, free_port
from test_checkpoint import SMALL, _children, _ckpt_args, _launch, _step_values, _train, uninterrupted

EAGER = ("--compile.enable", "false")


def _finish(proc: subprocess.Popen, lines: list[str]) -> str:
    lines.append(proc.communicate(timeout=300)[0])  # a rank hung in a collective fails the test here
    return "".join(lines)


def _failed(nproc: int, args: list[str]) -> str:
    def launch():
        proc = _launch(nproc, args)
        return subprocess.CompletedProcess(proc.args, proc.returncode, _finish(proc, []))
    proc = again_if_a_rank_died_of_a_signal(launch)  # a failed resume saves nothing: a rerun starts the same
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc.stdout


def _script_on_two_ranks(script: Path, folder: Path, *args: str) -> subprocess.CompletedProcess:
    """`script` (train.py patched) under torchrun on 2 ranks, checkpointing into `folder`, emptied
    before each launch: run again when a rank dies of a signal."""
    def launch():
        shutil.rmtree(folder, ignore_errors=True)
        return subprocess.run(_torchrun_cmd(*_ckpt_args(folder, *args), script=script),
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE)))
    return again_if_a_rank_died_of_a_signal(launch, fresh_each_time=True)


def _our_lines(out: str, start: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(start)]


def _no_traceback_from_the_ranks(out: str) -> None:
    """torchrun prints its own ChildFailedError; no trace may run through the trainer's files."""
    assert not any(f'File "{HERE / name}"' in out for name in ("train.py", "checkpoint.py")), out[-4000:]


@pytest.mark.parametrize("nproc, dp_shard, change, message", [
    (1, 1, ("--model.hidden_size", "128"), "model.hidden_size = 256, this run has 128"),
    (2, 1, ("--model.rms_norm_eps", "1e-6"), "model.rms_norm_eps = 1e-05, this run has 1e-06"),
    (4, 2, ("--optimizer.lr", "1e-3"), "optimizer.lr = 0.0008, this run has 0.001"),
], ids=["1proc-hidden", "tp2-rms_norm_eps", "dp_shard2xtp2-lr"])
def test_resume_with_a_changed_model_or_lr_is_one_line(tmp_root, tmp_path, nproc, dp_shard, change, message):
    _, full_folder = uninterrupted(tmp_root, 2, 1)
    folder = tmp_path / "ckpt"
    shutil.copytree(full_folder / "step-15", folder / "step-15")
    out = _failed(nproc, [*_ckpt_args(folder), *EAGER, "--parallelism.dp_shard", str(dp_shard), *change])
    [line] = _our_lines(out, "error: ")
    assert line == (f"error: {folder / 'step-15'} was written with {message}: resume with the same [model], "
                    "[optimizer], [lr_scheduler], training.seed and [data] (data.tokenized: its files and tokenizer, "
                    "unchanged), or use another checkpoint.folder"), line
    assert "step " not in out.split(line)[0] and "Size mismatch" not in out, out[-3000:]
    _no_traceback_from_the_ranks(out)


def test_every_model_key_lr_warmup_and_seed_are_refused_and_steps_batch_and_mesh_are_logged(tmp_path):
    """The record a save writes into complete.json against a changed config, key by key."""
    import copy
    import json

    from checkpoint import MARKER, CheckpointError, require_same_run, run_record
    from conftest import small_config

    cfg = small_config()
    (tmp_path / MARKER).write_text(json.dumps({"step": 1, "files": {}, "run": run_record(cfg)}))
    refused = [(part, key) for part in ("model", "optimizer", "lr_scheduler") for key in cfg[part]] + [("training", "seed")]
    for section, key in refused:
        changed = copy.deepcopy(cfg)
        changed[section][key] = "other"
        with pytest.raises(CheckpointError, match=f"was written with {section}.{key} = .*, this run has 'other'"):
            require_same_run(tmp_path, changed, print)
    logged, changed = [], copy.deepcopy(cfg)
    for section, key in (("training", "steps"), ("training", "local_batch_size"), ("training", "seq_len"),
                         ("parallelism", "dp_shard"), ("parallelism", "tp")):
        changed[section][key] = cfg[section][key] * 2
    changed["training"]["max_norm"] = 2.0  # not recorded: any value resumes
    require_same_run(tmp_path, changed, logged.append)
    t, p = cfg["training"], cfg["parallelism"]
    assert logged == [f"checkpoint: resuming with training.steps {t['steps']} -> {2 * t['steps']}, "
                      f"training.local_batch_size {t['local_batch_size']} -> {2 * t['local_batch_size']}, "
                      f"training.seq_len {t['seq_len']} -> {2 * t['seq_len']}, "
                      f"parallelism.dp_shard {p['dp_shard']} -> {2 * p['dp_shard']}, parallelism.tp {p['tp']} -> {2 * p['tp']}"]
    logged.clear()
    require_same_run(tmp_path, cfg, logged.append)
    assert logged == []


def test_resume_with_more_steps_trains_on_and_says_so(tmp_root, tmp_path):
    _, full_folder = uninterrupted(tmp_root, 2, 1)
    folder = tmp_path / "ckpt"
    shutil.copytree(full_folder / "step-15", folder / "step-15")
    out = _train(1, [*_ckpt_args(folder), *EAGER, "--training.steps", "25"])
    assert "checkpoint: resuming with training.steps 20 -> 25, parallelism.tp 2 -> 1" in out, out[-3000:]
    assert sorted(_step_values(out)) == list(range(16, 26)), out[-3000:]


HIDDEN_SHARD = """
import sys
import checkpoint, train

write_marker = checkpoint.write_marker


def write_marker_without_rank_1s_shard(path, step, run):
    if step == 10:  # as rank 0 sees a node without a shared file system
        (path / "__1_0.distcp").rename(path.parent / "hidden.distcp")
    return write_marker(path, step, run)


checkpoint.write_marker = write_marker_without_rank_1s_shard
train.exit_without_finalizing(train.main)
"""


def test_a_shard_rank_0_cannot_see_writes_no_marker_and_keeps_the_previous_checkpoint(tmp_path):
    """The marker lists the files DCP's .metadata names, not those rank 0 sees in the folder."""
    folder, script = tmp_path / "ckpt", tmp_path / "hidden_shard.py"
    script.write_text(HIDDEN_SHARD)
    proc = _script_on_two_ranks(script, folder, *EAGER, "--training.steps", "10", "--checkpoint.keep_latest_k", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    [line] = _our_lines(out, "error: ")
    assert line == (f"error: step 10: saving {folder / 'step-10'} failed: rank 0 sees 2 of the 3 files DCP wrote "
                    "(__1_0.distcp is missing or short): checkpoint.folder must be one file system that every node "
                    f"shares; {folder / 'step-5'} stays the last complete checkpoint"), line
    _no_traceback_from_the_ranks(out)
    assert sorted(p.name for p in folder.iterdir()) == ["hidden.distcp", "step-5"]
    assert checkpoint_state(folder / "step-5") == "complete"


def _can_mount_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _on_tmpfs(mount: str, size_mib: int, nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """train.py with a `size_mib` tmpfs mounted at `mount`, in a mount namespace of its own
    (seen by the run only): a small disk without root. The tmpfs, and what is on it, end with
    the command, so the folder is copied to `mount`.kept."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}"] if nproc > 1 else [sys.executable]
    script = (f'mount -t tmpfs -o size={size_mib}m tmpfs "$0" && "$@"; rc=$?; cp -a "$0" "$0.kept"; exit $rc')
    os.makedirs(mount, exist_ok=True)
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, mount, *launcher,
                           str(HERE / "train.py"), *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare --user --mount for a small tmpfs")
@pytest.mark.parametrize("nproc", [1, 2], ids=["1proc", "tp2"])
def test_full_disk_save_is_one_line_and_the_previous_checkpoint_resumes_exactly(tmp_path, nproc):
    # One checkpoint of the 2-block model is 33 MiB: 45 MiB holds one, not two.
    disk = tmp_path / "disk"
    args = [*_ckpt_args(disk / "ckpt"), *EAGER, "--training.steps", "10"]
    proc = _on_tmpfs(str(disk), 45, nproc, args)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    [warning] = _our_lines(out, "warning: checkpoint.folder")
    assert "room for 1 checkpoint(s) of 33 MiB, not the 2" in warning, warning
    [line] = _our_lines(out, "error: ")
    kept = tmp_path / "disk.kept" / "ckpt"
    # torch.save's zip writer reports a full disk without its errno: "(0 MiB free; RuntimeError: ...)" then.
    assert line.startswith(f"error: step 10: saving {disk / 'ckpt' / 'step-10'} failed: No space left on device"), line
    assert line.endswith(f"; {disk / 'ckpt' / 'step-5'} stays the last complete checkpoint"), line
    _no_traceback_from_the_ranks(out)
    assert sorted(p.name for p in kept.iterdir()) == ["step-5"], "the unfinished step-10 is removed"
    # The failed run is the uninterrupted one up to step 10: resumed on a roomy disk, steps 6-10 match it.
    resumed = _train(nproc, [*_ckpt_args(kept), *EAGER, "--training.steps", "10"])
    assert f"checkpoint: loaded step 5 from {kept / 'step-5'}" in resumed, resumed[-3000:]
    for name in ("loss", "grad norm"):
        expected = {s: v for s, v in _step_values(out, name).items() if s > 5}
        assert _step_values(resumed, name) == pytest.approx(expected, abs=1e-6, rel=0), name


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare --user --mount for a small tmpfs")
def test_no_room_for_one_checkpoint_is_a_config_error(tmp_path):
    disk = tmp_path / "disk"
    proc = _on_tmpfs(str(disk), 20, 2, [*_ckpt_args(disk / "ckpt")])
    assert proc.returncode != 0
    [line] = _our_lines(proc.stderr, "config error: ")
    assert line == (f"config error: checkpoint.folder = '{disk / 'ckpt'}' has 20 MiB free, less than one checkpoint "
                    "of [model] (33 MiB: 12 bytes per parameter for the weights and AdamW's two moments)"), line
    assert "step " not in proc.stdout and "TP groups" not in proc.stdout, "before any process group"


def _send_sigterm(proc: subprocess.Popen, to: str) -> None:
    """"group": torchrun's session's group (os.killpg), which its workers, in sessions of their
    own, are not in; "every process": torchrun and each rank, as SLURM's scancel and time limit
    signal a job step; "one rank": the last."""
    workers = _children(proc.pid)
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    for pid in {"every process": [proc.pid, *workers], "one rank": workers[-1:]}.get(to, []):
        os.kill(pid, signal.SIGTERM)


def _signalled_after(nproc: int, args: list[str], line: str, to: str, times: int = 1) -> str:
    """Start training; once rank 0 logs `line`, SIGTERM `to` (_send_sigterm), `times` times 0.1 s apart."""
    proc = _launch(nproc, args)
    lines = []
    for text in proc.stdout:
        lines.append(text)
        if text.startswith(line):
            for i in range(times):
                time.sleep(0.1 * (i > 0))
                _send_sigterm(proc, to)
            break
    out = _finish(proc, lines)  # the pipe closes once every rank has exited
    assert proc.returncode != 0, out[-3000:]
    return out


def _stop_step(out: str, folder: Path) -> int:
    """The step after which every rank stopped, its checkpoint saved and complete."""
    [line] = _our_lines(out, "stopped by ")
    stop = int(line.split("after step ")[1].split(";")[0])
    assert line == f"stopped by SIGTERM after step {stop}; saved {folder / f'step-{stop}'}", line
    assert 7 <= stop < 20 and max(_step_values(out)) == stop, out[-3000:]
    assert checkpoint_state(folder / f"step-{stop}") == "complete", "every rank wrote its shards"
    return stop


def test_a_group_sigterm_saves_the_step_every_rank_finished_and_resumes_exactly(tmp_root, tmp_path):
    full, _ = uninterrupted(tmp_root, 2, 1)
    folder = tmp_path / "ckpt"
    stop = _stop_step(_signalled_after(2, _ckpt_args(folder), "step   7 ", to="group"), folder)
    resumed = _train(2, _ckpt_args(folder))
    assert f"checkpoint: loaded step {stop} from {folder / f'step-{stop}'}" in resumed, resumed[-3000:]
    for name in ("loss", "grad norm"):
        expected = {s: v for s, v in _step_values(full, name).items() if s > stop}
        assert _step_values(resumed, name) == pytest.approx(expected, abs=1e-6, rel=0), name


def test_sigterm_to_every_process_twice_is_one_stop(tmp_path):
    """Each rank gets 3 or 4 copies in 0.1 s (two direct, and torchrun's; torchrun itself ends at
    its second signal, with a traceback): one request (preemption.ONE_REQUEST_S), saved as one."""
    folder = tmp_path / "ckpt"
    _stop_step(_signalled_after(2, _ckpt_args(folder, *EAGER), "step   7 ", to="every process", times=2), folder)


def test_copies_within_the_window_are_one_request_and_a_later_signal_ends_at_once(monkeypatch):
    """preemption.note_stop_signals' handler, called as a signal calls it, on a clock the test sets."""
    import preemption

    now, ended = [100.0], []
    monkeypatch.setattr(preemption, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(preemption.signal, "raise_signal", ended.append)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        received = preemption.note_stop_signals()
        note = signal.getsignal(signal.SIGTERM)
        for dt in (0.0, 0.01, 0.1, preemption.ONE_REQUEST_S):
            now[0] = 100.0 + dt
            note(signal.SIGTERM, None)
        assert received == [signal.SIGTERM] * 4 and not ended, "copies within the window: one request"
        assert signal.getsignal(signal.SIGTERM) is note
        now[0] = 100.0 + preemption.ONE_REQUEST_S + 0.01
        note(signal.SIGINT, None)
        assert ended == [signal.SIGINT] and signal.getsignal(signal.SIGINT) == signal.SIG_DFL, "after it: at once"
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_sigterm_to_one_rank_stops_both_after_the_same_step_with_checkpoints_off():
    out = _signalled_after(2, [*SMALL, *EAGER, "--training.steps", "500"], "step   3 ", to="one rank")
    [line] = _our_lines(out, "stopped by ")
    stop = int(line.split("after step ")[1].split(";")[0])
    assert line == f"stopped by SIGTERM after step {stop}; checkpoints are off: nothing saved", line
    assert max(_step_values(out)) == stop < 10, out[-3000:]  # rank 0, which no signal reached, stopped too


SIGNALLED_IN_THE_EXPORT = """
import os, signal, sys
import hf_export, train

finish_hf_folder = hf_export.finish_hf_folder


def finish_hf_folder_signalled(*args):
    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's pre-emption, as the HF export's last writes start
    return finish_hf_folder(*args)


hf_export.finish_hf_folder = finish_hf_folder_signalled
train.exit_without_finalizing(train.main)
"""


def test_sigterm_in_the_final_hf_export_finishes_the_write_and_stops(tmp_path):
    """A signal after the loop was noted and never acted on: the held-out loss and the summary ran
    on. Now the write in progress finishes whole, and the run stops in one line."""
    folder = tmp_path / "ckpt"
    script = tmp_path / "signalled_in_the_export.py"
    script.write_text(SIGNALLED_IN_THE_EXPORT)
    proc = subprocess.run([sys.executable, str(script), *_ckpt_args(folder, *EAGER, "--training.steps", "2",
                                                                     "--checkpoint.last_save_in_hf", "true")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                                                PYTHONPATH=str(HERE)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert _our_lines(out, "stopped by ") == ["stopped by SIGTERM after the HF export; skipped what was left"], out[-3000:]
    assert "summary:" not in out
    assert sorted(p.name for p in (folder / "step-2-hf").iterdir()) == ["config.json", "generation_config.json",
                                                                         "model.safetensors"]
    assert not (folder / "step-2-hf.tmp").exists()


ONE_RANK_FILLS_THE_DISK_IN_THE_EXPORT = """
import errno, os
import hf_export, train

join_shards = hf_export.join_shards


def join_shards_on_a_full_disk(*args):
    join_shards(*args)
    if os.environ["RANK"] == "1":  # the disk fills as rank 1 joins its last file; rank 0's went well
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


hf_export.join_shards = join_shards_on_a_full_disk
train.exit_without_finalizing(train.main)
"""


def test_a_full_disk_on_one_rank_in_the_hf_export_is_one_line_and_no_folder(tmp_path):
    """Every rank hears of rank 1's failure: one line and no step-2-hf (nor .tmp), the DCP step complete.
    torch's consolidate_safetensors_files_on_every_rank would leave rank 0 in its barrier until the
    timeout, then a traceback (hf_export.join_shards)."""
    folder, script = tmp_path / "ckpt", tmp_path / "full_in_the_export.py"
    script.write_text(ONE_RANK_FILLS_THE_DISK_IN_THE_EXPORT)
    proc = _script_on_two_ranks(script, folder, *EAGER, "--training.steps", "2", "--checkpoint.last_save_in_hf",
                                "true", "--checkpoint.hf_max_shard_mb", "1", "--comm.init_timeout_seconds", "30")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert _our_lines(out, "error: ") == [f"error: step 2: writing the HF weights to {folder / 'step-2-hf'} failed: "
                                          f"No space left on device; {folder / 'step-2'} is complete"], out[-3000:]
    _no_traceback_from_the_ranks(out)
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"] and checkpoint_state(folder / "step-2") == "complete"


SLOW_RANK_0_WRITES = """
import time

import torch

import checkpoint, hf_export, train

write_marker, finish_hf_folder = checkpoint.write_marker, hf_export.finish_hf_folder


def slow(write):
    def written_slowly(*args):
        time.sleep(8)  # a slow file system, while the other rank waits in a collective
        return write(*args)
    return written_slowly


def evaluate(*args):  # after the HF export: its wait is over, the training timeout back
    world = torch.distributed.distributed_c10d._get_default_group()
    print(f"held-out loss under a {world._get_backend(torch.device('cpu')).options._timeout.seconds} s timeout")
    return train_evaluate(*args)


checkpoint.write_marker, hf_export.finish_hf_folder = slow(write_marker), slow(finish_hf_folder)
train_evaluate, train.evaluate = train.evaluate, evaluate
train.exit_without_finalizing(train.main)
"""


def test_slow_rank_0_writes_outlast_the_training_timeout(tmp_path):
    """comm.train_timeout_seconds (3 s here) bounds every collective after step 1, but not the wait
    for rank 0's marker, prune and HF export (8 s each): those run under init_timeout_seconds, and
    the held-out loss after the export under the training timeout again."""
    folder, script = tmp_path / "ckpt", tmp_path / "slow_writes.py"
    script.write_text(SLOW_RANK_0_WRITES)
    proc = _script_on_two_ranks(script, folder, *EAGER, "--training.steps", "4", "--checkpoint.interval", "2",
                                "--checkpoint.last_save_in_hf", "true", "--comm.train_timeout_seconds", "3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "checkpoint: saved step 4" in out and "checkpoint: wrote the HF weights of step 4" in out, out[-3000:]
    assert "summary:" in out
    assert out.count("held-out loss under a 3 s timeout") == 2, out[-3000:]

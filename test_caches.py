"""Warm restarts: a second TP run with the same compile cache loads its graph from the
AOTAutograd and FX-graph caches on every rank, each rank only its own entries, and without
`workarounds.keep_device_mesh_hash_out_of_pickles` it would miss (the test that says when the
workaround can go)."""

import os
import re
import subprocess
import textwrap

import pytest

from conftest import HERE, _losses, _torchrun_cmd, again_if_a_rank_died_of_a_signal

SMALL = ("--training.steps", "3", "--model.num_hidden_layers", "2", "--training.seq_len", "64",
         "--training.local_batch_size", "2", "--data.max_bytes", "1000000", "--validation.steps", "1",
         "--metrics.measure_cpu_peak", "false")

WITHOUT_WORKAROUND = """
import sys
sys.path.insert(0, {here!r})
import train
import workarounds

workarounds.keep_device_mesh_hash_out_of_pickles = lambda: None
train.exit_without_finalizing(train.main)
"""


def _run(cache_dir, tmp_path, workaround: bool = True) -> subprocess.CompletedProcess:
    """train.py on 2 ranks (TP 2) with `cache_dir` as the inductor cache, logging what
    AOTAutograd's cache does."""
    script = HERE / "train.py"
    if not workaround:
        script = tmp_path / "without_workaround.py"
        script.write_text(textwrap.dedent(WITHOUT_WORKAROUND.format(here=str(HERE))))
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
               TORCH_LOGS="torch._functorch._aot_autograd.autograd_cache")
    cmd = _torchrun_cmd(*SMALL, script=script)
    proc = again_if_a_rank_died_of_a_signal(lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                                                                   env=env))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _summary(proc, field: str) -> str:
    [line] = [line for line in proc.stdout.splitlines() if line.startswith(f"  {field} ")]
    return line[len(field) + 2:].strip()


def _keys(proc, pattern: str) -> dict[int, set[str]]:
    """{rank: AOTAutograd cache keys} from the log lines that match `pattern` (one group: the key)."""
    keys = {0: set(), 1: set()}
    for line in proc.stderr.splitlines():
        rank, found = re.match(r"\[rank(\d)\]:", line), re.search(pattern, line)
        if rank and found:
            keys[int(rank.group(1))].add(found.group(1))
    return keys


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One inductor cache for both tests: the second reuses the first's C++ builds, which
    neither AOTAutograd's nor the FX-graph key depends on."""
    return tmp_path_factory.mktemp("inductor-cache")


@pytest.fixture(scope="module")
def cold(cache_dir, tmp_path_factory):
    """The first TP run into the empty cache, shared by both tests."""
    return _run(cache_dir, tmp_path_factory.mktemp("cold"))


def test_second_tp_run_hits_the_compile_caches_each_rank_its_own(cache_dir, cold, tmp_path):
    warm = _run(cache_dir, tmp_path)
    assert re.fullmatch(r"AOTAutograd 0 hit, \d+ missed; FX graph 0 hit, \d+ missed on every rank",
                        _summary(cold, "compile caches")), cold.stdout
    assert re.fullmatch(r"AOTAutograd [1-9]\d* hit, 0 missed; FX graph [1-9]\d* hit, 0 missed on every rank",
                        _summary(warm, "compile caches")), warm.stdout
    assert _summary(warm, "compiled graphs") == "1 for 2 blocks"
    assert _losses(warm.stdout) == pytest.approx(_losses(cold.stdout), abs=1e-6)

    written = _keys(cold, r"Writing AOTAutograd cache entry to .*/aotautograd/([^/]+)/")
    loaded = _keys(warm, r"AOTAutograd cache hit for key (\S+)")
    assert written[0] and written[1] and not written[0] & written[1], f"the ranks' keys must differ: {written}"
    for rank in (0, 1):
        assert loaded[rank] and loaded[rank] <= written[rank], f"rank {rank} loaded {loaded[rank]}, wrote {written}"


def test_without_the_mesh_hash_workaround_a_second_tp_run_misses(cache_dir, cold, tmp_path):
    """A run without the workaround after `cold`, which wrote the entries it would hit: the
    workaround only drops `_hash` from the key. When this fails, the installed torch keys its
    caches stably by itself: remove workarounds.keep_device_mesh_hash_out_of_pickles."""
    second = _run(cache_dir, tmp_path, workaround=False)
    assert re.fullmatch(r"AOTAutograd 0 hit, [1-9]\d* missed; .* on every rank", _summary(second, "compile caches")), \
        second.stdout

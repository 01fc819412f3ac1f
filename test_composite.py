"""The checkpoints users download as vision + text folders (Qwen3.5, Gemma 3 4B-27B), written by stock
transformers' save_pretrained: their text model trains by the one path, Qwen3.5's hybrid layers on TP 2 + SP +
compile with one process's losses, and the export gives the folder back, the vision tower as it came."""

import json
import signal
from pathlib import Path

import pytest
import torch

from conftest import _killed_after_save, _losses, _torchrun
from harness import free_port, make_documents, make_hub_composite
from test_checkpoint import _step_values

STEPS = ("--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--validation.steps", "1", "--metrics.measure_cpu_peak", "false", "--checkpoint.enable", "true",
         "--checkpoint.interval", "2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("composites")
    return {"root": root, "docs": make_documents(root / "docs.jsonl"),
            **{family: make_hub_composite(root / family, family) for family in ("qwen3_5", "gemma3")}}


def args(folders: dict, family: str, folder: Path, *more: str) -> list[str]:
    return [*STEPS, "--checkpoint.folder", str(folder), "--checkpoint.initial_load_path", str(folders[family]),
            "--checkpoint.initial_load_in_hf", "true", "--data.path", str(folders["docs"]),
            "--data.cache_folder", str(folders["root"] / "tokenized"), *more]


@pytest.fixture(scope="module")
def run(folders):
    """run(family, nproc, dp_shard): (train.py's output, its checkpoint folder), 4 steps saved every 2; on one
    process compile off; exported at the end. Each launched once."""
    runs = {}

    def launch(family: str, nproc: int, dp_shard: int = 1):
        if (family, nproc, dp_shard) not in runs:
            folder = folders["root"] / f"{family}-{nproc}-{dp_shard}"
            proc = _torchrun(*args(folders, family, folder, "--compile.enable", str(nproc > 1).lower(),
                                   "--checkpoint.last_save_in_hf", "true",
                                   "--parallelism.dp_shard", str(dp_shard), "--training.local_batch_size", str(2 // dp_shard)),
                             launcher=(f"--nproc_per_node={nproc}", f"--master_port={free_port()}"))
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[family, nproc, dp_shard] = proc.stdout, folder
        return runs[family, nproc, dp_shard]
    return launch


def test_a_qwen3_5_folder_trains_its_text_model_as_one_process(run):
    """Qwen3.5's text model (3 Gated DeltaNet blocks to 1 gated-attention block) on TP 2 + SP + compile: a graph
    per layer kind, no recompile; the 4 losses are one process's, and so are dp_shard 2 x tp 2's."""
    out, _ = run("qwen3_5", 2)
    assert "compiled graphs      2 for 4 blocks" in out and "recompiles           0" in out, out[-2000:]
    single, two_d = _losses(run("qwen3_5", 1)[0]), _losses(run("qwen3_5", 4, 2)[0])
    assert len(single) == 4 and _losses(out) == pytest.approx(single, abs=1e-4)
    assert two_d == pytest.approx(single, abs=1e-4)


def test_a_qwen3_5_run_killed_after_a_save_resumes_exactly(folders, run, tmp_path):
    """kill -9 after step 2's save, then the same command: steps 3 and 4 are the uninterrupted run's (its rows
    held by heads go to DCP in HF's order and come back)."""
    whole, _ = run("qwen3_5", 2)
    again = args(folders, "qwen3_5", tmp_path / "killed")
    assert _killed_after_save(2, *again) == -signal.SIGKILL, "the run ended before its step-2 save"
    resumed = _torchrun(*again)
    assert resumed.returncode == 0 and "checkpoint: loaded step 2" in resumed.stdout, resumed.stderr[-3000:]
    assert _step_values(resumed.stdout) == pytest.approx({s: v for s, v in _step_values(whole).items() if s > 2}, abs=1e-6)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_a_composites_export_is_its_source_folder_with_the_trained_text_model(folders, run, family):
    """step-4-hf/ has the source's architectures, model_type and tensor names (Gemma 3's as transformers 4
    wrote them); its vision tower and projector are the source's bit for bit; its text weights are the DCP
    checkpoint's, cast to bfloat16, and one process's export's (to bfloat16's rounding: the rows TP 2 holds
    by heads are in HF's order), as are dp_shard 2 x tp 2's; stock transformers loads it as the source's class."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    _, folder = run(family, 2)
    source, export = folders[family], folder / "step-4-hf"

    def tensors(path: Path) -> dict:
        found = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                found |= {k: f.get_tensor(k) for k in f.keys()}
        return found
    before, after = tensors(source), tensors(export)
    assert before.keys() == after.keys()
    config, source_config = (json.loads((path / "config.json").read_text()) for path in (export, source))
    assert (config["architectures"], config["model_type"]) == (source_config["architectures"], source_config["model_type"])
    prefix = "model.language_model." if family == "qwen3_5" else "language_model.model."
    text = {k for k in before if k.startswith(prefix) or k.endswith("lm_head.weight")}
    assert len(text) < len(before), "no vision tensor"
    for k in before.keys() - text:
        assert after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]), k
    trained = {"model": {("model." + k.removeprefix(prefix) if k.startswith(prefix) else "lm_head.weight"):
                         torch.empty_like(after[k], dtype=torch.float32) for k in text}}
    dcp.load(trained, checkpoint_id=folder / "step-4")
    ours = {("model." + k.removeprefix(prefix) if k.startswith(prefix) else "lm_head.weight"): k for k in text}
    for name, k in ours.items():
        assert torch.equal(after[k], trained["model"][name].to(torch.bfloat16)), k
    assert sum(not torch.equal(after[k], before[k]) for k in text) > len(text) // 2, "nothing was trained"
    single = tensors(run(family, 1)[1] / "step-4-hf")
    for k in text:
        torch.testing.assert_close(after[k].float(), single[k].float(), rtol=1e-2, atol=1e-3, msg=k)
    if family == "qwen3_5":  # FSDP over its rows by heads: dp_shard 2 x tp 2's export too
        two_d = tensors(run(family, 4, 2)[1] / "step-4-hf")
        for k in text:
            torch.testing.assert_close(two_d[k].float(), single[k].float(), rtol=1e-2, atol=1e-3, msg=k)
    model = AutoModelForImageTextToText.from_pretrained(export)
    assert type(model).__name__ == source_config["architectures"][0]

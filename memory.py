"""Peak memory per rank against model size and mesh: train.py's own summary, 2 steps per run.

    OMP_NUM_THREADS=1 python memory.py                # about 45 minutes on 2 CPU cores
    OMP_NUM_THREADS=1 python memory.py --activations  # long sequences against config.peak_per_rank
    OMP_NUM_THREADS=1 python memory.py --export [TREE] [--key value ...]  # each rank's peak in the HF export

Each run: compile off, AC none, batch 1 x 64 tokens, no held-out loss; once with glibc's
allocator as it is, once with a fixed mmap threshold (freed tensors of 128 KiB or more go back
to the OS at once; glibc's default threshold grows to 32 MiB and keeps them in the heap) and
torch's huge pages for tensors of 2 MiB or more (the same peaks, fewer page faults).
"ratio" is a rank's peak minus the same mesh's debugmodel peak (the interpreter, torch, gloo,
the data) over the rank's params + optimizer: what the model costs per byte of shard."""
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent
SIZES = {  # [model] overrides; the vocabulary of a real tokenizer
    "debugmodel": {},
    "106M": {"hidden_size": 768, "num_hidden_layers": 8, "intermediate_size": 2048, "vocab_size": 32000},
    "334M": {"hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 4096, "vocab_size": 32000},
}
MESHES = {"1 process": (1, 1), "dp_shard 2": (2, 1), "dp_shard 4": (4, 1), "dp_shard 2 x tp 2": (2, 2)}
FLAGS = ["--compile.enable", "false", "--activation_checkpoint.mode", "none", "--training.steps", "2",
         "--training.local_batch_size", "1", "--training.seq_len", "64", "--validation.steps", "0",
         "--metrics.measure_cpu_peak", "false"]


RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "131072"}
ALLOCATORS = {"glibc's default": {},
              "MALLOC_MMAP_THRESHOLD_=131072 THP_MEM_ALLOC_ENABLE=1": {**RETURN_FREED, "THP_MEM_ALLOC_ENABLE": "1"}}


def run(size: str, dp_shard: int, tp: int, hf: Path | None, allocator: dict, extra: tuple = ()) -> tuple[list[float], float]:
    """(each rank's peak MiB, params + optimizer MiB on the largest rank) from the run's summary;
    with `hf`, the weights from that HF folder (checkpoints on: the last step is saved too)."""
    model = [arg for key, value in SIZES[size].items() for arg in (f"--model.{key}", str(value))] + list(extra)
    if hf:
        shutil.rmtree(hf.parent / "ckpt", ignore_errors=True)  # the last run's step 2 would leave nothing to train
        model += ["--checkpoint.enable", "true", "--checkpoint.folder", str(hf.parent / "ckpt"),
                  "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf", "true", "--data.tokenizer", "bytes"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={dp_shard * tp}", str(HERE / "train.py"),
           *FLAGS, *model, "--parallelism.dp_shard", str(dp_shard), "--parallelism.tp", str(tp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **allocator})
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{size} on {dp_shard} x {tp} failed:\n{out[-3000:]}")
    peaks = [float(p) for p in re.search(r"peak memory per rank ([\d, ]+) MiB", out).group(1).split(",")]
    shard = max(float(p) for p in re.search(r"params \+ optimizer\s+([\d., ]+) MiB per rank", out).group(1).split(","))
    return peaks, shard


def write_hf_folder(size: str, folder: Path) -> Path:
    """`size`'s seeded model as an HF folder, as stock from_pretrained reads it."""
    import tomllib

    import torch

    from model import build_model

    with open(HERE / "config.toml", "rb") as f:
        model_cfg = {**tomllib.load(f)["model"], **SIZES[size]}
    torch.manual_seed(0)
    build_model(model_cfg).save_pretrained(folder / "hf")
    return folder / "hf"


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="memory-") as folder:  # 5 GB: removed even on Ctrl-C
        table(write_hf_folder("334M", Path(folder)))


def table(hf: Path) -> None:
    print("| model | mesh | params + optimizer per rank, MiB |"
          + "".join(f" peak per rank, MiB ({name}) | ratio |" for name in ALLOCATORS))
    print("|---|---|---|" + "---|---|" * len(ALLOCATORS))
    for mesh, (dp_shard, tp) in MESHES.items():
        base = {}
        rows = [(size, None) for size in SIZES] + ([("334M", hf)] if dp_shard * tp == 4 else [])
        for size, hf_folder in rows:
            cells = []
            for name, allocator in ALLOCATORS.items():
                peaks, shard = run(size, dp_shard, tp, hf_folder, allocator)
                base.setdefault(name, max(peaks))
                ratio = f"{(max(peaks) - base[name]) / shard:.2f}" if size != "debugmodel" else "-"
                cells += [", ".join(f"{p:,.0f}" for p in peaks), ratio]
            name = f"{size}, from an HF folder" if hf_folder else size
            print(f"| {name} | {mesh} | {shard:,.1f} | {' | '.join(cells)} |", flush=True)


def activations() -> None:
    """The debugmodel at long sequences, batch 1, with a fixed mmap threshold (what is allocated,
    not what glibc keeps): each run's peak over the same run at 64 tokens, beside the activation
    term of config.peak_per_rank, the memory check's estimate."""
    from config import load_config, parse_args, peak_per_rank

    allocator = RETURN_FREED
    print("| mesh | AC | seq_len | peak per rank, MiB | over 64 tokens, MiB | estimated activations over 64 tokens, MiB |")
    print("|---|---|---|---|---|---|")
    for mesh, tp in (("1 process", 1), ("tp 2 + SP", 2)):
        for ac in ("none", "full"):
            base = {}
            for seq in (64, 1024, 4096, 8192):
                extra = ("--activation_checkpoint.mode", ac, "--training.seq_len", str(seq))
                peaks, _ = run("debugmodel", 1, tp, None, allocator, extra)
                _, overrides = parse_args([*FLAGS, *extra, "--parallelism.tp", str(tp), "--parallelism.dp_shard", "1"])
                estimate = peak_per_rank(load_config(str(HERE / "config.toml"), tp, overrides))["activations"] / 2**20
                base.setdefault("peak", max(peaks)), base.setdefault("estimate", estimate)
                print(f"| {mesh} | {ac} | {seq} | {', '.join(f'{p:,.0f}' for p in peaks)} | "
                      f"{max(peaks) - base['peak']:,.0f} | {estimate - base['estimate']:,.0f} |", flush=True)


def anonymous_memory() -> int:
    """This process's resident anonymous memory (RssAnon): not the pages of a mapped safetensors file."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("RssAnon:")[1].split()[0]) * 1024


def peak_anonymous_memory_above_now(work):
    """(work(), the most anonymous memory it held above what was held before), sampled every ms."""
    before, peak, done = anonymous_memory(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_memory() - before)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        return work(), peak[0]
    finally:
        done.set()
        sampler.join()


MEASURED_EXPORT = """
import os, sys
sys.path.insert(0, os.environ["HERE"])
from memory import peak_anonymous_memory_above_now
sys.path.insert(0, os.environ["TREE"])  # its modules and train, ahead of this tree's
import train
try:
    import hf_export as exporter
except ImportError:  # a tree from before hf_export.py: the export in checkpoint.py
    import checkpoint as exporter


def measured(save_hf):
    def save(*args):
        result, peak = peak_anonymous_memory_above_now(lambda: save_hf(*args))
        line = f"export: rank {os.environ['RANK']} {peak / 2**20:.0f} MiB\\n"
        os.write(1, line.encode())  # one write: the ranks share the pipe
        return result
    return save


exporter.save_hf = measured(exporter.save_hf)
train.exit_without_finalizing(train.main)
"""


def export(tree: Path, extra: list[str], size: str = "334M", dp_shard: int = 4) -> None:
    """Each rank's anonymous memory during save_hf above what it held as the export began
    (sampled every ms, freed tensors returned at once), for `tree`'s train.py (this one's by default):
    `size` at random initialisation, so float32, on dp_shard ranks."""
    import tempfile

    model = [arg for key, value in SIZES[size].items() for arg in (f"--model.{key}", str(value))]
    with tempfile.TemporaryDirectory(prefix="export-") as folder:
        script = Path(folder, "measured_export.py")
        script.write_text(MEASURED_EXPORT)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={dp_shard}", str(script), *FLAGS,
               *model, "--parallelism.dp_shard", str(dp_shard), "--parallelism.tp", "1", "--checkpoint.enable", "true",
               "--checkpoint.folder", str(Path(folder, "ckpt")), "--checkpoint.last_save_in_hf", "true", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=folder,
                              env={**os.environ, **RETURN_FREED, "TREE": str(tree.resolve()), "HERE": str(HERE.resolve())})
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"the export on {dp_shard} ranks failed:\n{out[-3000:]}")
    print(*re.findall(r"^export: .*$|^checkpoint: wrote the HF .*$|^  params \+ optimizer .*$", out, re.M), sep="\n")


if __name__ == "__main__":
    if "--export" in sys.argv:
        args = sys.argv[sys.argv.index("--export") + 1 :]
        export(Path(args.pop(0)) if args and not args[0].startswith("--") else HERE, args)
    else:
        activations() if "--activations" in sys.argv else main()

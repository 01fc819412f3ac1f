"""Recipe B's reach: every dense HF decoder family under TP 2 + SP + compile + full AC.

    python reach.py                        # measure every family on the installed torch, into reach.csv
    python reach.py --families gemma3_text,olmo2
    python reach.py --table                # RESULTS.md's table, from reach.csv
    python reach.py --windows-only         # the sliding-window rows alone
    python reach.py --plans TREE           # each row's plan digest, with TREE's project files
    python reach.py --by-path              # each family correct here, through train.py, into by_path.csv

Each family is built tiny from its own config class (the tests' shrunk [model]: 4 blocks,
hidden 256, 16 heads, 8 kv heads, head_dim 16; token ids inside the vocabulary; every dropout 0;
SDPA where transformers allows it), parallelized by parallelize.py with HF's own layer and
`attention_gather = "norm_output"`, trained 3 steps of 64 tokens on 2 gloo ranks with the tests'
harness (harness.run_training) and compared with one eager process on the same batches: losses,
gradient norms and every parameter's step-1 gradient. A second run counts the kwargs plan's
graphs on the same torch. A family whose config has a sliding window runs again with windows
WINDOWS, one on each side of seq_len / TP = 32.
"""

import argparse
import tempfile
import time
import warnings
from pathlib import Path

# The families named in the survey's brief, then any other dense decoder-only family found; two
# variants of a family's config ("+", harness.build_family): Phi-3-mini's MHA, stablelm's qk_layernorm.
FAMILIES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "granite", "gemma", "gemma2", "gemma3_text",
            "cohere", "cohere2", "olmo", "olmo2", "phi3", "phi3+mha", "glm", "glm4", "stablelm",
            "stablelm+qk_layernorm", "starcoder2", "helium", "smollm3", "ernie4_5", "seed_oss", "arcee", "nemotron",
            "exaone4", "hunyuan_v1_dense", "apertus")
# Why, for results the error line does not explain (diagnosed by reading the family's code).
CAUSES = {
    "cohere2": "two kinds of block: RoPE in its sliding-window layers only",
    "smollm3": "two kinds of block: every 4th has no RoPE",
    "olmo2": "post-norm: attention's input gathered by keyword, a recompile per block on torch 2.10.0",
    "olmo3": "post-norm, as olmo2",
    "exaone4": "post-norm, as olmo2; sliding and full layers",
    "glm": "a fused [gate; up]: its rows held by parts, hf_layout.RowsByParts",
    "glm4": "as glm",
    "phi3+mha": "Phi-3-mini's layout: fused [q; k; v] and [gate; up]",
    "apertus": "its MLP's xIELU activation has parameters",
    "cohere_compass_text": "its default config has no RoPE parameters for its layer type",
    "gemma3n_text": "its KV-sharing layers do not fit 4 blocks",
    "qwen3_5_text": "Gated DeltaNet by heads, a graph per layer kind; torch 2.10.0 has no DTensor softplus",
}
WINDOWS = (48, 16)  # seq_len / TP < 48 < seq_len; 16 < seq_len / TP
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def dense_families() -> tuple[list[str], dict[str, list[str]]]:
    """(FAMILIES, then every other model_type with a `*ForCausalLM` whose layers call
    `self.self_attn`, dense and text-only; {why left out: model_types})."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from survey import survey_attention_calls

    calls = {family for style in ("keyword", "positional") for family in survey_attention_calls()[style]}
    found, left_out = list(FAMILIES), {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in found:
            continue
        try:
            config = AutoConfig.for_model(model_type).to_dict()
        except Exception as e:  # a default config that does not validate
            left_out.setdefault(f"its default config does not build ({type(e).__name__})", []).append(model_type)
            continue
        why = ("encoder-decoder" if config.get("is_encoder_decoder") else
               "multimodal (a text_config inside)" if config.get("text_config") else
               "mixture of experts" if any((config.get(key) or 0) > 1 for key in MOE_KEYS) else
               "its layers do not call self.self_attn" if model_type_to_module_name(model_type) not in calls else None)
        if why:
            left_out.setdefault(why, []).append(model_type)
        else:
            found.append(model_type)
    return found, left_out


RECIPE_B = {"parallelism.decoder_layer": "stock", "parallelism.attention_gather": "norm_output"}
KWARGS_PLAN = {"parallelism.decoder_layer": "stock", "parallelism.attention_gather": "pre_hook"}


def _rank_main(rank: int, port: int, family: str, window: int | None, out: str) -> None:
    """Both plans on this rank of 2 (recipe B alone with a window), one after the other, with
    Dynamo's state reset between."""
    import json

    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from harness import join_gloo, run_training, small_config  # the tests' harness: 4 blocks, recompile_limit 2

    join_gloo(rank, 2, port)
    results = {}
    for name, plan in (("recipe_b", RECIPE_B), ("kwargs", KWARGS_PLAN))[:1 if window else 2]:
        try:
            results[name] = run_training(small_config(**plan), 2, arch=family, window=window,
                                         grads_path=out + ".grads.pt" if name == "recipe_b" else None)
        except Exception as e:  # a refusal from apply_tp, or a failure while building
            results[name] = {"error": first_line(e)}
        torch._dynamo.reset()
        counters.clear()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def first_line(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


MAX_MILLIONS = 300


def has_sliding_window(family: str) -> bool:
    from transformers import AutoConfig

    try:
        return "sliding_window" in AutoConfig.for_model(family.split("+")[0]).to_dict()
    except Exception:  # a default config that does not build
        return False


def count_parameters(family: str, window: int | None = None) -> tuple[int, list[str]]:
    """Parameters at the tests' sizes, and the model's kinds of attention layer."""
    import torch

    from harness import build_family, small_config

    with torch.device("meta"):
        model = build_family(family, small_config()["model"], window=window)
    config = model.config
    kinds = sorted(set(getattr(config, "layer_types", None) or
                       ["full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"]))
    return sum(p.numel() for p in model.parameters()), kinds


def measure(family: str, window: int | None = None, timeout: float = 300) -> dict:
    """One row: recipe B and (without a window) the kwargs plan on 2 ranks, against one eager process."""
    import json
    import os

    import torch.multiprocessing as mp

    from harness import free_port, gradient_differences, run_training, small_config

    row = {"family": family, "window": window}
    try:
        millions, row["kinds"] = count_parameters(family, window)
        millions /= 1e6
    except Exception:  # a config that does not build: the runs below record its error
        millions = 0
    if millions > MAX_MILLIONS:  # blt's byte-level encoders: 4.6 billion, killed for memory
        error = {"error": f"SizeError: {millions:.0f}M parameters at [model]'s sizes: its config does not shrink"}
        return {**row, "single": error, "recipe_b": error, "kwargs": error}
    out = os.path.join(tempfile.mkdtemp(prefix="reach-"), "result.json")
    for attempt in (1, 2):  # a rank killed by a signal while inductor compiles (RESULTS.md, faults): once more
        row.pop("recipe_b", None), row.pop("kwargs", None)
        context = mp.start_processes(_rank_main, args=(free_port(), family, window, out), nprocs=2, join=False)
        try:
            deadline = time.monotonic() + timeout
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result in {timeout:.0f} s")
            with open(out) as f:
                row.update(json.load(f))
            break
        except Exception as e:  # a rank that died, or hung
            for process in context.processes:
                process.kill()
            row["recipe_b"] = row["kwargs"] = {"error": first_line(e)}
            if getattr(e, "signal_name", None) is None or attempt == 2:
                break
            print(f"{family} (window {window}): {first_line(e)}; running it again", flush=True)
    row.setdefault("kwargs", {"error": "not run with a window"})
    if row["recipe_b"].get("error"):  # refused or failed: nothing to compare
        return {**row, "single": {}}
    try:
        row["single"] = run_training(small_config(**{**RECIPE_B, "compile.enable": False, "parallelism.tp": 1}), 1,
                                     arch=family, window=window, grads_path=out + ".single.pt")
        row["param_grads"] = gradient_differences(out + ".grads.pt", out + ".single.pt")
    except Exception as e:
        row["single"] = {"error": first_line(e)}
    return row


def plan_digest(family: str, window: int | None) -> str:
    """What parallelize applies to `family`, as a digest: the layout check's refusal, or every
    block's plan under both gathers, each style with its settings. A family whose digest is the
    same at two commits (--plans) need not be measured again."""
    import hashlib

    import torch

    import family_plan
    import parallelize
    from harness import build_family, small_config

    def plan(block, gather):
        try:
            styles = parallelize.block_plan(model, block, "stock", gather)
            return sorted((name, type(s).__name__, sorted(map(repr, vars(s).items()))) for name, s in styles.items())
        except Exception as e:
            return first_line(e)

    try:
        with torch.device("meta"):
            model = build_family(family, small_config()["model"], window=window)
        family_plan.require_llama_layout_and_masks(model)
        text = repr([plan(block, gather) for gather in ("norm_output", "pre_hook") for block in model.model.layers])
    except Exception as e:
        text = first_line(e)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def summarize(row: dict) -> dict:
    """The table's cells for one torch: graphs, recompiles, the largest loss and gradient-norm
    differences from one process, the kwargs plan's graphs, and the first error."""
    b, kwargs, single = row["recipe_b"], row["kwargs"], row["single"]
    kwargs_error = kwargs.get("error") or ""
    cells = {"graphs": b.get("graphs", "-"), "recompiles": b.get("recompiles", "-"), "loss": "-", "grad": "-",
             "param": max(row["param_grads"].values()) if row.get("param_grads") else "-",
             "kwargs": kwargs.get("graphs", "-") if not kwargs_error else
             "refused" if kwargs_error.startswith("PlanError") else "-"}
    if kwargs.get("error") and "recompile_limit" in kwargs["error"]:
        cells["kwargs"] = f"{kwargs['graphs']}, limit hit"
    error = b.get("error") or single.get("error")
    error = error and error.strip().splitlines()[0][:300]  # run_training keeps Dynamo's whole message
    if not error and len(b["losses"]) == len(single["losses"]):
        cells["loss"] = max(abs(x - y) for x, y in zip(b["losses"], single["losses"]))
        cells["grad"] = max(abs(x - y) / y for x, y in zip(b["grad_norms"], single["grad_norms"]))
    cells["error"] = error
    return cells


def verdict(cells: dict) -> str:
    """"correct" (one process's losses and gradient norms to 1e-4 at every step, every parameter's
    step-1 gradient to 1e-4 relative), "drift after step 1", "WRONG" (a step-1 gradient off),
    "refused" by the plan in one line, "not run" (too large), or "fails" (any other error)."""
    if cells["error"]:
        return ("refused" if cells["error"].startswith("PlanError") else
                "not run" if cells["error"].startswith("SizeError") else "fails")
    if isinstance(cells["loss"], str):
        return "fails"
    if isinstance(cells["param"], str):
        return "fails"
    if cells["param"] > 1e-4:  # a gradient nothing sums is off at step 1, whatever the losses say
        return "WRONG"
    if cells["loss"] > 1e-4 or cells["grad"] > 1e-4:
        return "drift after step 1"
    return "correct" if (cells["graphs"], cells["recompiles"]) == (1, 0) else f"correct, {cells['graphs']} graphs"


VERDICTS = str(Path(__file__).with_name("reach.csv"))  # committed: a row per torch, family and window
COLUMNS = ("torch", "family", "window", "verdict", "graphs", "recompiles", "loss_diff", "grad_norm_rel_diff",
           "param_grad_rel_diff", "kwargs_plan_graphs", "error")


def verdict_row(version: str, row: dict) -> dict:
    """One measured row as the verdict file's columns."""
    cells = summarize(row)
    number = lambda x: f"{x:.1e}" if isinstance(x, float) else str(x)  # noqa: E731
    return dict(zip(COLUMNS, (version, row["family"], str(row["window"] or ""), verdict(cells), cells["graphs"],
                              cells["recompiles"], number(cells["loss"]), number(cells["grad"]), number(cells["param"]),
                              cells["kwargs"], cells["error"] or "")))


def read_verdicts(path: str = VERDICTS) -> list[dict]:
    import csv
    import os

    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_verdicts(rows: list[dict], path: str = VERDICTS) -> None:
    """Replace these rows' (torch, family, window) in the file and keep every other row."""
    import csv

    key = lambda r: (r["torch"], r["family"], str(r["window"]))  # noqa: E731
    merged = {key(r): r for r in read_verdicts(path)}
    merged.update({key(r): {c: str(r[c]) for c in COLUMNS} for r in rows})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(merged.values())


def counts(rows: list[dict], version: str) -> dict[str, int]:
    """README's figures for one torch: families (config variants "+" left out), correct ones, those
    also correct at both windows, refused ones, and the rest (failing, or not run)."""
    by_family = {}
    for r in rows:
        if r["torch"] == version and "+" not in r["family"]:
            by_family.setdefault(r["family"], {})[r["window"]] = r["verdict"]
    correct = [f for f, v in by_family.items() if v[""].startswith("correct")]
    return {"families": len(by_family), "correct": len(correct),
            "both windows": sum(all(by_family[f].get(w, "").startswith("correct") for w in map(str, WINDOWS))
                                for f in correct),
            "refused": sum(v[""] == "refused" for v in by_family.values()),
            "other": sum(not v[""].startswith(("correct", "refused")) for v in by_family.values())}


def verdict_table(rows: list[dict]) -> str:
    """RESULTS.md's table: one row per family, its verdict on the newest torch and, where they differ, on
    the others (window rows folded in, a refusal's or failure's line cut short; the whole line and every
    figure are in the file)."""
    versions = sorted({r["torch"] for r in rows}, key=lambda v: tuple(map(int, v.split("."))), reverse=True)

    def short(error: str) -> str:  # a refusal's line up to its reason; any line's first sentence, to 50 characters
        if error.startswith(("PlanError: ", "SizeError: ")):
            error = error.partition(": ")[2].split(": ")[0]
        error = error.split(". ")[0]
        return error if len(error) <= 50 else error[:50].rsplit(" ", 1)[0] + " ..."

    cells = {}
    for r in rows:
        text = r["verdict"] + (f": `{short(r['error'])}`" if r["error"] else "")
        cells.setdefault(r["family"], {}).setdefault(r["torch"], {})[r["window"]] = text
    heads = [f"torch {versions[0]}"] + [f"torch {v} where it differs" for v in versions[1:]]
    lines = ["| family | " + " | ".join(heads) + " |", "|---|" + "---|" * len(versions)]
    for family, per_torch in cells.items():
        shown = []
        for version in versions:
            by_window = per_torch.get(version, {})
            text = by_window.get("", "-")  # not measured on this torch
            windows = [by_window[w] for w in map(str, WINDOWS) if w in by_window]
            if windows and set(windows) == {text} and text.startswith("correct"):
                text += ", both windows"
            elif windows and {w.split(":")[0] for w in windows} != {text.split(":")[0]}:  # another verdict
                text += ("; windows: " + windows[0] if len(set(windows)) == 1 else
                         "; " + ", ".join(f"window {w}: {by_window[w]}" for w in map(str, WINDOWS) if w in by_window))
            shown.append("" if shown and text == shown[0] else text)
        cause = CAUSES.get(family)
        lines.append(f"| {family}{f' ({cause})' if cause else ''} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


BY_PATH = Path(__file__).with_name("by_path.csv")  # committed: reach.py --by-path's rows
TRAIN_ARGS = ("--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size", "2",
              "--validation.steps", "1", "--metrics.measure_cpu_peak", "false", "--checkpoint.enable", "true",
              "--checkpoint.initial_load_in_hf", "true")


def by_path(family: str, root: Path) -> dict:
    """`family` as a user brings it: a folder that stock save_pretrained writes (harness.make_hub_family:
    the tests' sizes, bfloat16), its tokenizer and 40 documents, trained 3 steps by train.py on TP 2
    with compile, and by one eager process; step 1 against stock transformers' loss on the same packed batch."""
    import re
    import subprocess
    import sys

    from harness import free_port, make_documents, make_hub_family, make_tokenizer, packed_batch, transformers_loss

    folder = make_tokenizer(make_hub_family(root / family, family))
    docs = root / "docs.jsonl" if (root / "docs.jsonl").exists() else make_documents(root / "docs.jsonl")
    row = {"family": family}
    for nproc in (2, 1):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                               f"--master_port={free_port()}", str(Path(__file__).with_name("train.py")), *TRAIN_ARGS,
                               "--checkpoint.folder", str(root / f"{family}-{nproc}"), "--checkpoint.initial_load_path",
                               str(folder), "--data.path", str(docs), "--data.cache_folder", str(root / "tokenized"),
                               "--compile.enable", str(nproc > 1).lower()], capture_output=True, text=True)
        if proc.returncode:
            return {**row, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
        row[nproc] = [float(x) for x in re.findall(r"^step +\d+ \| loss ([\d.]+)", proc.stdout, re.M)]
        if nproc > 1:
            row["graphs"], row["recompiles"] = (re.search(rf"{key} +(\d+)", proc.stdout)[1] for key in
                                                ("compiled graphs", "recompiles"))
    x, y, position_ids = packed_batch(docs, folder, 1, 2, 64)
    return {"family": family, "graphs": row["graphs"], "recompiles": row["recompiles"],
            "step_1_vs_transformers": f"{abs(row[2][0] - transformers_loss(folder, x, y, position_ids)):.1e}",
            "losses_vs_one_process": f"{max(abs(a - b) for a, b in zip(row[2], row[1])):.1e}", "error": ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help="comma-separated model_types (default: every dense family found)")
    parser.add_argument("--table", action="store_true", help=f"print RESULTS.md's table from {VERDICTS}, run nothing")
    parser.add_argument("--windows-only", action="store_true", help="only the sliding-window rows")
    parser.add_argument("--by-path", action="store_true", help=f"each family correct on this torch through train.py "
                        f"from a Hub folder, into {BY_PATH.name}")
    parser.add_argument("--plans", metavar="TREE", help="print each row's plan digest, with the project's files "
                        "from TREE (a checkout of any commit); diff two commits' to see which rows changed")
    args = parser.parse_args()
    if args.table:
        return print(verdict_table(read_verdicts()))
    if args.plans:
        import sys

        sys.path.insert(0, args.plans)

    import torch

    warnings.filterwarnings("ignore")
    if args.by_path:
        return measure_by_path(args.families.split(",") if args.families else None)
    families = args.families.split(",") if args.families else dense_families()[0]
    runs = [(family, window) for family in families
            for window in ((None,) * (not args.windows_only) + (WINDOWS if has_sliding_window(family) else ()))]
    if args.plans:
        return print("\n".join(f"{family} (window {window}): {plan_digest(family, window)}" for family, window in runs))
    for family, window in runs:
        start = time.perf_counter()
        row = verdict_row(torch.__version__.split("+")[0], measure(family, window))
        write_verdicts([row])  # row by row: an interrupted run keeps what it measured
        print(f"{family} (window {window}): {row} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(verdict_table(read_verdicts()))


def measure_by_path(families: list[str] | None) -> None:
    """by_path for `families`, or each family (variants too) reach.csv records correct on this torch, into BY_PATH."""
    import csv

    import torch

    version = torch.__version__.split("+")[0]
    families = families or [r["family"] for r in read_verdicts() if r["torch"] == version and not r["window"]
                            and r["verdict"].startswith("correct")]
    columns = ("torch", "family", "graphs", "recompiles", "step_1_vs_transformers", "losses_vs_one_process", "error")
    root = Path(tempfile.mkdtemp(prefix="by-path-"))
    with open(BY_PATH, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, lineterminator="\n")
        writer.writeheader()
        for family in families:
            start = time.perf_counter()
            row = {"torch": version, **by_path(family, root)}
            writer.writerow({c: row.get(c, "-") for c in columns})
            f.flush()
            print(f"{family}: {row} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

"""Benchmark: this project's HF path against torchtitan's llama3 debugmodel and transformers' own TP.

    python bench.py --quick                       # 7-20 minutes on 2 CPU cores, by machine
    python bench.py --seq-len 4096 --batch 1 --steps 3 --warm-rounds 0 --variants patched,native --ac none
                                                  # memory at a long sequence, with and without SP
    python bench.py --nproc 1 --variants patched,titan --model.hidden_size 2048 --training.mixed_precision_param bfloat16
                                                  # train.py's --section.key value overrides: any shape, dtype
    python bench.py --data DOCS --tokenizer FOLDER --seq-len 2048 --batch 8
                                                  # the data path alone: tokenization, cached start-up, windows/s
    python bench.py --make-qwen3-5 FOLDER          # a Qwen3.5 folder at 0.8B's widths, 4 layers, and documents

Variants, same shapes, data, seed, optimizer, TP degree, AC (full unless --ac none), inductor per block,
and compute dtype (training.mixed_precision_param: bfloat16 autocasts every variant's forward):
  patched  train.py's model with PositionalLlamaDecoderLayer (the fix)
  stock    train.py's model with HF's LlamaDecoderLayer and the input_kwarg_layouts plan
  norm     HF's LlamaDecoderLayer with the plan-only fix (attention's input gathered at the norm)
  eager    patched, without compile
  titan    torchtitan.models.llama3 at [model]'s shapes with torchtitan's apply_tp/apply_ac/apply_compile,
           holding patched's initial weights (so its loss column equals patched's)
  native   transformers' own TP (from_pretrained with DistributedConfig(tp_size)), no sequence
           parallel; the same weights through an HF folder, HF's checkpointing, each block compiled
The loss gap is each variant's largest per-step difference from one process (eager, same batches).
Each run is its own torchrun process group. A cold round (empty inductor cache) comes first,
then warm rounds (cache kept); within a round the variants alternate, so drift hits all alike,
and each round starts one variant later, so no variant is always first.
"""

import time

T_START = time.perf_counter()  # time to first step counts the imports too

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from config import ConfigError, parse_args

HERE = Path(__file__).parent
VARIANTS = ("patched", "stock", "norm", "eager", "titan", "native")
RESULT_TAG = "BENCH_RESULT "


# -----------------------------------------------------------------------------
# worker: one variant, one torchrun process group


def variant_config(variant: str, args, world_size: int) -> dict:
    """config.toml with the benchmark's shapes, then the command line's `--section.key value`
    overrides (train.py's parser and checks), then the variant's layer, plan and compile."""
    from config import load_config

    overrides = {"training.steps": args.steps, "training.local_batch_size": args.batch, "training.seq_len": args.seq_len,
                 "model.num_hidden_layers": args.layers, "activation_checkpoint.mode": args.ac, **args.overrides,
                 "parallelism.decoder_layer": "stock" if variant in ("stock", "norm", "native") else "positional",
                 "parallelism.attention_gather": "norm_output" if variant == "norm" else "pre_hook",
                 "compile.enable": variant != "eager",
                 "compile.fail_on_recompile": False}  # the benchmark counts recompiles instead
    return load_config(str(HERE / "config.toml"), world_size, overrides)


def titan_args(hf_config, seq_len: int):
    """torchtitan's llama3 args for an HF `LlamaConfig`: its debugmodel's with each field the HF config
    sets, so config.toml's are the debugmodel's own (test_parity.py). torchtitan sizes the MLP as
    2/3 x 4 x dim rounded up to `multiple_of`; another width sets `multiple_of` to it."""
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    c, rope = hf_config, hf_config.rope_parameters
    debugmodel = llama3_args["debugmodel"]
    args = dataclasses.replace(
        debugmodel, dim=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
        n_kv_heads=None if c.num_key_value_heads == c.num_attention_heads else c.num_key_value_heads,
        vocab_size=c.vocab_size, norm_eps=c.rms_norm_eps, rope_theta=rope["rope_theta"], max_seq_len=seq_len,
        rope_scaling_args=RoPEScalingArgs(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                                          rope["original_max_position_embeddings"]))
    two_thirds, width = int(8 * c.hidden_size / 3), c.intermediate_size
    if -(-two_thirds // args.multiple_of) * args.multiple_of != width:
        args = dataclasses.replace(args, multiple_of=width, ffn_dim_multiplier=min(1.0, width / two_thirds))
    return args


def titan_from_hf(hf_model, seq_len: int):
    """torchtitan's own llama3 `Transformer` holding `hf_model`'s weights, converted by
    torchtitan's `Llama3StateDictAdapter.from_hf`, at `titan_args`."""
    from torchtitan.models.llama3 import Llama3StateDictAdapter, Transformer

    args = titan_args(hf_model.config, seq_len)
    model = Transformer(args)
    weights = Llama3StateDictAdapter(args, None).from_hf(hf_model.state_dict())
    model.load_state_dict(weights, strict=True)  # freqs_cis is a non-persistent buffer, made from args
    return model


def build_titan(cfg: dict, device):
    """torchtitan's llama3 at [model]'s shapes, from the same seeded HF weights as the other variants,
    parallelized by torchtitan's own functions."""
    import torch
    from torchtitan.config.job_config import ActivationCheckpoint, Compile
    from torchtitan.models.llama3.infra.parallelize import apply_ac, apply_compile, apply_tp

    from model import build_model
    from parallelize import build_parallel_dims
    from workarounds import OP_SAC_SAVE_LIST, materialize_embedding_output
    from train import build_optimizer

    t = cfg["training"]
    torch.manual_seed(t["seed"])
    model = titan_from_hf(build_model(cfg["model"]), t["seq_len"]).to(device)
    tp = cfg["parallelism"]["tp"]
    if tp > 1:
        tp_mesh = build_parallel_dims(cfg, tp, device.type).get_mesh("tp")
        apply_tp(model, tp_mesh, loss_parallel=cfg["parallelism"]["loss_parallel"], enable_float8_tensorwise_tp=False)
        # torchtitan's own model hits the same AsyncCollectiveTensor backward failure on torch 2.14.1.
        materialize_embedding_output(model.tok_embeddings)
    if cfg["activation_checkpoint"]["mode"] == "full":
        apply_ac(model, ActivationCheckpoint(mode="full"), model_compile_enabled=True,
                 op_sac_save_list=OP_SAC_SAVE_LIST)
    apply_compile(model, Compile(enable=True, backend="inductor"))
    model.train()
    return model, *build_optimizer(model, cfg)


def build_native(cfg: dict, device, folder: Path):
    """transformers' own tensor parallelism: the seeded model written as an HF folder, read back
    by from_pretrained with DistributedConfig (its plan, no sequence parallel), then HF's
    activation checkpointing and each block compiled, as transformers' docs show."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    from model import build_model
    from train import build_optimizer

    t = cfg["training"]
    if dist.get_rank() == 0:
        torch.manual_seed(t["seed"])
        build_model(cfg["model"], "stock").save_pretrained(folder)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                             distributed_config=DistributedConfig(tp_size=dist.get_world_size()))
    if cfg["activation_checkpoint"]["mode"] == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for block in model.model.layers:
        block.compile(backend="inductor", fullgraph=True)
    model.train()
    return model.to(device), *build_optimizer(model, cfg)


def clip_dtensor_and_plain_grads_(parameters, max_norm: float):
    """torch's clipping for a model whose gradients are some DTensors, some plain (transformers'
    TP): torchtitan's clip_grad_norm_ refuses the mix in one foreach call."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    squares = [g.norm() ** 2 for g in grads]
    total = sum(s.full_tensor() if isinstance(s, DTensor) else s for s in squares).sqrt()
    for g in grads:
        g.mul_((max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def worker(variant: str, args) -> None:
    import torch
    import torch.distributed as dist

    import parallelize
    import report
    import train
    from data import load_stdlib_bytes, random_windows
    from model import build_model

    launch = train.launch_env()
    cfg = variant_config(variant, args, launch.world_size)
    device = train.init_distributed(launch, cfg["comm"]["init_timeout_seconds"])
    t = cfg["training"]
    torch.set_float32_matmul_precision(t["float32_matmul_precision"])  # as train.main
    peak = report.peak_flops(device, cfg)
    data, _ = load_stdlib_bytes(cfg["data"]["max_bytes"])
    if variant == "titan":
        model, optimizer, scheduler = build_titan(cfg, device)
        forward = lambda model, x: model(x)  # noqa: E731
    elif variant == "native":
        model, optimizer, scheduler = build_native(cfg, device, Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "hf")
        forward = lambda model, x: model(x, use_cache=False).logits  # noqa: E731 (a KV cache recompiles per block)
        train.clip_grad_norm_ = clip_dtensor_and_plain_grads_  # train_step's, in this variant's own process
    else:
        model, optimizer, scheduler = train.build_training(cfg, device, parallelize.build_parallel_dims(cfg, launch.world_size, device.type))
        forward = train.forward_logits
    batches = random_windows(data, t["local_batch_size"], t["seq_len"], torch.Generator().manual_seed(t["seed"]))
    run = train.train_loop(model, optimizer, scheduler, batches, range(1, t["steps"] + 1), cfg, device,
                           rank=launch.rank, log=lambda *a: None, forward=forward, t_start=T_START)
    peaks = report.gather_from_ranks(report.peak_memory_mib(device))
    graphs, recompiles = report.dynamo_compile_counts()
    with torch.device("meta"):  # every variant is the same model: torchtitan's count for it
        flops = report.flops_per_token(build_model(cfg["model"]), cfg)
    if launch.rank == 0:
        tokens_per_s = report.tokens_per_step(cfg) / statistics.median(run.step_times[2:])
        result = dict(variant=variant, time_to_first_step=run.time_to_first_step, tokens_per_s=tokens_per_s,
                      model_flops=flops * tokens_per_s, peak_flops=peak[0], peak=peak[1],
                      peak_mib=peaks, graphs=graphs, recompiles=recompiles,
                      losses=run.losses)
        print(RESULT_TAG + json.dumps(result), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# driver: cold round, warm rounds, one table


def run_variant(variant: str, args, cache_dir: Path, nproc: int | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc or args.nproc}",
           str(Path(__file__).resolve()), "--worker", variant, "--seq-len", str(args.seq_len),
           "--batch", str(args.batch), "--steps", str(args.steps), "--layers", str(args.layers),
           "--ac", args.ac, *args.override_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    # The exception line closes rank 0's traceback: the last unindented "[rank0]: " line.
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line[len("[rank0]: "):] for line in lines
              if line.startswith("[rank0]: ") and not line[len("[rank0]: "):].startswith((" ", "^"))]
    return dict(variant=variant, error=(errors or lines or ["no output"])[-1])


def describe(r: dict) -> str:
    if "error" in r:
        return f"FAILED: {r['error']}"
    return (f"first step {r['time_to_first_step']:.1f} s, {r['tokens_per_s']:.0f} tokens/s, "
            f"graphs {r['graphs']}, recompiles {r['recompiles']}")


def summarize(cold: dict, warm: list[dict], one: list[float]) -> dict:
    runs = [cold] + warm
    return dict(cold_ttfs=cold["time_to_first_step"],
                warm_ttfs=statistics.median(r["time_to_first_step"] for r in warm) if warm else None,
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in runs),
                model_flops=statistics.median(r["model_flops"] for r in runs),
                peak_flops=[r["peak_flops"] for r in runs], peak=cold["peak"],
                peak_mib=max(max(r["peak_mib"]) for r in runs), graphs=cold["graphs"],
                recompiles=cold["recompiles"], first_loss=cold["losses"][0], last_loss=cold["losses"][-1],
                loss_gap=max(abs(a - b) for a, b in zip(cold["losses"], one, strict=True)))


def print_table(rows: dict, args) -> None:
    import torch
    import torchtitan
    import transformers

    print(f"\n{os.cpu_count()} CPU cores, {args.nproc} ranks (TP={args.nproc}), {args.layers} layers, "
          f"batch {args.batch}, "
          f"seq {args.seq_len}, AC {args.ac}, {args.steps} steps, {args.warm_rounds} warm round(s); torch {torch.__version__}, "
          f"torchtitan {torchtitan.__version__}, transformers {transformers.__version__}; "
          f"overrides: {' '.join(args.override_args) or 'none'}")
    # One peak for every row: each run times its own, 1.09-1.37x apart in one --quick table so far,
    # which gave rows of the same tokens/s MFUs 10 points apart.
    ran = [r for r in rows.values() if "error" not in r]
    measured = [p for r in ran for p in r["peak_flops"]]
    if ran:
        peak = statistics.median(measured)
        print(f"MFU of one peak for every row: {peak / 1e9:.0f} GFLOP/s, the median of {len(measured)} runs' "
              f"({min(measured) / 1e9:.0f}-{max(measured) / 1e9:.0f}); the first run's: {ran[0]['peak']}")
    print("| variant | first step cold (s) | first step warm (s) | steady tokens/s | vs titan | MFU | "
          "peak MiB/rank | graphs | recompiles | loss first -> last | loss gap |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    titan = rows.get("titan")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error'][:200]} |||||||||")
            continue
        ratio = f"{r['tokens_per_s'] / titan['tokens_per_s']:.2f}x" if titan and "error" not in titan else "-"
        warm = f"{r['warm_ttfs']:.1f}" if r["warm_ttfs"] is not None else "-"
        print(f"| {name} | {r['cold_ttfs']:.1f} | {warm} | {r['tokens_per_s']:.0f} | {ratio} | {r['model_flops'] / peak:.1%} | "
              f"{r['peak_mib']:.0f} | {r['graphs']} | {r['recompiles']} | "
              f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} | {r['loss_gap']:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 steps, one warm round")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="default 20 (8 with --quick)")
    parser.add_argument("--warm-rounds", type=int, default=None, help="default 2 (1 with --quick)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--ac", choices=("full", "none"), default="full", help="activation checkpointing")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--data", help="time the data path alone on these documents (data.path), nothing else")
    parser.add_argument("--tokenizer", default="bytes", help="with --data: data.tokenizer")
    parser.add_argument("--make-qwen3-5", metavar="FOLDER", help="a Qwen3.5 folder at 0.8B's widths, 4 layers; FOLDER/docs.jsonl")
    parser.add_argument("--make-conversations", nargs=2, metavar=("COUNT", "PATH"),
                        help="write COUNT conversations from the standard library's docstrings to PATH, nothing else")
    args, args.override_args = parser.parse_known_args()
    if args.make_conversations:
        return make_conversations(args.make_conversations[1], int(args.make_conversations[0]))
    if args.make_qwen3_5:
        return make_qwen3_5(Path(args.make_qwen3_5))
    if args.data:
        return bench_data(args.data, args.tokenizer, args.seq_len, args.batch)
    try:  # the rest: train.py's --section.key value overrides, read by its parser
        config_path, args.overrides = parse_args(args.override_args)
    except ConfigError as e:
        parser.error(str(e))
    if config_path or args.overrides.get("parallelism.dp_shard", 1) != 1:
        parser.error("bench.py takes config.toml with overrides, and TP over --nproc ranks only (no --config, no dp_shard)")
    args.steps = args.steps or (8 if args.quick else 20)
    if args.steps < 3:
        parser.error("--steps must be >= 3: the steady rate is the median after two warm-up steps")
    if args.worker:
        return worker(args.worker, args)
    args.warm_rounds = args.warm_rounds if args.warm_rounds is not None else (1 if args.quick else 2)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")

    # Read the libraries once, untimed, so that the first cold run does not also pay for
    # loading them from disk into the OS page cache.
    subprocess.run([sys.executable, "-c", "import torch, torchtitan.distributed, transformers, train"],
                   cwd=HERE, check=True)
    cache_root = Path(tempfile.mkdtemp(prefix="bench-inductor-"))
    runs = {v: [] for v in variants}
    try:
        for round_ in range(1 + args.warm_rounds):
            # Alternate the variants within a round, and rotate who goes first: the first run of a
            # round read ~15% slow (the variants in reverse order: patched 0.83-0.86x torchtitan first, 1.02x last).
            for v in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
                if round_ == 0:
                    shutil.rmtree(cache_root / v, ignore_errors=True)  # cold: an empty cache
                r = run_variant(v, args, cache_root / v)
                print(f"round {round_} ({'cold' if round_ == 0 else 'warm'}) {v}: {describe(r)}", flush=True)
                runs[v].append(r)
        one = run_variant("eager", args, cache_root / "one", nproc=1)  # the reference: one process
        if "error" in one:
            raise SystemExit(f"the one-process reference failed: {one['error']}")
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    rows = {v: rs[0] if "error" in rs[0] else summarize(rs[0], [r for r in rs[1:] if "error" not in r], one["losses"])
            for v, rs in runs.items()}
    print_table(rows, args)


def bench_data(path: str, tokenizer: str, seq_len: int, batch: int, seconds: float = 10.0) -> None:
    """data.prepare into an empty cache (the first run: tokenization's tokens/s, chat templates rendered
    included, and the cores it kept busy: CPU seconds / wall seconds), again from the cache (start-up), then
    batches from the memory map for `seconds` on one thread: the data path's tokens/s per rank, the share
    of them that are targets, and for conversations the time to pack an epoch."""
    import resource

    import torch

    import data

    torch.set_num_threads(1)
    cache = tempfile.mkdtemp(prefix="bench-data-")
    keys = dict(path=path, split="train", text_field="text", tokenizer=tokenizer, cache_folder=cache, max_bytes=0)
    try:
        for run in ("first run", "cached"):
            wall, cpu = time.perf_counter(), time.process_time()
            corpus = data.prepare(keys, "", 1 << 40, batch, seq_len)
            wall, cpu, tokens = time.perf_counter() - wall, time.process_time() - cpu, corpus.train.tokens
            built = f"; tokenized {tokens.ids.size:,} tokens in {tokens.built:.2f} s: {tokens.ids.size / tokens.built:,.0f} " \
                    f"tokens/s on {cpu / wall:.2f} cores" if tokens.built else ""
            print(f"{run}: prepare {wall:.2f} s, {len(corpus.train):,} training {data.kind(corpus.train)}{built}; "
                  f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB", flush=True)
        source = corpus.train.windows(batch, seq_len, seed=0)
        if corpus.train.conversations():
            tokens, start = corpus.train.trained(seq_len)[0], time.perf_counter()
            print(f"epoch 0 {source.packed(tokens)} in {time.perf_counter() - start:.2f} s")
        windows, count, targets, start = iter(source), 0, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            targets += int((next(windows)[1] != data.IGNORED).sum())
            count += 1
        elapsed = time.perf_counter() - start
        print(f"windows of {seq_len} x {batch}: {count:,} batches in {elapsed:.1f} s, "
              f"{count * batch * seq_len / elapsed:,.0f} tokens/s on one thread, {targets / (count * batch * seq_len):.1%} "
              "of them targets")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def make_conversations(path: str, count: int) -> None:
    """`count` conversations as JSON lines of messages, from the standard library's docstrings: a system turn,
    then one to three questions about a function or class, each answered by a paragraph of its docstring."""
    import ast
    import json
    import random
    import sysconfig

    answers = []
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(file.read_text(errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and (doc := ast.get_docstring(node)):
                answers += [(f"{file.stem}.{node.name}", part.strip()) for part in doc.split("\n\n") if part.strip()]
    rng, lines = random.Random(0), []
    for _ in range(count):
        turns = [{"role": "system", "content": "You explain Python's standard library, briefly."}]
        for name, answer in rng.sample(answers, rng.randint(1, 3)):
            turns += [{"role": "user", "content": f"What about {name}?"}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": turns}))
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"wrote {count:,} conversations from {len(answers):,} docstring paragraphs to {path}")


def make_qwen3_5(folder: Path) -> None:
    """A vision + text Qwen3.5 folder as stock save_pretrained writes it, bf16: the text model at Qwen3.5-0.8B's
    widths (hidden 1024; attention 8 heads, 2 key/value heads of 256; linear attention 16 key and 16 value heads of
    128; MLP 3584), 4 of its layers (3 Gated DeltaNet, 1 gated attention), a 32,768 vocabulary, harness.py's
    tokenizer; and 3,000 documents in folder/docs.jsonl."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from harness import make_documents, make_tokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_5", text_config=dict(
        vocab_size=32768, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=16,
        linear_value_head_dim=128, max_position_embeddings=4096), vision_config=dict(
        depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=1024, patch_size=16))
    AutoModelForImageTextToText.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    make_tokenizer(folder)
    make_documents(folder / "docs.jsonl", count=3000)


if __name__ == "__main__":
    main()

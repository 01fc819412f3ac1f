"""README's recipes as a user pastes them: each block of "The fix to copy", run in a plain HF
trainer that imports nothing from this project (stock `LlamaForCausalLM`, torch's
`parallelize_module` with torchtitan's llama3 plan on HF names, TP 2 + SP on gloo, torch's
`checkpoint_wrapper`, per-block `torch.compile(fullgraph=True)`, AdamW). Marked `recompile_proof`:
CI runs it on the pinned torch and on torch 2.10.0, where the bug lives.
"""

import functools
import json
import linecache
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import HERE, HOOK_GUARD_BUG, NUM_BLOCKS, STEPS, TP, free_port, run_tp, small_config

EMBEDDING_LINE = "    model.model.embed_tokens.register_forward_hook(lambda _m, _i, out: out.clone())\n"


def readme_blocks(readme: str) -> dict[str, str]:
    """The README's code blocks fenced as ```python recipe-a / recipe-b / both."""
    return dict(re.findall(r"^```python (recipe-a|recipe-b|both)\n(.*?)^```$", readme, re.S | re.M))


def recipes() -> dict[str, str]:
    """What the trainer runs: each recipe with the `both` block, and (on the pinned torch)
    recipe A without the embedding line, which says whether that line is still needed."""
    blocks = readme_blocks((HERE / "README.md").read_text())
    assert set(blocks) == {"recipe-a", "recipe-b", "both"}, f"README's recipe blocks: {sorted(blocks)}"
    codes = {"A": blocks["recipe-a"] + blocks["both"], "B": blocks["recipe-b"] + blocks["both"]}
    if not HOOK_GUARD_BUG:  # CI time: on torch 2.10.0 too block 0 compiles its own graph (RESULTS.md)
        codes["A without the embedding line"] = blocks["recipe-a"].replace(EMBEDDING_LINE, "") + blocks["both"]
    return codes


def run_block(code: str) -> dict:
    """The names `code` defines, run as a file of its own (so that inspect can read its source)."""
    filename = f"<README.md block {abs(hash(code))}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    names = {"__name__": "readme_recipe"}
    exec(compile(code, filename, "exec"), names)
    return names


# torchtitan's llama3 plan (llama3/infra/parallelize.py, apply_tp) on HF's module names, loss parallel on.
TOP_PLAN = {
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "model.norm": SequenceParallel(),
    "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
}
BLOCK_PLAN = {  # without attention's input: the recipes' part
    "input_layernorm": SequenceParallel(),
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    "post_attention_layernorm": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}


def plain_trainer(code: str, cfg: dict, batches: list, tp_mesh) -> dict:
    """A user's trainer with `code` pasted in: losses, gradient norms, Dynamo's graph and recompile counts."""
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    recipe = run_block(code)
    t = cfg["training"]
    torch.manual_seed(t["seed"])
    model = LlamaForCausalLM(LlamaConfig(**cfg["model"]))
    parallelize_module(model, tp_mesh, TOP_PLAN)
    recipe["parallelize_blocks"](model, tp_mesh, BLOCK_PLAN)
    for i, block in enumerate(model.model.layers):
        model.model.layers.register_module(str(i), torch.compile(checkpoint_wrapper(block, preserve_rng_state=False),
                                                                 fullgraph=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    warmup = t["warmup_steps"]  # linear warm-up, then linear decay to zero
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / (warmup + 1) if s < warmup else
                                                  max(0.0, 1 - (s - warmup) / max(1, t["steps"] - warmup)))
    result = {"losses": [], "grad_norms": [], "error": None}
    try:
        for x, y in batches:
            logits = recipe["forward_logits"](model, x)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t["max_norm"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            result["losses"].append(loss.full_tensor().item())
            result["grad_norms"].append(grad_norm.full_tensor().item())
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    result["graphs"] = counters["stats"]["unique_graphs"]
    result["recompile_reasons"] = [r for reasons in guard_failures.values() for r in reasons]
    return result


def _rank_main(rank: int, port: int, codes: dict, cfg: dict, batches_path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(TP), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tp_mesh = init_device_mesh("cpu", (TP,))
    batches = torch.load(batches_path)
    results = {name: plain_trainer(code, cfg, batches, tp_mesh) for name, code in codes.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


@functools.cache
def run_recipes(tmp_root: str) -> dict:
    """Every recipe on 2 gloo ranks, with the project's trainer's batches (the data, not its code)."""
    import train

    cfg = small_config()
    t = cfg["training"]
    data, _ = train.load_stdlib_bytes(cfg["data"]["max_bytes"])
    it = train.batches(data, t["local_batch_size"], t["seq_len"], torch.Generator().manual_seed(t["seed"]))
    batches_path, out = Path(tmp_root) / "readme-batches.pt", Path(tmp_root) / "readme-recipes.json"
    torch.save([next(it) for _ in range(t["steps"])], batches_path)
    mp.spawn(_rank_main, args=(free_port(), recipes(), cfg, str(batches_path), str(out)), nprocs=TP)
    return json.loads(out.read_text())


@pytest.mark.recompile_proof
@pytest.mark.parametrize("recipe", ["A", "B"])
def test_readme_recipe_compiles_one_graph_with_the_trainers_numbers(tmp_root, recipe):
    r = run_recipes(tmp_root)[recipe]
    assert r["error"] is None, f"README's recipe {recipe}: {r['error']}"
    assert (r["graphs"], r["recompile_reasons"]) == (1, []), f"{r['graphs']} graphs for {NUM_BLOCKS} blocks"
    trainer = run_tp(tmp_root)  # the project's trainer, TP 2, on the same weights and batches
    assert len(r["losses"]) == STEPS
    assert r["losses"] == pytest.approx(trainer["losses"], abs=1e-5)
    assert r["grad_norms"] == pytest.approx(trainer["grad_norms"], rel=1e-5)


def test_without_the_embedding_line_recipe_a_fails(tmp_root):
    """Block 0 gets the TP embedding's AsyncCollectiveTensor and a graph of its own (on 2.14.1 and
    2.15.0, then a crash in backward). The test of workarounds.materialize_embedding_output: when
    this fails, the installed torch hands block 0 a plain tensor by itself."""
    r = run_recipes(tmp_root)["A without the embedding line"]
    assert r["graphs"] == 2, f"block 0 should compile a graph of its own: {r}"


def test_readme_layer_follows_installed_transformers():
    from test_recompile import _normalized_forward
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    recipe = run_block(readme_blocks((HERE / "README.md").read_text())["recipe-a"])
    assert _normalized_forward(recipe["PositionalLlamaDecoderLayer"].forward) == _normalized_forward(
        LlamaDecoderLayer.forward), "README's recipe A no longer copies transformers' LlamaDecoderLayer.forward"

"""README's recipes as a user pastes them: the blocks of "The fix to copy" (README's plan
included), run in a plain HF trainer that imports no plan from this project (stock HF models,
torch's `parallelize_module`, TP 2 + SP on gloo, torch's `checkpoint_wrapper`, per-block
`torch.compile(fullgraph=True)`, AdamW), on a tied Llama; recipe B on Qwen3 with README's plan
and with family_plan.py copied, and on OLMo 2 and a tied Gemma 3. Marked `recompile_proof`: CI runs it on the pinned torch and on
torch 2.10.0, where the bug lives.
"""

import ast
import functools
import importlib.util
import inspect
import json
import linecache
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import (HERE, HOOK_GUARD_BUG, NUM_BLOCKS, STEPS, TP, _torchrun_cmd, again_if_a_rank_died_of_a_signal,
                      assert_every_gradient_matches, join_gloo, run_tp, small_config, spawn)
from harness import build_family, forget_the_last_model, whole_gradients
from workarounds import FOREACH_SCALES_PARTIAL_GRADIENTS

EMBEDDING_LINE = "    model.model.embed_tokens.register_forward_hook(lambda _m, _i, out: out.clone())\n"


def readme_blocks(readme: str) -> dict[str, str]:
    """The README's code blocks fenced as ```python plan / recipe-a / recipe-b / both."""
    return dict(re.findall(r"^```python (plan|recipe-a|recipe-b|both)\n(.*?)^```$", readme, re.S | re.M))


# Each case: (README's blocks to paste, the model's family, its block plan: README's BLOCK_PLAN or family_plan.py's).
def cases() -> dict[str, tuple[str, str, str]]:
    """README's recipes as pasted, on a tied Llama (Llama 3.2 1B's layout); recipe B's guard against
    TOP_PLAN applied without parallelize_top (untied); recipe B on Qwen3 with README's Llama plan (its
    guard must refuse), and with family_plan.py on Qwen3, OLMo 2 and a tied Gemma 3; on the pinned
    torch recipe A without the embedding line, which says whether that line is still needed."""
    blocks = readme_blocks((HERE / "README.md").read_text())
    assert set(blocks) == {"plan", "recipe-a", "recipe-b", "both"}, f"README's recipe blocks: {sorted(blocks)}"
    a, b = (blocks["plan"] + blocks[recipe] + blocks["both"] for recipe in ("recipe-a", "recipe-b"))
    found = {"A": (a, TIED_LLAMA, "readme"), "B": (b, TIED_LLAMA, "readme"),
             "B, TOP_PLAN without parallelize_top": (b, TIED_LLAMA, "top_plan_only"),
             "B on qwen3, Llama's plan": (b, "qwen3", "readme"), "B on qwen3, family_plan.py": (b, "qwen3", "family_plan"),
             "B on olmo2, family_plan.py": (b, "olmo2", "family_plan"),
             "B on gemma3_text, family_plan.py": (b, TIED_GEMMA3, "family_plan")}
    if not HOOK_GUARD_BUG:  # CI time: on torch 2.10.0 too block 0 compiles its own graph (RESULTS.md)
        found["A without the embedding line"] = (a.replace(EMBEDDING_LINE, ""), "llama", "readme")
    return found


def run_block(code: str) -> dict:
    """The names `code` defines, run as a file of its own (so that inspect can read its source)."""
    filename = f"<README.md block {abs(hash(code))}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    names = {"__name__": "readme_recipe"}
    exec(compile(code, filename, "exec"), names)
    return names


def copied_family_plan(folder: str):
    """family_plan.py copied into `folder` and imported from there, as a user copies it (its hybrid_plan and
    hf_layout, the rest of README's copy list, are this project's)."""
    path = Path(folder) / "copied_family_plan.py"
    tmp = path.with_name(f"{path.name}.{os.getpid()}")  # every rank copies it: atomically, or another reads half
    tmp.write_text((HERE / "family_plan.py").read_text())
    os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location("copied_family_plan", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # as `import` does: Dynamo looks it up
    spec.loader.exec_module(module)
    return module


TIED_LLAMA, TIED_GEMMA3 = "llama+tie_word_embeddings", "gemma3_text+tie_word_embeddings"


def build(arch: str, cfg: dict):
    """A seeded model: a Llama from [model] ("+tie_word_embeddings": tied), else harness.build_family's."""
    torch.manual_seed(cfg["training"]["seed"])
    family, *variants = arch.split("+")
    if family != "llama":
        return build_family(arch, cfg["model"])
    return LlamaForCausalLM(LlamaConfig(**{**cfg["model"], "tie_word_embeddings": "tie_word_embeddings" in variants}))


def adamw_and_schedule(model, cfg: dict):
    """A user's AdamW with torchtitan's settings; linear warm-up, then linear decay to zero."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["optimizer"]["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    warmup, steps = cfg["lr_scheduler"]["warmup_steps"], cfg["training"]["steps"]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / (warmup + 1) if s < warmup else
                                                        max(0.0, 1 - (s - warmup) / max(1, steps - warmup)))


def plain_trainer(code: str, arch: str, plan: str, cfg: dict, batches: list, tp_mesh, grads_path: str) -> dict:
    """A user's trainer with `code` pasted in: losses, gradient norms, Dynamo's graph and recompile
    counts; every parameter's step-1 gradient (clipped, whole) saved to `grads_path`."""
    from torch._dynamo.utils import counters, guard_failures

    forget_the_last_model()
    recipe = run_block(code)
    t = cfg["training"]
    model = build(arch, cfg)
    result = {"losses": [], "grad_norms": [], "error": None}
    try:
        if plan == "family_plan":
            family_plan = copied_family_plan(os.path.dirname(grads_path))
            family_plan.require_llama_layout_and_masks(model)
            block_plan = family_plan.block_plan(model.model.layers[0], "norm_output")
        else:
            block_plan = recipe["BLOCK_PLAN"]
        if plan == "top_plan_only":  # README's plan dict applied by hand: the tie is lost
            parallelize_module(model, tp_mesh, recipe["TOP_PLAN"])
        else:
            recipe["parallelize_top"](model, tp_mesh)
        recipe["parallelize_blocks"](model, tp_mesh, block_plan)
    except ValueError as e:
        result["error"] = f"{type(e).__name__}: {e}"
        return result
    for i, block in enumerate(model.model.layers):
        model.model.layers.register_module(str(i), torch.compile(checkpoint_wrapper(block, preserve_rng_state=False),
                                                                 fullgraph=True))
    optimizer, scheduler = adamw_and_schedule(model, cfg)
    try:
        for step, (x, y) in enumerate(batches):
            logits = recipe["forward_logits"](model, x)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss.backward()
            grad_norm = recipe["clip_grad_norm_"](model, t["max_norm"])  # README's, as pasted
            if step == 0:
                grads = whole_gradients(model)
                if dist.get_rank() == 0:
                    torch.save(grads, grads_path)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            result["losses"].append(loss.full_tensor().item())
            result["grad_norms"].append(grad_norm.full_tensor().item())
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    result["graphs"] = counters["stats"]["unique_graphs"]
    result["tied"] = model.lm_head.weight is model.model.embed_tokens.weight  # one parameter, after the steps
    result["recompile_reasons"] = [r for reasons in guard_failures.values() for r in reasons]
    return result


def one_process(arch: str, cfg: dict, batches: list, grads_path: str) -> dict:
    """The same model, optimizer and batches in one eager process: the reference."""
    t = cfg["training"]
    model = build(arch, cfg)
    optimizer, scheduler = adamw_and_schedule(model, cfg)
    result = {"losses": [], "grad_norms": []}
    for step, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(input_ids=x, use_cache=False).logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        result["grad_norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), t["max_norm"]).item())
        if step == 0:
            torch.save(whole_gradients(model), grads_path)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        result["losses"].append(loss.item())
    return result


def _rank_main(rank: int, port: int, jobs: list, cfg: dict, batches_path: str) -> None:
    join_gloo(rank, TP, port)
    tp_mesh = init_device_mesh("cpu", (TP,))
    batches = torch.load(batches_path)
    for case, out in jobs:
        result = plain_trainer(*case, cfg, batches, tp_mesh, f"{out}.grads.pt")
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


@functools.cache
def run_recipes(tmp_root: str) -> dict:
    """Every case on the same 2 gloo ranks, one after another (a spawn per case took CI 3 minutes more), with
    the project's trainer's batches (the data, not its code); each result's "grads" names its step-1 gradients."""
    from data import load_stdlib_bytes, random_windows

    cfg = small_config()
    t = cfg["training"]
    data, _ = load_stdlib_bytes(cfg["data"]["max_bytes"])
    it = random_windows(data, t["local_batch_size"], t["seq_len"], torch.Generator().manual_seed(t["seed"]))
    batches_path = Path(tmp_root) / "readme-batches.pt"
    torch.save([next(it)[:2] for _ in range(t["steps"])], batches_path)
    outs = {name: (case, str(Path(tmp_root) / f"readme-case-{i}.json")) for i, (name, case) in enumerate(cases().items())}
    spawn(_rank_main, lambda port: (port, list(outs.values()), cfg, str(batches_path)), TP, f"README's recipes on {TP} ranks")
    results = {name: {**json.loads(Path(out).read_text()), "grads": f"{out}.grads.pt"} for name, (_, out) in outs.items()}
    for arch in ("qwen3", "olmo2", TIED_GEMMA3):
        one = Path(tmp_root) / f"readme-{arch}-one.grads.pt"
        results[f"{arch}, one process"] = {**one_process(arch, cfg, torch.load(batches_path), str(one)), "grads": str(one)}
    return results


@pytest.mark.recompile_proof
@pytest.mark.parametrize("recipe", ["A", "B"])
def test_readme_recipe_compiles_one_graph_with_the_trainers_numbers(tmp_root, recipe):
    r = run_recipes(tmp_root)[recipe]
    assert r["error"] is None, f"README's recipe {recipe}: {r['error']}"
    assert (r["graphs"], r["recompile_reasons"]) == (1, []), f"{r['graphs']} graphs for {NUM_BLOCKS} blocks"
    assert r["tied"], "lm_head is no longer the embedding's parameter"
    trainer = run_tp(tmp_root, **{"model.tie_word_embeddings": True})  # the project's trainer, TP 2, same weights, batches
    assert len(r["losses"]) == STEPS
    assert r["losses"] == pytest.approx(trainer["losses"], abs=1e-5)
    assert r["grad_norms"] == pytest.approx(trainer["grad_norms"], rel=1e-5)
    assert_every_gradient_matches(r, trainer, rel=1e-5)


@pytest.mark.recompile_proof
def test_readme_recipe_b_with_llamas_plan_refuses_qwen3_before_the_first_step(tmp_root):
    """Qwen3's per-head q_norm and k_norm are in no entry of Llama's plan: the pasted guard
    refuses, where without it the losses match one process and those gradients are one rank's share."""
    r = run_recipes(tmp_root)["B on qwen3, Llama's plan"]
    assert r["error"] == ("ValueError: model.layers.0.self_attn.q_norm.weight is not in the TP plan: "
                          "its gradient would be one rank's share"), r["error"]
    assert r["losses"] == []


@pytest.mark.recompile_proof
def test_readme_recipe_b_with_the_copied_family_plan_trains_qwen3_as_one_process(tmp_root):
    """family_plan.py copied (README's copy list: with hybrid_plan.py and hf_layout.py, which import nothing
    else from this project) plans q_norm and k_norm: every parameter's step-1 gradient and every loss as one
    process's, in one graph."""
    results = run_recipes(tmp_root)
    r, single = results["B on qwen3, family_plan.py"], results["qwen3, one process"]
    assert r["error"] is None, r["error"]
    assert (r["graphs"], r["recompile_reasons"]) == (1, []), r["recompile_reasons"]
    assert r["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert_every_gradient_matches(r, single)
    copied = {"family_plan", "hybrid_plan", "hf_layout"}  # README's "Another family"
    for name in copied:
        tree = ast.parse((HERE / f"{name}.py").read_text())
        imported = {(node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
                    for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        assert imported & {p.stem for p in HERE.glob("*.py")} <= copied, f"{name}.py imports {imported}"


@pytest.mark.recompile_proof
def test_readme_recipe_b_refuses_a_tied_model_that_top_plan_untied(tmp_root):
    """TOP_PLAN applied by hand gives lm_head a weight of its own, whose gradient lacks the
    embedding's share (63% off one process's, losses 0.65 apart at step 3): the guard refuses."""
    r = run_recipes(tmp_root)["B, TOP_PLAN without parallelize_top"]
    assert r["error"] == "ValueError: lm_head is tied in config, not in the model: call parallelize_top", r["error"]
    assert r["losses"] == []


@pytest.mark.recompile_proof
def test_readme_recipe_b_with_the_copied_family_plan_keeps_gemma3s_tied_embedding(tmp_root):
    """Gemma 3 ties lm_head to its (scaled) embedding: one parameter through parallelize_top, so
    every step-1 gradient and every loss is one process's."""
    results = run_recipes(tmp_root)
    r, single = results["B on gemma3_text, family_plan.py"], results[f"{TIED_GEMMA3}, one process"]
    assert r["error"] is None, r["error"]
    assert r["tied"] and r["recompile_reasons"] == [], r["recompile_reasons"]
    assert r["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert_every_gradient_matches(r, single)


@pytest.mark.recompile_proof
def test_readme_recipe_b_with_the_copied_family_plan_trains_post_norm_olmo2_as_one_process(tmp_root):
    """A post-norm block has no norm before attention: family_plan gathers attention's input by
    keyword, and README's recipe B skips its norm call. One graph and one process's numbers on the
    pinned torch; on torch 2.10.0 the recompile per block README names (the kwargs hook's id)."""
    results = run_recipes(tmp_root)
    r, single = results["B on olmo2, family_plan.py"], results["olmo2, one process"]
    if HOOK_GUARD_BUG:
        assert r["error"].startswith("FailOnRecompileLimitHit"), r["error"]
        assert "_forward_pre_hooks_with_kwargs" in r["recompile_reasons"][0], r["recompile_reasons"]
        return
    assert r["error"] is None, r["error"]
    assert (r["graphs"], r["recompile_reasons"]) == (1, []), r["recompile_reasons"]
    assert r["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert_every_gradient_matches(r, single)


def test_readme_forward_logits_is_the_trainers():
    """README's `both` block and model.py build the same full-sequence masks: one source."""
    import model

    recipe = run_block(readme_blocks((HERE / "README.md").read_text())["both"])
    assert inspect.getsource(recipe["forward_logits"]) == inspect.getsource(model.forward_logits)
    assert recipe["MASKS"] == model.MASKS


def test_without_the_embedding_line_recipe_a_fails(tmp_root):
    """Block 0 gets the TP embedding's AsyncCollectiveTensor and a graph of its own (on 2.14.1 and
    2.15.0, then a crash in backward). The test of workarounds.materialize_embedding_output: when
    this fails, the installed torch hands block 0 a plain tensor by itself."""
    if HOOK_GUARD_BUG:
        pytest.skip("cases() leaves this case out on torch < 2.11 (CI time); RESULTS.md has its 2.10.0 cell")
    r = run_recipes(tmp_root)["A without the embedding line"]
    assert r["graphs"] == 2, f"block 0 should compile a graph of its own: {r}"


def test_readme_layer_follows_installed_transformers():
    from test_recompile import _normalized_forward
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    recipe = run_block(readme_blocks((HERE / "README.md").read_text())["recipe-a"])
    assert _normalized_forward(recipe["PositionalLlamaDecoderLayer"].forward) == _normalized_forward(
        LlamaDecoderLayer.forward), "README's recipe A no longer copies transformers' LlamaDecoderLayer.forward"


PARTIAL_GRADIENT_CLIPPED = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial
from torchtitan.distributed.utils import clip_grad_norm_
import workarounds

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
for name, clip in (("torchtitan's", clip_grad_norm_), ("the workaround's", workarounds.clip_grad_norm_)):
    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Partial()]))
    # a SequenceParallel norm's weight gradient: each rank holds its tokens' share (1 and 2)
    weight.grad = DTensor.from_local(torch.full((4,), 1.0 + dist.get_rank()), mesh, [Partial()])
    clip([weight], 1.0)  # whole gradient 3 in each of 4 elements: norm 6, scaled to 0.5
    whole = weight.grad.full_tensor()[0].item()  # every rank takes part
    if dist.get_rank() == 0:
        print(f"{name}: {whole:.4f}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.recompile_proof
def test_without_the_clip_workaround_torch_2_10_leaves_sequence_parallel_gradients_unscaled(tmp_path):
    """workarounds.clip_grad_norm_ and README's clip_grad_norm_ (foreach=False for torch 2.10.0 and 2.11.0):
    there the foreach path leaves a Partial gradient as it was. When torchtitan's scales it on every
    torch CI runs, the workaround and README's foreach=False may go."""
    script = tmp_path / "partial_gradient_clipped.py"
    script.write_text(PARTIAL_GRADIENT_CLIPPED)
    cmd = _torchrun_cmd(script=script)
    proc = again_if_a_rank_died_of_a_signal(lambda: subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    torchtitan = "0.5000" if FOREACH_SCALES_PARTIAL_GRADIENTS else "3.0000 (unscaled)"
    assert [line for line in proc.stdout.splitlines() if "'s: " in line] == [f"torchtitan's: {torchtitan[:6]}", "the workaround's: 0.5000"], (
        f"{proc.stdout}: torchtitan's clip_grad_norm_ was expected to give {torchtitan} on torch {torch.__version__}")

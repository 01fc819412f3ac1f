"""The recompile proof: one compiled graph for all blocks with either fix, and what the stock
HF layer with the kwargs plan does instead, on the installed torch.

Tests marked `recompile_proof` are the ones CI also runs on torch 2.10.0, where the bug lives:
there the kwargs plan must hit FailOnRecompileLimitHit and both fixes must compile 1 graph
(on TP 2, and the positional layer on dp_shard 2 x tp 2).
Run: pytest -v test_recompile.py    (on torch 2.10.0: pytest -v -m recompile_proof test_recompile.py)
"""

import ast
import inspect
import json
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import parallelize
import train
from conftest import (HERE, HOOK_GUARD_BUG, NUM_BLOCKS, STEPS, TP, assert_every_gradient_matches, run_2d,
                      join_gloo, run_one, run_together, run_tp, small_config, spawn)
from config import validate
from family_plan import FUSED_PARTS, fused_colwise, refuse_unplanned_parameters
from harness import build_family
from model import PositionalLlamaDecoderLayer, build_model, forward_logits
from parallelize import apply_tp
from survey import markdown_table, survey_attention_calls


STOCK = {"parallelism.decoder_layer": "stock"}
NORM_OUTPUT = {"parallelism.attention_gather": "norm_output"}
RUNS_TOGETHER = {TP: [("llama", None, o) for o in ({}, STOCK, {**STOCK, **NORM_OUTPUT})]}  # the proof's: run on torch 2.10.0 too


def positional_tp(tmp_root):
    return run_tp(tmp_root)


def stock_tp(tmp_root):
    return run_tp(tmp_root, **STOCK)


# 1. --------------------------------------------------------------------------


@pytest.mark.recompile_proof
def test_positional_layer_compiles_one_graph_for_all_blocks(tmp_root):
    r = positional_tp(tmp_root)
    assert r["graphs"] == 1, (
        f"{r['graphs']} graphs for {NUM_BLOCKS} blocks (TP=2, full AC, fullgraph compile); "
        f"Dynamo's recompile reasons: {r['recompile_reasons'][:2]}; error: {r['error']}"
    )
    assert r["recompiles"] == 0, r["recompile_reasons"]
    assert r["recompile_reasons"] == []
    assert r["error"] is None, r["error"]
    assert len(r["losses"]) == STEPS


# 2. --------------------------------------------------------------------------


@pytest.mark.recompile_proof
def test_no_kwargs_pre_hook_with_positional_layer_one_per_attention_with_stock(tmp_root):
    assert positional_tp(tmp_root)["kwargs_hooks"] == [], "a with_kwargs=True pre-hook is the bug's precondition"
    stock = stock_tp(tmp_root)
    assert len(stock["attention_modules"]) == NUM_BLOCKS
    assert stock["kwargs_hooks"] == stock["attention_modules"]


# 3. --------------------------------------------------------------------------


@pytest.mark.recompile_proof
def test_stock_layer_behaviour_matches_installed_torch(tmp_root):
    assert_stock_layer_behaviour(stock_tp(tmp_root))


def assert_stock_layer_behaviour(r: dict) -> None:
    if HOOK_GUARD_BUG:
        # torch < 2.11 guards on the kwargs pre-hook's id, which differs per block.
        assert r["error"] is not None and "recompile_limit" in r["error"], (
            f"torch {torch.__version__} has the hook-guard bug, so the stock layer should hit "
            f"recompile_limit under fullgraph=True; got error={r['error']}, graphs={r['graphs']}"
        )
        assert r["graphs"] == torch._dynamo.config.recompile_limit
        assert any("_forward_pre_hooks_with_kwargs" in reason for reason in r["recompile_reasons"])
    else:
        assert r["error"] is None, r["error"]
        assert (r["graphs"], r["recompiles"]) == (1, 0), (
            f"torch {torch.__version__} carries the Dynamo fix (pytorch/pytorch#172519), so the "
            f"stock layer should compile once; reasons: {r['recompile_reasons']}"
        )


# The plan-only fix: attention's input gathered at input_layernorm's output ----


@pytest.mark.recompile_proof
def test_norm_output_plan_on_stock_layer_is_one_graph_with_the_positional_layers_losses(tmp_root):
    r = run_tp(tmp_root, **STOCK, **NORM_OUTPUT)
    assert (r["graphs"], r["recompiles"]) == (1, 0), (r["recompile_reasons"][:2], r["error"])
    assert r["error"] is None, r["error"]
    assert r["kwargs_hooks"] == [], "the norm-output plan must leave no with_kwargs=True pre-hook"
    assert r["losses"] == pytest.approx(positional_tp(tmp_root)["losses"], abs=1e-6)


def _comm_counts_main(rank: int, port: int, out: str) -> None:
    """Collectives of one eager forward + backward, per plan, counted by DTensor's CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode

    join_gloo(rank, TP, port)
    counts = {}
    for layer, gather in (("positional", "pre_hook"), ("stock", "norm_output")):
        cfg = small_config(**{"model.num_hidden_layers": 2, "compile.enable": False, "activation_checkpoint.mode": "none",
                              "parallelism.decoder_layer": layer, "parallelism.attention_gather": gather})
        validate(cfg, TP)
        model = train.build_training(cfg, torch.device("cpu"), parallelize.build_parallel_dims(cfg, TP, "cpu"))[0]
        with CommDebugMode() as comm:
            forward_logits(model, torch.randint(0, 256, (2, 64))).sum().backward()
        counts[gather] = {str(op): n for op, n in comm.get_comm_counts().items()}
    if rank == 0:
        Path(out).write_text(json.dumps(counts))
    dist.destroy_process_group()


def test_norm_output_plan_communicates_as_the_pre_hook_plan(tmp_path):
    """The same all-gather / reduce-scatter pairs. Both breaks give the right numbers and more
    traffic: without GATHER_AT_NORM_OUTPUT, q, k and v each all-gather attention's Shard(1)
    input; with its use_local_output=True, each all-reduces its input gradient."""
    out = tmp_path / "counts.json"
    spawn(_comm_counts_main, lambda port: (port, str(out)), TP, "the two plans' communication counts")
    counts = json.loads(out.read_text())
    assert counts["norm_output"] == counts["pre_hook"], counts
    assert any("all_gather" in op for op in counts["pre_hook"]), counts


OTHER_ARCHITECTURES = [("gemma3_text", 48, 1), ("mistral", 16, 1), ("cohere2", 48, 2), ("gemma2", 16, 1),
                       ("phi3+mha", 16, 1), ("olmo2", None, 1), ("bitnet", None, 1)]


@pytest.mark.parametrize("arch, window, graphs", OTHER_ARCHITECTURES)
def test_norm_output_plan_fixes_other_hf_architectures(tmp_root, arch, window, graphs):
    """Per-head q/k norms and four block norms (gemma), each planned by its type; a sliding window
    between seq_len / TP and seq_len (48) or under it (16), from masks built for the whole
    sequence; gemma2's eager attention; phi3's fused [q; k; v] and [gate; up] with its per-rank
    head count; post-norm blocks with norms across heads (olmo2); bitnet's sub-norms across the
    sharded features of attention and the MLP. One graph per kind of block
    (cohere2: sliding layers with RoPE and full ones without, the second a recompile; gemma2's two
    kinds differ in the mask alone). reach.py runs every dense family and both windows, on torch
    2.10.0 too (RESULTS.md)."""
    run_together(tmp_root, TP, [(a, w, {**STOCK, **NORM_OUTPUT}) for a, w, _ in OTHER_ARCHITECTURES])
    r = run_tp(tmp_root, arch, window=window, **STOCK, **NORM_OUTPUT)
    assert r["error"] is None, r["error"]
    assert r["kwargs_hooks"] == (r["attention_modules"] if arch == "olmo2" else [])  # post-norm: by keyword
    assert (r["graphs"], r["recompiles"]) == (graphs, graphs - 1), r["recompile_reasons"]
    single_eager = run_one(arch, window)
    assert r["losses"] == pytest.approx(single_eager["losses"], abs=1e-5), f"{arch}: TP=2 vs 1 process"
    assert r["grad_norms"] == pytest.approx(single_eager["grad_norms"], rel=1e-4), f"{arch}: TP=2 vs 1 process"
    assert_every_gradient_matches(r, single_eager)


def _norm_gradients_main(rank: int, port: int, out: str) -> None:
    """Gemma3's block-norm weight gradients after one eager TP 2 forward/backward, with the plan's
    norm planning and without it (the norms left plain, the unplanned-parameter refusal off)."""
    import parallelize

    join_gloo(rank, TP, port)
    cfg = small_config(**{**NORM_OUTPUT, "parallelism.decoder_layer": "stock", "compile.enable": False,
                          "activation_checkpoint.mode": "none"})
    validate(cfg, TP)
    planned, grads = parallelize.block_plan, {}
    for variant in ("planned", "unplanned"):
        if variant == "unplanned":
            parallelize.block_plan = lambda *args: {
                name: style for name, style in planned(*args).items() if name not in BLOCK_NORMS}
            parallelize.refuse_unplanned_parameters = lambda *args: None
        torch.manual_seed(0)
        model = build_family("gemma3_text", cfg["model"])
        parallelize.parallelize(model, parallelize.build_parallel_dims(cfg, TP, "cpu"), cfg)
        forward_logits(model, GRADIENT_BATCH).float().pow(2).mean().backward()
        grads[variant] = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).tolist()
                          for name, p in model.named_parameters() if name.rsplit(".", 2)[-2] in BLOCK_NORMS}
    if rank == 0:
        Path(out).write_text(json.dumps(grads))
    dist.destroy_process_group()


BLOCK_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
GRADIENT_BATCH = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))


def test_without_the_norm_planning_gemma3_norms_get_wrong_gradients_in_silence(tmp_path):
    """The risk the norm planning (and the unplanned-parameter refusal) removes: a block norm
    the plan does not name runs on its rank's tokens, and nothing sums its gradient. Forward
    and backward raise nothing; the gradients are one rank's share."""
    out = tmp_path / "grads.json"
    spawn(_norm_gradients_main, lambda port: (port, str(out)), TP, "gemma3 without the norm planning")
    grads = json.loads(out.read_text())
    torch.manual_seed(0)
    model = build_family("gemma3_text", small_config()["model"])
    forward_logits(model, GRADIENT_BATCH).float().pow(2).mean().backward()
    single = {name: p.grad for name, p in model.named_parameters() if name in grads["planned"]}
    assert len(single) == len(BLOCK_NORMS) * NUM_BLOCKS
    for name, grad in single.items():
        assert torch.allclose(torch.tensor(grads["planned"][name]), grad, rtol=1e-4, atol=1e-6), name
    wrong = [name for name, grad in single.items()
             if not torch.allclose(torch.tensor(grads["unplanned"][name]), grad, rtol=1e-2, atol=1e-6)]
    assert wrong == list(single), f"only {wrong} differ from one process without the norm planning"


@pytest.mark.recompile_proof
@pytest.mark.parametrize("family, message", [
    ("phi3", "Phi3Attention.qkv_proj fuses 16 query heads with 8 key/value heads: no one placement"),
    ("stablelm+qk_layernorm", "StableLmAttention.q_layernorm holds one module per head, indexed by the global head count"),
    ("biogpt", "BioGptForCausalLM has no model.embed_tokens: the plan names HF's Llama layout"),
])
def test_tp_plan_refuses_what_it_cannot_make_correct_before_any_change(family, message):
    """apply_tp raises before it touches the model (no mesh is needed to get there)."""
    model = build_family(family, small_config()["model"])
    with pytest.raises(ValueError) as e:
        apply_tp(model, None, "stock", "norm_output")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def _fused_projection_main(rank: int, port: int, out: str) -> None:
    """Each fused projection of 4 features a part under family_plan.fused_colwise, eager and under Dynamo + AOTAutograd:
    its largest differences from one process, in its output, weight and gradients: this rank's share of each part."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    join_gloo(rank, TP, port)
    mesh, result = init_device_mesh("cpu", (TP,)), {}  # as README's users make it: no names
    for name, parts in FUSED_PARTS.items():
        for backend in (None, "aot_eager"):
            torch.manual_seed(0)
            one, x, weights = torch.nn.Linear(8, parts * 4), torch.randn(2, 3, 8), torch.randn(2, 3, parts * 4)
            sharded = torch.nn.Linear(8, parts * 4)
            sharded.load_state_dict(one.state_dict())
            parallelize_module(sharded, mesh, fused_colwise(sharded, name))
            mine = lambda t: torch.cat([part.chunk(TP, -1)[rank] for part in t.chunk(parts, -1)], -1)  # noqa: E731
            rows = lambda t: mine(t.T).T if t.ndim == 2 else mine(t)  # noqa: E731 (a weight's or bias's)
            (one(x) * weights).sum().backward()
            y = (torch.compile(sharded, backend=backend) if backend else sharded)(x)
            (y * mine(weights)).sum().backward()
            result[f"{name}, {backend or 'eager'}"] = max((y - mine(one(x))).abs().max().item(), *(
                (getattr(sharded, p).to_local() - rows(getattr(one, p))).abs().max().item() for p in ("weight", "bias")), *(
                (getattr(sharded, p).grad.to_local() - rows(getattr(one, p).grad)).abs().max().item() for p in ("weight", "bias")))
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.recompile_proof
def test_fused_projection_gives_each_rank_its_part_of_each_and_the_one_process_gradients(tmp_path):
    """glm's [gate; up] and phi3's [q; k; v] (hf_layout.RowsByParts): rank r's output, weight rows and their
    gradients are the r-th 1/TP of every part of one process's, on every torch, with no collective."""
    out = tmp_path / "fused.json"
    spawn(_fused_projection_main, lambda port: (port, str(out)), TP, "fused projections")
    result = json.loads(out.read_text())
    assert result and all(difference < 1e-5 for difference in result.values()), result


@pytest.mark.parametrize("change, message", [
    ({"_attn_implementation": "flex_attention"},
     "LlamaForCausalLM runs attention as 'flex_attention'; the TP plan's full-sequence masks are for 'sdpa' and 'eager'"),
    ({"layer_types": ["chunked_attention"] * NUM_BLOCKS},
     "LlamaForCausalLM has chunked_attention layers, whose mask HF would build from each rank's seq_len/TP tokens"),
    ({"use_bidirectional_attention": True, "sliding_window": 48},
     "LlamaForCausalLM sets use_bidirectional_attention (sliding_window 48): the full-sequence masks are causal"),
])
def test_tp_plan_refuses_masks_it_cannot_build_for_the_whole_sequence(change, message):
    model = build_model(small_config()["model"])
    for key, value in change.items():
        setattr(model.config, key, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_tp(model, None, "stock", "norm_output")


def test_a_block_parameter_left_out_of_the_plan_is_refused():
    block = build_model(small_config()["model"]).model.layers[0]
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight is not in the TP plan"):
        refuse_unplanned_parameters(block, "model.layers.0")


def test_readmes_reach_counts_and_results_table_are_reach_csvs():
    """README's counts of recipe B's reach (the pinned torch's rows) and RESULTS.md's table are
    what reach.py wrote to reach.csv."""
    import reach

    rows = reach.read_verdicts()
    pinned = re.search(r"^torch==([\d.]+)", (HERE / "requirements.txt").read_text(), re.M).group(1)
    c = reach.counts(rows, pinned)
    assert (f"Of {c['families']} dense HF families, {c['correct']} match one process per parameter ({c['both windows']} "
            f"with both sliding windows), {c['refused']} are refused in one line, {c['other']} fail or do not build "
            f"small") in " ".join((HERE / "README.md").read_text().split()), c
    assert reach.verdict_table(rows) in (HERE / "RESULTS.md").read_text(), "RESULTS.md's reach table: `python reach.py --table`"


def test_survey_table_in_results_matches_installed_transformers():
    survey = survey_attention_calls()
    assert {"llama", "qwen2", "qwen3", "mistral"} <= set(survey["keyword"]), "these call self_attn by keyword"
    assert "bart" in survey["positional"]
    table = markdown_table(survey)
    assert table in (HERE / "RESULTS.md").read_text(), f"RESULTS.md's survey table is stale; `python survey.py`:\n{table}"


# FSDP2 x TP: dp_shard 2 x tp 2 on 4 ranks -----------------------------------


@pytest.mark.recompile_proof
def test_2d_compiles_one_graph_without_kwargs_pre_hook_on_attention(tmp_root):
    r = run_2d(tmp_root)
    assert (r["graphs"], r["recompiles"]) == (1, 0), (
        f"{r['graphs']} graphs for {NUM_BLOCKS} blocks on dp_shard 2 x tp 2; reasons: {r['recompile_reasons'][:2]}; "
        f"error: {r['error']}")
    assert r["error"] is None, r["error"]
    sharded = sorted(["", "model.embed_tokens", "model.norm", "lm_head", *(f"model.layers.{i}" for i in range(NUM_BLOCKS))])
    assert r["fsdp_modules"] == sharded
    assert r["attention_kwargs_hooks"] == [], "a with_kwargs=True pre-hook on attention is the bug's precondition"


def test_2d_norm_output_plan_on_stock_layer_compiles_one_graph(tmp_root):
    r = run_2d(tmp_root, **STOCK, **NORM_OUTPUT)
    assert (r["graphs"], r["recompiles"]) == (1, 0), (r["recompile_reasons"][:2], r["error"])
    assert r["error"] is None, r["error"]
    assert r["attention_kwargs_hooks"] == []
    assert r["losses"] == pytest.approx(run_2d(tmp_root)["losses"], abs=1e-5)


# 4. --------------------------------------------------------------------------


def _normalized_forward(fn) -> str:
    """forward's AST without annotations or docstring, hidden_states passed positionally."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    func.returns = None
    for arg in func.args.args + func.args.kwonlyargs + [func.args.vararg, func.args.kwarg]:
        if arg is not None:
            arg.annotation = None
    if isinstance(func.body[0], ast.Expr) and isinstance(func.body[0].value, ast.Constant):
        func.body = func.body[1:]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.self_attn":
            hidden = [k for k in node.keywords if k.arg == "hidden_states"]
            if hidden:
                node.keywords.remove(hidden[0])
                node.args.insert(0, hidden[0].value)
    return ast.dump(tree)


def test_vendored_layer_follows_installed_transformers():
    import transformers

    assert _normalized_forward(PositionalLlamaDecoderLayer.forward) == _normalized_forward(
        LlamaDecoderLayer.forward
    ), (
        f"transformers {transformers.__version__} changed LlamaDecoderLayer.forward "
        f"({inspect.getsourcefile(LlamaDecoderLayer)}): copy its new body into "
        "model.PositionalLlamaDecoderLayer.forward and pass hidden_states to self.self_attn positionally"
    )


def test_device_maps_keep_each_vendored_layer_whole():
    """transformers' device maps (from_pretrained(device_map=...)) keep whole only the layer
    classes named in `_no_split_modules`, by class name; build_model adds the vendored one."""
    from transformers.integrations.accelerate import compute_module_sizes, infer_auto_device_map

    with torch.device("meta"):
        model = build_model(small_config()["model"])
    size = compute_module_sizes(model)[0][""]
    max_memory = {0: int(0.55 * size), "cpu": 10 * size}  # two devices: the layers must be split between them

    def split_layers(no_split: set) -> list[str]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Device 0 is not available" on a CPU machine
            device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
        assert set(device_map.values()) == {0, "cpu"}
        return [name for name in device_map if name.startswith("model.layers.") and name.count(".") > 2]

    assert "PositionalLlamaDecoderLayer" in model._no_split_modules
    assert split_layers(model._no_split_modules) == []
    assert split_layers({"LlamaDecoderLayer"}) != [], "HF's own list alone splits a vendored layer"


# the trainer itself --------------------------------------------------------




@pytest.mark.parametrize("attention_gather", ["pre_hook", "norm_output"])
def test_the_derived_plan_of_a_llama_block_is_the_literal_llama_plan(attention_gather):
    """family_plan.block_plan, which plans every other family, derives parallelize.LLAMA_BLOCK_PLAN
    (but self_attn's entry) for Llama's blocks: the same names, style types and layouts."""
    import family_plan
    import parallelize

    def described(plan: dict) -> dict:
        return {name: (type(style).__name__, vars(style)) for name, style in plan.items()}

    block = build_model(small_config()["model"]).model.layers[0]
    literal = {name: style for name, style in parallelize.LLAMA_BLOCK_PLAN.items() if name != "self_attn"}
    assert described(family_plan.block_plan(block, attention_gather)) == described(literal)

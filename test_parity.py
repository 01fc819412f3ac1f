"""The numbers, anchored: the model is torchtitan's own llama3 debugmodel, and losses and
gradient norms agree across one process, TP 2, dp_shard 2 x tp 2 and the norm-output plan.

Gradient norms matter beside losses: AdamW's update is unchanged when a gradient is multiplied
by a constant and clipping rescales all gradients alike, so a data-parallel sum where a mean
belongs, or a TP gradient counted twice, leaves the losses as they are. The norm before
clipping sees it. (A resumed run's norms are checked in test_checkpoint.py.)
"""

import copy
import dataclasses
import tomllib

import pytest
import torch

import train
from bench import titan_from_hf
from conftest import (DP_SHARD, GLOBAL_BATCH, HERE, TP, assert_every_gradient_matches, run_2d, run_one, run_tp,
                      small_config)
from data import load_stdlib_bytes, random_windows
from model import build_model, forward_logits

NORM_OUTPUT_PLAN = {"parallelism.decoder_layer": "stock", "parallelism.attention_gather": "norm_output"}
TITAN_STEPS = 10
TITAN_SHAPES = {"model.num_hidden_layers": 6, "training.steps": TITAN_STEPS}
EAGER = {"compile.enable": False}
TIED = {"model.tie_word_embeddings": True}
LOSS_PARALLEL_OFF = {"parallelism.loss_parallel": False}
TWO_D = {"parallelism.dp_shard": DP_SHARD}
RUNS_TOGETHER = {TP: [("llama", None, o) for o in (TITAN_SHAPES, EAGER, {}, GLOBAL_BATCH, NORM_OUTPUT_PLAN, LOSS_PARALLEL_OFF)],
                 DP_SHARD * TP: [("llama", None, TWO_D), ("llama", None, {**TWO_D, **TIED})]}


def default_config() -> dict:
    with open(HERE / "config.toml", "rb") as f:
        return tomllib.load(f)


def held_out_batch(cfg: dict) -> torch.Tensor:
    t = cfg["training"]
    _, held_out = load_stdlib_bytes(1_000_000)
    return next(random_windows(held_out, 2, t["seq_len"], torch.Generator().manual_seed(t["seed"])))[0]


def test_default_config_logits_equal_torchtitans_debugmodel():
    from torchtitan.models.llama3 import llama3_args

    cfg = default_config()
    torch.manual_seed(cfg["training"]["seed"])
    hf = build_model(cfg["model"]).eval()
    titan = titan_from_hf(hf, cfg["training"]["seq_len"]).eval()
    debugmodel = llama3_args["debugmodel"]
    assert titan.model_args == dataclasses.replace(debugmodel, max_seq_len=cfg["training"]["seq_len"]), \
        "torchtitan's debugmodel, unmodified but for max_seq_len"
    x = held_out_batch(cfg)
    with torch.no_grad():
        hf_logits, titan_logits = forward_logits(hf, x), titan(x)
    assert (hf_logits - titan_logits).abs().max().item() < 1e-5

    # The check can fail: without the debugmodel's RoPE scaling the same weights differ (2e-3).
    unscaled = copy.deepcopy(cfg["model"])
    unscaled["rope_parameters"]["factor"] = 1.0
    torch.manual_seed(cfg["training"]["seed"])
    with torch.no_grad():
        unscaled_logits = forward_logits(build_model(unscaled).eval(), x)
    assert (unscaled_logits - titan_logits).abs().max().item() > 1e-4


@pytest.mark.parametrize("hidden, intermediate, heads, kv_heads", [(512, 1024, 8, 4), (384, 2048, 6, 2)])
def test_torchtitans_model_at_other_shapes_gives_the_hf_models_logits(hidden, intermediate, heads, kv_heads):
    """bench.py's titan variant at any [model]: an MLP width torchtitan's rounding does not give,
    grouped key/value heads, another norm eps and RoPE factor; the same logits to 1e-5 (2e-6 measured)."""
    model_cfg = copy.deepcopy(default_config()["model"])
    model_cfg.update(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, num_hidden_layers=2, rms_norm_eps=1e-6)
    model_cfg["rope_parameters"]["factor"] = 4.0
    torch.manual_seed(0)
    hf = build_model(model_cfg).eval()
    titan = titan_from_hf(hf, 128).eval()
    x = torch.randint(0, 256, (2, 128))
    with torch.no_grad():
        assert (forward_logits(hf, x) - titan(x)).abs().max().item() < 1e-5


def test_trainer_losses_equal_torchtitans_model_on_the_same_batches(tmp_root):
    """This trainer (TP 2, compiled, full AC, the default 6 layers) against torchtitan's
    Transformer with the converted initial weights, one eager process, the same batches,
    AdamW, schedule and clipping."""
    trainer = run_tp(tmp_root, **TITAN_SHAPES)
    assert trainer["error"] is None, trainer["error"]

    cfg = small_config(**TITAN_SHAPES)
    t = cfg["training"]
    torch.manual_seed(t["seed"])
    titan = titan_from_hf(build_model(cfg["model"]), t["seq_len"])
    optimizer, scheduler = train.build_optimizer(titan, cfg)
    data, _ = load_stdlib_bytes(cfg["data"]["max_bytes"])
    batches = random_windows(data, t["local_batch_size"], t["seq_len"], torch.Generator().manual_seed(t["seed"]))
    losses, grad_norms = [], []
    for _ in range(TITAN_STEPS):
        x, y, _ = next(batches)
        loss, grad_norm = train.train_step(titan, optimizer, scheduler, x, y, t["max_norm"], lambda m, x: m(x))
        losses.append(loss)
        grad_norms.append(grad_norm)
    assert trainer["losses"] == pytest.approx(losses, abs=1e-4)
    assert trainer["grad_norms"] == pytest.approx(grad_norms, rel=1e-4)
    assert losses[-1] < losses[0] - 1, losses


def test_tp_matches_single_process_and_compiled_matches_eager(tmp_root):
    tp_eager = run_tp(tmp_root, **EAGER)
    single_eager = run_one()
    tp_compiled = run_tp(tmp_root)
    assert single_eager["error"] is None and tp_eager["error"] is None
    assert tp_eager["losses"] == pytest.approx(single_eager["losses"], abs=1e-4), "TP=2 vs 1 process"
    assert tp_compiled["losses"] == pytest.approx(tp_eager["losses"], abs=1e-4), "compiled vs eager"
    assert single_eager["losses"][-1] < single_eager["losses"][0], "the loss should fall"


def test_2d_losses_equal_one_process_and_tp_only_with_the_same_global_batch(tmp_root):
    two_d = run_2d(tmp_root)
    single_eager = run_one(**GLOBAL_BATCH)
    tp_only = run_tp(tmp_root, **GLOBAL_BATCH)
    assert two_d["error"] is None and single_eager["error"] is None and tp_only["error"] is None
    assert two_d["losses"] == pytest.approx(single_eager["losses"], abs=1e-4), "dp_shard 2 x tp 2 vs 1 process"
    assert two_d["losses"] == pytest.approx(tp_only["losses"], abs=1e-4), "dp_shard 2 x tp 2 vs tp 2"
    # The global batch really is twice the local one: the 2D run differs from one process
    # that sees only the local batch.
    assert abs(two_d["losses"][0] - run_one()["losses"][0]) > 1e-3


def test_gradient_norms_are_equal_on_every_mesh_and_plan(tmp_root):
    """Before clipping, at every step, to 1e-4 relative: one process, TP 2 and dp_shard 2 x tp 2
    on one global batch; one process, TP 2 and the norm-output plan on another. And every
    parameter's step-1 gradient, whole, to 1e-4 relative."""
    runs = [
        ("TP 2", GLOBAL_BATCH, run_tp(tmp_root, **GLOBAL_BATCH)),
        ("dp_shard 2 x tp 2", GLOBAL_BATCH, run_2d(tmp_root)),
        ("TP 2, local batch", {}, run_tp(tmp_root)),
        ("TP 2, stock layer + norm-output plan", {}, run_tp(tmp_root, **NORM_OUTPUT_PLAN)),
    ]
    for name, batch, r in runs:
        assert r["error"] is None, (name, r["error"])
        single = run_one(**batch)["grad_norms"]
        assert r["grad_norms"][0] == pytest.approx(single[0], rel=1e-4), f"step 1: {name} vs one process"
        assert r["grad_norms"] == pytest.approx(single, rel=1e-4), f"{name} vs one process"
        assert_every_gradient_matches(r, run_one(**batch))


def test_summary_flops_per_token_are_torchtitans_for_the_debugmodel():
    import report

    cfg = default_config()
    torch.manual_seed(0)
    hf = build_model(cfg["model"])
    titan = titan_from_hf(hf, cfg["training"]["seq_len"])
    _, titan_flops = titan.model_args.get_nparams_and_flops(titan, cfg["training"]["seq_len"])
    assert report.flops_per_token(hf, cfg) == titan_flops == 38_555_136  # torchtitan's function on HF's model


def test_summary_flops_per_token_count_a_tied_lm_head():
    """torchtitan's function lists a tied weight once and subtracts it as the embedding, which
    dropped lm_head's matmul: about a fifth of Llama 3.2 1B's FLOPs. Tied or not, equal FLOPs."""
    import report

    cfg = default_config()
    tied = {**cfg, "model": {**cfg["model"], "tie_word_embeddings": True}}
    untied_model, tied_model = build_model(cfg["model"]), build_model(tied["model"])
    assert tied_model.lm_head.weight is tied_model.model.embed_tokens.weight
    assert report.flops_per_token(tied_model, tied) == report.flops_per_token(untied_model, cfg) == 38_555_136


def test_loss_parallel_keeps_logits_sharded_with_the_replicated_numbers(tmp_root):
    """On by default, as in torchtitan: lm_head's output stays Shard(2) on the vocabulary, and
    losses and gradient norms are those of replicated logits and of one process."""
    sharded, replicated = run_tp(tmp_root), run_tp(tmp_root, **LOSS_PARALLEL_OFF)
    assert sharded["error"] is None and replicated["error"] is None
    assert sharded["logits"] == ["(Shard(dim=2),)"] and replicated["logits"] == ["tensor"]
    assert (sharded["graphs"], sharded["recompiles"]) == (1, 0)
    assert sharded["losses"] == pytest.approx(replicated["losses"], abs=1e-5)
    assert sharded["grad_norms"] == pytest.approx(replicated["grad_norms"], rel=1e-5)
    assert sharded["losses"] == pytest.approx(run_one()["losses"], abs=1e-5)


def test_in_float64_tp_and_tied_2d_with_loss_parallel_equal_one_process(tmp_root):
    """The float32 tests' 1e-4 on gradient norms is rounding, not a difference: in float64 (eager;
    the loss itself stays float32, as torchtitan's) TP 2, and dp_shard 2 x tp 2 with tied
    embeddings, both with loss parallel, give one process's losses to 1e-6 and gradient norms to
    1e-7 (measured: 4.8e-7, and 9.1e-9 on TP 2, 7.3e-9 tied on 2D; float32 TP 2: 4.2e-5), and
    every parameter's step-1 gradient to 1e-7."""
    for name, tied, r in (("TP 2", {}, run_tp(tmp_root, float64=True, **GLOBAL_BATCH, **EAGER)),
                          ("tied dp_shard 2 x tp 2", TIED, run_2d(tmp_root, float64=True, **TIED, **EAGER))):
        single = run_one(float64=True, **tied, **GLOBAL_BATCH)
        assert r["error"] is None and r["logits"] == ["(Shard(dim=2),)"], (name, r["error"], r["logits"])
        assert r["forward_dtypes"] == ["torch.float64"] and r["tied"] == single["tied"] == bool(tied), name
        assert r["losses"] == pytest.approx(single["losses"], abs=1e-6), name
        assert r["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-7), name
        assert_every_gradient_matches(r, single, rel=1e-7)


def test_tied_embeddings_share_one_parameter_through_tp_and_fsdp_with_the_one_process_numbers(tmp_root):
    """lm_head and the embedding stay one parameter through TP and FSDP (Llama 3.2's tying), on
    dp_shard 2 x tp 2 (TP's tie and FSDP's one group at once). Gradient norms to 1e-4: one process's
    float32 norm of the 2048 x 256 gradient is itself 7e-5 from float64 (TP's two halves: 4e-5)."""
    single = run_one(**TIED, **GLOBAL_BATCH)
    r = run_2d(tmp_root, **TIED)
    assert r["error"] is None, r["error"]
    assert r["tied"] and r["equal_weights"], "lm_head is no longer the embedding"
    assert (r["graphs"], r["recompiles"]) == (1, 0)
    assert r["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert r["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)
    assert_every_gradient_matches(r, single)
    assert single["tied"]
    untied = run_one(**GLOBAL_BATCH)
    assert not untied["tied"] and not untied["equal_weights"]
    assert abs(untied["losses"][0] - single["losses"][0]) > 1e-2, "tying changes the model"

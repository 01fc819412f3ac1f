"""Your model, any family recipe B trains: Hub folders of four families, written by stock transformers'
save_pretrained, train by the one path on TP 2 + SP + compile with transformers' step-1 loss and one
process's losses, and export as the source folder with the trained weights; a family recipe B cannot
train is one line before any process group. Folders, tokenizer and documents are made here (harness.py)."""

import json
from pathlib import Path

import pytest
import torch

from conftest import _losses, _torchrun
from harness import free_port, make_documents, make_hub_family, make_tokenizer, packed_batch, transformers_loss
from test_documents import each_one_line

FAMILIES = {  # folder: harness.build_family's family, its sliding window
    "qwen3": ("qwen3", None),  # per-head q and k norms, untied
    "gemma3_text": ("gemma3_text+tie_word_embeddings", 16),  # tied; a window of 16 in windows of 64; a scaled embedding
    "olmo2": ("olmo2", None),  # post-norm: no norm before attention, its input gathered by keyword
    "phi3": ("phi3+mha", None),  # Phi-3-mini's layout: fused [q; k; v] and [gate; up]
}
STEPS = ("--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--validation.steps", "1", "--metrics.measure_cpu_peak", "false")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    return {"docs": make_documents(root / "docs.jsonl"),
            **{name: make_tokenizer(make_hub_family(root / name, family, window))
               for name, (family, window) in FAMILIES.items()}}


@pytest.fixture(scope="module")
def run(folders, tmp_path_factory):
    """run(name, nproc): (train.py's output, its checkpoint folder) from that family's folder on TP nproc
    (one process: compile off), exported at the end; each launched once."""
    runs = {}

    def launch(name: str, nproc: int):
        if (name, nproc) not in runs:
            folder = tmp_path_factory.mktemp(f"{name}-{nproc}") / "ckpt"
            proc = _torchrun(*STEPS, "--checkpoint.enable", "true", "--checkpoint.folder", str(folder),
                             "--checkpoint.initial_load_path", str(folders[name]), "--checkpoint.initial_load_in_hf", "true",
                             "--checkpoint.last_save_in_hf", str(nproc > 1).lower(), "--data.path", str(folders["docs"]),
                             "--compile.enable", str(nproc > 1).lower(),
                             launcher=(f"--nproc_per_node={nproc}", f"--master_port={free_port()}"))
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[name, nproc] = proc.stdout, folder
        return runs[name, nproc]
    return launch


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_folder_trains_by_the_one_path_as_transformers_and_one_process(folders, run, name):
    """Recipe B on HF's own layer: 1 graph for the 4 blocks, no recompile; step 1's loss is stock
    transformers' on the same packed batch, and the 3 losses are one process's."""
    out, _ = run(name, 2)
    assert "layer=stock | gather=norm_output" in out, out[:2000]
    assert "compiled graphs      1 for 4 blocks" in out and "recompiles           0" in out, out[-2000:]
    x, y, position_ids = packed_batch(folders["docs"], folders[name], 1, 2, 64)
    assert (position_ids == 0).sum() > len(x), "no window packs two documents"
    assert _losses(out)[0] == pytest.approx(transformers_loss(folders[name], x, y, position_ids), abs=1e-5)
    assert _losses(out) == pytest.approx(_losses(run(name, 1)[0]), abs=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_familys_export_is_its_source_folder_with_the_trained_weights(folders, run, name):
    """step-3-hf/ loads in stock transformers with every key of the source's config.json; its logits are
    those of the source model holding the trained float32 weights (the DCP checkpoint's) cast to bfloat16:
    a fused weight in HF's layout, a tied lm_head tied."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    _, folder = run(name, 2)
    source, export = folders[name], folder / "step-3-hf"
    raw = lambda folder: {k: v for k, v in json.loads((folder / "config.json").read_text()).items()  # noqa: E731
                          if k not in ("dtype", "architectures", "transformers_version")}
    assert raw(export).items() >= raw(source).items()
    model, trained = AutoModelForCausalLM.from_pretrained(export), AutoModelForCausalLM.from_pretrained(source)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tied = model.config.tie_word_embeddings
    assert tied == (name == "gemma3_text") and (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    state = {"model": {key: torch.empty_like(w, dtype=torch.float32) for key, w in model.state_dict().items()
                       if not (tied and key == "lm_head.weight")}}
    dcp.load(state, checkpoint_id=folder / "step-3")
    trained.load_state_dict({key: w.to(torch.bfloat16) for key, w in state["model"].items()}, strict=not tied)
    x, _, position_ids = packed_batch(folders["docs"], source, 1, 2, 64)
    with torch.no_grad():
        logits = model(input_ids=x, position_ids=position_ids, use_cache=False).logits
        assert torch.equal(logits, trained(input_ids=x, position_ids=position_ids, use_cache=False).logits)
        assert not torch.equal(logits, AutoModelForCausalLM.from_pretrained(source)(
            input_ids=x, position_ids=position_ids, use_cache=False).logits), "nothing was trained"


def test_a_family_recipe_b_cannot_train_is_one_line_before_any_process_group(folders, tmp_path, capsys, monkeypatch):
    """Through train.config_or_exit: reach.csv's verdict and its reason, a mixture of experts, a family
    never tried, a composite whose text family is refused, and a recipe other than B for a family other
    than Llama; each exit 2 in one line."""
    from transformers import AutoConfig

    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for family in ("phi", "opt", "mixtral", "gpt2", "qwen3_5_moe"):
        AutoConfig.for_model(family).save_pretrained(tmp_path / family)
    hf = ["--checkpoint.enable", "true", "--checkpoint.folder", str(tmp_path / "ckpt"), "--checkpoint.initial_load_in_hf",
          "true", "--data.path", str(folders["docs"]), "--checkpoint.initial_load_path"]
    probes = [
        (hf + [str(tmp_path / "phi")], "holds a 'phi' model, which reach.csv records as refused on torch 2.1"),
        (hf + [str(tmp_path / "phi")], "PlanError: PhiForCausalLM has no model.norm: the plan names HF's Llama layout"),
        (hf + [str(tmp_path / "opt")], "holds a 'opt' model, which reach.csv records as refused on torch 2.1"),
        (hf + [str(tmp_path / "mixtral")], "holds a 'mixtral' model, a mixture of experts: recipe B's plan shards "
         "dense MLPs (reach.csv, RESULTS.md's \"Recipe B's reach\")"),
        (hf + [str(tmp_path / "gpt2")], "holds a 'gpt2' model, which recipe B has not been tried on (reach.csv"),
        (hf + [str(tmp_path / "qwen3_5_moe")], "holds a 'qwen3_5_moe' model whose text model is 'qwen3_5_moe_text', a "
         "mixture of experts: recipe B's plan shards dense MLPs"),  # a composite: its text family's verdict
        (hf + [str(folders["qwen3"]), "--parallelism.attention_gather", "pre_hook"], "parallelism.attention_gather = "
         "'pre_hook': a 'qwen3' model trains by recipe B, with parallelism.attention_gather = 'norm_output'"),
        (hf + [str(folders["qwen3"]), "--training.local_batch_size", "2", "--training.seq_len", "64"], None),
    ]
    each_one_line(probes, capsys)


def _load_main(rank: int, port: int, folders: dict, out: str) -> None:
    """TP 2: each family's build that its folder fills (no init replay), then one that its checkpoint fills, under LargestCopy."""
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import checkpoint
    import parallelize
    import train
    from checkpoint import load_hf
    from config import read_hf_folder, validate
    from conftest import join_gloo, small_config
    from hf_layout import in_hf_layout
    from test_materialize import LargestCopy

    join_gloo(rank, 2, port)
    results = {}
    for name, folder in folders.items():
        cfg = small_config(**{"checkpoint.enable": True, "checkpoint.initial_load_path": folder, "compile.enable": False,
                              "checkpoint.initial_load_in_hf": True, "checkpoint.folder": str(Path(out).parent / name)})
        read_hf_folder(cfg, {})
        validate(cfg, 2)
        dims = lambda: parallelize.build_parallel_dims(cfg, 2, "cpu")  # noqa: E731
        build = lambda: train.build_training(cfg, torch.device("cpu"), dims(), draw=False)  # noqa: E731
        rng = torch.manual_seed(12345).get_state()
        with LargestCopy(made=True) as copied:
            model, optimizer, scheduler = build()
            load_hf(model, Path(folder))
        whole = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731
        with safe_open(Path(folder) / "model.safetensors", framework="pt") as f:
            wrong = [n for n, p in in_hf_layout(get_model_state_dict(model), model).items()  # a tied lm_head: no tensor
                     if n in f.keys() and not torch.equal(whole(p), f.get_tensor(n).float())]
        checkpoint.save(cfg, 1, model, optimizer, scheduler, torch.Generator(), lambda line: None)
        with LargestCopy(made=True) as resumed:  # the same, from its DCP checkpoint
            again, *schedule = build()
            checkpoint.resume(cfg, again, *schedule, torch.Generator(), lambda line: None)
        wrong += [f"resumed {n}" for (n, p), q in zip(model.named_parameters(), again.parameters())
                  if not torch.equal(whole(p), whole(q))]
        results[name] = dict(largest=max(copied.numel, resumed.numel), wrong=wrong,
                             drew=not torch.equal(rng, torch.random.get_rng_state()),
                             largest_shard=max((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def test_a_familys_folder_fills_each_ranks_shards_with_no_draw(folders, tmp_path):
    """Gemma 3 (tied; an embedding with a buffer) and Phi-3-mini (fused weights) on TP 2: built on meta,
    no init replay, filled from the folder, then again from a DCP checkpoint of it: no random number;
    every weight the folder's (a fused one in HF's order, by hf_layout.in_hf_layout). No tensor made, copied or
    sent is larger than the rank's largest shard: a fused weight's rows, as DCP reads them, go to their ranks by
    one all-to-all."""
    from conftest import spawn

    out = tmp_path / "load.json"
    names = {name: str(folders[name]) for name in ("gemma3_text", "phi3")}
    spawn(_load_main, lambda port: (port, names, str(out)), 2, "families' HF loads on TP 2")
    results = json.loads(out.read_text())
    for name, r in results.items():
        assert not r["drew"] and not r["wrong"], (name, r)
        assert r["largest"] <= r["largest_shard"], (name, r)

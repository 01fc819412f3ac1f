"""The model is built on meta: each rank holds its shards and, while they are filled, one full
parameter on the host; the weights are the ones a seeded one-process build gives. FSDP's
backward gathers each block, never the embedding."""
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import train
from conftest import DP_SHARD, TP, join_gloo, small_config, spawn
from config import count_parameters, validate
from harness import hf_name
from memory import peak_anonymous_memory_above_now
from model import build_model

# Large enough that the model, not the interpreter, sets each rank's peak: 58M parameters.
BIG = {"model.hidden_size": 512, "model.intermediate_size": 1408, "model.num_hidden_layers": 8,
       "model.vocab_size": 32000, "compile.enable": False}


@pytest.mark.parametrize("tied", [False, True])
def test_the_meta_build_gives_the_weights_and_buffers_a_seeded_one_process_build_gives(tied):
    cfg = small_config(**{"model.tie_word_embeddings": tied})
    model, *_ = train.build_training(cfg, torch.device("cpu"))
    torch.manual_seed(cfg["training"]["seed"])
    reference = build_model(cfg["model"])
    built = {hf_name(n): p for n, p in model.named_parameters()}
    assert built.keys() == dict(reference.named_parameters()).keys()
    for name, p in reference.named_parameters():
        assert torch.equal(built[name], p), name
    for (name, b), (_, want) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(b, want), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


class LargestCopy(TorchDispatchMode):
    """The most elements any op copies or communicates (views of a mapped file are neither; a DTensor's:
    its shard's); with `made`, also any tensor a factory op makes (torch.empty's, which the init replay fills)."""

    def __init__(self, made: bool = False):
        super().__init__()
        self.numel, self.made = 0, made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):  # in place, or a new output (DTensor's redistribute)
            moved = tree_leaves((args, kwargs, out))
        elif func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten.clone.default):
            moved = tree_leaves(out)
        elif self.made and not any(isinstance(t, torch.Tensor) for t in tree_leaves((args, kwargs))):  # a factory
            moved = tree_leaves(out)
        else:
            moved = []
        # A DTensor op copies shards, unless its operands' placements differ: then it redistributes, out of sight.
        whole = len({t.placements for t in tree_leaves((args, kwargs)) if isinstance(t, DTensor)}) > 1
        local = lambda t: t._local_tensor if isinstance(t, DTensor) and not whole else t  # noqa: E731
        self.numel = max([self.numel, *(local(t).numel() for t in moved if isinstance(t, torch.Tensor) and not t.is_meta)])
        return out


def _set_up_main(rank: int, port: int, hf_folder: str, out: str) -> None:
    """TP 2: set-up, an HF load, then an HF export, each with this rank's peak memory above what it held before;
    a set-up without the init replay and the same load: the largest copy, whether it drew, what differs."""
    import torch.distributed as dist

    import parallelize
    from checkpoint import load_hf
    from hf_export import save_hf
    from materialize import local, piece

    join_gloo(rank, TP, port)
    cfg = small_config(**BIG)
    validate(cfg, TP)
    dims = parallelize.build_parallel_dims(cfg, TP, "cpu")

    train.build_training(small_config(), torch.device("cpu"), dims)  # what set-up imports and caches, first
    (model, *_), set_up = peak_anonymous_memory_above_now(lambda: train.build_training(cfg, torch.device("cpu"), dims))
    with LargestCopy() as hf_load:
        load_hf(model, Path(hf_folder))
    from safetensors import safe_open
    with safe_open(Path(hf_folder) / "model.safetensors", framework="pt") as f:
        wrong = [n for n, p in model.named_parameters()
                 if not torch.equal(local(p), f.get_tensor(hf_name(n))[piece(tuple(p.shape), p)])]
    rng = torch.manual_seed(12345).get_state()  # not the state the seeded build left
    with LargestCopy(made=True) as no_draw:  # a build that a load fills: no init replay
        loaded, *_ = train.build_training(cfg, torch.device("cpu"), dims, draw=False)
        load_hf(loaded, Path(hf_folder))
    drew = not torch.equal(rng, torch.random.get_rng_state())
    differ = [n for (n, a), (_, b) in zip([*model.named_parameters(), *model.named_buffers()],
                                          [*loaded.named_parameters(), *loaded.named_buffers()], strict=True)
              if not torch.equal(local(a), local(b))]
    export_cfg = {**cfg, "checkpoint": {**cfg["checkpoint"], "folder": str(Path(out).parent / "ckpt")}}
    _, export = peak_anonymous_memory_above_now(lambda: save_hf(export_cfg, 1, model, "bytes", lambda line: None))
    shards = sum(local(p).numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    largest_shard = max(local(p).numel() for p in model.parameters())
    if rank == 0:
        Path(out).write_text(json.dumps(dict(set_up=set_up, hf_load=hf_load.numel, no_draw=no_draw.numel, drew=drew,
                                             differ=differ, largest_shard=largest_shard, export=export,
                                             shards=shards, largest=largest,
                                             full=sum(p.numel() * 4 for p in model.parameters()), wrong=wrong)))
    dist.destroy_process_group()


def test_on_tp_2_no_rank_holds_the_whole_model_in_set_up_hf_load_or_export(tmp_path):
    """Also a build that the HF load fills (train.build_training's draw=False, as for a folder or a
    checkpoint): it copies nothing larger than a shard and draws no random number."""
    cfg = small_config(**BIG)
    torch.manual_seed(1)
    build_model(cfg["model"]).save_pretrained(tmp_path / "hf")
    out = tmp_path / "memory.json"
    spawn(_set_up_main, lambda port: (port, str(tmp_path / "hf"), str(out)), TP, "set-up and HF load on TP 2")
    m = json.loads(out.read_text())
    mib = {k: round(v / 2**20) for k, v in m.items() if k in ("set_up", "shards", "largest", "full")}
    assert not m["wrong"], f"the HF load filled these shards wrong: {m['wrong']}"
    # A rank's set-up holds its shards and, one at a time, a full parameter (the generator's stream).
    assert m["set_up"] < 1.25 * (m["shards"] + m["largest"]) < m["full"], mib
    # The HF load copies each tensor's slices into the shards: nothing larger is copied or sent.
    assert m["hf_load"] <= m["largest_shard"], (m["hf_load"], m["largest_shard"])
    # A build the load fills replays no init: no full-size host tensor, no random number, the same model.
    assert m["no_draw"] <= m["largest_shard"] and not m["drew"] and not m["differ"], m
    # The export serialises a rank's piece of one file, then joins whole tensors one at a time.
    assert m["export"] < 1.25 * max(m["shards"], m["largest"]) < m["full"], {**mib, "export": m["export"] >> 20}


def _backward_gathers_main(rank: int, port: int, out: str) -> None:
    """dp_shard 2: the modules whose FSDP groups all-gather in one backward (FSDP's own record of
    a gather, the group's module name)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    import parallelize
    from model import forward_logits

    join_gloo(rank, DP_SHARD, port)
    # A vocabulary of 4096 makes [norm, lm_head] the largest FSDP group; a block is the next.
    cfg = small_config(**{"parallelism.dp_shard": DP_SHARD, "compile.enable": False, "model.vocab_size": 4096})
    validate(cfg, DP_SHARD)
    model, *_ = train.build_training(cfg, torch.device("cpu"), parallelize.build_parallel_dims(cfg, DP_SHARD, "cpu"))
    x = torch.randint(0, 256, (1, cfg["training"]["seq_len"]))
    real_unshard, gathered = FSDPParamGroup.unshard, {"forward": [], "backward": []}

    def unshard(group, async_op=False):
        pending = group._all_gather_result is not None
        real_unshard(group, async_op)
        if not pending and group._all_gather_result is not None:  # this call all-gathered
            gathered[phase].append((group._module_fqn, sum(p.sharded_param.numel() for p in group.fsdp_params)))
    FSDPParamGroup.unshard, phase = unshard, "forward"
    loss = train.cross_entropy(forward_logits(model, x), x)
    phase = "backward"
    loss.backward()
    if rank == 0:
        Path(out).write_text(json.dumps(dict(gathered=gathered, blocks=[f"model.layers.{i}" for i in
                                                                        range(len(model.model.layers))],
                                             model=cfg["model"])))
    dist.destroy_process_group()


def test_fsdp_backward_gathers_each_block_but_not_the_embedding(tmp_path):
    out = tmp_path / "gathers.json"
    spawn(_backward_gathers_main, lambda port: (port, str(out)), DP_SHARD, "one backward on dp_shard 2")
    m = json.loads(out.read_text())
    # The embedding's backward needs the token ids only: gathering its weight costs a full copy at the peak.
    # Final norm + lm_head are not resharded after forward: backward starts with them gathered.
    assert sorted(name for name, _ in m["gathered"]["backward"]) == m["blocks"], m
    # config.peak_per_rank's "FSDP groups" term: the largest group any gather makes whole.
    assert max(n for phase in m["gathered"].values() for _, n in phase) == count_parameters(m["model"])[1], m

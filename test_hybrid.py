"""Qwen3.5's hybrid layers (Gated DeltaNet beside gated attention): packed documents stay apart in the
linear-attention layers' convolution and recurrent state, as attention's block-causal masks keep them."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybrid_plan import keep_documents_apart_in_linear_attention
from model import build_model, forward_logits

SIZES = dict(model_type="qwen3_5_text", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512, attn_implementation="sdpa")
LENGTH = 100  # a document over one chunk of the gated delta rule (64 tokens)


def document_loss(logits: torch.Tensor, document: torch.Tensor) -> float:
    return F.cross_entropy(logits[0, :-1], document[0, 1:]).item()


@pytest.fixture(scope="module")
def hybrid():
    """(a float32 Qwen3.5 text model of 3 Gated DeltaNet layers and 1 attention layer, a document). Its
    state decays slowly, as a trained model's long-memory heads: at HF's init (decay rates up to 16)
    a state leaked across a copy's first chunk has faded by the next."""
    keep_documents_apart_in_linear_attention()  # as hub_folder.read does for a Qwen3.5 folder
    torch.manual_seed(0)
    model = build_model(SIZES).eval()
    with torch.no_grad():
        for block in model.model.layers[:3]:
            block.linear_attn.A_log.uniform_(0.01, 0.1).log_()
    return model, torch.randint(0, 300, (1, LENGTH))


def four_copies(document: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return document.repeat(1, 4), torch.arange(LENGTH).repeat(4)[None]  # positions restart at each copy


def test_each_of_four_packed_copies_of_a_document_loses_what_the_document_alone_does(hybrid):
    """model.forward_logits on the packed window: every layer kind (convolution, recurrent state, attention)
    restarts at each copy, across the chunks of 64 tokens that a copy spans; transformers' loss on the
    document alone is the reference."""
    model, document = hybrid
    with torch.no_grad():
        alone = document_loss(model(document).logits, document)
        logits = forward_logits(model, *four_copies(document))
    copies = [document_loss(logits[:, i * LENGTH:(i + 1) * LENGTH], document) for i in range(4)]
    assert copies == pytest.approx([alone] * 4, abs=1e-5)


def test_without_the_workaround_transformers_leaks_one_document_into_the_next(hybrid):
    """hybrid_plan.keep_documents_apart_in_linear_attention is needed while this holds (transformers
    5.24.0): stock transformers, given the packed window's position_ids (its own way to pack), keeps the
    copies apart in attention alone; the second copy's loss differs from the document's."""
    model, document = hybrid
    ids, positions = four_copies(document)
    with torch.no_grad():
        alone = document_loss(model(document).logits, document)
        second = document_loss(model(input_ids=ids, position_ids=positions).logits[:, LENGTH:2 * LENGTH], document)
    assert abs(second - alone) > 1e-4


def test_the_packed_window_gives_every_parameter_the_gradient_of_the_document_alone(hybrid):
    """Backward through the restarts: the mean loss over four identical copies has the document's
    gradient, parameter by parameter (the convolution, A_log, dt_bias and the gated norm included)."""
    model, document = hybrid

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}
    alone = gradients(F.cross_entropy(model(document).logits[0, :-1], document[0, 1:]))
    ids, positions = four_copies(document)
    targets = ids.clone()[0, 1:]
    targets[LENGTH - 1::LENGTH] = -100  # no target across copies
    packed = gradients(F.cross_entropy(forward_logits(model, ids, positions)[0, :-1], targets))
    for name in alone:
        torch.testing.assert_close(packed[name], alone[name], rtol=1e-4, atol=1e-6, msg=name)


def _heads_main(rank: int, port: int, out: str) -> None:
    """TP 2 on a Qwen3.5 text model whose value heads are twice its key heads: each Gated DeltaNet parameter's
    local piece against the whole one's; then its rows in HF's order for DCP (hf_layout) and back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import parallelize
    from harness import join_gloo
    from hf_layout import in_hf_layout, in_plan_layout

    join_gloo(rank, 2, port)
    torch.manual_seed(0)
    whole = build_model({**SIZES, "linear_value_head_dim": 8, "linear_num_value_heads": 8})  # v: 64 rows, q and k: 32
    model = build_model({**SIZES, "linear_value_head_dim": 8, "linear_num_value_heads": 8})
    model.load_state_dict(whole.state_dict())
    parallelize.apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), "stock", "norm_output")
    wrong = []
    for name, p in model.named_parameters():
        if ".linear_attn." not in name:
            continue
        full, mine = whole.get_parameter(name).detach(), p.to_local()
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # its key heads' q and k, their value heads' v
            q, k, v = full.split([32, 32, 64])
            expected = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
        elif name.endswith("out_proj.weight"):
            expected = full.chunk(2, dim=1)[rank]
        elif name.endswith("norm.weight"):  # over one head's features: every rank's
            expected = full
        else:  # in_proj_z, in_proj_a, in_proj_b, A_log, dt_bias: by value head
            expected = full.chunk(2)[rank]
        share = 1 if name.endswith("norm.weight") else 2
        if not (isinstance(p, DTensor) and mine.numel() * share == full.numel() and torch.equal(mine, expected)):
            wrong.append(name)
    state = model.state_dict()
    hf = in_hf_layout(state, model)
    wrong += [f"in HF's order: {n}" for n, v in hf.items() if not torch.equal(v.full_tensor(), whole.state_dict()[n])]
    back = in_plan_layout(hf, model)
    wrong += [f"back: {n}" for n, v in back.items() if not torch.equal(v.to_local(), state[n].to_local())]
    if rank == 0:
        Path(out).write_text(json.dumps(wrong))
    dist.destroy_process_group()


def test_each_rank_holds_its_heads_share_of_every_gated_deltanet_parameter(tmp_path):
    """hybrid_plan.linear_attention_plan on TP 2: every linear-attention parameter is a DTensor whose local piece
    is 1/TP of the whole, its own heads' rows (the gated norm, over one head's features, whole on each rank);
    hf_layout gives in_proj_qkv's and conv1d's rows in HF's order and takes them back."""
    from conftest import spawn

    out = tmp_path / "heads.json"
    spawn(_heads_main, lambda port: (port, str(out)), 2, "Gated DeltaNet shards on TP 2")
    assert json.loads(out.read_text()) == []

"""Your Llama and your text: a Hub-format folder by one path, its tokenizer, your documents packed
with block-causal masks under TP + SP, the loss per target token, the data position in checkpoints,
and the one-line refusals. Folders, tokenizer and documents are made here (harness.py)."""

import json
import re
import signal

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import TP, _killed_after_save, _losses, _torchrun, assert_every_gradient_matches, small_config, spawn
from harness import (free_port, join_gloo, make_documents, make_hub_llama, make_tokenizer, packed_batch,
                     transformers_loss, whole_gradients)

STEPS = ("--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--validation.steps", "1", "--metrics.measure_cpu_peak", "false")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """Two Hub-format Llamas (Llama 3.2-like: legacy rope_scaling, bfloat16, tied, GQA, 128,256 ids;
    Llama 2-like: default RoPE, untied), each with a tokenizer, and 40 documents as JSON lines (12: few)."""
    root = tmp_path_factory.mktemp("user")
    folders = {kind: make_tokenizer(make_hub_llama(root / kind, kind)) for kind in ("llama3", "llama2")}
    return {**folders, "docs": make_documents(root / "docs.jsonl"), "few": make_documents(root / "few.jsonl", 12)}


@pytest.fixture(scope="module")
def hub_run(files, tmp_path_factory):
    """hub_run(kind, nproc, dp_shard): (torchrun's output, its checkpoint folder) of 2 steps on the
    documents from that folder, exported at the end in files of 10 MB; each launched once."""
    runs = {}

    def run(kind: str, nproc: int, dp_shard: int):
        if (kind, nproc, dp_shard) not in runs:
            folder = tmp_path_factory.mktemp(f"{kind}-{nproc}") / "ckpt"
            proc = _torchrun(*STEPS, "--checkpoint.enable", "true", "--checkpoint.folder", str(folder),
                             "--checkpoint.initial_load_path", str(files[kind]), "--checkpoint.initial_load_in_hf", "true",
                             "--checkpoint.last_save_in_hf", "true", "--checkpoint.hf_max_shard_mb", "10",
                             "--data.path", str(files["docs"]), "--parallelism.dp_shard", str(dp_shard),
                             launcher=(f"--nproc_per_node={nproc}", f"--master_port={free_port()}"))
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[kind, nproc, dp_shard] = proc.stdout, folder
        return runs[kind, nproc, dp_shard]
    return run


@pytest.mark.parametrize("kind, nproc, dp_shard", [("llama3", 4, 2), ("llama2", 2, 1)])  # each folder, each mesh
def test_a_hub_folder_trains_on_your_documents_with_transformers_loss(files, hub_run, kind, nproc, dp_shard):
    """One path to the model: [model] is its config.json as transformers reads it (the Llama 3 folder
    is in transformers 4's format), its tokenizer packs the documents; 1 graph, 0 recompiles; step 1's
    loss is stock transformers' on the same packed batch. On dp_shard 2 the ranks hold different counts
    of targets: the loss is per target token of the global batch, not a mean of the ranks' means."""
    out, _ = hub_run(kind, nproc, dp_shard)
    assert "compiled graphs      1 for" in out and "recompiles           0" in out, out[-2000:]
    x, y, position_ids = packed_batch(files["docs"], files[kind], dp_shard, 2, 64)
    assert (position_ids == 0).sum() > len(x), "no window packs two documents"
    assert _losses(out)[0] == pytest.approx(transformers_loss(files[kind], x, y, position_ids), abs=1e-5)


def test_the_export_is_the_source_folder_with_the_trained_weights(files, hub_run):
    """From the bfloat16, tied Llama 3 folder on dp_shard 2 x tp 2: step-2-hf/ loads in stock
    transformers with the source's config (bos/eos, RoPE; every key of its config.json, as older
    transformers read them), generation config and tokenizer; every weight is the trained float32
    one (the DCP checkpoint's) cast to bfloat16, so the logits and what generate writes are those of
    the trained model cast; the 16 MB embedding is a file alone."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out, folder = hub_run("llama3", 4, 2)
    source, export = files["llama3"], folder / "step-2-hf"
    assert f"wrote the HF weights of step 2 to {export} (2 file(s), bfloat16)" in out, out[-2000:]
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert set(index.values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    for name in set(index.values()):  # as stored: from_pretrained would cast to config.json's dtype
        with safe_open(export / name, "pt") as f:
            assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}, name
    config = lambda folder: {**AutoConfig.from_pretrained(folder).to_dict(), "_name_or_path": None}  # noqa: E731
    assert config(export) == config(source)
    raw = lambda folder: {k: v for k, v in json.loads((folder / "config.json").read_text()).items()  # noqa: E731
                          if k not in ("dtype", "architectures", "transformers_version")}
    assert {"rope_theta", "rope_scaling", "torch_dtype"} <= raw(source).keys()  # transformers 4's keys
    assert raw(export).items() >= raw(source).items(), "transformers <= 4.57 would read another RoPE"
    assert json.loads((export / "generation_config.json").read_text()) == \
        json.loads((source / "generation_config.json").read_text())
    tokenizer, source_tokenizer = AutoTokenizer.from_pretrained(export), AutoTokenizer.from_pretrained(source)
    texts = [json.loads(line)["text"] for line in files["docs"].read_text().splitlines()]
    assert [tokenizer(t)["input_ids"] for t in texts] == [source_tokenizer(t)["input_ids"] for t in texts]

    model = AutoModelForCausalLM.from_pretrained(export)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    trained = AutoModelForCausalLM.from_pretrained(source)  # bfloat16, as the export
    state = {"model": {name: torch.empty_like(w, dtype=torch.float32) for name, w in model.state_dict().items()
                       if name != "lm_head.weight"}}
    dcp.load(state, checkpoint_id=folder / "step-2")
    for name, weight in state["model"].items():
        assert torch.equal(model.state_dict()[name], weight.to(torch.bfloat16)), name
    trained.load_state_dict({name: w.to(torch.bfloat16) for name, w in state["model"].items()}, strict=False)
    x, _, position_ids = packed_batch(files["docs"], source, 2, 2, 64)
    with torch.no_grad():
        logits = model(input_ids=x, position_ids=position_ids, use_cache=False).logits
        assert torch.equal(logits, trained(input_ids=x, position_ids=position_ids, use_cache=False).logits)
    assert torch.equal(model.generate(x[:1], max_new_tokens=4, do_sample=False),
                       trained.generate(x[:1], max_new_tokens=4, do_sample=False))


def test_an_export_with_no_source_folder_takes_bos_and_eos_from_the_tokenizer(files, tmp_path):
    """The debugmodel trained from scratch on documents: float32, its tokenizer beside it, and
    config.json's and generation_config.json's bos/eos are the tokenizer's, not LlamaConfig's 1 and 2."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    import hf_export
    import train

    cfg = small_config(**{"checkpoint.folder": str(tmp_path), "compile.enable": False})
    model, *_ = train.build_training(cfg, torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(files["llama2"])
    hf_export.save_hf(cfg, 1, model, tokenizer, lambda line: None)
    export, ids = tmp_path / "step-1-hf", (tokenizer.bos_token_id, tokenizer.eos_token_id)
    config, generation = AutoConfig.from_pretrained(export), GenerationConfig.from_pretrained(export)
    assert (config.bos_token_id, config.eos_token_id) == (generation.bos_token_id, generation.eos_token_id) == ids == (0, 1)
    assert config.dtype == torch.float32
    assert AutoTokenizer.from_pretrained(export)("a text")["input_ids"] == tokenizer("a text")["input_ids"]


# the loss per target token when dp ranks hold different counts of targets ---------------------

def uneven_batch():
    """dp rank 0's two rows keep 6 targets, rank 1's all but 2 (-100: none)."""
    x = torch.randint(3, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    y[:2, 3:] = -100
    y[2:, :1] = -100
    return x, y


def _uneven_rank(rank: int, port: int, out: str) -> None:
    """dp_shard 2 (FSDP2): train.train_step on this rank's rows, its loss and step-1 gradients."""
    import parallelize
    import train

    join_gloo(rank, 2, port)
    cfg = small_config(**{"parallelism.dp_shard": 2, "parallelism.tp": 1})
    parallel_dims = parallelize.build_parallel_dims(cfg, 2, "cpu")
    model, optimizer, scheduler = train.build_training(cfg, torch.device("cpu"), parallel_dims)
    clip, grads = train.clip_grad_norm_, {}
    train.clip_grad_norm_ = lambda parameters, max_norm: grads.update(whole_gradients(model)) or clip(parameters, max_norm)
    x, y = uneven_batch()
    loss, _ = train.train_step(model, optimizer, scheduler, x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2],
                               1e9, dp_mesh=parallel_dims.get_optional_mesh("batch"))
    if rank == 0:
        torch.save({"loss": loss, "grads": grads}, out)
        torch.save(grads, out + ".grads.pt")
    dist.destroy_process_group()


def test_ranks_with_different_counts_of_targets_give_the_one_process_loss_and_gradients(tmp_path):
    """The loss is the global batch's mean per target token (a sum over ranks / a count over ranks),
    not the mean of each rank's mean: on dp_shard 2 with 12 and 124 targets, one process's loss and
    every parameter's gradient."""
    import train

    cfg = small_config(**{"parallelism.tp": 1, "compile.enable": False})
    model, _, _ = train.build_training(cfg, torch.device("cpu"))
    x, y = uneven_batch()
    loss_sum = train.cross_entropy(train.forward_logits(model, x), y)
    (loss_sum / (y != -100).sum()).backward()
    reference = str(tmp_path / "one.grads.pt")
    torch.save(whole_gradients(model), reference)
    out = str(tmp_path / "uneven.pt")
    spawn(_uneven_rank, lambda port: (port, out), 2, "uneven targets on dp_shard 2")
    assert torch.load(out)["loss"] == pytest.approx((loss_sum / (y != -100).sum()).item(), abs=1e-5)
    assert_every_gradient_matches({"grads": out + ".grads.pt"}, {"grads": reference}, rel=1e-5)


# packed documents against the same documents alone -----------------------------------------

DOCS = [[20, 30, 14], [40, 24]]  # document lengths per row of a 64-token window


def packed_documents(seed: int = 0, changed: tuple[int, int] | None = None):
    """Two rows packing DOCS of random ids; `changed`: that (row, document) drawn again."""
    generator, rows = torch.Generator().manual_seed(seed), []
    for r, lengths in enumerate(DOCS):
        docs = [torch.randint(3, 256, (n,), generator=generator) for n in lengths]
        if changed and changed[0] == r:
            docs[changed[1]] = torch.randint(3, 256, (lengths[changed[1]],), generator=torch.Generator().manual_seed(99))
        rows.append(docs)
    x = torch.stack([torch.cat(docs) for docs in rows])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in docs]) for docs in rows])
    y = torch.stack([torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs]) for docs in rows])
    return x, y, positions, rows  # y: each document's last token has no target here (its own alone neither)


def per_document(logits: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Each document's loss, the mean over its targets."""
    losses = []
    for r, lengths in enumerate(DOCS):
        start = 0
        for n in lengths:
            losses.append(F.cross_entropy(logits[r, start : start + n], y[r, start : start + n]).item())
            start += n
    return losses


def _packed_rank(rank: int, port: int, out: str) -> None:
    """TP 2 + SP + per-block compile: a packed batch's per-document losses, step-1 gradients, and
    the logits again with one document changed."""
    import parallelize
    import train
    from torch.distributed.tensor import DTensor

    join_gloo(rank, TP, port)
    cfg = small_config(**{"parallelism.tp": TP})
    model, _, _ = train.build_training(cfg, torch.device("cpu"), parallelize.build_parallel_dims(cfg, TP, "cpu"))
    x, y, positions, _ = packed_documents()
    logits = train.forward_logits(model, x, positions)
    with train.vocab_parallel(logits):
        (train.cross_entropy(logits, y) / (y != -100).sum()).backward()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    grads = whole_gradients(model)
    x, _, positions, _ = packed_documents(changed=(0, 1))
    with torch.no_grad():
        changed, logits = full(train.forward_logits(model, x, positions)), full(logits).detach()  # collectives
    if rank == 0:
        torch.save({"logits": logits, "changed": changed}, out)
        torch.save(grads, out + ".grads.pt")
    dist.destroy_process_group()


def one_process_alone(cfg: dict):
    """The same model in one eager process, each document alone (no packing, no position_ids)."""
    import train

    cfg = {**cfg, "parallelism": {**cfg["parallelism"], "tp": 1}, "compile": {**cfg["compile"], "enable": False}}
    model, _, _ = train.build_training(cfg, torch.device("cpu"))
    _, y, _, rows = packed_documents()
    sums, count = [], 0
    for docs in rows:
        for doc in docs:
            logits = train.forward_logits(model, doc[None])
            target = torch.cat([doc[1:], torch.tensor([-100])])[None]
            sums.append(train.cross_entropy(logits, target))
            count += len(doc) - 1
    (sum(sums) / count).backward()
    lengths = [n - 1 for row in DOCS for n in row]
    return [s.item() / n for s, n in zip(sums, lengths)], whole_gradients(model), model


def test_packed_documents_equal_each_document_alone_on_one_process_and_tp(tmp_path):
    """Per-document losses and every parameter's step-1 gradient of a packed batch equal the same
    documents run alone in one process, to 1e-5: packed in one process, and on TP 2 + SP + compile.
    A changed document leaves its row-mates' logits unchanged."""
    import train

    cfg = small_config()
    alone, alone_grads, model = one_process_alone(cfg)
    x, y, positions, _ = packed_documents()
    model.zero_grad()
    logits = train.forward_logits(model, x, positions)
    (train.cross_entropy(logits, y) / (y != -100).sum()).backward()
    assert per_document(logits, y) == pytest.approx(alone, abs=1e-5)
    for name, grad in whole_gradients(model).items():
        assert ((grad - alone_grads[name]).norm() / alone_grads[name].norm()).item() <= 1e-5, name
    out, reference = str(tmp_path / "packed-tp.pt"), str(tmp_path / "alone.grads.pt")
    torch.save(alone_grads, reference)
    spawn(_packed_rank, lambda port: (port, out), TP, "packed documents on 2 ranks")
    tp = torch.load(out)
    assert per_document(tp["logits"], y) == pytest.approx(alone, abs=1e-5)
    assert_every_gradient_matches({"grads": out + ".grads.pt"}, {"grads": reference}, rel=1e-5)
    row0, row1 = DOCS[0], DOCS[1]
    kept = torch.cat([torch.arange(0, row0[0]), torch.arange(row0[0] + row0[1], sum(row0))])
    assert torch.allclose(tp["changed"][0, kept], tp["logits"][0, kept], atol=1e-6)
    assert torch.allclose(tp["changed"][1], tp["logits"][1], atol=1e-6)
    assert not torch.allclose(tp["changed"][0, row0[0] : row0[0] + row0[1]], tp["logits"][0, row0[0] : row0[0] + row0[1]])



# one line before any work -------------------------------------------------------------------

SMALL_BATCH = ("--training.local_batch_size", "2", "--training.seq_len", "64")


def test_each_data_problem_is_one_line_before_any_work(files, tmp_path, capsys, monkeypatch):
    """Through train.config_or_exit (before any process group), exit 2 and one line naming the problem."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "no-text.jsonl").write_text('{"body": "a document"}\n')
    (tmp_path / "short.jsonl").write_text('{"text": "one short document"}\n' * 3)
    small_vocabulary = make_hub_llama(tmp_path / "small-vocabulary", "llama2")  # 32,000 ids
    capsys.readouterr()  # transformers' progress bars
    hf = ["--checkpoint.enable", "true", "--checkpoint.folder", str(tmp_path / "ckpt"), "--checkpoint.initial_load_in_hf",
          "true", "--checkpoint.initial_load_path"]
    probes = [
        (hf + [str(files["llama3"])], f"data.path is empty: the standard library's bytes, as ids 0-255, mean nothing "
         f"to {files['llama3']}'s vocabulary of 128,256; set data.path to your documents, or data.tokenizer = bytes"),
        (["--data.path", str(files["docs"])], "needs a tokenizer: set data.tokenizer to a folder with tokenizer.json"),
        (["--data.path", str(files["docs"]), "--data.tokenizer", str(tmp_path)], f"{tmp_path} has no tokenizer "
         "transformers can load"),
        (["--data.path", str(files["docs"]), "--data.tokenizer", str(files["llama3"]), *SMALL_BATCH], None),  # 400 ids
        (hf + [str(small_vocabulary), "--data.path", str(files["docs"]), "--data.tokenizer", "bytes", *SMALL_BATCH], None),
        (["--data.path", str(tmp_path / "*.txt"), "--data.tokenizer", "bytes"], "matches no .txt, .jsonl, .json, .parquet file"),
        (["--data.path", str(tmp_path / "no-text.jsonl"), "--data.tokenizer", "bytes"], "has no 'text' field (its fields: body)"),
        (["--data.path", str(tmp_path / "short.jsonl"), "--data.tokenizer", "bytes"], "holds 54 training tokens (3 "
         "documents, 0 empty or null skipped; held out: every 10th document), fewer than one global batch's 2,049"),
        (["--model.vocab_size", "128", "--data.path", str(files["docs"]), "--data.tokenizer", "bytes"],
         "the bytes tokenizer has 256 ids, more than model.vocab_size = 128"),
        (["--model.attn_implementation", "flex_attention"], "'flex_attention' is refused: torch 2.15 has no FlexAttention "
         "backward on CPU"),
        (hf + [str(files["llama3"]), "--model.num_hidden_layers", "6", "--data.path", str(files["docs"])],
         f"--model.num_hidden_layers = 6, but {files['llama3']}/config.json has num_hidden_layers = 4 (as transformers reads it)"),
    ]
    each_one_line(probes, capsys)


def each_one_line(probes: list, capsys, before: tuple = ()) -> None:
    """train.config_or_exit on `before` + each probe's arguments: exit 2 and one line holding its message
    (None: every check passes)."""
    import train

    for argv, message in probes:
        argv = [*before, *argv]
        if message is None:
            train.config_or_exit(argv, train.launch_env())
            continue
        with pytest.raises(SystemExit) as exit:
            train.config_or_exit(argv, train.launch_env())
            pytest.fail(f"{argv} passed every check")
        lines = capsys.readouterr().err.splitlines()
        assert exit.value.code == 2 and len(lines) == 1 and message in lines[0], (argv, lines)


def test_each_bad_file_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """Your text as users have it, through train.config_or_exit: exit 2 and one line naming the file and where."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    good = json.dumps({"text": "a good document " * 40})
    (tmp_path / "broken.jsonl").write_text(f"{good}\n{good}\n{{\"text\": \"cut\n{good}\n")
    (tmp_path / "latin").mkdir()
    (tmp_path / "latin" / "a.txt").write_text("plain text " * 50)
    (tmp_path / "latin" / "b.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    (tmp_path / "latin.jsonl").write_bytes(f"{good}\n".encode() + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    (tmp_path / "array.json").write_text(f"[{good},\n{good},\n]")
    (tmp_path / "list.jsonl").write_text(f"{good}\n[1, 2]\n")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": null}\n{"text": ""}\n')
    (tmp_path / "number.jsonl").write_text(f'{good}\n{{"text": 12}}\n')
    (tmp_path / "content.jsonl").write_text(json.dumps({"content": "text " * 100}) + "\n")
    (tmp_path / "snap" / "data").mkdir(parents=True)
    (tmp_path / "snap" / "data" / "train-00000-of-00001.jsonl").write_text(good + "\n")
    (tmp_path / "snap" / "data" / "test-00000-of-00001.jsonl").write_text(good + "\n")
    small = ["--training.local_batch_size", "2", "--training.seq_len", "64", "--data.cache_folder", str(tmp_path / "c")]
    probes = [
        (["--data.path", str(tmp_path / "broken.jsonl")], f"{tmp_path / 'broken.jsonl'}:3: not a JSON record (Invalid "
         "control character at, column 14)"),
        (["--data.path", str(tmp_path / "latin")], f"{tmp_path / 'latin' / 'b.txt'}: the bytes at offset 3 (b'\\xe9 au'...) are not UTF-8"),
        (["--data.path", str(tmp_path / "latin.jsonl")], f"{tmp_path / 'latin.jsonl'}: the bytes at offset "
         f"{len(good) + 1 + 13} (b'\\xe9\"}}\\n'...) are not UTF-8"),
        (["--data.path", str(tmp_path / "array.json")], f"{tmp_path / 'array.json'}:3: not valid JSON (Expecting value)"),
        (["--data.path", str(tmp_path / "list.jsonl")], f"{tmp_path / 'list.jsonl'}:2 is a JSON list, not an object with a "
         "'text' field"),
        (["--data.path", str(tmp_path / "empty.jsonl")], "holds 0 training tokens (0 documents, 3 empty or null skipped"),
        (["--data.path", str(tmp_path / "number.jsonl")], f"{tmp_path / 'number.jsonl'}:2: text is a int, not text"),
        (["--data.path", str(tmp_path / "content.jsonl")], f"{tmp_path / 'content.jsonl'}:1 has no 'text' field (its "
         "fields: content); name yours with data.text_field"),
        (["--data.path", str(tmp_path / "content.jsonl"), "--data.text_field", "content"], None),
        (["--data.path", str(tmp_path / "snap"), "--data.split", "validation"], "has no 'validation' split (its "
         "splits: train, test); set data.split"),
        (["--data.path", str(tmp_path / "content.jsonl"), "--data.text_field", "content", "--validation.path",
          str(tmp_path / "snap")], "validation.path = " + repr(str(tmp_path / "snap")) + " has no 'validation' split"),
        (["--validation.path", str(tmp_path / "held.jsonl")], f"validation.path = {str(tmp_path / 'held.jsonl')!r} "
         "needs data.path"),
        (["--data.path", str(tmp_path / "content.jsonl"), "--data.text_field", "content", "--data.cache_folder",
          "/proc/nope"], "data.cache_folder = '/proc/nope' cannot hold the tokenized copy"),
    ]
    each_one_line(probes, capsys, before=("--data.tokenizer", "bytes", *small))



# a killed run resumes at the same document and token ------------------------------------------

def test_a_run_killed_after_a_save_resumes_at_the_same_document_and_token(files, tmp_path):
    """TP 2, 6 steps over a corpus of fewer tokens (new shuffled epochs): kill -9 every process once step 3
    is saved; the same command resumes from the saved token offset and gives the uninterrupted run's losses.
    With a document added to the file since, the resume stops in one line (a data position is into the old ones)."""
    docs = tmp_path / "few.jsonl"
    docs.write_text(files["few"].read_text())
    args = [*STEPS, "--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.initial_load_in_hf", "true",
            "--checkpoint.initial_load_path", str(files["llama2"]), "--data.path", str(docs),
            "--data.cache_folder", str(tmp_path / "tokenized")]
    whole = _torchrun(*args, "--checkpoint.folder", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    tokens = int(re.search(r"data: 11 documents, ([\d,]+) tokens", whole.stdout).group(1).replace(",", ""))
    assert 3 * 2 * 64 < tokens < 6 * 2 * 64, f"{tokens} tokens: the resumed steps do not begin a new epoch"
    resumed = [*args, "--checkpoint.folder", str(tmp_path / "killed"), "--checkpoint.interval", "3"]
    assert _killed_after_save(3, *resumed) == -signal.SIGKILL, "the run ended before its step-3 save"
    again = _torchrun(*resumed)
    assert again.returncode == 0 and "checkpoint: loaded step 3" in again.stdout, again.stderr[-3000:]
    assert _losses(again.stdout) == pytest.approx(_losses(whole.stdout)[3:], abs=1e-6)
    docs.write_text(docs.read_text() + json.dumps({"text": "one more document"}) + "\n")
    changed = _torchrun(*resumed)
    errors = [line for line in changed.stderr.splitlines() if line.startswith("error:")]
    assert changed.returncode != 0 and len(errors) == 1 and "was written with data.tokenized = " in errors[0], \
        changed.stderr[-3000:]


def test_every_kind_of_data_path_gives_the_same_documents(files, tmp_path):
    """A folder or glob of .txt (a document per file), .jsonl, .parquet and a datasets folder
    (save_to_disk, other columns beside `text`): the same documents in the same order; and the same
    conversations from JSON lines, parquet and a datasets folder (messages with a tool call, prompt-completion)."""
    import datasets

    from documents import read_documents, splits_of
    from harness import CONVERSATION

    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    chats = [{"messages": CONVERSATION + [call, {"role": "tool", "content": "done"}], "prompt": "unused"}] * 3
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    datasets.Dataset.from_list(chats).to_parquet(str(tmp_path / "chats.parquet"))
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "chats"))
    drop_nones = lambda m: {k: v for k, v in m.items() if v is not None}  # noqa: E731 (Arrow's missing keys)
    for path in ("chats.jsonl", "chats.parquet", "chats"):
        [(_, source)] = splits_of(str(tmp_path / path)).items()
        got = [([drop_nones(m) for m in c.messages], c.trained) for c in read_documents(source, "text")]
        assert got == [(chats[0]["messages"], (2, 4, 5))] * 3, path

    texts = [json.loads(line)["text"] for line in files["docs"].read_text().splitlines()]
    (tmp_path / "txt").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(text)
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "docs.parquet"))
    datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts}).save_to_disk(str(tmp_path / "saved"))
    for path in (files["docs"], tmp_path / "txt", tmp_path / "txt" / "*.txt", tmp_path / "docs.parquet", tmp_path / "saved"):
        [(split, files)] = splits_of(str(path)).items()
        read = [text if isinstance(text, str) else "".join(text) for text in read_documents(files, "text")]  # .txt: in blocks
        assert split == "train" and read == texts, path

"""Conversations: records with `messages`, or `prompt` and `completion`, rendered once by the folder's chat
template, the assistant's tokens (content and end-of-turn) the only targets, packed whole. The reference is
transformers' own assistant masks, from the same templates with {% generation %} marks (harness.py)."""

import json
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
from conftest import _killed_after_save, _torchrun, free_port
from harness import CONVERSATION, REASONING, DpMesh, assistant_tokens, make_chat_tokenizer, make_hub_llama, make_tokenizer
from test_checkpoint import _step_values

CFG = {"training": {"seed": 42, "seq_len": 256, "local_batch_size": 2, "global_batch_size": -1}, "parallelism": {"dp_shard": 1}}


def keys(tmp_path, path, tokenizer, **more) -> dict:
    return {"path": str(path), "split": "train", "text_field": "text", "tokenizer": str(tokenizer),
            "cache_folder": str(tmp_path / "cache"), "max_bytes": 1_000_000, **more}


def conversations_of(documents: "data.Documents") -> list[tuple[list, list]]:
    """Each conversation's (ids, mask) as the tokenized copy holds them."""
    starts, tokens = np.asarray(documents.tokens.starts), documents.tokens
    return [(tokens.ids[starts[d] : starts[d + 1]].tolist(), tokens.mask[starts[d] : starts[d + 1]].astype(int).tolist())
            for d in documents.docs]


@pytest.mark.parametrize("style", ["chatml", "qwen3", "llama3"])
def test_the_targets_are_the_assistant_turns_transformers_marks(tmp_path, style):
    """The ids of each conversation rendered once, whole; the targets exactly the tokens of transformers'
    assistant masks: each assistant turn's content and end-of-turn token, not the role header, not the
    system or user turns, not the line end after. Qwen3's template renders past turns without their
    reasoning, so the conversation rendered up to its last turn is no prefix of the whole: the whole's
    tokens train. A prompt and completion as messages train the completion's assistant turn alone; as
    text, untemplated, the completion and EOS (TRL's formats). The Llama 3 template is in tokenizer_config.json."""
    from transformers import AutoTokenizer

    folder = make_chat_tokenizer(tmp_path / "tokenizer", style)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    records = [{"messages": CONVERSATION}, {"messages": REASONING},
               {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}, {"prompt": "Q: 2 + 2?\nA:", "completion": " 4"}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    corpus = data.prepare(keys(tmp_path, tmp_path / "chat.jsonl", folder), "", 1000, 2, 256)
    got = conversations_of(corpus.train)
    assert got[:2] == [tuple(assistant_tokens(folder, messages, style)) for messages in (CONVERSATION, REASONING)]
    if style == "qwen3":
        before_last = tokenizer.apply_chat_template(REASONING[:2], tokenize=False)
        assert not tokenizer.apply_chat_template(REASONING, tokenize=False).startswith(before_last)
    ids, mask = assistant_tokens(folder, CONVERSATION, style)
    first_turn_ends = mask.index(0, mask.index(1))
    assert got[2] == (ids, [0] * first_turn_ends + mask[first_turn_ends:])
    prompt, completion = len(tokenizer("Q: 2 + 2?\nA:")["input_ids"]), tokenizer("Q: 2 + 2?\nA: 4")["input_ids"]
    assert got[3] == (completion + [tokenizer.eos_token_id], [0] * prompt + [1] * (len(completion) - prompt + 1))


def test_conversations_are_packed_whole_and_a_long_one_is_cut_and_counted(tmp_path):
    """In an epoch every conversation once, whole in one window: positions from 0, targets the next token where
    it is the assistant's. One longer than seq_len: its first seq_len tokens, alone; one whose first seq_len
    tokens hold no target (a long system turn) is left out; the data line counts both. Best fit puts two
    short conversations in most windows; the rest of a window is padding without targets. dp ranks' rows
    are one process's global batch; a resumed position gives the same windows."""
    from collections import Counter

    import report

    folder = make_chat_tokenizer(tmp_path / "tokenizer")
    long = CONVERSATION[:3] + [{"role": "user", "content": "Once more?"}, {"role": "assistant", "content": "Yes. " * 80}]
    no_target = [{"role": "system", "content": "Answer. " * 150}] + CONVERSATION[1:3]
    records = [CONVERSATION[: 3 + 2 * (i % 2)] for i in range(60)] + [long, no_target]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    corpus = data.prepare(keys(tmp_path, tmp_path / "chat.jsonl", folder), "", 1000, 2, 256)
    masks = {tuple(ids[:256]): mask[:256] for ids, mask in conversations_of(corpus.train)}
    assert max(map(len, masks)) == 256 and corpus.train.trained(256)[2:] == (2, 1)
    windows = data.Packed(corpus.train, 4, 256, seed=42)
    line = report.data_line({"data": keys(tmp_path, tmp_path / "chat.jsonl", folder), **CFG}, corpus, windows)
    assert "data: 56 conversations, " in line and "2 over seq_len cut to it, 1 left out: no target in it" in line, line
    seen, count = Counter(), len(windows.packing(0)[1]) - 1
    for x, y, positions in (windows.rows(windows.next_window()) for _ in range(count)):  # epoch 0
        starts = [int(s) for s in np.flatnonzero(positions == 0)] + [256]
        for a, b in zip(starts, starts[1:]):
            ids = tuple(x[a:b].tolist())
            if ids not in masks:  # padding, the window's rest
                assert b == 256 and (y[a:b] == -100).all()
                continue
            seen[ids] += 1
            assert y[a:b].tolist() == [t if m else -100 for t, m in zip(ids[1:], masks[ids][1:])] + [-100]
    assert seen == Counter(tuple(ids[:256]) for ids, mask in conversations_of(corpus.train) if any(mask[:256]))
    assert count <= 55 * 0.6, f"{count} windows: best fit puts two short conversations in most"

    one = iter(data.Packed(corpus.train, 4, 256, seed=42))
    ranks = [iter(data.Packed(corpus.train, 2, 256, DpMesh(r), seed=42)) for r in (0, 1)]
    for _ in range(30):  # several epochs
        batch = next(one)
        for r, it in enumerate(ranks):
            assert all(torch.equal(a, b[2 * r : 2 * r + 2]) for a, b in zip(next(it), batch))
    stream = iter(windows)
    next(stream)
    resumed = data.Packed(corpus.train, 4, 256, seed=42)
    resumed.set_state(windows.get_state())
    assert all(torch.equal(a, b) for a, b in zip(next(iter(resumed)), next(stream)))


def test_each_conversation_problem_is_one_line(tmp_path, capsys, monkeypatch):
    """Through train.config_or_exit: exit 2 and one line naming the problem."""
    from test_documents import each_one_line

    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    chat, plain = make_chat_tokenizer(tmp_path / "chat"), make_tokenizer(tmp_path / "plain")
    write = lambda name, *records: (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))  # noqa: E731
    write("chat.jsonl", *[{"messages": CONVERSATION}] * 3)
    write("no-role.jsonl", {"messages": CONVERSATION}, {"messages": [{"content": "hi"}, CONVERSATION[2]]})
    write("no-content.jsonl", {"messages": CONVERSATION[:2] + [{"role": "assistant"}]})
    write("no-assistant.jsonl", *[{"messages": CONVERSATION[:2]}] * 3)
    write("mixed.jsonl", {"messages": CONVERSATION}, {"text": "a document"})
    write("half.jsonl", {"prompt": "Q?", "completion": CONVERSATION[2:3]})
    write("long-system.jsonl", *[{"messages": [{"role": "system", "content": "Answer. " * 40}] + CONVERSATION[1:3]}] * 3)
    small = ["--training.local_batch_size", "2", "--training.seq_len", "64", "--data.cache_folder", str(tmp_path / "c")]
    probes = [
        (["--data.path", str(tmp_path / "chat.jsonl"), "--data.tokenizer", str(plain)], f"{plain}'s tokenizer has no "
         "chat template (chat_template in tokenizer_config.json, or chat_template.jinja): conversations need one"),
        (["--data.path", str(tmp_path / "no-role.jsonl")], f"{tmp_path / 'no-role.jsonl'}:2: message 1 has no 'role'"),
        (["--data.path", str(tmp_path / "no-content.jsonl")], "no-content.jsonl:1: message 3 (assistant) has no 'content'"),
        (["--data.path", str(tmp_path / "no-assistant.jsonl")], "holds 0 training tokens (0 conversations, 3 without an "
         "assistant turn to train skipped; held out: every 10th document), fewer than one"),
        (["--data.path", str(tmp_path / "mixed.jsonl")], f"{tmp_path / 'mixed.jsonl'}:1 is a conversation, "
         f"{tmp_path / 'mixed.jsonl'}:2 a document: give documents or conversations, not both"),
        (["--data.path", str(tmp_path / "half.jsonl")], "half.jsonl:1: prompt is a str, not a list of messages (role, "
         "content): give prompt and completion both as text or both as messages"),
        (["--data.path", str(tmp_path / "long-system.jsonl")], "holds 0 training tokens (3 conversations, 0 without an "
         "assistant turn to train skipped, 3 with no target in their first 64; held out: every 10th document), fewer than one"),
        (["--data.path", str(tmp_path / "chat.jsonl")], None),
    ]
    each_one_line(probes, capsys, before=("--data.tokenizer", str(chat), "--model.vocab_size", "1000", *small))


# training on a conversation: TP 2 + SP + compile, against transformers and one process ---------------------

RUN = ("--training.seq_len", "256", "--training.local_batch_size", "2", "--training.steps", "4",
       "--validation.steps", "1", "--metrics.measure_cpu_peak", "false", "--checkpoint.enable", "true",
       "--checkpoint.initial_load_in_hf", "true")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A Hub Llama folder with a ChatML template, 40 copies of one conversation; run(name, *args) launches
    train.py on them (2 ranks unless `--nproc`), once per name: (its output, its checkpoint folder)."""
    root = tmp_path_factory.mktemp("chat")
    folder = make_chat_tokenizer(make_hub_llama(root / "model", "llama2"))
    (root / "chat.jsonl").write_text((json.dumps({"messages": CONVERSATION}) + "\n") * 40)
    runs = {}

    def run(name: str, *args: str, nproc: int = 2):
        if name not in runs:
            ckpt = root / name
            proc = _torchrun(*RUN, "--checkpoint.initial_load_path", str(folder), "--data.path", str(root / "chat.jsonl"),
                             "--data.cache_folder", str(root / "tokenized"), "--checkpoint.folder", str(ckpt), *args,
                             launcher=(f"--nproc_per_node={nproc}", f"--master_port={free_port()}"))
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[name] = proc.stdout, ckpt
        return runs[name]
    run.folder, run.root = folder, root
    return run


def conversation_loss(folder, messages: list, style: str = "chatml") -> float:
    """Stock transformers' mean loss over the assistant's tokens of `messages` alone, rendered once (the reference)."""
    from transformers import AutoModelForCausalLM

    ids, mask = assistant_tokens(folder, messages, style)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    keep = torch.tensor(mask[1:], dtype=torch.bool)
    return F.cross_entropy(logits[keep], torch.tensor(ids[1:])[keep]).item()


def test_a_conversation_trains_on_the_assistants_tokens_as_transformers_and_one_process(chat_run):
    """TP 2 + SP + per-block compile on copies of one conversation (a system turn, two assistant turns),
    packed two a window: step 1's loss is transformers' mean over that conversation's assistant tokens
    alone (1e-5); 1 graph, 0 recompiles; the first 3 losses are one process's (1e-4)."""
    out, _ = chat_run("tp2")
    assert "compiled graphs      1 for" in out and "recompiles           0" in out, out[-2000:]
    assert "data: 36 conversations, " in out and "packed whole, best fit" in out, out[-2000:]
    assert _step_values(out)[1] == pytest.approx(conversation_loss(chat_run.folder, CONVERSATION), abs=1e-5)
    one, _ = chat_run("one-process", "--parallelism.tp", "1", "--compile.enable", "false", nproc=1)
    assert list(_step_values(out).values())[:3] == pytest.approx(list(_step_values(one).values())[:3], abs=1e-4)


def test_a_conversation_run_killed_after_a_save_resumes_exactly(chat_run):
    """kill -9 of every process once step 2 is saved; the same command resumes at the saved window and gives
    the uninterrupted run's steps 3 and 4 (1e-6)."""
    whole, _ = chat_run("tp2")
    args = [*RUN, "--checkpoint.initial_load_path", str(chat_run.folder), "--data.path", str(chat_run.root / "chat.jsonl"),
            "--data.cache_folder", str(chat_run.root / "tokenized"), "--checkpoint.folder", str(chat_run.root / "killed"),
            "--checkpoint.interval", "2"]
    assert _killed_after_save(2, *args) == -signal.SIGKILL, "the run ended before its step-2 save"
    again = _torchrun(*args)
    assert again.returncode == 0 and "checkpoint: loaded step 2" in again.stdout, again.stderr[-3000:]
    assert _step_values(again.stdout) == pytest.approx({s: v for s, v in _step_values(whole).items() if s > 2}, abs=1e-6)


def test_a_prompt_and_completion_as_text_trains_on_the_completion_alone(chat_run, tmp_path):
    """One process, untemplated: step 1's loss is transformers' mean over the completion's tokens and EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt, completion = "Question: what does textwrap.dedent do?\nAnswer:", " It removes common leading whitespace."
    (tmp_path / "pc.jsonl").write_text((json.dumps({"prompt": prompt, "completion": completion}) + "\n") * 20)
    proc = _torchrun(*RUN, "--checkpoint.initial_load_path", str(chat_run.folder), "--data.path", str(tmp_path / "pc.jsonl"),
                     "--checkpoint.folder", str(tmp_path / "ckpt"), "--data.cache_folder", str(tmp_path / "tokenized"),
                     "--training.steps", "1", "--parallelism.tp", "1", "--compile.enable", "false",
                     launcher=("--nproc_per_node=1", f"--master_port={free_port()}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(chat_run.folder)
    ids = tokenizer(prompt + completion)["input_ids"] + [tokenizer.eos_token_id]
    first = len(tokenizer(prompt)["input_ids"])  # the completion's first token
    model = AutoModelForCausalLM.from_pretrained(chat_run.folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    reference = F.cross_entropy(logits[first - 1 : -1], torch.tensor(ids[first:])).item()
    assert _step_values(proc.stdout)[1] == pytest.approx(reference, abs=1e-5)

"""Training the shrunk config.toml through the trainer's own builders, on this process or a
gloo rank: the tests' harness (conftest.py) and reach.py's, one home for both."""

import os
import socket
import tomllib
from pathlib import Path

import torch
import torch._inductor.config
import torch.distributed as dist
from torch.distributed.tensor import DTensor, _redistribute

import parallelize
import report
import train
from config import validate
from data import load_stdlib_bytes, random_windows
from hf_layout import rows_by_parts, rows_reordered, state_dict_name

HERE = Path(__file__).parent
STEPS = 3
# More blocks than Dynamo's recompile_limit, so that on a torch with the hook-guard bug the
# stock layer runs into the limit, as a real model's 32 blocks run into the default 8. The limit
# is lowered to 2 here (in this process and, as the module is imported again, in every spawned
# rank): the bug is the same, and each recompile the stock layer makes on torch 2.10.0 costs a
# whole block compile, 4 ranks on 2 cores.
torch._dynamo.config.recompile_limit = 2
NUM_BLOCKS = torch._dynamo.config.recompile_limit + 2


def small_config(**overrides) -> dict:
    """config.toml, shrunk to test size; overrides are {"section.key": value}."""
    with open(HERE / "config.toml", "rb") as f:
        cfg = tomllib.load(f)
    cfg["model"]["num_hidden_layers"] = NUM_BLOCKS
    cfg["training"].update(steps=STEPS, local_batch_size=2, seq_len=64)
    cfg["data"]["max_bytes"] = 1_000_000
    cfg["validation"]["steps"] = 1
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    return cfg


def build_family(family: str, model_cfg: dict, kv_heads: int = 8, window: int | None = None, **config):
    """A randomly initialised `*ForCausalLM` of `family` (a transformers model_type) with
    [model]'s sizes, from the family's own config class; `window`: its sliding window, switched on
    (qwen2's use_sliding_window) in the upper half of the blocks where the family lets it choose.
    Variants after "+": "mha" (as many key/value heads as heads), or a config flag set True
    ("stablelm+qk_layernorm"); `config`: other config keys."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, *variants = family.split("+")
    heads = model_cfg["num_attention_heads"]
    kv_heads = heads if "mha" in variants else kv_heads
    sizes = dict(hidden_size=model_cfg["hidden_size"], intermediate_size=model_cfg["intermediate_size"],
                 num_hidden_layers=model_cfg["num_hidden_layers"], num_attention_heads=heads,
                 num_key_value_heads=kv_heads, head_dim=model_cfg["hidden_size"] // heads,
                 vocab_size=model_cfg["vocab_size"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 use_cache=False, tie_word_embeddings=False) | config
    sizes.update({flag: True for flag in variants if flag != "mha"})  # "gemma3_text+tie_word_embeddings"
    if window:
        sizes.update(sliding_window=window, use_sliding_window=True, max_window_layers=model_cfg["num_hidden_layers"] // 2)
    try:
        config = AutoConfig.for_model(family, **sizes)
    except Exception:  # zamba2: per-layer lists sized for its default depth; keep their last n entries
        defaults = AutoConfig.for_model(family).to_dict()
        n, n_default = model_cfg["num_hidden_layers"], defaults.get("num_hidden_layers")
        per_layer = {key: [sizes[key]] * n if key in sizes else value[-n:]
                     for key, value in defaults.items() if isinstance(value, list) and len(value) == n_default}
        config = AutoConfig.for_model(family, **{**sizes, **per_layer})
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)  # or the comparison with one process measures random masks
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError as e:  # gemma2: no SDPA (softcapping); eager gets the same full-sequence masks
        if "scaled_dot_product_attention" not in str(e):
            raise
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def run_training(cfg: dict, world_size: int, device=torch.device("cpu"), arch: str = "llama",
                 window: int | None = None, grads_path: str | None = None) -> dict:
    """Train training.steps steps with the trainer's own functions; report global-mean losses,
    gradient norms before clipping, and what Dynamo saw. `arch` other than "llama": that
    transformers model_type (build_family, with `window`), parallelized by the same code.
    `grads_path`: rank 0 saves every parameter's step-1 gradient there, whole and clipped."""
    from torch._dynamo.utils import guard_failures

    validate(cfg, world_size)
    torch.set_float32_matmul_precision(cfg["training"]["float32_matmul_precision"])  # as train.main
    data, _ = load_stdlib_bytes(cfg["data"]["max_bytes"])
    t = cfg["training"]
    parallel_dims = parallelize.build_parallel_dims(cfg, world_size, device.type)
    dp_mesh = parallel_dims.get_optional_mesh("batch") if parallel_dims else None
    if arch == "llama":
        model, optimizer, scheduler = train.build_training(cfg, device, parallel_dims)
    else:
        torch.manual_seed(t["seed"])
        model = build_family(arch, cfg["model"], window=window).to(device)
        parallelize.parallelize(model, parallel_dims, cfg)
        optimizer, scheduler = train.build_optimizer(model, cfg)
    # FSDP2 puts with_kwargs=True pre-hooks on the modules it shards (outside the compiled
    # frames); the bug's precondition is one on attention, inside every compiled block.
    kwargs_hooks = sorted(n for n, m in model.named_modules() if m._forward_pre_hooks_with_kwargs)
    result = {
        "kwargs_hooks": kwargs_hooks,
        "attention_kwargs_hooks": [n for n in kwargs_hooks if n.endswith("self_attn")],
        "attention_modules": sorted(n for n, m in model.named_modules() if n.endswith("self_attn")),
        "fsdp_modules": sorted(n for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")),
        "losses": [],
        "grad_norms": [],
        "error": None,
    }
    # What the mixed-precision policy really does: lm_head's weight dtype inside forward (after
    # FSDP's unshard) and the dtype of the gradients FSDP reduce-scatters.
    forward_dtypes, reduce_dtypes, logits, logits_dtypes = set(), set(), set(), set()
    model.lm_head.register_forward_pre_hook(lambda module, _: forward_dtypes.add(str(module.weight.dtype)))
    model.lm_head.register_forward_hook(lambda module, _, out: logits.add(str(getattr(out, "placements", "tensor"))))
    model.lm_head.register_forward_hook(lambda module, _, out: logits_dtypes.add(str(out.dtype)))
    # FSDP2 calls dist.reduce_scatter_single on torch 2.14, dist.reduce_scatter_tensor on 2.10.
    rs_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    reduce_scatter = getattr(dist, rs_name)

    def recording_reduce_scatter(output, input, *args, **kwargs):
        reduce_dtypes.add(str(input.dtype))
        return reduce_scatter(output, input, *args, **kwargs)

    setattr(dist, rs_name, recording_reduce_scatter)
    matmuls = set()  # a bfloat16 run's: the dtype of every matmul inductor compiles, forward and backward
    if t["mixed_precision_param"] == "bfloat16":  # a plain callable: inductor's FX-graph cache is bypassed
        torch._inductor.config.post_grad_custom_post_pass = lambda graph: matmuls.update(
            str(n.meta["val"].dtype) for n in graph.nodes if n.target in MATMULS)
    batches = random_windows(data, t["local_batch_size"], t["seq_len"], torch.Generator().manual_seed(t["seed"]), dp_mesh)
    clip, amp = train.clip_grad_norm_, parallelize.autocast(cfg, device.type)  # bfloat16 without FSDP

    def clip_and_save_step_1_gradients(parameters, max_norm):  # clipped: what the optimizer applies
        train.clip_grad_norm_ = clip
        grad_norm = clip(parameters, max_norm)
        grads = whole_gradients(model)
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(grads, grads_path)
        return grad_norm

    if grads_path:
        train.clip_grad_norm_ = clip_and_save_step_1_gradients
    try:
        for _ in range(t["steps"]):
            x, y, _ = next(batches)
            loss, grad_norm = train.train_step(model, optimizer, scheduler, x, y, t["max_norm"], dp_mesh=dp_mesh, amp=amp)
            result["losses"].append(loss)
            result["grad_norms"].append(grad_norm)
    except Exception as e:  # the recompile-limit error under fullgraph=True, on affected torch
        result["error"] = f"{type(e).__name__}: {e}"
    train.clip_grad_norm_ = clip
    setattr(dist, rs_name, reduce_scatter)
    torch._inductor.config.post_grad_custom_post_pass = None
    result["forward_dtypes"], result["reduce_scatter_dtypes"] = sorted(forward_dtypes), sorted(reduce_dtypes)
    result["matmul_dtypes"] = sorted(matmuls)
    result["logits"], result["logits_dtypes"] = sorted(logits), sorted(logits_dtypes)  # "(Shard(dim=2),)": loss parallel
    embedding, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    result["tied"] = lm_head is embedding  # after the steps too: one parameter, updated once
    result["equal_weights"] = torch.equal(*(w.full_tensor() if isinstance(w, DTensor) else w for w in (embedding, lm_head)))
    result["graphs"], result["recompiles"] = report.dynamo_compile_counts()
    result["recompile_reasons"] = [r for reasons in guard_failures.values() for r in reasons]
    return result


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def whole_gradients(model) -> dict:
    """Every parameter's gradient, gathered whole (a collective: every rank calls it), by HF's name
    (without compile's and AC's wrapper prefixes)."""
    grads, by_parts = {}, rows_by_parts(model)  # hf_layout.RowsByParts's rows, in HF's order
    for name, p in model.named_parameters():
        if p.grad is None:  # unused: none on either side
            continue
        grad = rows_reordered(p.grad, by_parts[hf_name(name)], to_hf=True) if hf_name(name) in by_parts else p.grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        grads[hf_name(name)] = grad.detach().clone()
    return grads


hf_name = state_dict_name  # a parameter's HF name, without compile's and AC's wrapper prefixes


def gradient_differences(grads_path: str, reference_path: str) -> dict:
    """{parameter: |g - g_ref| / |g_ref|} (L2 norms) between two saved step-1 gradients."""
    grads, reference = torch.load(grads_path), torch.load(reference_path)
    assert grads.keys() == reference.keys(), sorted(grads.keys() ^ reference.keys())[:4]
    return {name: ((grads[name] - g).norm() / g.norm().clamp_min(1e-12)).item() for name, g in reference.items()}


def forget_the_last_model() -> None:
    """Before another model in this process: Dynamo's caches and counts, and DTensor's cached
    redistributions (torch 2.10.0, not 2.15.0: a second model's vocabulary-parallel embedding
    reuses the first's and fails `assert self.mask_buffer.data is not None`)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # guard_failures and the frame compile counts too
    counters.clear()
    _redistribute._gen_transform_infos.cache_clear()


class DpMesh:
    """What data.Windows and data.Packed read of a dp mesh: dp rank `rank` of `size`."""

    def __init__(self, rank: int, size: int = 2):
        self.rank, self.dp_size = rank, size

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.dp_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, world_size: int, port: int) -> None:
    """A spawned worker (a test's, reach.py's) joins a gloo group of `world_size` on localhost, one thread each."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")


# -----------------------------------------------------------------------------
# a user's own Llama folder, tokenizer and documents, made here: nothing downloads

def make_tokenizer(folder: Path, vocab_size: int = 400, text: str = "") -> Path:
    """A byte-level BPE tokenizer (GPT-2's pre-tokenizer) trained on a few KB of the standard library and
    `text` (the `tokenizers` library), as the Hub keeps Llama 3's: tokenizer.json whose post-processor
    adds <s> (BOS), and tokenizer_config.json naming BOS and EOS."""
    import json
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:8000] + text
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


HUB_LLAMAS = {  # small Llamas with the Hub's config.json keys (transformers 4's rope_scaling and rope_theta)
    "llama3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_BLOCKS, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=128256, tie_word_embeddings=True,
                   max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}, rope_theta=500000.0,
                   torch_dtype="bfloat16"),  # Llama 3.2 1B's kinds of values: tied, GQA, bfloat16
    "llama2": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=NUM_BLOCKS, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096,
                   rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, rope_scaling=None, rope_theta=10000.0,
                   torch_dtype="float32"),  # Llama 2 / TinyLlama's: untied, no head_dim key, default RoPE
}


def make_hub_llama(folder: Path, kind: str, seed: int = 0) -> Path:
    """A randomly initialised Llama of HUB_LLAMAS[kind] as a Hub folder: the weights in its dtype
    (model.safetensors, no tied lm_head), config.json as transformers 4 wrote it, a generation_config.json."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    hub = dict(HUB_LLAMAS[kind])
    legacy = {key: hub.pop(key) for key in ("rope_scaling", "rope_theta", "torch_dtype")}
    rope = {"rope_type": "default", **(legacy["rope_scaling"] or {}), "rope_theta": legacy["rope_theta"]}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**hub, rope_parameters=rope)).to(getattr(torch, legacy["torch_dtype"]))
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "dtype", "transformers_version") + (("head_dim",) if "head_dim" not in hub else ()):
        config.pop(key, None)
    config.update(legacy, transformers_version="4.45.0")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": hub["bos_token_id"], "eos_token_id": hub["eos_token_id"], "do_sample": True,
                  "temperature": 0.6, "top_p": 0.9}  # Llama 3.2's sampling, not what transformers makes from config.json
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder


def make_hub_family(folder: Path, family: str, window: int | None = None, seed: int = 0) -> Path:
    """A randomly initialised `family` at the tests' sizes (build_family, `window` in its upper half) as
    stock transformers' save_pretrained writes it, in bfloat16, with make_tokenizer's BOS and EOS (no
    padding id: its embedding row would be zeros, and a norm of zeros has an infinite gradient)."""
    torch.manual_seed(seed)
    model = build_family(family, small_config()["model"], window=window, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


COMPOSITES = {  # the text model at the tests' sizes (4 blocks, vocabulary over make_tokenizer's), a vision tower of one block
    "qwen3_5": dict(text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_BLOCKS,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                                     linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4,
                                     linear_value_head_dim=16),  # value heads twice the key heads: v of another size
                    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                       patch_size=4, num_position_embeddings=64)),
    "gemma3": dict(text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_BLOCKS,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                                    sliding_window=16),  # tied, as Gemma 3 4B-27B
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=32, patch_size=8), mm_tokens_per_image=4),
}


def make_hub_composite(folder: Path, family: str, seed: int = 0) -> Path:
    """A randomly initialised vision + text model of COMPOSITES[family] as stock transformers' save_pretrained
    writes it, in bfloat16, with make_tokenizer's tokenizer: what users download as Qwen3.5 or Gemma 3 4B."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **COMPOSITES[family])
    AutoModelForImageTextToText.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    return make_tokenizer(folder)


def make_documents(path: Path, count: int = 40, seed: int = 0) -> Path:
    """`count` documents of different lengths, cut from the standard library, as JSON lines with a `text` field."""
    import json
    import random
    import sysconfig

    texts = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-m]*.py"))
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        text = texts[i % len(texts)].read_text(errors="replace")
        start = rng.randrange(max(1, len(text) - 3000))
        lines.append(json.dumps({"id": i, "text": text[start : start + rng.randrange(10, 120)]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def packed_batch(docs: Path, tokenizer_folder: Path, dp_size: int, batch_size: int, seq_len: int, seed: int = 42):
    """The global batch step 1 trains on, packed here without the project's code: the training documents
    (every 10th from the 10th held out), each with its tokenizer's BOS and an EOS, end to end in epoch 0's
    order (numpy's permutation seeded by [training.seed, 0]); dp rank r's windows are the r-th batch_size of
    the global batch. A window's positions restart at each document, whose first token is no target."""
    import json

    import numpy as np
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    texts = [json.loads(line)["text"] for line in docs.read_text().splitlines()]
    train = [text for i, text in enumerate(texts) if i % 10 != 9]
    ids, starts = [], []
    for k in np.random.default_rng([seed, 0]).permutation(len(train)):
        doc = tokenizer(train[k])["input_ids"] + [tokenizer.eos_token_id]
        ids, starts = ids + doc, starts + [True] + [False] * (len(doc) - 1)
    rows = []
    for b in range(batch_size * dp_size):
        window, start = ids[b * seq_len : (b + 1) * seq_len + 1], starts[b * seq_len : (b + 1) * seq_len + 1]
        positions = []
        for s in start[:-1]:
            positions.append(0 if s or not positions else positions[-1] + 1)
        rows.append((window[:-1], [-100 if s else i for i, s in zip(window[1:], start[1:])], positions))
    return tuple(torch.tensor(column) for column in zip(*rows))


def transformers_loss(folder: Path, x, y, position_ids, per_rank: int | None = None) -> float:
    """Stock transformers' loss of the folder's model (float32) on the batch: HF builds the block-causal
    mask from position_ids itself, without a cache only (with the Hub's use_cache = true it attends
    across documents). The mean per target token; `per_rank`: the mean of each dp rank's mean
    instead (rows per rank), what a loss averaged per rank would give."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=x, position_ids=position_ids, use_cache=False).logits
    losses = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
    if per_rank:
        return torch.stack([losses[i : i + per_rank].sum() / (y[i : i + per_rank] != -100).sum()
                            for i in range(0, len(y), per_rank)]).mean().item()
    return (losses.sum() / (y != -100).sum()).item()


# conversations: chat templates written here in the formats the Hub's use, and transformers' own masks ------

CONVERSATION = [  # a system turn, two assistant turns
    {"role": "system", "content": "You answer about Python's standard library in one sentence."},
    {"role": "user", "content": "What does textwrap.dedent do?"},
    {"role": "assistant", "content": "It removes the whitespace that every line of a text starts with."},
    {"role": "user", "content": "And textwrap.fill?"},
    {"role": "assistant", "content": "It wraps a paragraph to a width and joins the lines with newlines."},
]
REASONING = [  # Qwen3's reasoning: the template drops it from turns before the last user turn
    {"role": "user", "content": "Is 7 prime?"},
    {"role": "assistant", "content": "<think>\nIt has no divisor but 1 and 7.\n</think>\n\nYes."},
    {"role": "user", "content": "Is 9?"},
    {"role": "assistant", "content": "<think>\n3 times 3 is 9.\n</think>\n\nNo, 3 divides it."},
]


def chat_template(style: str, marked: bool = False) -> str:
    """A chat template: "chatml" (Qwen2.5's format: <|im_start|>role ... <|im_end|>), "qwen3" (ChatML that
    drops the reasoning of assistant turns before the last user turn and writes a <think> block in those
    after it, as Qwen3's) or "llama3" (<|start_header_id|>role<|end_header_id|> ... <|eot_id|>, Llama 3's).
    `marked`: transformers' {% generation %} marks around each assistant turn's content and end-of-turn
    token, from which apply_chat_template(return_assistant_tokens_mask=True) makes its masks."""
    begin, end = ("{%- generation -%}", "{%- endgeneration -%}") if marked else ("", "")
    if style == "llama3":
        return ("{{- bos_token -}}{%- for m in messages -%}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' -}}"
                "{%- if m.role == 'assistant' -%}" + begin + "{{- m.content | trim + '<|eot_id|>' -}}" + end +
                "{%- else -%}{{- m.content | trim + '<|eot_id|>' -}}{%- endif -%}{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}")
    reasoning = ("{%- set ns = namespace(last_user=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
                 "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}") if style == "qwen3" else ""
    think = ("{%- set content = m.content.split('</think>')[-1].lstrip('\n') -%}"
             "{%- set thought = m.content.split('</think>')[0].split('<think>')[-1].strip('\n') "
             "if '</think>' in m.content else '' -%}"
             "{%- if loop.index0 > ns.last_user -%}{{- '<think>\n' + thought + '\n</think>\n\n' -}}{%- endif -%}"
             "{{- content -}}") if style == "qwen3" else "{{- m.content -}}"
    return (reasoning + "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' -}}"
            "{%- if m.role == 'assistant' -%}" + begin + think + "{{- '<|im_end|>' -}}" + end +
            "{%- else -%}{{- m.content + '<|im_end|>' -}}{%- endif -%}{{- '\n' -}}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def make_chat_tokenizer(folder: Path, style: str = "chatml") -> Path:
    """make_tokenizer's, trained on the conversations' words too, with the special tokens of `style`'s format,
    Qwen3's <think> and </think> (added, not special) and chat_template(style), saved as save_pretrained does."""
    import json

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tokenizer(folder, 500, json.dumps(CONVERSATION + REASONING) * 20))
    specials = {"llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}.get(style, ["<|im_start|>", "<|im_end|>"])
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = chat_template(style)
    tokenizer.save_pretrained(folder)
    if style == "llama3":  # the template in tokenizer_config.json, as older Hub folders keep it
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "chat_template.jinja").unlink()
    return folder


def assistant_tokens(folder: Path, messages: list, style: str) -> tuple[list[int], list[int]]:
    """(ids, assistant mask) as transformers makes them from chat_template(style, marked=True): the reference."""
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, chat_template=chat_template(style, marked=True), return_dict=True, return_assistant_tokens_mask=True)
    return out["input_ids"], out["assistant_masks"]

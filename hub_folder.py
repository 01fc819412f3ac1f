"""A Hub folder as [model]: its config.json as transformers reads it, a composite's (vision + text:
Qwen3.5, Gemma 3 4B-27B, Mistral Small 3.x) text model's; the family's verdict (reach.csv); and the names
its tensors have there, which the load, the checks and the export go by. Problems are returned, one line."""

import csv
import json
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from hybrid_plan import keep_documents_apart_in_linear_attention
from model import build_model

RECIPE_B = {"decoder_layer": "stock", "attention_gather": "norm_output"}
REACH = Path(__file__).with_name("reach.csv")  # reach.py's verdicts per family and torch
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")  # reach.py's
TEXT_PREFIXES = {"model.language_model.": "lm_head.weight",  # a composite's text model, as 5.24 saves Qwen3.5
                 "language_model.model.": "language_model.lm_head.weight"}  # as it saves Gemma 3 and Mistral 3


def read(cfg: dict, overrides: dict) -> str | None:
    """With checkpoint.initial_load_in_hf, [model] becomes the folder's config.json as transformers reads it
    (legacy rope_scaling and rope_theta too; a composite's text_config, tied as the composite is), its
    model_type naming the family, with [model]'s attn_implementation, which no weight depends on. A family
    other than Llama trains by recipe B. A family reach.csv does not record correct, or a --model.key that
    disagrees with the folder, is the problem returned."""
    c = cfg.get("checkpoint", {})
    if not (c.get("enable") is True and c.get("initial_load_in_hf") is True and c.get("initial_load_path")):
        return None
    path, name = Path(c["initial_load_path"]), f"checkpoint.initial_load_path = {c['initial_load_path']!r}"
    try:
        folder = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{name}: transformers cannot read its config.json: {str(e).strip().splitlines()[0]}"
    config = folder.get_text_config(decoder=True)  # a composite's text model; else the folder's
    holds = f"a {folder.model_type!r} model" + (f" whose text model is {config.model_type!r}" if config is not folder else "")
    if problem := family_problem(config):
        return f"{name} holds {holds}, {problem}"
    found = {key: value for key, value in config.to_dict().items() if key not in ("_name_or_path", "transformers_version")}
    found["tie_word_embeddings"] = folder.tie_word_embeddings  # a composite's lm_head is tied as the composite says
    attention = cfg.get("model", {}).get("attn_implementation", "sdpa")  # eager where HF has no SDPA (gemma2)
    found["attn_implementation"] = "eager" if not MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa else attention
    for dotted, value in overrides.items():
        have = {"model": found}
        for key in dotted.split("."):
            have = have.get(key) if isinstance(have, dict) else None
        if dotted.startswith("model.") and dotted != "model.attn_implementation" and have != value:
            return (f"--{dotted} = {value!r}, but {path}/config.json has {dotted[6:]} = {have!r} (as transformers reads it): "
                    "[model] comes from the folder")
    cfg["model"] = found
    if "linear_attention" in found.get("layer_types", ()):  # Qwen3.5's Gated DeltaNet, on one process too
        keep_documents_apart_in_linear_attention()
    if config.model_type != "llama":  # recipe B: HF's own layer, attention's input gathered at its norm's output
        for key, value in RECIPE_B.items():
            if overrides.get(f"parallelism.{key}", value) != value:
                return (f"parallelism.{key} = {overrides[f'parallelism.{key}']!r}: a {config.model_type!r} model trains "
                        f"by recipe B, with parallelism.{key} = {value!r}")
        cfg.setdefault("parallelism", {}).update(RECIPE_B)
    return None


def family_problem(config) -> str | None:
    """Why recipe B cannot train this config's family, from reach.csv's verdict on this torch (on the
    pinned 2.15.0 where it has none for this one); None where it matches one process per parameter.
    A variant (`phi3+mha`: as many key/value heads as heads) is the row its config fits."""
    rows = list(csv.DictReader(REACH.open()))
    rows = [r for r in rows if r["torch"] == torch.__version__.split("+")[0]] or [r for r in rows if r["torch"] == "2.15.0"]
    verdicts, family = {r["family"]: r for r in rows if not r["window"]}, config.model_type
    fits = lambda flag: config.num_key_value_heads == config.num_attention_heads if flag == "mha" else getattr(config, flag, False)  # noqa: E731
    row = next((r for f, r in verdicts.items() if f.startswith(family + "+") and fits(f.split("+")[1])), verdicts.get(family))
    if row is None:
        moe = any((getattr(config, key, 0) or 0) > 1 for key in MOE_KEYS)
        return ("a mixture of experts: recipe B's plan shards dense MLPs" if moe else "which recipe B has not been tried on") \
            + " (reach.csv, RESULTS.md's \"Recipe B's reach\")"
    if not row["verdict"].startswith("correct"):
        return f"which reach.csv records as {row['verdict']} on torch {row['torch']}: {row['error']}"
    return None


def tensors(path: Path) -> tuple[dict[str, str], dict[str, tuple]]:
    """({[model]'s tensor name: its name in the folder}, {every tensor there: (shape, bytes, file)}): a
    composite's text model under its prefix; its vision tower and projector are no name of [model]'s."""
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:  # the safetensors header: 8 bytes of its length, then JSON
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        found.update({k: (t["shape"], t["data_offsets"][1] - t["data_offsets"][0], file.name)
                      for k, t in header.items() if k != "__metadata__"})
    prefix = next((p for p in TEXT_PREFIXES if any(k.startswith(p) for k in found)), "model.")
    head = TEXT_PREFIXES.get(prefix, "lm_head.weight")
    return {("model." + k.removeprefix(prefix) if k != head else "lm_head.weight"): k
            for k in found if k.startswith(prefix) or k == head}, found


def mismatch(path: Path, model_cfg: dict) -> str | None:
    """Which tensor of an HF folder's safetensors has another shape than [model] (its config.json, as
    `read` reads it) builds, in a few words; None if none does. Tensors of no [model] name are not compared."""
    if not any(path.glob("*.safetensors")):
        return "no *.safetensors file"
    with torch.device("meta"):
        want = {k: list(v.shape) for k, v in build_model(model_cfg).state_dict().items()
                if not (k == "lm_head.weight" and model_cfg["tie_word_embeddings"])}
    names, found = tensors(path)
    have = {ours: list(found[theirs][0]) for ours, theirs in names.items()}
    unused = {"lm_head.weight"} if model_cfg["tie_word_embeddings"] else set()  # some tied exports keep a copy
    wrong = next((key for key in sorted(want.keys() | have.keys() - unused) if want.get(key) != have.get(key)), None)
    return f"{names.get(wrong, wrong)} has shape {have.get(wrong, 'none')} there, {want.get(wrong, 'none')} for [model]" if wrong else None

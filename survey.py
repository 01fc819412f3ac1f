"""How transformers' decoder layers call attention: `hidden_states` by keyword or positionally.

    python survey.py        # the table in RESULTS.md, for the installed transformers

A keyword call needs TP's `PrepareModuleInput(input_kwarg_layouts=...)`, whose with_kwargs=True
pre-hook recompiles every block on torch <= 2.10 (pytorch/pytorch#170110). The norm-output plan
(`parallelism.attention_gather = "norm_output"`) avoids the hook; reach.py says for which families.
"""

import ast
from collections import defaultdict
from pathlib import Path

STYLES = ("keyword", "positional", "other")


def call_style(call: ast.Call) -> str:
    """How one `self.self_attn(...)` call passes the hidden states."""
    if any(k.arg == "hidden_states" for k in call.keywords):
        return "keyword"
    if call.args:
        return "positional"
    return "other"  # e.g. only **kwargs, or another keyword name


def survey_attention_calls(models_dir: Path | None = None) -> dict[str, list[str]]:
    """{style: sorted model families}: each family (a folder of `transformers/models`) whose
    `modeling_*.py` calls `self.self_attn`. A family with several kinds of layer counts under
    the first of STYLES that one of its calls uses: one keyword call is enough to need the
    kwargs plan."""
    if models_dir is None:
        import transformers

        models_dir = Path(transformers.__file__).parent / "models"
    styles = defaultdict(set)
    for path in sorted(models_dir.glob("*/modeling_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.self_attn":
                styles[path.parent.name].add(call_style(node))
    survey = {style: [] for style in STYLES}
    for family, found in sorted(styles.items()):
        survey[next(style for style in STYLES if style in found)].append(family)
    return survey


EXAMPLES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "deepseek_v3", "gpt_oss", "bert", "gpt2", "t5")


def markdown_table(survey: dict[str, list[str]]) -> str:
    import transformers

    lines = [f"| how `self.self_attn` gets `hidden_states` (transformers {transformers.__version__}) "
             "| model families | for example |", "|---|---|---|"]
    for style, families in survey.items():
        named = [f for f in EXAMPLES if f in families] or families[:4]
        lines.append(f"| {style} | {len(families)} | {', '.join(named)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table(survey_attention_calls()))

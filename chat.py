"""Conversations as text and target spans, for tokens.py: each rendered once, whole, by the tokenizer
folder's chat template (as inference renders it), and the characters of each trained assistant turn
found in that text: from the end of the generation prompt (the role header) through the end-of-turn
token, so the model learns to stop. Nothing the template writes after that token is a target.

Where a turn starts: the template renders the conversation up to it with the generation prompt, which
must begin the whole text (templates that rewrite earlier turns, as Qwen3 strips past reasoning, do so
only behind the last user turn). A prompt and completion given as text are not templated (as TRL's).
"""

import functools

from documents import Conversation, DataError

PROBE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello there."}]


def render(c: Conversation, tokenizer) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, each target span's [start, end) characters, plain): `plain` text takes the tokenizer's special
    tokens as a document does, and its EOS is a target; a templated one holds its own."""
    if isinstance(c.messages, tuple):  # prompt and completion as text
        prompt, completion = c.messages
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))], True
    eot, source = end_of_turn(tokenizer), tokenizer.name_or_path
    text, spans = as_text(tokenizer, c.messages, c.tools, c.where), []
    for i in c.trained:
        before = as_text(tokenizer, c.messages[:i], c.tools, c.where, generation_prompt=True)
        if not text.startswith(before) or (spans and len(before) < spans[-1][1]):
            raise DataError(f"{c.where}: {source}'s chat template renders the conversation before message {i + 1} "
                            "unlike the beginning of the whole: where that turn starts is unknown")
        end = text.find(eot, len(before))
        if end < 0:
            raise DataError(f"{c.where}: {source}'s chat template writes no {eot} after message {i + 1}")
        spans.append((len(before), end + len(eot)))
    return text, spans, False


@functools.lru_cache(maxsize=4)
def end_of_turn(tokenizer) -> str:
    """The special token the template writes after an assistant's content (<|im_end|>, <|eot_id|>, <end_of_turn>)."""
    source = getattr(tokenizer, "name_or_path", tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{source}'s tokenizer has no chat template (chat_template in tokenizer_config.json, or "
                        "chat_template.jinja): conversations need one; give an instruct model's tokenizer as data.tokenizer")
    text = as_text(tokenizer, PROBE, None, "a probe conversation")
    after = text.find(PROBE[1]["content"], len(as_text(tokenizer, PROBE[:1], None, "a probe", generation_prompt=True)))
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    found = sorted((text.find(s, after), s) for s in specials if after >= 0 and text.find(s, after) >= 0)
    if not found:
        raise DataError(f"{source}'s chat template writes no special token after an assistant's content: its end of "
                        "turn cannot be trained")
    return found[0][1]


def as_text(tokenizer, messages: list, tools, where: str, generation_prompt: bool = False) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except (TemplateError, TypeError, ValueError) as e:  # a template's raise_exception, or a message it cannot take
        raise DataError(f"{where}: the chat template refuses it: {str(e).strip().splitlines()[0]}") from None

"""Where an answer ends: at the first EOS token, or at the token that completes one of the
env's stop strings (``answer_format``), whichever comes first. Every generation path ends in
:func:`completion_from_ids`, so the tokens trained on are exactly the answer's."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from magrpo.errors import ModelLoadError
from magrpo.losses import completion_length
from magrpo.rollout import Completion

logger = logging.getLogger(__name__)


def completion_from_ids(
    agent: str,
    prompt_ids: list[int],
    ids: Sequence[int],
    eos_ids: Sequence[int],
    tokenizer,
    stop: Sequence[str] = (),
) -> Completion:
    """Generated ids as a Completion: cut after the first EOS (padding and anything a batch
    kept generating dropped) or after the token that completes a ``stop`` string, whichever
    comes first; ``finished`` when it ended either way; text without specials.

    Every generation path ends here, so the tokens trained on are exactly the answer's,
    whether or not the sampler itself stopped at the string."""
    ids = [int(token) for token in ids]
    kept = ids[: completion_length(ids, eos_ids)]
    finished = bool(kept) and kept[-1] in eos_ids
    text = tokenizer.decode(kept, skip_special_tokens=True)
    if stop and any(s in text for s in stop):
        kept = kept[: _stop_length(kept, stop, tokenizer)]
        text = tokenizer.decode(kept, skip_special_tokens=True)
        finished = True
    return Completion(agent, text, list(prompt_ids), kept, finished)


def _stop_length(ids: list[int], stop: Sequence[str], tokenizer) -> int:
    """The fewest leading tokens of ``ids`` whose text contains a stop string (there is one:
    containing it only grows with the prefix, so a binary search finds the first)."""
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        text = tokenizer.decode(ids[:middle], skip_special_tokens=True)
        if any(s in text for s in stop):
            high = middle
        else:
            low = middle + 1
    return low


def ends_an_answer(ids: list[int], stop: Sequence[str], tokenizer) -> bool:
    """Whether the newest token completed a stop string: checked on the last tokens only
    (a string of n characters lies within the last n + 1 tokens that completed it)."""
    window = max(len(s) for s in stop) + 1
    text = tokenizer.decode(ids[-window:], skip_special_tokens=True)
    return any(s in text for s in stop)


def check_turn_end(loaded) -> None:
    """A chat template exists, and the token that ends an assistant turn stops generation.

    Without the second, a model whose template ends turns with a token that is not one of
    its EOS tokens would write past the end of every answer until ``max_new_tokens``.
    """
    tokenizer = loaded.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(
            f"The tokenizer of agents {', '.join(loaded.agents)} has no chat template, but "
            "use_chat_template is on. Pass --no-use-chat-template to give the model raw text "
            "prompts (as the paper does with base models), or use a model with a chat template."
        )
    marker = "\u2045answer\u2046"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}],
        tokenize=False,
    )
    after = text.split(marker, 1)[1].lstrip() if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    if ids and ids[0] not in loaded.eos_ids:
        logger.warning(
            "The chat template of agents %s ends a turn with %r, which is not an EOS token of "
            "the model; it is added to the tokens that end an answer.",
            ", ".join(loaded.agents), tokenizer.convert_ids_to_tokens(ids[0]),
        )
        loaded.eos_ids = sorted({*loaded.eos_ids, ids[0]})

"""Cooperative writing: two agents write complementary texts about one source document.

TLDR (``tldr-v2``): a Reddit post; ``concise`` writes a short summary, ``detailed`` a longer
one with richer vocabulary and transitions. arXiv (``arxiv-v2``): a paper abstract;
``background`` writes the background and motivation of an introduction, ``method`` its
methodology and implications. Neither agent sees the other's text; the joint reward
(``rewards/writing.py``) scores how well the two fit together.

Prompt styles. ``"paper"`` (the default) is the authors' prompts: they name each agent's part
and, for the detailed summary, ask for more distinct words and transition words, but they state
no word count and no length ratio, so the agents have to discover the reward's targets from the
reward alone, as in the paper. ``"explicit-targets"`` states the word range and, for TLDR, the
length relation, which makes the task easier and the results incomparable with the paper's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..data import Records
from ..errors import ConfigError
from ..rewards.writing import (
    ARXIV_REWARD,
    MAX_WRITING_REWARD,
    TLDR_REWARD,
    WritingRewardSpec,
    score_writing,
    writing_feedback,
)
from ..task import Evaluation, Task

PROMPT_STYLES = ("paper", "explicit-targets")
"""The prompt variants every writing task offers; the first is the default."""


class WritingTask(Task):
    """Two roles, one source text field, a gated writing reward.

    ``prompt_styles`` maps each name of :data:`PROMPT_STYLES` to one template per role; a
    template may use ``{source}``, ``{min_words}`` and ``{max_words}``.
    """

    source_field: str = ""
    reward_spec: WritingRewardSpec
    prompt_styles: Mapping[str, Mapping[str, str]] = {}
    max_reward = MAX_WRITING_REWARD
    #: The rewards pay nothing for an answer of more than 256 words. A tokenizer that splits
    #: at spaces (SmolLM's, Qwen's) spends at least one token per word, so 256 tokens stay
    #: within the cap. At 384, 58 of 96 untrained TLDR joint answers passed it and scored 0
    #: (docs/training.md, "The token limit").
    suggested_max_tokens = 256

    def __init__(
        self,
        records: Records,
        *,
        prompt_style: str = "paper",
        min_words: int | None = None,
        max_words: int | None = None,
        max_copied_share: float | None = WritingRewardSpec.max_copied_share,
    ):
        super().__init__(records)
        if not isinstance(prompt_style, str) or prompt_style not in self.prompt_styles:
            raise ConfigError(
                f"prompt_style must be one of {', '.join(map(repr, self.prompt_styles))}, "
                f"got {prompt_style!r}."
            )
        self.prompt_style = prompt_style
        low, high = self.reward_spec.word_range
        low = low if min_words is None else min_words
        high = high if max_words is None else max_words
        if not (isinstance(low, int) and isinstance(high, int) and 0 <= low <= high):
            raise ConfigError(
                f"min_words and max_words must be integers with 0 <= min_words <= max_words, "
                f"got {low!r} and {high!r}."
            )
        if max_copied_share is not None and not (
            isinstance(max_copied_share, int | float) and 0 <= max_copied_share <= 1
        ):
            raise ConfigError(
                "max_copied_share must be a number from 0 to 1 (the largest share of a text's "
                "six-word runs that may be copied from the source), or None for the paper's "
                f"reward, which does not check copying; got {max_copied_share!r}."
            )
        self.reward_spec = dataclasses.replace(
            self.reward_spec, word_range=(low, high), max_copied_share=max_copied_share
        )

    def prompts(self, item: Mapping[str, Any]) -> dict[str, str]:
        source = item[self.source_field].strip()
        low, high = self.reward_spec.word_range
        return {
            role: template.format(source=source, min_words=low, max_words=high)
            for role, template in self.prompt_styles[self.prompt_style].items()
        }

    def evaluate(self, item: Mapping[str, Any], actions: Mapping[str, str]) -> Evaluation:
        first, second = self.roles
        source = item[self.source_field]
        score = score_writing(actions[first], actions[second], self.reward_spec, source=source)
        total = sum(score.parts.values())
        return Evaluation(
            reward_parts=score.parts,
            details={"failed_level": score.failed_level or "", **score.measurements},
            feedback=writing_feedback(score, self.reward_spec, (first, second)),
            solved=total >= self.max_reward - 1e-9,
        )


# The "paper" templates are the authors' prompt formatters, word for word:
# summary_agent_formatter, elaboration_agent_formatter (TLDR), background_agent_formatter and
# complementary_agent_formatter (arXiv) in train_magrpo.py of
# github.com/OpenMLRL/LLM_Collab_Writing (commit 0ed95e4b), for arXiv 2508.04652.


class TldrTask(WritingTask):
    roles = ("concise", "detailed")
    source_field = "prompt"
    reward_spec = TLDR_REWARD
    prompt_styles = {
        "paper": {
            "concise": (
                "Create a concise summary response to this post.\n\n"
                "Query:\n{source}\n\n"
                "IMPORTANT INSTRUCTIONS:\n"
                "- Provide a brief, focused summary in one sentence or a few sentences\n"
                "- Be factual and informative\n"
            ),
            "detailed": (
                "Create a detailed summary response to this post.\n\n"
                "Original Query:\n{source}\n\n"
                "IMPORTANT INSTRUCTIONS:\n"
                "- Use more unique words\n"
                "- Use some transition words to improve flow\n"
            ),
        },
        "explicit-targets": {
            "concise": (
                "Summarise the following Reddit post in one or two short sentences "
                "({min_words}-{max_words} words). A teammate writes a longer, detailed summary "
                "of the same post; yours is the concise one.\n\n{source}\n\nConcise summary:"
            ),
            "detailed": (
                "Write a detailed summary of the following Reddit post ({min_words}-{max_words} "
                "words), about two to three times as long as a one-sentence summary. Use varied "
                "vocabulary and transition words (for example, however, therefore, in addition). "
                "A teammate writes the concise summary.\n\n{source}\n\nDetailed summary:"
            ),
        },
    }


class ArxivTask(WritingTask):
    roles = ("background", "method")
    source_field = "abstract_text"
    reward_spec = ARXIV_REWARD
    prompt_styles = {
        "paper": {
            "background": (
                "Based on the following scientific abstract, expand content for an "
                "introduction section.\n\n"
                "Abstract:\n{source}\n\n"
                "IMPORTANT INSTRUCTIONS:\n"
                "- There is another agent that will provide methodology and implications\n"
                "- You just need to focus on background and motivation\n"
                "- Avoid repeating methodology and implications content\n"
            ),
            "method": (
                "Based on the following scientific abstract, expand content for an "
                "introduction section.\n\n"
                "Abstract:\n{source}\n\n"
                "IMPORTANT INSTRUCTIONS:\n"
                "- There is another agent that will provide the background and motivation\n"
                "- You just need to focus on methodology and implications\n"
                "- Avoid repeating background and motivation content\n"
            ),
        },
        "explicit-targets": {
            "background": (
                "Here is the abstract of a research paper. Write the first part of its "
                "introduction ({min_words}-{max_words} words): the background and the motivation "
                "of the work. A teammate writes the second part, on the methodology and its "
                "implications, so do not cover those.\n\nAbstract:\n{source}\n\nBackground:"
            ),
            "method": (
                "Here is the abstract of a research paper. Write the second part of its "
                "introduction ({min_words}-{max_words} words): the methodology and its "
                "implications. A teammate writes the first part, on the background and "
                "motivation, so do not cover those.\n\nAbstract:\n{source}\n\nMethodology:"
            ),
        },
    }

"""One text for all roles: a combined prompt, and the split of a combined answer.

The answer marks each role's part with a heading line ``### <role>``. Headings are matched
leniently (one to six ``#``, optional bold or code markers and colon, any case) because small models
vary the form; text before the first heading and roles without a heading get nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

HEADING = "### {role}"


def combine_observations(observations: Mapping[str, str]) -> str:
    roles = list(observations)
    sections = "\n\n".join(
        f"{HEADING.format(role=role)}\n{text}" for role, text in observations.items()
    )
    return (
        f"You write the parts of a team of {len(roles)} roles in one answer. Each role's task "
        f"follows its heading.\n\n{sections}\n\n"
        f"Answer with one section per role, in this order: {', '.join(roles)}. Start each "
        "section with its heading line exactly as above (for example "
        f"`{HEADING.format(role=roles[0])}`) and write nothing else."
    )


def split_response(text: str, roles: Sequence[str]) -> dict[str, str]:
    alternatives = "|".join(re.escape(role) for role in roles)
    heading = re.compile(
        rf"^[ \t]*#{{1,6}}[ \t]*[*`]*[ \t]*({alternatives})[ \t]*[*`]*[ \t]*:?[ \t]*$", re.M | re.I
    )
    parts = dict.fromkeys(roles, "")
    matches = list(heading.finditer(text))
    canonical = {role.lower(): role for role in roles}
    boundaries = [match.start() for match in matches] + [len(text)]
    for match, end in zip(matches, boundaries[1:], strict=True):
        role = canonical[match.group(1).lower()]
        if not parts[role]:  # the first section of a role counts
            parts[role] = text[match.end() : end].strip()
    return parts

"""Which sampled answers hit the token limit, would a smaller limit cut more, and do they loop?

    python benchmarks/cut_off_answers.py benchmarks/results/learning_coophumaneval.json --step 0
    python benchmarks/cut_off_answers.py \\
        benchmarks/results/untrained_coding_answers_v2-512.json --limits 256 320 384 448

Reads a result of ``learning.py`` (one checkpoint's answers, ``--step``) or of
``untrained_coding_answers.py``, whose records flag every cut-off answer. A learning.py result
without those flags keeps, per joint action, only the share of its answers that were cut off;
the cut-off answers are the joint's longest, so that many of the longest are taken. Answers are
re-tokenised with the run's model's tokenizer. ``--limits`` gives the share that each smaller
limit would have cut: an answer that finished in n tokens finishes under any limit >= n,
because the seeded sampler draws the same tokens whatever the limit. A cut-off answer *repeats*
when its last 40 characters already occur earlier in it: the model was looping, and a larger
limit would only have made the loop longer. ``--show`` prints the end of every other cut-off
answer, to be read by hand (prose, or code still being written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from magrpo.models import resolve_model

TAIL = 40  # characters whose repetition marks a loop


def repeats(text: str) -> bool:
    """True when the answer's last ``TAIL`` characters already occur earlier in it."""
    return len(text) > 2 * TAIL and text[-TAIL:] in text[:-TAIL]


def settings(result: dict) -> tuple[str | None, int]:
    """The model and the token limit that the result's answers were sampled with."""
    if "answers" in result:  # learning.py
        return result["train_config"]["model"], result["train_config"]["max_new_tokens"]
    return result["model"]["id"], result["config"]["max_new_tokens"]


def cut_agents(record: dict, tokens: dict[str, int]) -> set[str]:
    """The agents whose answer in this joint was cut off: the record's own flags or, in a
    learning.py result that keeps only the joint's share, that many of its longest answers."""
    if "cut" in record:
        return {agent for agent, cut in record["cut"].items() if cut}
    longest = sorted(tokens, key=tokens.get, reverse=True)
    return set(longest[: round(record["cut off"] * len(tokens))])


def sampled_answers(result: dict, step: str, length) -> list[dict]:
    """Every answer of the result as {agent, problem, sample, text, tokens, cut}."""
    if "answers" in result:  # learning.py: one list of joint answers per checkpoint
        if step not in result["answers"]:
            raise SystemExit(f"step {step} is not in the result: {sorted(result['answers'])}")
        records = result["answers"][step]
    else:
        records = result["samples"]
    answers = []
    for r in records:
        tokens = {agent: length(text) for agent, text in r["texts"].items()}
        cut = cut_agents(r, tokens)
        answers += [
            {"agent": agent, "problem": r.get("problem", r.get("index")), "sample": r["sample"],
             "text": text, "tokens": tokens[agent], "cut": agent in cut}
            for agent, text in r["texts"].items()
        ]  # fmt: skip
    return answers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a JSON file of learning.py or untrained_*")
    parser.add_argument("--step", default="0", help="learning.py: the checkpoint's step")
    parser.add_argument("--limits", type=int, nargs="*", default=[], help="smaller limits")
    parser.add_argument("--show", action="store_true", help="print the non-repeating ones")
    args = parser.parse_args(argv)

    result = json.loads(args.result.read_text())
    model, limit = settings(result)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    answers = sampled_answers(
        result, args.step,
        lambda text: len(tokenizer(text, add_special_tokens=False).input_ids),
    )  # fmt: skip
    limits = sorted({*args.limits, limit})
    if limits[-1] > limit:
        parser.error(f"--limits must not exceed the run's own limit, {limit}")

    print(f"{args.result}, limit {limit} tokens")
    print("| agent | answers | " + " | ".join(f"cut off at {n}" for n in limits), end=" | ")
    print(f"of those at {limit}, repeating their last {TAIL} characters |")
    print("| --- |" + " ---: |" * (len(limits) + 2))
    for agent in [*dict.fromkeys(a["agent"] for a in answers), None]:
        mine = [a for a in answers if agent in (None, a["agent"])]
        cut_at = [sum(a["cut"] or a["tokens"] > n for a in mine) for n in limits]
        looping = sum(a["cut"] and repeats(a["text"]) for a in mine)
        shares = " | ".join(f"{c} ({c / len(mine):.0%})" for c in cut_at)
        print(f"| {agent or 'all'} | {len(mine)} | {shares} | {looping} |")
    if args.show:
        for a in answers:
            if a["cut"] and not repeats(a["text"]):
                print(f"\n--- {a['agent']}, problem {a['problem']}, sample {a['sample']}:")
                print(f"... {a['text'][-300:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

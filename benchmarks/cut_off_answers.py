"""Which answers of a learning result hit the token limit, and are they loops?

    python benchmarks/cut_off_answers.py benchmarks/results/learning_coophumaneval.json --step 0

A result of ``learning.py`` keeps every sampled answer's text but, per joint action, only the
share of its answers that were cut off. Within a joint action the cut-off answers are its
longest ones, so this re-tokenises each answer with the run's tokenizer and takes that many
of the longest. A cut-off answer *repeats* when its
last 40 characters already occur earlier in it: the model was looping, and a larger limit
would only have made the loop longer. ``--show`` prints the end of every other cut-off answer,
to be read by hand (prose, or code still being written).
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a JSON file written by learning.py")
    parser.add_argument("--step", default="0", help="the checkpoint's step (0: untrained)")
    parser.add_argument("--show", action="store_true", help="print the non-repeating ones")
    args = parser.parse_args(argv)

    result = json.loads(args.result.read_text())
    if args.step not in result["answers"]:
        parser.error(f"step {args.step} is not in {args.result}: {sorted(result['answers'])}")
    config = result["train_config"]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config["model"]))
    records = result["answers"][args.step]

    counts: dict[str, dict[str, int]] = {}
    for record in records:
        texts = record["texts"]
        length = {
            a: len(tokenizer(t, add_special_tokens=False).input_ids) for a, t in texts.items()
        }
        cut = sorted(texts, key=length.get, reverse=True)[: round(record["cut off"] * len(texts))]
        for agent, text in texts.items():
            row = counts.setdefault(agent, {"answers": 0, "cut off": 0, "repeating": 0})
            row["answers"] += 1
            if agent not in cut:
                continue
            row["cut off"] += 1
            if repeats(text):
                row["repeating"] += 1
            elif args.show:
                print(f"--- {agent}, problem {record['problem']}, sample {record['sample']}:")
                print(f"... {text[-300:]}\n")

    print(f"{args.result}, step {args.step}, limit {config['max_new_tokens']} tokens")
    print("| agent | answers | cut off | of which repeat their last 40 characters |")
    print("| --- | ---: | ---: | ---: |")
    for agent, row in counts.items():
        print(f"| {agent} | {row['answers']} | {row['cut off']} | {row['repeating']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

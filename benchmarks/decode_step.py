"""Sampling with the fused decode step (``magrpo/speedups/llama_decode.py``) against transformers'
forward, in ``Policies.sample``, on CPU.

    .venv/bin/python benchmarks/decode_step.py                      # SmolLM2-135M (Llama)
    .venv/bin/python benchmarks/decode_step.py --architecture qwen2 # random Qwen2, same shape
    .venv/bin/python benchmarks/decode_step.py --finetune full --repeats 6
    .venv/bin/python benchmarks/decode_step.py --finetune full --against one-at-a-time
    .venv/bin/python benchmarks/decode_step.py --against onednn     # the products' kernel
    .venv/bin/python benchmarks/decode_step.py --against module-norms  # the norms' kernel
    .venv/bin/python benchmarks/decode_step.py --against torch-attention  # attention's kernel
    .venv/bin/python benchmarks/decode_step.py --against module-activation  # SwiGLU's kernel

Two agents, one prompt each, G samples per prompt, ``--max-new-tokens`` tokens; the two paths
alternate in one process (same prompts, same seeds, so the same work), after one warm-up
call each. ``--architecture qwen2`` builds a randomly initialised Qwen2 with SmolLM2-135M's
shape and tokenizer (no Qwen2 checkpoint is available offline): the speed of a decode step
depends on the shapes, not on the weights' values. ``--against one-at-a-time`` (full
fine-tuning: one model per agent) measures instead the two models decoding side by side,
one share of the threads each (``magrpo/speedups/threads.py``), against one model after the other
(``AutoSpeedups.side_by_side`` off), both with the fused step. ``--against onednn`` measures the
fused step's products by the blocked kernel (``magrpo/speedups/blocked_matmul.py``) against
oneDNN's on packed weights. ``--against module-norms`` measures the step's RMSNorms in one
kernel call each (``blocked_matmul.rms_norm``) against transformers' modules. ``--against
torch-attention`` measures the step's attention by its kernel
(``magrpo/speedups/decode_attention.py``) against torch's operators (two flash-attention
calls merged). ``--against module-activation`` measures SwiGLU's activation in one kernel
call (``blocked_matmul.silu_mul``) against the model's ``act_fn(gate) * up``. Prints seconds
per ``sample`` call.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

import magrpo.speedups.auto as auto_speedups
import magrpo.speedups.llama_decode as llama_decode
from magrpo.loading import load_policies
from magrpo.models import resolve_model
from magrpo.policies import SamplingParams

PROMPTS = [
    ("aux", "Write a helper function that returns the sum of the squares of a list. " * 6),
    ("main", "Write a function that returns the largest even number in a list, or None. " * 6),
]


# The old way each ``--against`` measures: (module, function, its replacement). The new way
# is the functions as they are.
OLD_WAYS = {
    "transformers": (auto_speedups, "llama_decode_supported", lambda *_, **__: False),
    "onednn": (llama_decode, "blocked_matmul_pays", lambda rows: False),
    "module-norms": (llama_decode, "_norm", lambda module, rows: module),
    "torch-attention": (llama_decode, "decode_attention_supported", lambda *_: False),
    "module-activation": (
        llama_decode,
        "_activation",
        lambda mlp, rows, dtype: functools.partial(llama_decode._gated, mlp.act_fn),
    ),
}


def random_qwen2(like: str, folder: Path) -> str:
    """A random Qwen2ForCausalLM with the shape and tokenizer of the Llama model at ``like``."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    llama = AutoConfig.from_pretrained(like)
    config = Qwen2Config(
        **{
            key: getattr(llama, key)
            for key in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "rms_norm_eps",
                "tie_word_embeddings",
                "pad_token_id",
                "eos_token_id",
                "bos_token_id",
            )
        },
        use_sliding_window=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(like).save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M)")
    parser.add_argument("--architecture", choices=("llama", "qwen2"), default="llama")
    parser.add_argument("--finetune", choices=("lora", "full"), default="lora")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--against",
        choices=(
            "transformers",
            "one-at-a-time",
            "onednn",
            "module-norms",
            "torch-attention",
            "module-activation",
        ),
        default="transformers",
        help="the fused step against transformers' forward, (--finetune full) models "
        "decoding side by side against one after the other, or the blocked kernel's "
        "products against oneDNN's, or the kernel's RMSNorm against transformers' modules, "
        "or the attention kernel against torch's operators, or the activation kernel "
        "against the model's activation",
    )
    args = parser.parse_args()
    if args.against == "one-at-a-time" and args.finetune != "full":
        parser.error("--against one-at-a-time needs --finetune full (one model per agent)")
    torch.set_num_threads(args.threads)
    model = args.model or str(resolve_model(None))
    with tempfile.TemporaryDirectory() as scratch:
        if args.architecture == "qwen2":
            model = random_qwen2(model, Path(scratch))
        policies = load_policies(
            [agent for agent, _ in PROMPTS],
            [model, model],
            finetune=args.finetune,
            dtype=args.dtype,
            use_chat_template=False,
        )
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.95)
        replaced = OLD_WAYS.get(args.against)  # None for one-at-a-time: a Policies flag
        if replaced is not None:
            module, name, old_way = replaced
            original = getattr(module, name)

        def sample(new: bool) -> float:
            """One ``sample`` call: the new way (fused step, models side by side, the decode
            kernels where they pay) or the old way of ``--against``."""
            policies.speedups.side_by_side = new or args.against != "one-at-a-time"
            if replaced is not None:
                setattr(module, name, original if new else old_way)
            started = time.perf_counter()
            policies.sample(PROMPTS, args.group_size, params, seeds=[0, 1])
            return time.perf_counter() - started

        times: dict[bool, list[float]] = {True: [], False: []}
        try:
            sample(True), sample(False)  # warm-up
            for _ in range(args.repeats):
                for new in (True, False):
                    times[new].append(sample(new))
        finally:
            if replaced is not None:
                setattr(module, name, original)
    new, old = statistics.median(times[True]), statistics.median(times[False])
    new_name, old_name = {
        "transformers": ("fused step", "transformers' forward"),
        "one-at-a-time": ("models side by side", "one at a time"),
        "onednn": ("blocked products", "oneDNN's"),
        "module-norms": ("kernel norms", "transformers' norms"),
        "torch-attention": ("kernel attention", "torch's attention"),
        "module-activation": ("kernel activation", "the model's activation"),
    }[args.against]
    print(
        f"{args.architecture} {args.finetune} {args.dtype}, G = {args.group_size}, "
        f"{args.max_new_tokens} tokens: {new_name} {new:.2f} s per sample call, "
        f"{old_name} {old:.2f} s, {old / new:.2f}x "
        f"(runs: {[round(t, 2) for t in times[True]]} / {[round(t, 2) for t in times[False]]})"
    )


if __name__ == "__main__":
    main()

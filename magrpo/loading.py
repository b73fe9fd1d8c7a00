"""Loading the agents' policies: transformers models, peft LoRA adapters, one shared base or
one model per agent."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

import torch

from magrpo.config import ConfigError
from magrpo.errors import ModelLoadError
from magrpo.policies import LoadedModel, Policies, adapter_name
from magrpo.speedups import Speedups, load_speedups

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_model(path: str, dtype: torch.dtype, device: torch.device, speedups: Speedups):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - any loader failure becomes one clear message
        raise ModelLoadError(
            f"Could not load the model or tokenizer at {path!r}: {type(error).__name__}: "
            f"{error}. Pass --model with a local folder that holds config.json, weights and "
            "tokenizer files (or a Hugging Face id available offline in the cache)."
        ) from error
    model = model.to(device)
    speedups.prepare_model(model)
    return model, tokenizer


def _lora_config(rank: int, alpha: float, target_modules: Sequence[str]):
    from peft import LoraConfig

    targets = "all-linear" if list(target_modules) == ["all-linear"] else list(target_modules)
    return LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )


def load_policies(
    agents: Sequence[str],
    model_paths: Sequence[str],
    *,
    finetune: str = "lora",
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    lora_target_modules: Sequence[str] = ("q_proj", "v_proj"),
    dtype: str = "float32",
    use_chat_template: bool = True,
    need_reference: bool = False,
    device: torch.device | str = "cpu",
    agent_devices: Sequence[torch.device | str] | None = None,
    speedups: Speedups | str = "auto",
) -> Policies:
    """Load the policies. ``model_paths``: one per agent (identical paths + LoRA: shared).

    ``agent_devices`` (one per agent) places separate models on separate devices, e.g. two
    7B agents on two GPUs; a shared base cannot be split, so it then needs one device.
    ``speedups``: ``auto`` | ``off`` or a :class:`~magrpo.speedups.Speedups`.
    """
    from peft import get_peft_model

    if isinstance(speedups, str):
        speedups = load_speedups(speedups)
    agents = list(agents)
    if len(model_paths) != len(agents):
        raise ModelLoadError(
            f"Got {len(model_paths)} model(s) for {len(agents)} agents ({', '.join(agents)}): "
            "pass one --model for all agents or exactly one --models entry per agent."
        )
    devices = [torch.device(d) for d in (agent_devices or [device] * len(agents))]
    if len(devices) != len(agents):
        raise ModelLoadError(
            f"Got {len(devices)} device(s) for {len(agents)} agents ({', '.join(agents)}): "
            "--agent-devices needs exactly one device per agent, in that order."
        )
    torch_dtype = DTYPES[dtype]
    lora = _lora_config(lora_rank, lora_alpha, lora_target_modules)
    models: list[LoadedModel] = []
    if finetune == "lora" and len(set(model_paths)) == 1:
        if len(set(devices)) > 1:
            raise ModelLoadError(
                f"--agent-devices {' '.join(map(str, devices))} puts agents on different "
                "devices, but with --finetune lora and one model every agent is an adapter on "
                "one shared base model, which lives on one device. Use --finetune full (or "
                "--models, one per agent) to give each agent its own model, or one device."
            )
        base, tokenizer = _load_model(model_paths[0], torch_dtype, devices[0], speedups)
        names = [adapter_name(a) for a in agents]
        if len(set(names)) != len(names):
            raise ModelLoadError(f"Agent names {agents} collide as adapter names {names}.")
        model = get_peft_model(base, copy.deepcopy(lora), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, copy.deepcopy(lora))
        model.set_requires_grad(names, requires_grad=True)
        model.eval()  # no dropout; and peft mixes adapters in a batch only in eval mode
        models.append(LoadedModel(model, tokenizer, agents, "shared_lora"))
    else:
        for agent, path, device in zip(agents, model_paths, devices, strict=True):
            model, tokenizer = _load_model(path, torch_dtype, device, speedups)
            reference = None
            if finetune == "lora":
                model = get_peft_model(
                    model, copy.deepcopy(lora), adapter_name=adapter_name(agent)
                )
                mode = "lora"
            else:
                mode = "full"
                if need_reference:
                    reference = copy.deepcopy(model).requires_grad_(False).eval()
            model.eval()
            models.append(LoadedModel(model, tokenizer, [agent], mode, reference))
    policies = Policies(models, use_chat_template, speedups)
    for agent in agents:
        count = sum(p.numel() for p in policies.named_trainable_parameters(agent).values())
        logger.info("agent %s: %s trainable parameters", agent, f"{count:,}")
    return policies


def agent_devices(
    names: list[str] | None, agents: list[str], world_size: int
) -> list[torch.device] | None:
    """``--agent-devices`` as torch devices, one per agent, checked."""
    if names is None:
        return None
    if world_size > 1:
        raise ConfigError(
            "--agent-devices places each agent on a fixed device, but this run has "
            f"{world_size} data-parallel processes, which each take their own "
            "device: drop --agent-devices, or run one process."
        )
    if len(names) != len(agents):
        raise ConfigError(
            f"--agent-devices lists {len(names)} device(s) but the env has "
            f"{len(agents)} agents ({', '.join(agents)}): give one per agent."
        )
    devices = []
    for name in names:
        try:
            device = torch.device(name)
        except RuntimeError as error:
            raise ConfigError(
                f"--agent-devices: {name!r} is not a torch device ({error})."
            ) from None
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError(
                f"--agent-devices: {name} does not exist; this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)."
            )
        devices.append(device)
    return devices

"""docs/training.md's config reference matches MAGRPOConfig (scripts/config_reference.py)."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "config_reference.py"


def load():
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_training_doc_has_the_current_config_reference():
    reference = load()
    assert reference.current(reference.DOC.read_text()) == reference.render(), (
        "docs/training.md's config reference is stale: run "
        "python scripts/config_reference.py --write"
    )


def test_every_config_field_is_in_a_group():
    """Every field sits under a section comment, so the help and the reference list it."""
    import dataclasses

    from magrpo.cli import field_groups
    from magrpo.config import MAGRPOConfig

    grouped = [name for _, names in field_groups(MAGRPOConfig) for name in names]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(MAGRPOConfig))

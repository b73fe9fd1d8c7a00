"""MAGRPO: multi-agent group-relative policy optimisation for LLM agents on text envs."""

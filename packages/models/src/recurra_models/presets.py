"""Named model sizes: the shapes of published checkpoints, with random weights.

``recurra_models.create("mamba2-130m")`` builds a model of that shape (keyword arguments
override fields, e.g. ``n_layer=4``); ``load_pretrained`` reads the published weights.
"""

from __future__ import annotations

from typing import Any

# name -> (architecture, config). Vocabulary sizes are the padded ones of the checkpoints.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # state-spaces/mamba-130m: GPT-NeoX vocabulary padded to a multiple of 8
    "mamba-130m": (
        "mamba",
        dict(
            vocab_size=50280,
            d_model=768,
            n_layer=24,
            d_state=16,
            d_conv=4,
            expand=2,
            tie_embeddings=True,
        ),
    ),
    # state-spaces/mamba2-130m: the same vocabulary padded to a multiple of 16
    "mamba2-130m": (
        "mamba2",
        dict(
            vocab_size=50288,
            d_model=768,
            n_layer=24,
            d_state=128,
            d_conv=4,
            expand=2,
            head_dim=64,
            n_groups=1,
            tie_embeddings=True,
        ),
    ),
    # RWKV-7 "Goose" 0.1B (World vocabulary; LoRA widths follow from n_embd: 64/64/32/128)
    "rwkv7-0.1b": ("rwkv7", dict(vocab_size=65536, n_embd=768, n_layer=12, head_size=64)),
}


def presets() -> list[str]:
    """The names of the presets, sorted."""
    return sorted(PRESETS)


def resolve(name: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(architecture, config) for an architecture or preset name; ``config`` overrides the
    preset's fields."""
    if name in PRESETS:
        arch, base = PRESETS[name]
        return arch, {**base, **config}
    return name, dict(config)

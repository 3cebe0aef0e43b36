"""Test-wide settings: one intra-op thread, so tests do not fight each other (or CI) for cores."""

from __future__ import annotations

import torch

torch.set_num_threads(1)

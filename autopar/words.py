"""The words every printed output shares: what "bubble" means and how a layer range reads.
A leaf module (imports nothing of the project): the Plan's fields (autopar/plan.py), its text
(autopar/report.py) and the timeline's title (autopar/timeline.py) all say them the same way.
"""
from __future__ import annotations


# "bubble" means one ratio everywhere (the plan's table, explain(), the timeline's title):
# Prediction.bubble_fraction, the pipeline's idle time over the compute time of the busiest
# rank — the papers' t_pb / t_id (2104.04473 §2.2), (p−1)/m for GPipe and 1F1B.
BUBBLE_MEANING = "idle ÷ compute time of the busiest rank, the papers' (p-1)/m"


def bubble_text(fraction: float) -> str:
    """'bubble 2.2% (idle ÷ compute ...)': how every printed output names the bubble."""
    return f"bubble {fraction * 100:.1f}% ({BUBBLE_MEANING})"


def layer_range(first: int, last: int) -> str:
    """Layer ranges are half-open everywhere, text and JSON alike: [first_layer, last_layer),
    last exclusive (Stage's fields; '[0, 12)' = layers 0 … 11)."""
    return f"layers [{first}, {last})"

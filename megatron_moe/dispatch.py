"""Dispatchers: move routed tokens to the ranks that own their experts and back.

router -> dispatcher.dispatch -> experts -> dispatcher.combine (as in torchtitan). The experts
never see communication: they get tokens, the local expert ids and combine weights of each
token's assignments, and return the weighted sum per token.

Legend: T tokens, K top_k, H hidden.
"""
from __future__ import annotations

from typing import Any

import torch


class Dispatcher:
    """Interface. ``dispatch`` returns what the local experts compute on plus a context for
    ``combine``, which brings the experts' outputs back in the order of the input tokens."""

    def dispatch(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def combine(self, y: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class LocalDispatcher(Dispatcher):
    """All experts live here: nothing moves (the gather/scatter is fused into the expert kernels)."""

    def dispatch(self, x_TH, expert_ids_TK, weights_TK):
        return x_TH, expert_ids_TK, weights_TK, None

    def combine(self, y_TH, ctx):
        return y_TH

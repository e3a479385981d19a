"""The convolution family: ``nn.Conv1d`` / ``nn.Conv2d`` (their own ``forward``), per-example factors via unfold."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Rule, Use
from .registry import own_forward, register_builtin

__all__: list[str] = []


def _conv(module: nn.Conv1d | nn.Conv2d, name: str, inp: torch.Tensor, out: torch.Tensor,
          grad: torch.Tensor) -> list[Use]:
    """``nn.Conv1d`` / ``nn.Conv2d`` via unfold (as Opacus ``grad_sample/conv.py``): with ``P`` the unfolded input
    patches ``(B, L, C_in/groups · k)`` and ``g`` the output gradient ``(B, L, C_out)`` over the ``L`` output
    positions, ``G_W = gᵀ P`` (groups = 1); ``G_b = Σ_l g``.

    Grouped / depthwise convolutions (Mamba): each output channel sees only its group's patches, so the per-position
    factor is the block outer product ``R_l = [g_{l,j} ⊗ P_{l,j}]_j`` of size ``|W|`` and ``G_W = Σ_l R_l`` (a "ones"
    use) — ``kernel · C_in/groups`` times the activation's memory, small for depthwise kernels.
    """
    nd = module.weight.dim() - 2
    c_out, c_in_g = module.weight.shape[:2]
    k = module.weight.shape[2:]
    x = inp if inp.dim() == nd + 2 else inp.unsqueeze(0)  # unbatched input: a batch of one
    if module.padding_mode != "zeros":
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        padding = (0,) * nd
    elif module.padding == "same":
        total = [d * (kk - 1) for d, kk in zip(module.dilation, k)]
        x = F.pad(x, [p for t in reversed(total) for p in (t // 2, t - t // 2)])
        padding = (0,) * nd
    elif module.padding == "valid":
        padding = (0,) * nd
    else:
        padding = module.padding
    if nd == 1:  # a 1-D convolution is a 2-D one over a height-1 image
        x = x.unsqueeze(2)
        kernel, dilation, stride, padding = (1, k[0]), (1, module.dilation[0]), (1, module.stride[0]), (0, padding[0])
    else:
        kernel, dilation, stride = k, module.dilation, module.stride
    patches = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # (B, C_in·k, L)
    b = patches.shape[0]
    g = grad.reshape(b, c_out, -1).transpose(1, 2)  # (B, L, C_out)
    patches = patches.transpose(1, 2)  # (B, L, C_in·k), channel-major like the weight
    groups = module.groups
    if groups == 1:
        uses = [Use(module.weight, g, patches, c_out, name)]
    else:
        seq = g.shape[1]
        g_blocks = g.reshape(b, seq, groups, c_out // groups, 1)
        p_blocks = patches.reshape(b, seq, groups, 1, c_in_g * patches.shape[-1] // (groups * c_in_g))
        outer = (g_blocks * p_blocks.to(g.dtype)).reshape(b, seq, -1)  # (B, L, |W|)
        uses = [Use(module.weight, None, outer, 1, name)]
    if module.bias is not None:
        uses.append(Use(module.bias, None, g, 1, name))
    return uses


_CONV = Rule("conv", _conv, ("weight", "bias"))

_is_plain_conv = (own_forward(nn.Conv1d), own_forward(nn.Conv2d))
register_builtin("conv", lambda m: _CONV if any(is_conv(m) for is_conv in _is_plain_conv) else None)
